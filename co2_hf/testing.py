"""Communicators for tests and benchmarks: a recording fake and a slow-link wrapper.

`FakeCommunicator` is one worker talking to itself (every all-reduce is the identity) that records
each call, so tests can check *when* the engine launches and waits; a hook can alter the reduced
buffer (e.g. to put ranks out of step). `DelayedCommunicator` wraps a real communicator and makes
each outer all-reduce complete no earlier than ``delay_s`` after its launch: a slow link simulated
honestly (the compute that overlaps it is real).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch import Tensor

from .core.comm import Communicator, LocalCommunicator, Pending


class FakeCommunicator(LocalCommunicator):
    """A single worker that records ``("launch", step)`` and ``("wait", step)`` events."""

    def __init__(self, *, delay_s: float = 0.0, on_reduce: Callable[[Tensor], None] | None = None) -> None:
        self.events: list[str] = []
        self.delay_s = delay_s
        self.on_reduce = on_reduce

    def launch(self, tensor: Tensor) -> Pending:
        self.events.append("launch")
        pending = Pending(tensor)
        pending.completed_at.append(pending.launched_at + self.delay_s)
        return pending

    def wait(self, pending: Pending, timeout_s: float) -> None:
        pending.mark_waited()
        self.events.append("wait")
        time.sleep(max(pending.completed_at[0] - time.perf_counter(), 0.0))
        if self.on_reduce is not None:
            self.on_reduce(pending.tensor)


class DelayedCommunicator(Communicator):
    """Wraps a communicator; each outer all-reduce completes at least ``delay_s`` after launch."""

    def __init__(self, inner: Communicator, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.num_workers, self.worker_index = inner.num_workers, inner.worker_index
        self.worker_size, self.shard_index = inner.worker_size, inner.shard_index

    def broadcast_(self, tensors: list[Tensor]) -> None:
        self.inner.broadcast_(tensors)

    def launch(self, tensor: Tensor) -> Pending:
        return self.inner.launch(tensor)

    def wait(self, pending: Pending, timeout_s: float) -> None:
        self.inner.wait(pending, timeout_s)
        due = pending.launched_at + self.delay_s
        time.sleep(max(due - time.perf_counter(), 0.0))
        real = pending.completed_at[0] if pending.completed_at else time.perf_counter()
        pending.completed_at[:] = [max(real, due)]

    def all_reduce_(self, tensor: Tensor) -> None:
        self.inner.all_reduce_(tensor)

    def reduce_stats(self, partials: Tensor) -> Tensor:
        return self.inner.reduce_stats(partials)
