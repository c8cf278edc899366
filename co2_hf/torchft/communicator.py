"""The outer all-reduce of CO2 on torchft: `TorchFTCommunicator`, the engine's `Communicator` over a
torchft Manager (a quorum before each boundary's launch, a SUM over the round's participants,
``commit`` the Manager's ``should_commit``), and `QuorumCollectives`, the coded wires' two
collectives over the quorum's group. The job around it (the Manager, its listeners, the engine on
a replica group): ``job.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions
from torchft.manager import Manager
from torchft.process_group import ProcessGroup

from ..core.codecs.collectives import Collectives
from ..core.comm import Communicator, Pending
from ..core.waits import BackgroundWork
from .transport import RecoveryTransport, SecretRefused

logger = logging.getLogger(__name__)

# torchft's own environment variables (torchft/manager.py, torchft/torchx.py)
LIGHTHOUSE_ENV, REPLICA_ENV, NUM_REPLICAS_ENV = "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"


class TorchFTCommunicator(Communicator):
    """The outer all-reduce through a torchft Manager: a quorum before each boundary's launch, a
    SUM over the round's participants, and ``commit`` = the Manager's ``should_commit``.

    ``pg`` is the Manager's process group, which the coded wires' collectives run on; ``timeout``
    bounds each of them. ``num_workers`` is the most replica groups the job runs (the header holds a
    slot for each); ``worker_index`` this replica group's id, kept by its replacements.
    ``quorum_timeout`` is the Manager's: with ``timeout`` it bounds a whole quorum (`_quorum`)."""

    reconfigures = True

    def __init__(
        self,
        manager: Manager,
        transport: RecoveryTransport,
        *,
        pg: ProcessGroup,
        timeout: timedelta,
        num_workers: int,
        worker_index: int,
        start_timeout_s: float = 60.0,
        quorum_timeout: timedelta = timedelta(seconds=300),
    ) -> None:
        self.manager, self.transport, self.pg = manager, transport, pg
        self.timeout = timeout
        # a quorum: the Lighthouse's answer, then the group's set-up, the source's metadata and the
        # recovery, each bounded by `timeout`; a margin for loading the state
        self.quorum_bound_s = quorum_timeout.total_seconds() + 3 * timeout.total_seconds() + 10
        self._last_coded: BackgroundWork | None = None
        self.num_workers, self.worker_index = num_workers, worker_index
        self.start_timeout_s = start_timeout_s
        self.joined = False  # past this replica's first quorum: every quorum after it is a boundary's
        self.peer_at_boundary = False  # this quorum loaded a peer's state taken inside a boundary's quorum
        self.dropped_rounds = 0  # all-reduces received but not committed (a participant failed)
        self._warned_alone = self._warned_crowd = False

    def broadcast_(self, tensors: list[Tensor]) -> None:
        pass  # the first quorum (init_sync) gives every replica the primary's state instead

    def start_quorum(self) -> bool:
        self.peer_at_boundary = False
        self._quorum()
        if not self.joined:
            self._wait_for_the_others()
            self.joined = True
        participants = self.manager.num_participants()
        if participants > self.num_workers and not self._warned_crowd:
            self._warned_crowd = True  # training goes on: the mean is over whoever sent
            logger.warning(
                "CO2: %d replica groups in the torchft quorum, more than %s=%d: a killed replica group's "
                "replacement joined before the Lighthouse dropped it, a group was started twice (two "
                "processes with one %s?), %s is too small, or a process outside the job joined the "
                "Lighthouse (it gets no state and gives none: docs/reliability.md)",
                participants,
                NUM_REPLICAS_ENV,
                self.num_workers,
                REPLICA_ENV,
                NUM_REPLICAS_ENV,
            )
        if participants == 1 and not self._warned_alone:
            self._warned_alone = True
            logger.warning(
                "CO2: replica %d is alone in its torchft quorum: it trains on by itself (its outer "
                "gradient is its own) until other replicas join",
                self.worker_index,
            )
        return self.peer_at_boundary

    def _wait_for_the_others(self) -> None:
        """At a job's start (torchft step 0: nobody has committed), ask again until every replica
        group is in the quorum, for up to ``start_timeout_s``. Otherwise the first to start would
        train alone and the Lighthouse's fast quorum would keep it apart from the others: two
        histories whose equal step counts torchft cannot tell apart. A replica joining a running
        job has healed to the others' step by now and does not wait."""
        deadline = time.monotonic() + self.start_timeout_s
        while self.manager.current_step() == 0 and self.manager.num_participants() < self.num_workers:
            if time.monotonic() > deadline:
                logger.warning(
                    "CO2: %d of %s=%d replica groups joined within %.0f s of the start; training "
                    "starts without the others (they rejoin from a live peer when they come)",
                    self.manager.num_participants(),
                    NUM_REPLICAS_ENV,
                    self.num_workers,
                    self.start_timeout_s,
                )
                return
            time.sleep(0.2)
            self._quorum()

    def _quorum(self) -> None:
        """One torchft quorum. The snapshot staged for a peer in the last quorum is withdrawn first:
        torchft names a snapshot by its step, which stays the same over many quorums with CO2 (at
        the start, and while rounds are dropped), so a peer healing in this quorum could otherwise
        load the state of an earlier boundary. It is withdrawn before this replica asks for the
        quorum, so before any peer can learn of it. A replica that is starting and whose recovery
        source refused its secret cannot join: it stops, naming the secret's variables."""
        self.transport.disallow_checkpoint()
        _within(self.quorum_bound_s, self.manager.start_quorum)
        refused = getattr(self.manager.errored(), "original_exception", None)
        if isinstance(refused, SecretRefused) and not self.joined:
            raise RuntimeError(f"{refused}. This replica cannot join the job: it stops") from refused

    def launch(self, tensor: Tensor) -> Pending:
        pending = Pending(tensor, senders=self.manager.num_participants())
        work = self.manager.allreduce(tensor, reduce_op=torch.distributed.ReduceOp.SUM)
        pending.work = work
        work.get_future().then(lambda _: pending.completed_at.append(time.perf_counter()))
        return pending

    def launch_coded(self, tensor: Tensor, reduce_: Callable[[Collectives], None]) -> Pending:
        """A coded all-reduce (int8/int4/sparse) over this quorum's group, off the main thread as
        over a plain process group. A failure is reported to the Manager, as its own all-reduce
        does: the round is then not committed (``commit``), and nothing is raised here."""
        pending = Pending(tensor, senders=self.manager.num_participants())  # waits for the quorum
        # this round is lost already (the quorum's group did not form, a peer failed): send nothing
        collectives = None if self.manager.errored() is not None else self._collectives()
        work, previous = BackgroundWork(), self._last_coded
        pending.work = self._last_coded = work

        def run() -> None:
            if collectives is not None:
                try:
                    reduce_(collectives)
                except Exception as error:  # a participant died or stalled with it in flight
                    self.manager.report_error(error)
            pending.completed_at.append(time.perf_counter())

        work.start(run, after=previous)
        return pending

    def _collectives(self) -> QuorumCollectives | None:
        """This quorum's collectives, or None (reported to the Manager: the round is dropped) when
        its group is not set up. torchft sets a quorum's id before it configures the group, so a
        failed set-up (a killed peer still counted by the Lighthouse: the store connection times
        out) leaves the group empty for the next quorums of the same id, which report no error."""
        try:
            return QuorumCollectives(self.pg, self.manager, self.timeout)
        except GroupNotFormed as error:
            self.manager.report_error(error)
            return None

    def wait(self, pending: Pending, timeout_s: float) -> None:
        pending.mark_waited()
        pending.work.wait(timedelta(seconds=timeout_s))  # a failure is the Manager's to report

    def commit(self, pending: Pending) -> bool:
        committed = self.manager.should_commit()
        self.dropped_rounds += not committed
        return committed

    def all_reduce_(self, tensor: Tensor) -> None:
        raise RuntimeError("CO2 internal error: co2_sync_warmup_steps is refused with torchft (TorchFT checks)")


