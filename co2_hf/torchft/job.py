"""CO2 on torchft: a worker that dies mid-round never stops the others, and its replacement takes
its state from a live peer, never from disk (``docs/algorithm.md``, "Surviving failures").

Each CO2 worker is one torchft replica group (one process this version). Before a boundary
launches, `TorchFTCommunicator` receives what is in flight and asks torchft's Manager for a quorum:
the Lighthouse decides who takes part in this round, the Manager reconfigures its gloo/NCCL group
over them, and a replica that is behind (a replacement, or a survivor that could not commit) loads
a live peer's whole state first. The outer gradient is summed over the round's participants; the
wire's header counts the finite ones, so the mean is over whoever sent. A coded wire (int8, int4,
sparse) runs its two collectives over the quorum's group (`QuorumCollectives`); its residuals
follow the group's changes (``core/codecs/quant.py``, ``QuantizedWire``) and never travel. A round whose all-reduce
fails (a participant died with it in flight) is dropped by ``commit``: nothing is applied. A
peer's state travels only between the job's own replicas, signed with the job's secret, and every
listener is on the job's address (``transport.py``; docs/reliability.md, "torchft: who can reach what").

The job: torchft's Manager built with every listener on the job's address (`build_manager`),
`TorchFT` (the engine on one replica group), a peer's state as this replica's (`own_state`) and the
job read from the environment (`job_from_env`). The communicator is ``communicator.py``, the
signed transport of a peer's state ``transport.py``, the launcher ``launch.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torchft.manager
from torch import nn
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from ..config import CO2Config
from ..core.co2 import CO2
from .communicator import LIGHTHOUSE_ENV, NUM_REPLICAS_ENV, REPLICA_ENV, TorchFTCommunicator
from .transport import JOB_ENV, RecoveryTransport, job_secret

logger = logging.getLogger(__name__)


def check_config(config: CO2Config) -> None:
    """Refuse the settings this version does not run on torchft, naming the flag (before anything starts)."""
    if config.co2_worker_size != 1:
        raise ValueError(f"co2_worker_size={config.co2_worker_size} with torchft: one process per replica group only")
    if config.co2_sync_warmup_steps:
        raise ValueError(f"co2_sync_warmup_steps={config.co2_sync_warmup_steps} with torchft: allowed is 0")


def build_manager(
    host: str,
    transport: RecoveryTransport,
    *,
    replica_id: str,
    lighthouse: str | None = None,
    timeout: timedelta,
    quorum_timeout: timedelta,
) -> tuple[Manager, JobGloo, torch.distributed.TCPStore]:
    """torchft's Manager for a replica group of one process as CO2 runs it: every listener on
    ``host``, a replica that is behind loaded before its quorum returns (no async quorum), a peer's
    state through ``transport`` (which follows the Manager). Returns it, its gloo group and its store
    (keep a reference: the store lives as long as it)."""
    store, pg = store_on(host), JobGloo(host, timeout)
    with manager_server_on(host):
        manager = Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=quorum_timeout,
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=store.port,
            lighthouse_addr=lighthouse,
            replica_id=replica_id,
            hostname=host,
            checkpoint_transport=transport,
            init_sync=True,
        )
    transport.follow(manager)
    return manager, pg, store


def store_on(host: str) -> torch.distributed.TCPStore:
    """A replica group's TCPStore listening on ``host`` only: given a port, TCPStore listens on every
    interface; given a socket already bound (``master_listen_fd``), on that socket's."""
    listener = socket.create_server((host, 0))
    port = listener.getsockname()[1]
    return torch.distributed.TCPStore(
        host, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach()
    )


@contextlib.contextmanager
def manager_server_on(host: str) -> Iterator[None]:
    """While torchft's Manager is built, its ManagerServer listens on ``host`` only. torchft 0.2.0
    binds it to ``[::]`` (every interface) with no way to say otherwise, so its module's
    ``ManagerServer`` is swapped, for the time of the constructor, for one given ``host``'s address."""
    original = torchft.manager.ManagerServer

    def bound(*, bind: str, **kwargs: Any) -> Any:
        return original(bind=f"{host}:{bind.rsplit(':', 1)[1]}", **kwargs)

    torchft.manager.ManagerServer = bound
    try:
        yield
    finally:
        torchft.manager.ManagerServer = original


