"""`CO2`: the engine's round schedule and the sequences of phases it runs (``docs/algorithm.md``).

The phases are methods of `Phases` (``phases.py``), which owns the outer state; each does one
thing, on the flat state chunk by chunk. In the order of the overlapped boundary:

1. ``_receive``   -- wait for the all-reduce in flight; the buffer then holds the mean ``D``;
2. ``_direction`` -- penalty ``P``, ``m <- beta*m + P*D``, clip ``m``, step ``v`` (if a ``D`` came);
3. ``_exchange``  -- ``d = start - x``; ``a <- a - alpha*v`` (if a ``D`` came); buffer <- ``d``;
4. ``_launch``    -- write the header, start the all-reduce of this round's ``d`` (never of live
   parameters; a non-finite worker sends zeros with weight 0 and restarts);
5. ``_reset``     -- ``x <- start`` (``a - o``, ``o`` from the start rule), in place;

and two more for the other sequences:

6. ``_apply``     -- ``a <- a - alpha*v`` alone, where no ``d`` is measured in the same pass;
7. ``_shift``     -- ``x <- x + (a_new - start)``, keeping the steps taken since the round started.

After each inner step `RoundSchedule` (``schedule.py``) says what is due; `step()` runs it:

- overlapped boundary (``co2_overlap``): receive, direction (penalised), exchange, launch, reset;
- synchronous boundary: exchange, launch, receive, direction, apply, reset;
- in-round apply, ``co2_overlap_steps = k`` steps into a round: receive, direction, apply, shift;
- ``finalize()``: a partial round's boundary, then drain, direction, apply, reset onto the anchor.

The start rule and the penalty are objects from ``rules.py``; the buffer's regions are named views
of `WireBuffer` (``wire.py``); reading and writing live tensors is `LiveTensors` (``live.py``).
One fp32 communication buffer carries ``D`` in and ``d`` out; scratch memory is one chunk.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from ..config import CO2Config
from .comm import Communicator, make_communicator
from .layout import DEFAULT_CHUNK_NUMEL, FlatLayout
from .live import has_dtensors, pin_state, reshard_fsdp, state_device
from .phases import Phases
from .rules import NoPenalty
from .schedule import Event, RoundSchedule
from .state import STATE_FORMAT, Progress, check_compatible

logger = logging.getLogger(__name__)

TIMEOUT_CHECK_BOUNDARY = 3  # co2_timeout_s is compared with the round timed between boundaries 2 and 3
FRESH = NoPenalty()  # an update whose base is still the anchor is not stale: P = 1


class CO2(Phases):
    """CO2 data-parallel training around an ``nn.Module``; call ``step()`` after each optimizer step.

    Args:
        model: the module to train; construct CO2 after moving it to its device.
        config: the ``co2_*`` settings (``CO2Config()`` when None).
        optimizer: the inner optimizer; when given, a worker found non-finite has its state cleared.
        process_group: the group of workers; None makes a dedicated group over all ranks of the
            default group (collective: every rank constructs CO2 at the same point), or runs a
            single worker when torch.distributed is not initialised.
        communicator: overrides ``process_group`` with an injected communicator (tests).
    """

    def __init__(
        self,
        model: nn.Module,
        config: CO2Config | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        process_group: Any = None,
        communicator: Communicator | None = None,
        *,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    ) -> None:
        self.config = cfg = config if config is not None else CO2Config()
        if not cfg.co2_enabled:
            raise ValueError("co2_enabled=False: train without CO2 (plain data parallel) instead")
        self.model = model
        device = state_device(model, cfg)
        comm = communicator or make_communicator(
            process_group=process_group,
            state_device=device,
            timeout_s=cfg.co2_timeout_s,
            worker_size=cfg.co2_worker_size,
            sharded_params=has_dtensors(model),
        )
        num_workers, layout = _workers_and_layout(model, cfg, comm, chunk_numel)
        super().__init__(
            cfg,
            comm=comm,
            layout=layout,
            device=device,
            num_workers=num_workers,
            optimizer=optimizer,
            pin_memory=pin_state(model, device),
        )
        self._boundaries_run = 0  # by this instance (not saved): the timeout check runs at the third
        self._round_started: float | None = None
        self.schedule = RoundSchedule(cfg.co2_local_steps, cfg.co2_overlap_steps)
        self._events = {Event.APPLY_IN_ROUND: self._apply_in_round, Event.BOUNDARY: self._boundary}
        self._boundary_phases = self._overlapped_boundary if cfg.co2_overlap else self._synchronous_boundary
        self._take_anchor()

    # ------------------------------------------------------------------ public API

    def step(self, *, skipped: bool = False) -> bool:
        """Count one inner step (``skipped``: AMP skipped it); run what the round schedule says is
        due after it (a boundary after ``tau`` steps). Returns True when a round boundary ran."""
        p = self.progress
        p.inner_steps += 1
        p.amp_skipped_steps += int(skipped)
        if not p.warmup_done:
            if p.inner_steps >= self.config.co2_sync_warmup_steps:
                self._take_anchor()
                p.warmup_done = True
            return False
        p.round_step += 1
        due = self.schedule.due(p.round_step)
        for event in due:
            self._events[event]()
        return Event.BOUNDARY in due

    # ------------------------------------------------------------------ the sequences (phases.py)

    @torch.no_grad()
    def _boundary(self) -> None:
        compute_s = time.perf_counter() - self._round_started if self._round_started is not None else 0.0
        with record_function("co2/boundary"):
            self._boundary_phases()
            self.progress.round += 1
            self.progress.round_step = 0
        self._boundaries_run += 1
        if self._boundaries_run == TIMEOUT_CHECK_BOUNDARY:
            _check_timeout(self.config.co2_timeout_s, compute_s, self.last_comm_s)
        self._round_started = time.perf_counter()

    def _overlapped_boundary(self) -> None:
        self._receive()  # D_{t-1}: none at round 0
        self._direction(self.penalty)  # its base a_{t-1} is one anchor move old: stale
        finite = self._exchange()  # applies D_{t-1} while writing d_t
        self._launch(finite)
        self._reset()

    def _synchronous_boundary(self) -> None:
        finite = self._exchange()  # nothing to apply yet: writes d_t
        self._launch(finite)
        self._receive()  # D_t, right away
        self._direction(FRESH)
        self._apply()
        self._reset()

    @torch.no_grad()
    def _apply_in_round(self) -> None:
        """Partial overlap (``co2_overlap_steps = k``): k steps into a round, apply the last
        round's average. Its base is still the anchor, so nothing is stale (P = 1)."""
        if self._pending is None and not self.progress.have_d:
            return  # round 0
        with record_function("co2/apply_in_round"):
            self._receive()
            self._direction(FRESH)
            self._apply()
            self._shift()

    # ------------------------------------------------------------------ counters and the rest of the API

    inner_steps = property(lambda self: self.progress.inner_steps, doc="Inner steps since construction.")
    round = property(lambda self: self.progress.round, doc="Index t of the current round.")
    round_step = property(lambda self: self.progress.round_step, doc="Inner steps taken in this round.")
    warmup_done = property(lambda self: self.progress.warmup_done, doc="The synchronous warm-up is over.")
    amp_skipped_steps = property(lambda self: self.progress.amp_skipped_steps, doc="Steps AMP skipped.")
    skipped_rounds = property(lambda self: self.progress.skipped_rounds, doc="Rounds no worker was finite.")

    @property
    def last_wait_s(self) -> float:
        """Seconds this rank was blocked waiting at the last boundary (exposed communication)."""
        return self._last_wait_s

    @property
    def in_warmup(self) -> bool:
        """True during ``co2_sync_warmup_steps``, while training is ordinary data parallel."""
        return not self.progress.warmup_done

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Average gradients: over every process during the warm-up (plain data parallel), then
        over the processes of this worker when ``co2_worker_size > 1``; else nothing.

        Call it after ``backward()`` and before the optimizer step (before unscaling, with AMP).
        """
        k, warm = self.comm.worker_size, self.progress.warmup_done
        # under FSDP2 the worker's gradients are already averaged (reduce-scattered) by FSDP
        if warm and (k == 1 or self.layout.presharded):
            return
        grads = self.live.grads()
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        if not warm:
            self.comm.all_reduce_(flat)  # every process; under FSDP2 the copies of this shard
            flat.div_(self.num_workers if self.layout.presharded else self.num_workers * k)
        else:
            self.comm.worker_all_reduce_(flat)
            flat.div_(k)
        torch._foreach_copy_([g.view(-1) for g in grads], list(flat.split([g.numel() for g in grads])))

    @torch.no_grad()
    def finalize(self) -> None:
        """End of training: apply every worker's steps and leave all workers on the final anchor.

        A partial round runs its boundary now; an in-flight all-reduce is waited for and applied
        with the same rule. Afterwards nothing is in flight, the round counters restart at 0 and
        the outer momentum is kept.
        """
        if not self.progress.warmup_done:
            self._take_anchor()
            self.progress.warmup_done = True
        if self.progress.round_step > 0:
            self._boundary()
        self._drain()
        # with a partial-overlap window nothing moved the anchor since the base of this D
        self._direction(self.penalty if self.config.co2_overlap_steps is None else FRESH)
        self._apply()
        self.start.clear_()
        self.live.write_all(self._start_of)  # the anchor itself, float buffers included
        self._anchor_news = False
        self.progress.round = self.progress.round_step = 0

    def anchor_state(self) -> dict[str, Tensor]:
        """The module's ``state_dict`` with every synchronised tensor taken from the anchor.

        Values are in each tensor's own dtype and on its own device (views of the fp32 anchor where
        both match; copies when the state is held in host memory, ``co2_state_device=cpu``):
        read-only, valid until the next boundary. During the warm-up the live tensors are the
        global model and are returned as they are.
        """
        state = self.model.state_dict()
        if not self.progress.warmup_done:
            return state
        anchor = self.live.gather_flat(self._anchor) if self.layout.gathers else self._anchor
        for segment in self.layout.segments:
            flat = anchor[segment.offset : segment.offset + segment.numel]
            # on the tensor's own device: host-memory state (co2_state_device=cpu) is copied there
            value = flat.view(segment.tensor.shape).to(device=segment.tensor.device, dtype=segment.tensor.dtype)
            if segment.dtensor is not None:  # FSDP2: the anchor's local shard, as a DTensor
                d = segment.dtensor
                value = DTensor.from_local(value, d.device_mesh, d.placements, shape=d.shape, stride=d.stride())
            for name in segment.names:
                state[name] = value
        return state

    @contextlib.contextmanager
    def anchor_in_place(self):
        """Within the block the live tensors hold the anchor; on exit they get their own values back.

        For evaluating the shared model where parameters cannot be swapped for other tensors
        (FSDP2 all-gathers its own shards in forward); elsewhere prefer `anchor_state` with
        ``torch.func.functional_call``, which copies nothing. Costs one copy of this process's
        live tensors. Issues no collective unless the worker splits a flat state between its
        processes (``co2_worker_size > 1`` without FSDP2), which all-gathers the anchor.
        """
        if not self.progress.warmup_done:  # the live tensors are the global model
            yield
            return
        saved = [segment.tensor.detach().clone() for segment in self.layout.segments]
        try:
            reshard_fsdp(self.model)  # FSDP2 must gather the shards anew, with the anchor in them
            with torch.no_grad():
                self.live.write_all(lambda chunk: self._anchor[chunk.start : chunk.stop])
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([s.tensor for s in self.layout.segments], saved)
            # a forward without backward leaves FSDP2's root unsharded, holding the anchor: drop it,
            # so that training gathers the live shards again
            reshard_fsdp(self.model)

    def outer_state_nbytes(self) -> int:
        """Bytes of persistent outer state held by this process (anchor, momentum, buffers)."""
        tensors = (self._anchor, self._momentum)
        return sum(t.numel() * t.element_size() for t in tensors) + self.wire.nbytes() + self.start.nbytes()

    def pop_metrics(self) -> dict[str, float]:
        """Mean of each per-round metric since the last call, plus the running counters."""
        out = {f"co2/{k}": sum(v) / len(v) for k, v in self._metrics.items() if v}
        if "co2/comm_s" in out and "co2/comm_wait_s" in out and out["co2/comm_s"] > 0:
            out["co2/hidden_frac"] = min(max(1 - out["co2/comm_wait_s"] / out["co2/comm_s"], 0.0), 1.0)
        out["co2/amp_skipped_steps"] = float(self.progress.amp_skipped_steps)
        out["co2/skipped_rounds"] = float(self.progress.skipped_rounds)
        self._metrics.clear()
        return out

    # ------------------------------------------------------------------ checkpoints (core/state.py)

    def state_dict(self) -> dict[str, Any]:
        """This rank's CO2 state, without any collective (``core/state.py``). Tensors are references
        (as with ``optimizer.state_dict()``): save or clone them before training continues."""
        self._drain()
        return {
            "format": STATE_FORMAT,
            **self._identity(),
            "anchor": self._anchor,
            "momentum": self._momentum,
            "buffer": self.wire.fp32,  # with a received D in it when "have_d" is set
            "own_outer_grad": self.start.offset,  # None under the anchor start rule
            "counters": self.progress.to_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore a state saved by this rank in the same setting; raise ``ValueError`` otherwise."""
        if self._pending is not None:
            raise RuntimeError("load_state_dict while an outer all-reduce is in flight")
        check_compatible(saved, **self._identity())
        self._anchor.copy_(saved["anchor"])
        self._momentum.copy_(saved["momentum"])
        self.wire.fp32.copy_(saved["buffer"])
        self.start.load_(saved["own_outer_grad"])
        self.progress = Progress.from_dict(saved["counters"])

    def _identity(self) -> dict[str, Any]:
        """What must match between a checkpoint and the run that loads it."""
        return {
            "config": self.config.co2_dict(),
            "layout": self.layout.describe(),
            "num_workers": self.num_workers,
            "worker_index": self.comm.worker_index,
        }


