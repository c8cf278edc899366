"""G simulated workers in one process, and the collectives of a world of one.

`SimulatedNetwork` stands in for the process group of G workers in one process, one thread per
worker: ``network.communicator(i)`` is worker i's `SimulatedCommunicator`, whose collectives are
matched by call order and summed in worker order (deterministic). `SimulatedCollectives` are the
all-to-all and all-gather of the quantized wire between them. `LocalCollectives` are those of a
world of one rank (each copies its input).
"""

from __future__ import annotations

import threading
import time

import torch
from torch import Tensor

from ..core.comm import Communicator, Pending


class SimulatedNetwork:
    """The collectives of G workers, matched by call order: the k-th launch of every worker
    belongs to the same all-reduce, as on a real process group."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._cond = threading.Condition()
        self._deposits: dict[tuple, dict[int, Tensor]] = {}

    def communicator(self, index: int) -> SimulatedCommunicator:
        return SimulatedCommunicator(self, index)

    def deposit(self, key: tuple, index: int, tensor: Tensor) -> None:
        with self._cond:
            self._deposits.setdefault(key, {})[index] = tensor.detach().clone()
            self._cond.notify_all()

    def collect(self, key: tuple, timeout_s: float) -> list[Tensor]:
        """Every worker's deposit for ``key``, in worker order, once all have arrived."""
        with self._cond:
            arrived = self._cond.wait_for(lambda: len(self._deposits.get(key, {})) == self.num_workers, timeout_s)
            if not arrived:
                raise RuntimeError(f"simulated collective {key} timed out after {timeout_s}s")
            return [self._deposits[key][i] for i in range(self.num_workers)]


class SimulatedCommunicator(Communicator):
    """Worker ``index`` of a `SimulatedNetwork`: each worker calls its own from a thread of its own
    (a blocking collective waits for the other workers' contributions)."""

    def __init__(self, network: SimulatedNetwork, index: int) -> None:
        self.network, self.worker_index, self.num_workers = network, index, network.num_workers
        self._calls: dict[str, int] = {}

    def _key(self, kind: str) -> tuple:
        n = self._calls.get(kind, 0)
        self._calls[kind] = n + 1
        return kind, n

    def broadcast_(self, tensors: list[Tensor]) -> None:
        key = self._key("broadcast")
        for j, tensor in enumerate(tensors):
            self.network.deposit((*key, j), self.worker_index, tensor)
            tensor.copy_(self.network.collect((*key, j), 60)[0])

    def launch(self, tensor: Tensor) -> Pending:
        pending = Pending(tensor, work=self._key("reduce"))
        self.network.deposit(pending.work, self.worker_index, tensor)
        return pending

    def launch_coded(self, tensor: Tensor, reduce_) -> Pending:
        # the coded all-reduce runs at the wait, in the worker's own thread: every worker waits for
        # its launches in the same order, so the collectives inside it meet as on a process group
        return Pending(tensor, work=("coded", reduce_))

    def wait(self, pending: Pending, timeout_s: float) -> None:
        pending.mark_waited()
        if pending.work[0] == "coded":
            pending.work[1](SimulatedCollectives(self))
        else:
            parts = self.network.collect(pending.work, timeout_s)
            pending.tensor.copy_(torch.stack(parts).sum(0))
        pending.completed_at.append(time.perf_counter())

    def all_reduce_(self, tensor: Tensor) -> None:
        key = self._key("all_reduce")
        self.network.deposit(key, self.worker_index, tensor)
        tensor.copy_(torch.stack(self.network.collect(key, 60)).sum(0))


class SimulatedCollectives:
    """The all-to-all and all-gather of the quantized wire (``Collectives``) between simulated workers."""

    def __init__(self, comm: SimulatedCommunicator) -> None:
        self.comm, self.world_size, self.rank = comm, comm.num_workers, comm.worker_index

    def all_to_all_(self, output: Tensor, input: Tensor) -> None:
        parts = self._exchange("all_to_all", input)
        output.copy_(torch.cat([part.view(self.world_size, -1)[self.rank] for part in parts]))

    def all_gather_(self, output: Tensor, input: Tensor) -> None:
        output.copy_(torch.cat(self._exchange("all_gather", input)))

    def _exchange(self, kind: str, tensor: Tensor) -> list[Tensor]:
        key = self.comm._key(kind)
        self.comm.network.deposit(key, self.rank, tensor)
        return self.comm.network.collect(key, 60)


class LocalCollectives:
    """The quantized wire's collectives (``Collectives``) in a world of one rank: each copies."""

    world_size, rank = 1, 0

    def all_to_all_(self, output: Tensor, input: Tensor) -> None:
        output.copy_(input)

    all_gather_ = all_to_all_