class JobGloo(ProcessGroupGloo):
    """torchft's reconfigurable gloo group, listening on the job's address. torchft 0.2.0 gives gloo
    its default device, which listens where the machine's host name resolves: with a loopback job,
    perhaps an interface the whole network reaches."""

    def __init__(self, host: str, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self.host = host

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        """torchft 0.2.0's ``ProcessGroupGloo._create_pg``, its device on ``host``."""
        from torch.distributed import ProcessGroup as Group
        from torch.distributed import ProcessGroupGloo as Gloo

        options = Gloo._Options()
        options._devices = [Gloo.create_device(hostname=self.host)]
        options._timeout, options._threads = self._timeout, 2  # torch's two threads for one device
        if self._global_ranks:
            options.global_ranks_in_group = self._global_ranks
        if self._group_rank and self._group_world_size:
            options.group_name = f"torchft_quorum_{self._quorum_id}_rank_{self._group_rank % self._group_world_size}"
        backend = Gloo(store, rank, world_size, options)
        backend._set_sequence_number_for_group()
        pg = Group(store, rank, world_size)
        pg._set_default_backend(Group.BackendType.GLOO)
        for device in ["cpu"] + ["cuda"] * torch.cuda.is_available():
            pg._register_backend(torch.device(device), Group.BackendType.GLOO, backend)
        return pg


def job_interface(lighthouse: str) -> str:
    """The address of this host's interface that reaches the Lighthouse: the one the job's
    replicas share, where every listener of a replica is."""
    host = lighthouse.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # UDP: no packet is sent
        return probe.getsockname()[0]


class TorchFT:
    """One replica group of a torchft job running CO2: ``TorchFT(config).start(model, optimizer)``.

    The Lighthouse address, this replica group's id and the job's number of replica groups come
    from torchft's environment variables unless given, the job's secret from ``CO2_FT_SECRET`` or
    ``CO2_FT_SECRET_FILE`` (`recovery.job_secret`; without it a replica refuses to start). Every
    listener of the replica (the recovery transport, the store, torchft's ManagerServer, gloo) is on
    the job's address, the interface that reaches the Lighthouse. ``timeout_s`` bounds a collective,
    a commit and a recovery (a frozen peer is dropped after it); ``quorum_timeout_s`` how long a
    replica waits for a quorum (set it above a round's compute); ``start_timeout_s`` how long the
    replicas of a job that is starting wait for each other before training without the late ones."""

    def __init__(
        self,
        config: CO2Config,
        *,
        lighthouse: str | None = None,
        replica_id: int | None = None,
        num_replicas: int | None = None,
        secret: bytes | None = None,
        timeout_s: float = 30.0,
        quorum_timeout_s: float = 300.0,
        start_timeout_s: float = 60.0,
    ) -> None:
        check_config(config)
        self.config = config
        self.lighthouse, self.replica_id, self.num_replicas = job_from_env(lighthouse, replica_id, num_replicas)
        secret = secret if secret is not None else job_secret()
        host, timeout = job_interface(self.lighthouse), timedelta(seconds=timeout_s)
        transport = RecoveryTransport(host, timeout, secret=secret, job=os.environ.get(JOB_ENV, ""))
        self.manager, pg, self._store = build_manager(
            host,
            transport,
            replica_id=f"co2_{self.replica_id}",
            lighthouse=self.lighthouse,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
        )
        self.comm = TorchFTCommunicator(
            self.manager,
            transport,
            pg=pg,
            timeout=timeout,
            num_workers=self.num_replicas,
            worker_index=self.replica_id,
            start_timeout_s=start_timeout_s,
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
        )

    def start(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        state: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] | None = None,
    ) -> CO2:
        """`build`, then `join`: CO2 around ``model``, joined to the job, with a live peer's state
        loaded if one was ahead. To resume from a checkpoint, load it between the two."""
        co2 = self.build(model, optimizer, state=state)
        self.join(co2)
        return co2

    def build(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        state: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] | None = None,
    ) -> CO2:
        """CO2 around ``model``, not joined yet. The model, the optimizer, CO2's state and the
        ``state`` pairs (name: (load, save), e.g. the data position) travel to a replica that is
        behind. A checkpoint is loaded into them before `join` (CO2's through `own_state`)."""
        co2 = CO2(model, self.config, optimizer, communicator=self.comm)
        self.comm.transport.check_state = lambda sent: co2.check_peer_state(sent["user"]["co2"]["engine"])
        take, lend = (lambda sent: self._take_peer_state(co2, sent)), (lambda: self._lend_state(co2))
        self.manager.register_state_dict_fn("co2", take, lend)
        self.manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        if optimizer is not None:
            self.manager.register_state_dict_fn("optimizer", optimizer.load_state_dict, optimizer.state_dict)
        for name, (load, save) in (state or {}).items():
            self.manager.register_state_dict_fn(name, load, save)
        return co2

    def join(self, co2: CO2) -> None:
        """The first quorum. If the others have committed rounds, a live peer's state replaces
        whatever this replica holds (a checkpoint's too) and it runs the boundary that peer is at.
        Started together (from scratch, or all from one checkpoint), the replicas agree on the
        first one's state."""
        co2.rejoin()

    def _lend_state(self, co2: CO2) -> dict[str, Any]:
        """CO2's state for a peer that is behind, and whether it is taken inside a boundary's quorum
        (every quorum after this replica's first one): the peer then runs that boundary too."""
        return {"engine": co2.state_dict(), "at_boundary": self.comm.joined}

    def _take_peer_state(self, co2: CO2, sent: dict[str, Any]) -> None:
        """A peer's CO2 state as this replica's (`_as_this_replica`). A survivor healed at a
        boundary keeps its own residuals; a replica that is starting takes zeros: any it holds were
        read from a checkpoint, older than what its predecessor went on to send."""
        joined = self.comm.joined
        residuals = _residuals(co2) if joined else _zero_residuals(co2)
        co2.load_state_dict(_as_this_replica(co2, sent["engine"], residuals))
        self.comm.peer_at_boundary = bool(sent["at_boundary"])

    @property
    def committed_rounds(self) -> int:
        """Rounds this replica's group committed (torchft's step; a replacement takes its peer's)."""
        return self.manager.current_step()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def own_state(co2: CO2, saved: dict[str, Any]) -> dict[str, Any]:
    """A CO2 state from a checkpoint of this job (replica group 0 writes them), to load into this
    replica group's engine before it joins: with its own worker index, and with the checkpoint's
    residuals only if this group wrote it (another group's would be sent twice; this one's own
    were not saved, so they start from zeros, which a WARNING says)."""
    if saved.get("num_workers") != co2.comm.num_workers:
        raise ValueError(
            f"the CO2 checkpoint was saved by a job of {saved.get('num_workers')!r} replica groups, this one "
            f"has {NUM_REPLICAS_ENV}={co2.comm.num_workers}: resume it with the same {NUM_REPLICAS_ENV}"
        )
    wrote_it = saved.get("worker_index") == co2.comm.worker_index
    if not wrote_it:
        logger.warning(
            "CO2: replica group %d resumes from replica group %s's checkpoint (only group 0 writes them): it "
            "starts with group 0's local model and inner optimizer state, and with no coded-wire residuals",
            co2.comm.worker_index,
            saved.get("worker_index"),
        )
    residuals = [part["residuals"] for part in saved["fragments"]] if wrote_it else _zero_residuals(co2)
    return _as_this_replica(co2, saved, residuals)


