"""Waiting for a collective's work, bounded: the host's wait (``co2_timeout_s`` at most), the CUDA
stream's join, the timing events, and `BackgroundWork`, the thread a coded all-reduce runs in,
which is waited for like a collective's work. The communicators (``comm.py``, its docstring's
"Timing" and "Timeouts" say why each is so; ``co2_hf/torchft/``) share them.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

POLL_S = 2e-4  # the host's poll interval while a CUDA collective is in flight at a boundary


class BackgroundWork:
    """``fn`` run in a daemon thread, with the three methods of a collective's work that
    `bounded_wait` uses, so that it waits for both alike. Daemon: a thread stuck in a collective
    with a dead peer must not keep a failing process alive. On CUDA the thread ends once its work
    is queued on the side stream; it is complete when the side stream's last event is."""

    def __init__(self) -> None:
        self._done, self._error = threading.Event(), None
        self.done_event: Any = None  # CUDA: recorded on the side stream after the last collective

    def start(self, fn: Callable[[], None], *, after: BackgroundWork | None = None) -> None:
        """Run ``fn`` in the thread, once ``after`` (the previous coded all-reduce on the same group,
        if still running) has ended: collectives on one group must run in issue order."""
        threads = torch.get_num_threads()
        args = (fn, after, threads)
        threading.Thread(target=self._run, args=args, name="co2-coded-all-reduce", daemon=True).start()

    def _run(self, fn: Callable[[], None], after: BackgroundWork | None, threads: int) -> None:
        try:
            # A new thread's OpenMP team is as wide as the machine whatever torch.set_num_threads said
            # (the setting is per thread): the codec's ops would spill onto the cores of the other
            # ranks' compute (on 2 cores with one rank each: every op on both). Keep the caller's width.
            torch.set_num_threads(threads)
            if after is not None:
                after.join()
            fn()
        except BaseException as error:  # handed to the waiting thread, which raises it
            self._error = error
        finally:
            self._done.set()

    def wait(self, timeout: datetime.timedelta) -> None:
        if not self._done.wait(timeout.total_seconds()):
            raise RuntimeError(f"timed out after {timeout.total_seconds()}s")
        if self._error is not None:
            raise RuntimeError(f"{type(self._error).__name__}: {self._error}") from self._error

    def is_completed(self) -> bool:
        return self._done.is_set() and (self.done_event is None or self.done_event.query())

    def block_current_stream(self) -> None:
        """CUDA: the current stream waits for the side stream's last event (the thread's error, if any,
        is raised instead)."""
        self.wait(datetime.timedelta(0))
        torch.cuda.current_stream().wait_event(self.done_event)

    def join(self) -> None:
        """Until the thread has ended (its errors are for its own waiter to raise)."""
        self._done.wait()

    def ended_within(self, timeout_s: float) -> bool:
        """Whether the thread ends within ``timeout_s`` (at exit: is a coded all-reduce stuck?)."""
        return self._done.wait(timeout_s)


def bounded_wait(work: Any, tensor: Tensor, timeout_s: float) -> None:
    """Block the host until ``work`` is done, ``timeout_s`` at most (RuntimeError past it); on CUDA
    tensors the compute stream then waits for it too (which returns at once: it is done)."""
    if not tensor.is_cuda:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():  # also True once the watchdog has set an error, which wait() raises
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s}s")
        time.sleep(POLL_S)
    block_current_stream(work)


def block_current_stream(work: Any) -> None:
    """Make the current CUDA stream wait for ``work`` without blocking the host (torch >= 2.7 names it
    ``block_current_stream``; ``synchronize`` is the same for NCCL on older versions)."""
    (getattr(work, "block_current_stream", None) or work.synchronize)()


def record_event(tensor: Tensor) -> Any:
    """A timing CUDA event recorded now on the current stream of ``tensor``'s device; None on CPU."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(tensor.device))
    return event