def _workers_and_layout(model: nn.Module, cfg: CO2Config, comm: Communicator, chunk_numel: int):
    """The number of worker processes (checked against the config) and this process's flat layout."""
    if comm.worker_size != cfg.co2_worker_size:
        raise ValueError(
            f"co2_worker_size={cfg.co2_worker_size} but the communicator has {comm.worker_size} process(es) per worker"
        )
    num_workers = cfg.check_world(comm.num_workers * comm.worker_size)
    layout = FlatLayout(model, worker_size=comm.worker_size, shard_index=comm.shard_index, chunk_numel=chunk_numel)
    if layout.presharded:  # FSDP2 inside the worker, never across workers
        layout.check_sharded_over(comm.worker_ranks())
    return num_workers, layout


def _check_timeout(timeout_s: float, compute_s: float, comm_s: float) -> None:
    """Warn once when co2_timeout_s leaves too little room: a peer that is merely one slow round
    behind would be taken for a dead one. Measured after the first rounds, which may include
    compilation and warm-up."""
    needed = 2 * (compute_s + comm_s)
    if timeout_s < needed:
        logger.warning(
            "CO2: co2_timeout_s=%gs is shorter than twice a round's compute (%.3gs) plus one outer "
            "all-reduce (%.3gs): a slow round could be taken for a dead peer. Set co2_timeout_s "
            "to at least %.3g.",
            timeout_s,
            compute_s,
            comm_s,
            needed,
        )
