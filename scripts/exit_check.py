"""Does a user's CO2Trainer script exit cleanly? N consecutive two-process runs, counted.

A run is ``torchrun --nproc_per_node 2`` of this file's worker: a script as a user writes it (a tiny
GPT-2 from a config, ``CO2Trainer``, train with evaluations and checkpoints, ``save_model``, then the
end of the script, without ``trainer.end()``). It is clean when the launcher exits 0 and no rank
printed ``terminate called`` (the C++ abort seen once in 19 runs before co2_hf destroyed the groups
at exit: ``co2_hf/core/comm.py``, `_destroy_groups_at_exit`).

    python scripts/exit_check.py --runs 100 --out exit_out              # prints one JSON line
    python scripts/exit_check.py --runs 20 --amplify 1000 --out exit_out  # the race made likely

``--amplify MS`` builds a small LD_PRELOAD shim (gcc) that makes every gloo worker thread sleep MS
milliseconds before it takes the GIL, from the last training step on: what a loaded machine does
by chance, so that a thread still alive at interpreter exit meets finalization nearly every run
(about 1 run in 3 aborted so before the fix). Each rank also reports how many gloo worker threads
are alive when the interpreter starts finalizing: the cause itself, 0 once the groups are destroyed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef void (*acquire_fn)(void *);
void PyEval_AcquireThread(void *tstate) {
    static acquire_fn real = NULL;
    if (!real) real = (acquire_fn)dlsym(RTLD_NEXT, "PyEval_AcquireThread");
    char name[32] = {0};
    pthread_getname_np(pthread_self(), name, sizeof name);
    const char *ms = getenv("CO2_EXIT_CHECK_GIL_DELAY_MS");
    long d = ms ? atol(ms) : 0;
    if (d > 0 && strncmp(name, "pt_gloo", 7) == 0) {
        struct timespec ts = {d / 1000, (d % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    real(tstate);
}
"""
GLOO_THREADS = re.compile(r"gloo worker threads alive at finalization: (\d+)")


def worker(out: str, *, steps: int, wire: str, amplify_ms: int) -> None:
    """The user's script (under torchrun)."""
    import atexit

    rank = int(os.environ["RANK"])

    def gloo_threads_left() -> None:  # registered first, so it runs after every other exit handler
        names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
        count = sum(name.startswith("pt_gloo") for name in names)
        print(f"rank {rank}: gloo worker threads alive at finalization: {count}", file=sys.stderr, flush=True)

    atexit.register(gloo_threads_left)

    import torch
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

    from co2_hf import CO2Trainer, CO2TrainingArguments

    class Amplify(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if amplify_ms and state.global_step == steps:
                os.environ["CO2_EXIT_CHECK_GIL_DELAY_MS"] = str(amplify_ms)  # read by the shim

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    ids = ((torch.arange(128)[:, None] + torch.arange(16)) % 64).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = CO2TrainingArguments(
        out,
        max_steps=steps,
        per_device_train_batch_size=4,
        logging_steps=4,
        eval_strategy="steps",
        eval_steps=steps // 2,
        save_strategy="steps",
        save_steps=steps // 2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        co2_local_steps=4,
        co2_comm_dtype=wire,
    )
    trainer = CO2Trainer(model=model, args=args, train_dataset=data, eval_dataset=data, callbacks=[Amplify()])
    trainer.train()
    trainer.save_model()
    # the end of the script: no trainer.end(), no destroy_process_group(), as in most user code


def build_shim(directory: str) -> str:
    source, library = os.path.join(directory, "gil_delay.c"), os.path.join(directory, "gil_delay.so")
    with open(source, "w") as f:
        f.write(SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", library, source, "-ldl", "-lpthread"], check=True)
    return library


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(out: str, *, steps: int, wire: str, amplify_ms: int, shim: str | None, timeout_s: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if shim is not None:
        env["LD_PRELOAD"] = shim
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port", str(free_port())),
        *(os.path.abspath(__file__), "--worker", out, "--steps", str(steps), "--wire", wire),
        *("--amplify", str(amplify_ms)),
    ]
    start = time.time()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        rc, log = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        rc, log = "timeout", str(expired.stdout or "") + str(expired.stderr or "")
    threads = [int(n) for n in GLOO_THREADS.findall(log)]
    return {
        "rc": rc,
        "terminate_called": log.count("terminate called"),
        "gloo_threads_at_exit": threads,
        "wall_s": round(time.time() - start, 1),
        "clean": rc == 0 and "terminate called" not in log,
        "tail": log[-2000:] if rc != 0 or "terminate called" in log else "",
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=24, help="training steps per run (a multiple of 8)")
    parser.add_argument("--wire", default="float32", help="co2_comm_dtype (int8: the coded all-reduce's thread)")
    parser.add_argument("--amplify", type=int, default=0, help="ms a gloo thread waits before the GIL (0: off)")
    parser.add_argument("--out", default="exit_out", help="folder for the runs' outputs and failing logs")
    parser.add_argument("--timeout_s", type=float, default=300.0)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.worker is not None:
        worker(a.worker, steps=a.steps, wire=a.wire, amplify_ms=a.amplify)
        return {}
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        shim = build_shim(tmp) if a.amplify else None
        results = []
        for i in range(a.runs):
            result = one_run(
                os.path.join(tmp, f"run{i}"),
                steps=a.steps,
                wire=a.wire,
                amplify_ms=a.amplify,
                shim=shim,
                timeout_s=a.timeout_s,
            )
            results.append(result)
            if not result["clean"]:
                with open(os.path.join(a.out, f"failed_run{i}.log"), "w") as f:
                    f.write(result["tail"])
    summary = {
        "runs": a.runs,
        "clean": sum(r["clean"] for r in results),
        "exit_codes": sorted({str(r["rc"]) for r in results}),
        "terminate_called": sum(r["terminate_called"] > 0 for r in results),
        "gloo_threads_at_exit": sorted({n for r in results for n in r["gloo_threads_at_exit"]}),
        "wall_s_per_run": round(sum(r["wall_s"] for r in results) / max(len(results), 1), 1),
        "wire": a.wire,
        "amplify_ms": a.amplify,
    }
    print(json.dumps(summary))
    with open(os.path.join(a.out, "summary.jsonl"), "a") as f:
        f.write(json.dumps(summary) + "\n")
    return summary


if __name__ == "__main__":
    main()
