"""Run a function on N fresh CPU processes joined by gloo, with a ``file://`` rendezvous.

Each rank's return value comes back to the caller; an exception on any rank fails the caller with
that rank's traceback, and a hang is killed after ``timeout_s`` instead of blocking the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
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
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(fn, rank, world, init_file, tmp, args), daemon=True)
            for rank in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        outputs = []
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} produced no result (hung ranks: {hung})")
            outputs.append(torch.load(path, weights_only=False))
        errors = [f"rank {r}:\n{o['error']}" for r, o in enumerate(outputs) if not o["ok"]]
        if errors:
            raise RuntimeError("\n".join(errors))
        if hung:
            raise RuntimeError(f"ranks {hung} did not exit within {timeout_s}s")
        return [o["result"] for o in outputs]