def _as_this_replica(co2: CO2, saved: dict[str, Any], residuals: list[Any]) -> dict[str, Any]:
    """Another replica's CO2 state is this one's but for the worker index (a header slot) and a
    coded wire's residuals (per fragment): what a replica has left to send of its own outer
    gradients and of the slice of the sum it coded last, never another's."""
    fragments = [{**theirs, "residuals": kept} for theirs, kept in zip(saved["fragments"], residuals, strict=True)]
    return {**saved, "worker_index": co2.comm.worker_index, "fragments": fragments}


def _residuals(co2: CO2) -> list[Any]:
    """This engine's residuals, per fragment (None: a wire without them). Nothing is in flight here:
    a quorum and a restore run with every all-reduce received."""
    return [part["residuals"] for part in co2.state_dict()["fragments"]]


def _zero_residuals(co2: CO2) -> list[Any]:
    return [None if r is None else {k: torch.zeros_like(v) for k, v in r.items()} for r in _residuals(co2)]


def job_from_env(
    lighthouse: str | None = None, replica_id: int | None = None, num_replicas: int | None = None
) -> tuple[str, int, int]:
    """The Lighthouse address, this replica group's id and the job's number of replica groups: the
    arguments given, else torchft's environment variables; a missing or bad one is named."""
    lighthouse = lighthouse or _env(LIGHTHOUSE_ENV)
    replica_id = _int(REPLICA_ENV, replica_id if replica_id is not None else _env(REPLICA_ENV))
    num_replicas = _int(NUM_REPLICAS_ENV, num_replicas if num_replicas is not None else _env(NUM_REPLICAS_ENV))
    if not 0 <= replica_id < num_replicas:
        raise ValueError(f"{REPLICA_ENV}={replica_id}: allowed are 0 .. {NUM_REPLICAS_ENV}-1 = {num_replicas - 1}")
    return lighthouse, replica_id, num_replicas


def _int(name: str, value: int | str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: allowed is an integer") from None


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"CO2 on torchft needs the environment variable {name} (torchft's; co2-ft-launch sets it)")
    return value
