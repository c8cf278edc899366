"""Does a user's CO2Trainer script exit cleanly? N consecutive two-process runs, counted.

A run is ``torchrun --nproc_per_node 2`` of this file's worker: a script as a user writes it (a tiny
GPT-2 from a config, ``CO2Trainer``, train with evaluations and checkpoints, ``save_model``, then the
end of the script, without ``trainer.end()``). It is clean when the launcher exits 0 and no rank
printed ``terminate called`` (the C++ abort seen once in 19 runs before co2_hf destroyed the groups
at exit: ``co2_hf/core/groups.py``, `_destroy_groups_at_exit`).

    python scripts/exit_check.py --runs 100 --out exit_out              # prints one JSON line
    python scripts/exit_check.py --runs 20 --amplify 1000 --out exit_out  # the race made likely
    python scripts/exit_check.py --runs 20 --freeze --co2_timeout_s 8 --out exit_out  # a frozen peer

``--amplify MS`` builds a small LD_PRELOAD shim (gcc) that makes every gloo worker thread sleep MS
milliseconds before it takes the GIL, from the last training step on: what a loaded machine does
by chance, so that a thread still alive at interpreter exit meets finalization nearly every run
(about 1 run in 3 aborted so before the fix). Each rank also reports how many gloo worker threads
are alive when the interpreter starts finalizing: the cause itself, 0 once the groups are destroyed.

``--freeze``: rank 1 stops itself (SIGSTOP) after an optimizer step, and the run checks how the other
rank ends: with exit status 1 within ``co2_timeout_s`` plus a few seconds, never SIGABRT. Even runs
keep the defaults (one fragment per inner step: the survivor stops in CO2's wait; run i freezes after
step 5 + i/2 mod 8, so some freezes meet a save and an evaluation); odd runs ("gather") log every step
with one fragment and freeze right after a boundary launched its all-reduce, so the survivor stops in
the Trainer's loss gather (torch's timeout) with CO2's all-reduce still in flight. Before co2_hf
abandoned the groups of a failed run at exit (``co2_hf/core/groups.py``, `_abandon_groups`), the
survivor printed its error, then hung at interpreter exit until the CO2 group's own timeout, a minute
later, and died of ``terminate called after throwing an instance of 'gloo::IoException'``. The ranks
are started without torchrun, whose agent would stop the survivor itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
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
FAULT_FILE = "fault.json"  # when rank 1 froze (--freeze)
ERROR_LINE = re.compile(r"^(?:\[rank0\]: )?\w+Error: (.*)$", re.M)  # a traceback's last line


def worker(
    out: str,
    *,
    steps: int,
    wire: str,
    amplify_ms: int,
    freeze_at: int = 0,
    co2_timeout_s: float = 900.0,
    gather: bool = False,
) -> None:
    """The user's script (under torchrun). ``freeze_at``: rank 1 stops itself after that step;
    ``gather``: one fragment, and a loss gather at every step (``--freeze``)."""
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
            if freeze_at and rank == 1 and state.global_step == freeze_at:
                freeze(out)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    ids = ((torch.arange(128)[:, None] + torch.arange(16)) % 64).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = CO2TrainingArguments(
        out,
        max_steps=steps,
        per_device_train_batch_size=4,
        logging_steps=1 if gather else 4,
        eval_strategy="steps",
        eval_steps=steps // 2,
        save_strategy="steps",
        save_steps=steps // 2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        co2_local_steps=4,
        co2_comm_dtype=wire,
        co2_timeout_s=co2_timeout_s,
        co2_fragments=1 if gather else None,
    )
    trainer = CO2Trainer(model=model, args=args, train_dataset=data, eval_dataset=data, callbacks=[Amplify()])
    trainer.train()
    trainer.save_model()
    # the end of the script: no trainer.end(), no destroy_process_group(), as in most user code


def engine_worker(out: str, *, freeze_at: int, co2_timeout_s: float, gather: bool) -> None:
    """``--engine``: the same fault on CO2's engine alone (no Trainer, so it starts in seconds): rank 1
    freezes before its optimizer step ``freeze_at``; ``gather``: one fragment, and after every step a
    collective on the default group (what the Trainer's loss gather is), timed out by its own timeout
    (``freeze_at`` 4: the survivor's all-reduce of round 1 is then in flight, alone)."""
    import datetime
    import math

    import torch
    import torch.distributed as dist

    from co2_hf import CO2, CO2Config

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=math.ceil(co2_timeout_s)))
    torch.manual_seed(rank)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = CO2Config(co2_local_steps=4, co2_timeout_s=co2_timeout_s, co2_fragments=1 if gather else None)
    co2 = CO2(model, config, optimizer=optimizer)
    for step in range(1, 1000):
        if rank == 1 and step == freeze_at:
            freeze(out)
        optimizer.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        co2.step()
        if gather:
            dist.all_reduce(torch.ones(1))


def freeze(out: str) -> None:
    """Rank 1 stops itself (SIGSTOP), after saying when."""
    with open(os.path.join(out, FAULT_FILE), "w") as f:
        json.dump({"at": time.time()}, f)
    os.kill(os.getpid(), signal.SIGSTOP)


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


