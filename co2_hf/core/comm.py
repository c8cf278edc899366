"""How CO2 talks to other workers: an injectable communicator.

The engine needs five verbs (``docs/algorithm.md``, "Communication"):

- ``broadcast_``: copy tensors from the first rank to every rank (blocking; at start-up);
- ``launch``: start a SUM all-reduce of the outer buffer across workers and return at once;
- ``wait``: block until a launched all-reduce is done (exactly once per launch);
- ``all_reduce_``: a blocking SUM across workers (data-parallel warm-up only);
- ``reduce_stats``: sum small statistics over the ranks of one worker (identity when the worker is
  one process, the only case so far) -- the hook through which sharded state plugs in.

`ProcessGroupCommunicator` implements them over a process group of CO2's own, issued from the
main thread with ``async_op=True``; no Python threads. `LocalCommunicator` is the single-worker
case, where every all-reduce is the identity. Tests inject fakes (``co2_hf.testing``).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class Pending:
    """An outer all-reduce in flight: its tensor, when it was launched and when it completed."""

    tensor: Tensor
    work: Any = None
    launched_at: float = field(default_factory=time.perf_counter)
    # set by the work's completion callback (a list, so the callback can append from any thread)
    completed_at: list[float] = field(default_factory=list)
    waited: bool = False

    def mark_waited(self) -> None:
        if self.waited:
            raise RuntimeError("CO2 internal error: an outer all-reduce was waited twice")
        self.waited = True

    def comm_seconds(self) -> float:
        """Launch to completion, as reported by the completion callback."""
        end = self.completed_at[0] if self.completed_at else time.perf_counter()
        return max(end - self.launched_at, 0.0)


class Communicator:
    """The interface the engine uses; see the module docstring for the verbs."""

    num_workers: int = 1
    worker_index: int = 0
    worker_size: int = 1
    shard_index: int = 0

    def broadcast_(self, tensors: list[Tensor]) -> None:
        raise NotImplementedError

    def launch(self, tensor: Tensor) -> Pending:
        raise NotImplementedError

    def wait(self, pending: Pending, timeout_s: float) -> None:
        raise NotImplementedError

    def all_reduce_(self, tensor: Tensor) -> None:
        raise NotImplementedError

    def reduce_stats(self, partials: Tensor) -> Tensor:
        return partials


class LocalCommunicator(Communicator):
    """One worker, no process group: every collective is the identity."""

    def broadcast_(self, tensors: list[Tensor]) -> None:
        pass

    def launch(self, tensor: Tensor) -> Pending:
        pending = Pending(tensor)
        pending.completed_at.append(pending.launched_at)
        return pending

    def wait(self, pending: Pending, timeout_s: float) -> None:
        pending.mark_waited()

    def all_reduce_(self, tensor: Tensor) -> None:
        pass


class ProcessGroupCommunicator(Communicator):
    """CO2's collectives over a torch.distributed process group dedicated to the outer all-reduce.

    Collectives on one group run in issue order, so the group must carry nothing else while an
    outer all-reduce is in flight: that is why CO2 creates its own group.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.num_workers = dist.get_world_size(group)
        self.worker_index = dist.get_rank(group)
        self._source = dist.get_global_rank(group, 0)

    def broadcast_(self, tensors: list[Tensor]) -> None:
        for tensor in tensors:
            dist.broadcast(tensor, src=self._source, group=self.group)

    def launch(self, tensor: Tensor) -> Pending:
        pending = Pending(tensor)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        pending.work = work
        work.get_future().then(lambda _: pending.completed_at.append(time.perf_counter()))
        return pending

    def wait(self, pending: Pending, timeout_s: float) -> None:
        pending.mark_waited()
        pending.work.wait(timeout=datetime.timedelta(seconds=timeout_s))

    def all_reduce_(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)


def make_communicator(*, process_group: Any = None, state_device: torch.device, timeout_s: float) -> Communicator:
    """The communicator for this process: local when torch.distributed is not initialised.

    With ``process_group=None`` CO2 creates a group of its own over all ranks of the default group
    (every rank must construct CO2 at the same point: creating a group is collective). Host-memory
    state needs gloo, whatever the default backend.
    """
    if process_group is None and not dist.is_initialized():
        return LocalCommunicator()
    if process_group is None:
        backend = "gloo" if state_device.type == "cpu" else None
        process_group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return ProcessGroupCommunicator(process_group)
