"""How CO2 talks to other workers: an injectable communicator.

The engine needs these eight verbs (``docs/algorithm.md``, "Communication"), and ``worker_ranks``:

- ``broadcast_``: copy tensors from the first rank to every rank (blocking; at start-up);
- ``launch``: start a SUM all-reduce of the outer buffer across workers and return at once;
- ``launch_coded``: the same for a buffer summed through codes (``co2_comm_dtype`` int8/int4,
  ``codecs/quant.py``): a blocking reduction handed the outer group's collectives, run off the main
  thread; return at once;
- ``wait``: block until a launched all-reduce is done (exactly once per launch);
- ``all_reduce_``: a blocking SUM over every process (data-parallel warm-up only; under FSDP2, over
  the processes that hold the same shard);
- ``reduce_stats``: sum small statistics over the processes of one worker, whose outer state is
  sharded between them (identity when a worker is one process);
- ``all_gather``: the chunks of the anchor held by the processes of one worker (identity for one);
- ``worker_all_reduce_``: a blocking SUM over the processes of one worker (its gradients, every
  step, when ``co2_worker_size > 1``);

and two that only a transport whose workers may come and go implements (torchft, ``co2_hf/torchft/``; the
others keep the defaults, False and True): ``start_quorum`` before a boundary's launch (the
round's participants; may load a live peer's state, and says whether that peer was at a boundary),
``commit`` after a wait (may the result be applied, or was the round dropped).

`ProcessGroupCommunicator` implements them over a process group of CO2's own, issued from the
main thread with ``async_op=True``. The one exception is ``launch_coded``: the quantized
all-reduce is two collectives with a decode, a sum and an encode between them, which no single
async collective expresses, so it runs in a daemon thread (`BackgroundWork`, ``waits.py``; one at
a time: one fragment is in flight at most, except at ``finalize``, when each starts after the one
before it), the only user of the outer group while it runs; on CUDA tensors on a side stream.
`LocalCommunicator` is the single-worker case, where every all-reduce is the identity. Tests inject
fakes (``co2_hf.testing``).

Timing. On CPU tensors (gloo) an all-reduce's completion is stamped on the host by its future's
callback, which gloo runs when the transfer ends. NCCL completes that future when the work is
*queued*, so on CUDA tensors CO2 times with CUDA events instead: one on the compute stream before
the launch and one on a side stream made to wait for the all-reduce (launch to completion), and
two on the compute stream around the wait (how long compute was held up: the exposed wait).

Timeouts. Every collective CO2 waits for is bounded on the host by ``co2_timeout_s`` and fails with
CO2's error naming it: gloo's ``wait(timeout)``; on CUDA tensors the outer all-reduce's completion
is polled with ``is_completed()`` (an event query, no synchronisation) up to the deadline (NCCL's own
``wait(timeout)`` blocks the host only on some torch versions). That poll is the one place the host
waits for the GPU between logging steps, and only for the all-reduce itself, launched steps before:
the compute stream keeps the work the host queued meanwhile (docs/gpus.md). CO2's groups get a
longer timeout (``groups.group_timeout``), so that NCCL's watchdog, which aborts the process when a collective
outlives its group's timeout, never fires first. The collectives inside a step on CUDA tensors (the
gradient average inside a worker, the warm-up, the boundary's statistics and anchor all-gathers
inside a worker) are not polled: the compute stream waits for them, the host does not; a peer lost
there is caught by the next bounded wait of an outer all-reduce, or by the watchdog at
the group timeout.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .codecs.collectives import Collectives, GroupCollectives
from .tally import Seconds
from .waits import BackgroundWork, block_current_stream, bounded_wait, record_event


@dataclass
class Pending:
    """An outer all-reduce in flight: its tensor, when it was launched and when it completed."""

    tensor: Tensor
    work: Any = None
    launched_at: float = field(default_factory=time.perf_counter)
    # set by the work's completion callback (a list, so the callback can append from any thread)
    completed_at: list[float] = field(default_factory=list)
    waited: bool = False
    # how many workers take part in this all-reduce (None: every worker); a fault-tolerant
    # transport's quorum may hold fewer (co2_hf/torchft/)
    senders: int | None = None
    # CUDA tensors: (before launch, after completion) and (before wait, after wait), see the module docstring
    launch_events: tuple[Any, Any] | None = None
    wait_events: tuple[Any, Any] | None = None

    def mark_waited(self) -> None:
        if self.waited:
            raise RuntimeError("CO2 internal error: an outer all-reduce was waited twice")
        self.waited = True

    def comm_time(self) -> Seconds:
        """Launch to completion: on the GPU's clock for CUDA tensors (read once the events have
        completed: `Seconds`), else as the completion callback stamped it. Call after the wait."""
        if self.launch_events is not None:
            return Seconds(events=self.launch_events)
        end = self.completed_at[0] if self.completed_at else time.perf_counter()
        return Seconds(max(end - self.launched_at, 0.0))

    def wait_time(self, since: float) -> Seconds:
        """How long the wait held compute up: the compute stream's stall for CUDA tensors (read once
        its events have completed), else the host's time since ``since`` (a ``time.perf_counter()``
        taken before the wait)."""
        if self.wait_events is not None:
            return Seconds(events=self.wait_events)
        return Seconds(time.perf_counter() - since)

    def comm_seconds(self) -> float:
        """`comm_time` now (on CUDA this waits for the GPU: for scripts and tests, not the engine)."""
        return self.comm_time().get()

    def wait_seconds(self, since: float) -> float:
        """`wait_time` now (on CUDA this waits for the GPU: for scripts and tests, not the engine)."""
        return self.wait_time(since).get()


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

    def launch_coded(self, tensor: Tensor, reduce_: Callable[[Collectives], None]) -> Pending:
        """``tensor``: the whole buffer, which ``reduce_`` sums in place (codes, and the header
        exactly) through the collectives it is handed."""
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

    # A transport whose group of workers may change between rounds (torchft: ``co2_hf/torchft/``) sets
    # ``reconfigures``: CO2 then receives every all-reduce in flight before a boundary and calls
    # ``start_quorum`` (which may load a live peer's state into this process) before launching;
    # ``commit`` says whether a received all-reduce may be applied (False: the round is dropped).
    reconfigures: bool = False

    def start_quorum(self) -> bool:
        """The quorum of the round about to launch. True: it loaded the state of a live peer taken
        inside that peer's boundary quorum, so the boundary at the loaded clock is still to run here
        (`CO2.rejoin`); a peer that is starting itself, or no peer, has nothing due."""
        return False

    def commit(self, pending: Pending) -> bool:
        return True


class LocalCommunicator(Communicator):
    """One worker, no process group: every collective is the identity."""

    def broadcast_(self, tensors: list[Tensor]) -> None:
        pass

    def launch(self, tensor: Tensor) -> Pending:
        pending = Pending(tensor)
        pending.completed_at.append(pending.launched_at)
        return pending

    def launch_coded(self, tensor: Tensor, reduce_: Callable[[Collectives], None]) -> Pending:
        return self.launch(tensor)  # nothing travels, so nothing is coded: the sum of one is itself

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
    ``timeout_s`` (``co2_timeout_s``) bounds every wait (module docstring, "Timeouts").
    """

    def __init__(
        self,
        outer: Any,
        *,
        worker: Any = None,
        everyone: Any = None,
        sharded_params: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        self.group, self.worker_group = outer, worker
        self.everyone = everyone if everyone is not None else outer
        # FSDP2 shards the parameters inside a worker: the process of index j in every worker holds
        # the same shard, so start-up broadcasts and warm-up all-reduces run over the outer group
        self.sharded_params = sharded_params
        self.timeout_s = timeout_s
        self.num_workers = dist.get_world_size(outer)
        self.worker_size = dist.get_world_size(worker) if worker is not None else 1
        self.worker_index = dist.get_rank(outer)
        self.shard_index = dist.get_rank(worker) if worker is not None else 0
        self._side_streams: dict[Any, Any] = {}
        self._collectives = GroupCollectives(outer)  # what a coded all-reduce runs on (launch_coded)
        self._last_background: BackgroundWork | None = None
        self.failed = False  # a collective failed or timed out: the exit hook leaves the groups alone
        _OPEN.add(self)

    def broadcast_(self, tensors: list[Tensor]) -> None:
        group = self.group if self.sharded_params else self.everyone
        source = dist.get_global_rank(group, 0)
        works = [dist.broadcast(tensor, src=source, group=group, async_op=True) for tensor in tensors]
        for work, tensor in zip(works, tensors):
            self._finish(work, tensor, "the start-up broadcast of the model")

    def launch(self, tensor: Tensor) -> Pending:
        pending = Pending(tensor)
        start = record_event(tensor)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        pending.work = work
        if start is None:  # gloo: the future completes when the transfer does
            work.get_future().then(lambda _: pending.completed_at.append(time.perf_counter()))
        else:  # NCCL completes the future at enqueue: time on a side stream that waits for the work
            with torch.cuda.stream(self._side_stream(tensor.device)):
                block_current_stream(work)
                pending.launch_events = (start, record_event(tensor))
        return pending

    def launch_coded(self, tensor: Tensor, reduce_: Callable[[Collectives], None]) -> Pending:
        pending = Pending(tensor)
        ready = record_event(tensor)  # CUDA: the buffer is written when the compute stream gets here
        side = self._side_stream(tensor.device) if tensor.is_cuda else None
        # the previous coded all-reduce, still running when finalize launches several fragments:
        # collectives on one group must run in issue order, so this one starts after it
        work, previous = BackgroundWork(), self._last_background
        pending.work = self._last_background = work

        def run() -> None:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                if side is not None:
                    side.wait_event(ready)
                reduce_(self._collectives)
                if side is not None:
                    work.done_event = record_event(tensor)  # on the side stream: all of it
                    pending.launch_events = (ready, work.done_event)
            pending.completed_at.append(time.perf_counter())

        work.start(run, after=previous)
        return pending

    def wait(self, pending: Pending, timeout_s: float) -> None:
        pending.mark_waited()
        before = record_event(pending.tensor)
        try:
            bounded_wait(pending.work, pending.tensor, timeout_s)  # raises; the engine names the round
        except RuntimeError:
            self.failed = True
            raise
        if before is not None:
            pending.wait_events = (before, record_event(pending.tensor))

    def all_reduce_(self, tensor: Tensor) -> None:
        group = self.group if self.sharded_params else self.everyone
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self._finish_in_stream(work, tensor, "the warm-up's gradient all-reduce")

    def worker_ranks(self) -> list[int]:
        """The global ranks of this process's worker."""
        if self.worker_group is None:
            return [dist.get_rank()]
        return dist.get_process_group_ranks(self.worker_group)

    def reduce_stats(self, partials: Tensor) -> Tensor:
        if self.worker_group is not None:
            work = dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=self.worker_group, async_op=True)
            self._finish_in_stream(work, partials, "the sum of the outer statistics over this worker's processes")
        return partials

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        if self.worker_group is None:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.worker_size)]
        work = dist.all_gather(parts, tensor, group=self.worker_group, async_op=True)
        self._finish_in_stream(work, tensor, "the all-gather of the anchor over this worker's processes")
        return parts

    def worker_all_reduce_(self, tensor: Tensor) -> None:
        if self.worker_group is not None:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.worker_group, async_op=True)
            self._finish_in_stream(work, tensor, "the gradient average over this worker's processes")

    def _finish_in_stream(self, work: Any, tensor: Tensor, what: str) -> None:
        """A collective inside a training step (the gradient average, the boundary's statistics and
        anchor all-gathers inside a worker): on CUDA it only joins the compute stream (a host wait
        there would stall the GPU; module docstring, "Timeouts"), elsewhere `_finish`."""
        if tensor.is_cuda:
            block_current_stream(work)
        else:
            self._finish(work, tensor, what)

    def _finish(self, work: Any, tensor: Tensor, what: str) -> None:
        """Wait for a collective on the host, ``co2_timeout_s`` at most; else CO2's error naming it."""
        try:
            bounded_wait(work, tensor, self.timeout_s)
        except RuntimeError as error:
            self.failed = True
            raise RuntimeError(
                f"CO2: {what} failed or did not finish within co2_timeout_s={self.timeout_s}s "
                f"(a peer may have died or stalled): {error}"
            ) from error

    def settled(self) -> bool:
        """No collective of CO2's failed, and no coded all-reduce is still running."""
        background = self._last_background
        return not self.failed and (background is None or background.ended_within(BACKGROUND_EXIT_WAIT_S))

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        return self._side_streams[device]


# ---------------------------------------------------------------------- open communicators

# the process-group communicators alive, for the exit hook (groups.py) to see whether one is unsettled
_OPEN: weakref.WeakSet[ProcessGroupCommunicator] = weakref.WeakSet()
BACKGROUND_EXIT_WAIT_S = 5.0  # at exit, how long a coded all-reduce may take to end before it counts as stuck