def one_frozen_run(
    out: str,
    *,
    steps: int,
    freeze_at: int,
    co2_timeout_s: float,
    timeout_s: float,
    gather: bool = False,
    engine: bool = False,
) -> dict:
    """Two ranks started directly; rank 1 freezes at step ``freeze_at``: how and when rank 0 ends."""
    os.makedirs(out, exist_ok=True)
    port, procs = str(free_port()), []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank)}
        env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        command = [sys.executable, os.path.abspath(__file__), "--worker", out, "--steps", str(steps)]
        command += ["--freeze_at", str(freeze_at), "--co2_timeout_s", str(co2_timeout_s)]
        command += ["--gather"] * gather + ["--engine"] * engine
        with open(os.path.join(out, f"rank{rank}.log"), "w") as log:
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        rc = procs[0].wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    ended = time.time()
    for proc in procs:
        proc.kill()
        proc.wait()
    with open(os.path.join(out, "rank0.log")) as f:
        log = f.read()
    fault_path = os.path.join(out, FAULT_FILE)
    fault = json.load(open(fault_path))["at"] if os.path.exists(fault_path) else None
    return {
        "freeze_at": freeze_at,
        "gather": gather,
        "rc": rc,
        "exit_after_fault_s": round(ended - fault, 2) if fault is not None else None,
        "error": _last_error(log),
        "terminate_called": log.count("terminate called"),
        "clean": rc == 1 and "terminate called" not in log and fault is not None,
        "tail": log[-3000:],
    }


def _last_error(log: str) -> str:
    """Whose error the survivor stopped with: "co2" (CO2's own, naming co2_timeout_s) or "torch"."""
    raised = ERROR_LINE.findall(log)
    return "none" if not raised else "co2" if "co2_timeout_s" in raised[-1] else "torch"


def frozen_runs(a: argparse.Namespace, tmp: str) -> dict:
    """``--freeze``: ``a.runs`` runs, each freezing rank 1 after another step; the survivors' ends."""
    results = []
    for i in range(a.runs):
        gather = i % 2 == 1
        freeze_at = 4 * (1 + i // 2 % 2) if gather else 5 + i // 2 % 8  # gather: right after a boundary
        timeout = a.co2_timeout_s + 120
        result = one_frozen_run(
            os.path.join(tmp, f"run{i}"),
            steps=a.steps,
            freeze_at=freeze_at,
            gather=gather,
            engine=a.engine,
            co2_timeout_s=a.co2_timeout_s,
            timeout_s=timeout,
        )
        results.append(result)
        if not result["clean"]:
            with open(os.path.join(a.out, f"failed_frozen_run{i}.log"), "w") as f:
                f.write(result["tail"])
    times = [r["exit_after_fault_s"] for r in results if r["exit_after_fault_s"] is not None]
    return {
        "runs": a.runs,
        "freeze": True,
        "co2_timeout_s": a.co2_timeout_s,
        "engine": a.engine,
        "exit_status_1": sum(r["clean"] for r in results),
        "exit_codes": sorted({str(r["rc"]) for r in results}),
        "terminate_called": sum(r["terminate_called"] > 0 for r in results),
        "exit_after_fault_s": [min(times), max(times)] if times else None,
        "errors": {kind: sum(r["error"] == kind for r in results) for kind in ("co2", "torch")},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=24, help="training steps per run (a multiple of 8)")
    parser.add_argument("--wire", default="float32", help="co2_comm_dtype (int8: the coded all-reduce's thread)")
    parser.add_argument("--amplify", type=int, default=0, help="ms a gloo thread waits before the GIL (0: off)")
    parser.add_argument("--out", default="exit_out", help="folder for the runs' outputs and failing logs")
    parser.add_argument("--timeout_s", type=float, default=300.0)
    parser.add_argument("--freeze", action="store_true", help="rank 1 freezes mid-run: does rank 0 exit 1 in time?")
    parser.add_argument("--co2_timeout_s", type=float, default=900.0)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--freeze_at", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--gather", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", action="store_true", help="--freeze: CO2's engine alone, without the Trainer")
    a = parser.parse_args(argv)
    if a.worker is not None and a.engine:
        engine_worker(a.worker, freeze_at=a.freeze_at, co2_timeout_s=a.co2_timeout_s, gather=a.gather)
        return {}
    if a.worker is not None:
        worker(
            a.worker,
            steps=a.steps,
            wire=a.wire,
            amplify_ms=a.amplify,
            freeze_at=a.freeze_at,
            co2_timeout_s=a.co2_timeout_s,
            gather=a.gather,
        )
        return {}
    os.makedirs(a.out, exist_ok=True)
    if a.freeze:
        with tempfile.TemporaryDirectory() as tmp:
            return _report(frozen_runs(a, tmp), a.out)
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
    return _report(summary, a.out)


def _report(summary: dict, out: str) -> dict:
    print(json.dumps(summary))
    with open(os.path.join(out, "summary.jsonl"), "a") as f:
        f.write(json.dumps(summary) + "\n")
    return summary


if __name__ == "__main__":
    main()
