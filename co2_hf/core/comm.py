"""How CO2 talks to other workers: an injectable communicator.

The engine needs five verbs (``docs/algorithm.md``, "Communication"):

- ``broadcast_``: copy tensors from the first rank to every rank (blocking; at start-up);
- ``launch``: start a SUM all-reduce of the outer buffer across workers and return at once;
- ``wait``: block until a launched all-reduce is done (exactly once per launch);
- ``all_reduce_``: a blocking SUM over every process (data-parallel warm-up only; under FSDP2, over
  the processes that hold the same shard);
- ``reduce_stats``: sum small statistics over the processes of one worker, whose outer state is
  sharded between them (identity when a worker is one process);
- ``all_gather``: the chunks of the anchor held by the processes of one worker (identity for one);
- ``worker_all_reduce_``: a blocking SUM over the processes of one worker (its gradients, every
  step, when ``co2_worker_size > 1``).

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

    def worker_ranks(self) -> list[int]:
        return [0]

    def reduce_stats(self, partials: Tensor) -> Tensor:
        return partials

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        return [tensor]

    def worker_all_reduce_(self, tensor: Tensor) -> None:
        pass


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
    """CO2's collectives over torch.distributed process groups of its own.

    ``outer`` carries the outer all-reduce and nothing else: collectives on one group run in issue
    order, so an in-flight outer all-reduce must not queue other traffic behind it. With
    ``co2_worker_size = k > 1``, ``outer`` holds the processes with the same index j inside their
    worker (each all-reduces slice j of the flat outer gradient, so the k slow transfers run in
    parallel), ``worker`` the k processes of this worker (fast link), ``everyone`` all processes.
    """

    def __init__(self, outer: Any, *, worker: Any = None, everyone: Any = None, sharded_params: bool = False) -> None:
        self.group, self.worker_group = outer, worker
        self.everyone = everyone if everyone is not None else outer
        # FSDP2 shards the parameters inside a worker: the process of index j in every worker holds
        # the same shard, so start-up broadcasts and warm-up all-reduces run over the outer group
        self.sharded_params = sharded_params
        self.num_workers = dist.get_world_size(outer)
        self.worker_size = dist.get_world_size(worker) if worker is not None else 1
        self.worker_index = dist.get_rank(outer)
        self.shard_index = dist.get_rank(worker) if worker is not None else 0

    def broadcast_(self, tensors: list[Tensor]) -> None:
        group = self.group if self.sharded_params else self.everyone
        source = dist.get_global_rank(group, 0)
        for tensor in tensors:
            dist.broadcast(tensor, src=source, group=group)

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
        group = self.group if self.sharded_params else self.everyone
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)

    def worker_ranks(self) -> list[int]:
        """The global ranks of this process's worker."""
        if self.worker_group is None:
            return [dist.get_rank()]
        return dist.get_process_group_ranks(self.worker_group)

    def reduce_stats(self, partials: Tensor) -> Tensor:
        if self.worker_group is not None:
            dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=self.worker_group)
        return partials

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        if self.worker_group is None:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.worker_size)]
        dist.all_gather(parts, tensor, group=self.worker_group)
        return parts

    def worker_all_reduce_(self, tensor: Tensor) -> None:
        if self.worker_group is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.worker_group)


def make_communicator(
    *,
    process_group: Any = None,
    state_device: torch.device,
    timeout_s: float,
    worker_size: int = 1,
    sharded_params: bool = False,
) -> Communicator:
    """The communicator for this process: local when torch.distributed is not initialised.

    With ``process_group=None`` CO2 creates groups of its own over all ranks of the default group
    (every rank must construct CO2 at the same point: creating a group is collective). With
    ``worker_size = k``, ranks ``w*k .. w*k+k-1`` form worker w. Host-memory state needs gloo,
    whatever the default backend.
    """
    if process_group is None and not dist.is_initialized():
        return LocalCommunicator()
    if process_group is not None:
        if worker_size != 1:
            raise ValueError(f"co2_worker_size={worker_size} needs process_group=None: CO2 builds its groups itself")
        return ProcessGroupCommunicator(process_group)
    backend = "gloo" if state_device.type == "cpu" else None
    kwargs = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    world, rank = dist.get_world_size(), dist.get_rank()
    if worker_size == 1:
        return ProcessGroupCommunicator(dist.new_group(**kwargs))
    everyone = dist.new_group(**kwargs)
    worker = outer = None
    for w in range(world // worker_size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(w * worker_size, (w + 1) * worker_size)), **kwargs)
        worker = group if rank // worker_size == w else worker
    for j in range(worker_size):
        group = dist.new_group(list(range(j, world, worker_size)), **kwargs)
        outer = group if rank % worker_size == j else outer
    return ProcessGroupCommunicator(outer, worker=worker, everyone=everyone, sharded_params=sharded_params)


_WORKER_MESHES: dict[tuple[str, int], Any] = {}


def worker_mesh(worker_size: int, device_type: str | None = None) -> Any:
    """The 1-D DeviceMesh of this process's CO2 worker: what FSDP2 shards over inside a worker.

    ``fully_shard(module, mesh=worker_mesh(k))`` shards the model over the k consecutive ranks of
    one worker (``co2_worker_size = k``), never across workers. Collective the first time (every
    rank calls it with the same arguments); cached afterwards. ``device_type`` defaults to cuda
    when available, else cpu.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("worker_mesh needs torch.distributed to be initialised (init_process_group)")
    world = dist.get_world_size()
    if not isinstance(worker_size, int) or worker_size < 1 or world % worker_size:
        raise ValueError(f"co2_worker_size={worker_size!r} must be an integer >= 1 dividing the world size {world}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    key = (device_type, worker_size)
    if key not in _WORKER_MESHES:
        shape = (world // worker_size, worker_size)  # row-major: worker w is ranks w*k .. w*k+k-1
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("co2_outer", "co2_worker"))
        _WORKER_MESHES[key] = mesh["co2_worker"]
    return _WORKER_MESHES[key]
