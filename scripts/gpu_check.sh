#!/usr/bin/env bash
# The prepared check for a machine with one CUDA GPU (docs: README "On GPUs"); about 8 minutes.
# Runs the CUDA-only tests, then scripts/gpu_overhead.py at its defaults (GPT-2 small, sequence
# 1024, bf16, tau 12: CO2's boundary and host-memory state against plain training). Needs a CUDA
# build of torch and the test extra installed; writes its logs under $OUT (default results/gpu).
set -euo pipefail
out="${OUT:-results/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python - <<'PY' | tee "$out/device.txt"
import torch
assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
PY
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_gpu_overhead.py 2>&1 | tee "$out/cuda_tests.log"
timeout 300 python scripts/gpu_overhead.py --device cuda --repeats 3 2>&1 | tee "$out/gpu_overhead.jsonl"
