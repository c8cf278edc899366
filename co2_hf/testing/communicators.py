"""Communicator fakes: one worker that records its calls, and wrappers around a real communicator.

`FakeCommunicator` is one worker talking to itself (every all-reduce is the identity) that records
each call, so tests can check *when* the engine launches and waits; a hook can alter the reduced
buffer (e.g. to put ranks out of step); ``num_workers`` tells the engine it is one of several
(for what the constructor sizes; nothing travels). `QuorumCommunicator` is one worker on a
transport that reconfigures between rounds (torchft's), dropping the rounds it is told to.
`RecordingCommunicator` wraps a real communicator and keeps what this rank sent and what each
all-reduce returned. `DelayedCommunicator` wraps a real communicator and makes each outer
all-reduce complete no earlier than ``delay_s`` after its launch: a slow link simulated honestly
(the compute that overlaps it is real). Both derive from `ForwardingCommunicator`, which forwards
every verb to the wrapped one: a new wrapper overrides only the verbs it changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from torch import Tensor

from ..core.comm import Communicator, LocalCommunicator, Pending


class FakeCommunicator(LocalCommunicator):
    """A single worker that records ``"launch"`` and ``"wait"`` events.

    ``num_workers > 1`` makes the engine believe it is one of that many workers (what it sizes at
    construction, e.g. the coded wire's residuals); every all-reduce is still the identity, so
    the sums are not a real run's."""

    def __init__(
        self,
        *,
        delay_s: float = 0.0,
        on_reduce: Callable[[Tensor], None] | None = None,
        num_workers: int = 1,
    ) -> None:
        self.num_workers = num_workers
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


class QuorumCommunicator(FakeCommunicator):
    """A single worker on a transport that reconfigures between rounds, as torchft does
    (``co2_hf/torchft/``): it records ``"quorum"`` (with how many all-reduces were in flight then, which
    must be none), ``"launch"``, ``"wait"`` and ``"commit"`` events, and ``commit`` answers False
    for the launches numbered in ``drop`` (0-based): those rounds are dropped, as when a
    participant dies with the all-reduce in flight. ``on_quorum`` runs inside each quorum, where
    torchft loads a live peer's state into a replica that is behind; it returns whether it loaded
    one taken at the peer's boundary (what ``start_quorum`` returns)."""

    reconfigures = True

    def __init__(
        self, *, drop: Iterable[int] = (), num_workers: int = 1, on_quorum: Callable[[], bool] | None = None
    ) -> None:
        super().__init__(num_workers=num_workers)
        self.drop, self.on_quorum, self._launched, self._in_flight = set(drop), on_quorum, [], 0

    def start_quorum(self) -> bool:
        self.events.append(f"quorum:{self._in_flight}")
        return self.on_quorum is not None and bool(self.on_quorum())

    def launch(self, tensor: Tensor) -> Pending:
        pending = super().launch(tensor)
        pending.senders = self.num_workers
        self._launched.append(pending)
        self._in_flight += 1
        return pending

    def wait(self, pending: Pending, timeout_s: float) -> None:
        super().wait(pending, timeout_s)
        self._in_flight -= 1

    def commit(self, pending: Pending) -> bool:
        self.events.append("commit")
        index = next(i for i, launched in enumerate(self._launched) if launched is pending)
        return index not in self.drop


class ForwardingCommunicator(Communicator):
    """Wraps a communicator and forwards every verb to it (tests/test_engine_local.py checks that
    none is left out): a wrapper derives from it and overrides only the verbs it changes."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.num_workers, self.worker_index = inner.num_workers, inner.worker_index
        self.worker_size, self.shard_index = inner.worker_size, inner.shard_index

    def broadcast_(self, tensors: list[Tensor]) -> None:
        self.inner.broadcast_(tensors)

    def launch(self, tensor: Tensor) -> Pending:
        return self.inner.launch(tensor)

    def launch_coded(self, tensor: Tensor, reduce_: Callable) -> Pending:
        return self.inner.launch_coded(tensor, reduce_)

    def wait(self, pending: Pending, timeout_s: float) -> None:
        self.inner.wait(pending, timeout_s)

    def all_reduce_(self, tensor: Tensor) -> None:
        self.inner.all_reduce_(tensor)

    def worker_ranks(self) -> list[int]:
        return self.inner.worker_ranks()

    def reduce_stats(self, partials: Tensor) -> Tensor:
        return self.inner.reduce_stats(partials)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        return self.inner.all_gather(tensor)

    def worker_all_reduce_(self, tensor: Tensor) -> None:
        self.inner.worker_all_reduce_(tensor)

    @property
    def reconfigures(self) -> bool:
        return self.inner.reconfigures

    def start_quorum(self) -> bool:
        return self.inner.start_quorum()

    def commit(self, pending: Pending) -> bool:
        return self.inner.commit(pending)


class RecordingCommunicator(ForwardingCommunicator):
    """Wraps a communicator; keeps what this rank sent and what the all-reduce returned, per round
    (``sent``: the buffer at each launch; ``summed``: the raw sum at each wait, before the engine
    divides it)."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner)
        self.sent, self.summed = [], []

    def launch(self, tensor: Tensor) -> Pending:
        self.sent.append(tensor.clone())
        return super().launch(tensor)

    def launch_coded(self, tensor: Tensor, reduce_: Callable) -> Pending:
        self.sent.append(tensor.clone())
        return super().launch_coded(tensor, reduce_)

    def wait(self, pending: Pending, timeout_s: float) -> None:
        super().wait(pending, timeout_s)
        self.summed.append(pending.tensor.clone())


class DelayedCommunicator(ForwardingCommunicator):
    """Wraps a communicator; each outer all-reduce completes at least ``delay_s`` after launch (the
    verbs inside a worker, ``co2_worker_size > 1``, are not delayed). Inject it at construction,
    ``CO2(model, config, communicator=DelayedCommunicator(inner, delay_s))``: the engine's
    fragments keep the communicator they were built with."""

    def __init__(self, inner: Communicator, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    def wait(self, pending: Pending, timeout_s: float) -> None:
        super().wait(pending, timeout_s)
        due = pending.launched_at + self.delay_s
        time.sleep(max(due - time.perf_counter(), 0.0))
        real = pending.completed_at[0] if pending.completed_at else time.perf_counter()
        pending.completed_at[:] = [max(real, due)]
