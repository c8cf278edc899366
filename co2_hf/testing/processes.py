"""N local CPU processes joined by gloo: `run_processes`, and `run_with_faults` for runs in which
ranks die or freeze on purpose.

`run_processes` runs a function on N fresh CPU processes joined by gloo through a ``file://``
rendezvous (parallel runs never fight over ports); each rank's return value comes back, an
exception on any rank fails the caller with that rank's traceback, and a hang is killed.
`run_with_faults` is its counterpart for runs in which ranks die or freeze on purpose: it reports
each rank's outcome instead of failing, and forks ranks from a server that imported the heavy
modules once, so that many short runs stay cheap.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch


def _entry(fn: Callable, rank: int, world: int, init_file: str, out_dir: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, result_path)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report to the parent, which decides what fails
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        os._exit(1)


def run_processes(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = _start_ranks(mp.get_context("spawn"), _entry, fn, world, tmp, args)
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        outputs = [_outcome(tmp, rank) for rank in range(world)]
        for rank, output in enumerate(outputs):
            if output is None:
                raise RuntimeError(f"rank {rank} produced no result (hung ranks: {hung})")
        errors = [f"rank {r}:\n{o['error']}" for r, o in enumerate(outputs) if not o["ok"]]
        if errors:
            raise RuntimeError("\n".join(errors))
        if hung:
            raise RuntimeError(f"ranks {hung} did not exit within {timeout_s}s")
        return [o["result"] for o in outputs]


# what Trainer runs import: a forkserver that imported them once starts each rank in a blink (the
# forkserver skips a module that is not installed: datasets comes with the `test`/`recipes` extras)
HF_PRELOAD = ("torch", "transformers", "datasets", "accelerate", "co2_hf.integrations.trainer")


def _entry_with_faults(fn: Callable, rank: int, world: int, init_file: str, out_dir: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        rendezvous = dict(init_method=f"file://{init_file}", rank=rank, world_size=world)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60), **rendezvous)
        torch.save({"ok": True, "result": fn(rank, world, *args)}, result_path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # no barrier and no teardown: a peer may be dead or frozen, and both would then block or abort
    os._exit(0)


def run_with_faults(
    fn: Callable,
    world: int,
    *args: Any,
    wait_for: Iterable[int] | None = None,
    timeout_s: float = 120.0,
    preload: tuple[str, ...] = ("torch",),
) -> list[dict[str, Any] | None]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes in which ranks may die or freeze.

    Returns one outcome per rank: ``{"ok": True, "result": ...}``, ``{"ok": False, "error":
    traceback}``, or None for a rank that left nothing (killed). Waits up to ``timeout_s`` for the
    ranks in ``wait_for`` (default: all), then SIGKILLs every rank still there (frozen ones
    included). Ranks are forked from a forkserver that imported ``preload`` once per session.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))  # only the first call, which starts the server, counts
    waited = set(range(world) if wait_for is None else wait_for)
    with tempfile.TemporaryDirectory() as tmp:
        procs = _start_ranks(ctx, _entry_with_faults, fn, world, tmp, args)
        deadline = time.monotonic() + timeout_s
        for rank in sorted(waited):
            procs[rank].join(max(deadline - time.monotonic(), 0.0))
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
        return [_outcome(tmp, rank) for rank in range(world)]


def _start_ranks(ctx: Any, entry: Callable, fn: Callable, world: int, tmp: str, args: tuple) -> list:
    """``world`` started processes of ``ctx`` running ``entry`` for ``fn``, joined by a ``file://``
    rendezvous in ``tmp``, where each writes its outcome (`_outcome`)."""
    init_file = os.path.join(tmp, "rendezvous")
    procs = [
        ctx.Process(target=entry, args=(fn, rank, world, init_file, tmp, args), daemon=True) for rank in range(world)
    ]
    for p in procs:
        p.start()
    return procs


def _outcome(tmp: str, rank: int) -> dict[str, Any] | None:
    """What rank ``rank`` wrote (``{"ok": ..., "result" or "error": ...}``), or None: it wrote nothing.
    Read as any file is, without unpickling arbitrary objects: a rank's result is made of tensors,
    numbers, strings and containers."""
    path = os.path.join(tmp, f"rank{rank}.pt")
    return torch.load(path, weights_only=True) if os.path.exists(path) else None
