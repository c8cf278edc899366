"""CO2's process groups: the ones it makes (their backend and timeout), the FSDP2 mesh of a worker,
and their end at interpreter exit (destroyed after a clean run, abandoned after a failure).

The communicator that uses the groups is ``comm.py``'s; this module builds it (`make_communicator`)
and owns the groups' lifetime, which is a process's business rather than one communicator's.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import gc
import sys
from typing import Any

import torch
import torch.distributed as dist

from .comm import _OPEN, Communicator, LocalCommunicator, ProcessGroupCommunicator


def group_timeout(timeout_s: float) -> datetime.timedelta:
    """The timeout of CO2's process groups: well above ``co2_timeout_s``, so that CO2's bounded waits
    raise its own error first and NCCL's watchdog only catches what CO2 does not wait for itself."""
    return datetime.timedelta(seconds=max(2 * timeout_s, timeout_s + 60))


def group_backend(state_device: torch.device, default_backend: str) -> str | None:
    """The backend of CO2's groups: the default group's (None) when the state lives with the model.
    Host-memory state needs gloo for the outer exchange; with a GPU model under NCCL the groups are
    per device (``cpu:gloo,cuda:nccl``), so the per-step gradient average inside a worker, on CUDA
    tensors, stays on NCCL (NVLink) and only host tensors cross gloo."""
    if state_device.type != "cpu":
        return None
    return "cpu:gloo,cuda:nccl" if "nccl" in default_backend else "gloo"


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
    ``worker_size = k``, ranks ``w*k .. w*k+k-1`` form worker w. The groups' backend is
    `group_backend`'s, their timeout `group_timeout`'s.
    """
    if process_group is None and not dist.is_initialized():
        return LocalCommunicator()
    if process_group is not None:
        if worker_size != 1:
            raise ValueError(f"co2_worker_size={worker_size} needs process_group=None: CO2 builds its groups itself")
        return ProcessGroupCommunicator(process_group, timeout_s=timeout_s)
    kwargs = dict(backend=group_backend(state_device, str(dist.get_backend())), timeout=group_timeout(timeout_s))
    world, rank = dist.get_world_size(), dist.get_rank()
    if worker_size == 1:
        return ProcessGroupCommunicator(dist.new_group(**kwargs), timeout_s=timeout_s)
    everyone = dist.new_group(**kwargs)
    worker, outer = _worker_group(worker_size, **kwargs), None
    for j in range(worker_size):
        group = dist.new_group(list(range(j, world, worker_size)), **kwargs)
        outer = group if rank % worker_size == j else outer
    return ProcessGroupCommunicator(
        outer, worker=worker, everyone=everyone, sharded_params=sharded_params, timeout_s=timeout_s
    )


def _worker_group(worker_size: int, **kwargs: Any) -> Any:
    """This process's worker: the group of ranks ``w*k .. w*k+k-1`` that holds it. Collective: every
    rank creates every worker's group, in the same order."""
    world, rank, mine = dist.get_world_size(), dist.get_rank(), None
    for w in range(world // worker_size):
        group = dist.new_group(list(range(w * worker_size, (w + 1) * worker_size)), **kwargs)
        mine = group if rank // worker_size == w else mine
    return mine


_WORKER_MESHES: dict[tuple[str, int, float | None], Any] = {}


def worker_mesh(worker_size: int, device_type: str | None = None, *, timeout_s: float | None = None) -> Any:
    """The 1-D DeviceMesh of this process's CO2 worker: what FSDP2 shards over inside a worker.

    ``fully_shard(module, mesh=worker_mesh(k, timeout_s=co2_timeout_s))`` shards the model over the
    k consecutive ranks of one worker (``co2_worker_size = k``), never across workers. Collective the
    first time (every rank calls it with the same arguments); cached afterwards. ``device_type``
    defaults to cuda when available, else cpu. ``timeout_s`` (``co2_timeout_s``) gives the mesh's
    groups `group_timeout` instead of torch's default (10 min on NCCL, 30 on gloo), so that FSDP2's
    collectives with a dead peer inside the worker end as soon as CO2's own.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        raise RuntimeError("worker_mesh needs torch.distributed to be initialised (init_process_group)")
    world = dist.get_world_size()
    if not isinstance(worker_size, int) or worker_size < 1 or world % worker_size:
        raise ValueError(f"co2_worker_size={worker_size!r} must be an integer >= 1 dividing the world size {world}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    key = (device_type, worker_size, timeout_s)
    if key not in _WORKER_MESHES:
        timeout = group_timeout(timeout_s) if timeout_s is not None else None
        mine = _worker_group(worker_size, timeout=timeout)
        _WORKER_MESHES[key] = DeviceMesh.from_group(mine, device_type, mesh_dim_names=("co2_worker",))
    return _WORKER_MESHES[key]


# ---------------------------------------------------------------------- interpreter exit


@atexit.register
def _destroy_groups_at_exit() -> None:
    """Destroy every process group before the interpreter finalizes, when CO2 made groups of its own;
    abandon them instead when the process is ending on a failure.

    Why destroy: a script that ends after ``trainer.train()`` leaves its gloo groups alive (the Trainer
    destroys them only in ``trainer.end()``, which few call). At interpreter exit a gloo worker
    thread that drops the last reference to a collective's tensor needs the GIL, which CPython no
    longer hands out; it ends the thread inside a C++ destructor, and the process aborts with
    ``terminate called without an active exception`` (SIGABRT, exit status 1 from the launcher)
    after training and saving succeeded. Destroying the groups here, while the interpreter is alive,
    joins those threads first (``scripts/exit_check.py`` counts clean exits). ``atexit`` runs handlers
    last-registered first, so the user's own exit handlers still find the groups. A no-op where the
    script destroyed the groups itself.

    Why abandon: after a failure (one of CO2's collectives failed or is stuck, or the script ends on
    an uncaught exception, such as the Trainer's own timeout) a collective may still be in flight
    towards a frozen peer. Destroying its group joins the group's worker thread, which stays blocked
    until the group's own timeout (`group_timeout`, a minute past ``co2_timeout_s``), and then gloo
    aborts the process from that thread (``terminate called after throwing an instance of
    'gloo::IoException'``, SIGABRT) instead of the exit status 1 of the error.
    """
    if not _OPEN or not (dist.is_available() and dist.is_initialized()):
        return
    if _exiting_on_error() or not all(comm.settled() for comm in list(_OPEN)):
        _abandon_groups()
        return
    _WORKER_MESHES.clear()
    dist.destroy_process_group()
    gc.collect()  # the groups' last references: their threads are joined now


def _exiting_on_error() -> bool:
    """The interpreter is ending on an uncaught exception (it prints it, and sets ``sys.last_value``,
    before the exit handlers run)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _abandon_groups() -> None:
    """Abort every process group and make sure none is ever destroyed, so that nothing joins a thread
    blocked in a collective: the process then exits at once with the status of its error.

    Every backend: ``abort`` is torch's teardown of a group with collectives in flight (on NCCL it
    aborts the communicators, so that no kernel keeps waiting and the watchdog has nothing to time
    out; on gloo it returns at once and leaves the blocked thread as it is). The groups' destructors
    would still join their threads: each group gets a reference CPython's finalization never
    drops, and the operating system reclaims what the groups hold when the process ends.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}))
    for group in groups:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never freed: no destructor, no join
    _WORKER_MESHES.clear()
    with contextlib.suppress(Exception):  # best effort: the process is ending on its own error anyway
        dist.distributed_c10d._abort_process_group()