def _within(seconds: float, call: Callable[[], None]) -> None:
    """``call()`` (torchft's ``start_quorum``, which waits on its quorum future without a limit),
    raising its error; a RuntimeError if it has not returned within ``seconds``. It runs on a thread
    of its own, on this thread's accelerator device."""
    device = torch.accelerator.current_device_index() if torch.accelerator.is_available() else None
    outcome: list[BaseException | None] = []

    def run() -> None:
        if device is not None:
            torch.accelerator.set_device_index(device)
        try:
            call()
            outcome.append(None)
        except BaseException as error:  # raised on the caller's thread below
            outcome.append(error)

    thread = threading.Thread(target=run, name="co2_quorum", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise RuntimeError(
            f"CO2: torchft's quorum did not return within {seconds:.0f} s (its quorum timeout and three "
            "recovery timeouts): this replica stops; its supervisor restarts it and it rejoins from a live peer"
        )
    if outcome[0] is not None:
        raise outcome[0]


class GroupNotFormed(RuntimeError):
    """The quorum's process group was not set up: the round cannot be sent, and is dropped."""


class QuorumCollectives:
    """The coded wires' two collectives (``core/codecs/collectives.py``) over the group of the Manager's
    current quorum: its participants, this replica's rank among them. Each waits ``timeout`` at
    most and raises on failure (the caller reports it to the Manager)."""

    def __init__(self, pg: ProcessGroup, manager: Manager, timeout: timedelta) -> None:
        self.pg, self.timeout = pg, timeout
        self.world_size, self.rank = manager.num_participants(), manager.participating_rank()
        try:
            size = pg.size()
        except AssertionError as error:  # torchft's wrapper holds no group: its configure failed
            raise GroupNotFormed(f"the process group of torchft's quorum is not set up ({error})") from error
        if self.rank is None or self.world_size != size:
            raise RuntimeError(
                f"CO2 internal error: a coded all-reduce outside a quorum (rank {self.rank}, "
                f"{self.world_size} participants, a group of {size})"
            )

    def all_to_all_(self, output: Tensor, input: Tensor) -> None:
        self.pg.alltoall_base(output, input, [], [], AllToAllOptions()).wait(self.timeout)

    def all_gather_(self, output: Tensor, input: Tensor) -> None:
        rows = list(output.view(self.world_size, -1).unbind(0))
        self.pg.allgather([rows], [input], AllgatherOptions()).wait(self.timeout)
