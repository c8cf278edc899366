"""`CO2`: the engine. It runs the plan's schedule on its fragments (``docs/algorithm.md``).

`Plan` (``schedule.py``) is the run's settings resolved once: F fragments, the window k, the start
rule and penalty that apply, whether updates are stale. After each inner step ``step()`` asks the
plan what is due and tells each fragment (``fragment.py``) what to do, through its public verbs:

- ``boundary()``: the fragment's round ends (the overlapped sequence: receive the average in
  flight, turn it into a step, measure and launch this round's outer gradient, reset; or the
  synchronous one without overlap);
- ``apply_in_round()``: ``k`` steps after a launch, apply that average mid-round (a window, or
  streaming fragments: ``k = tau / F``);
- ``restart()``: a worker found non-finite in one fragment restarts the others' rounds too;
- ``finish()``: ``finalize()``'s part, after a partial round's boundary: wait, apply, reset onto
  the anchor; ``drain()``: complete the all-reduce in flight before a checkpoint.

``co2_fragments = F`` splits the flat state into F slices, each a `Fragment` (its own start rule,
counters and quantizer, on views of the engine's anchor and momentum) with its own round, offset
by ``tau / F`` steps; with one fragment it is the whole state. The fragments' communication
buffers come from one `WirePool` (``wire.py``): a buffer is held only from a boundary until its
average is applied, so streaming fragments share one. Reading and writing the live tensors is
`LiveTensors` (``live.py``); scratch memory is one chunk.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..allowed import refuse_torchft
from ..config import CO2Config
from .comm import Communicator
from .fragment import Fragment
from .groups import make_communicator
from .layout import DEFAULT_CHUNK_NUMEL, FlatLayout
from .live import LiveTensors, Scratch, has_dtensors, pin_state, reshard_fsdp, state_device
from .rules import warn_about_start_rule
from .schedule import Event, Plan, fit_default_fragments
from .state import STATE_FORMAT, Progress, check_compatible, from_dict, to_dict, upgrade
from .tally import CONSECUTIVE_SKIPPED, NONFINITE, NONFINITE_ROUND, OUT_OF_STEP, OUT_OF_STEP_ROUND, SKIPPED, Tally
from .wire import WirePool

logger = logging.getLogger(__name__)

TIMEOUT_CHECK_BOUNDARY = 3  # co2_timeout_s is compared with the round timed between boundaries 2 and 3
# How pop_metrics combines a round's per-fragment means into one figure per metric (default: sum:
# seconds add up over a round's fragments)
ROOT_SUM_SQUARE = ("outer_grad_norm", "momentum_norm")  # norms of the whole outer vectors
MEAN = ("clip_ratio",)
PENALTY = ("penalty_sum", "penalty_elements")  # summed over the window: penalty_mean is their ratio


class CO2:
    """CO2 data-parallel training around an ``nn.Module``; call ``step()`` after each optimizer step.

    Args:
        model: the module to train; construct CO2 after moving it to its device.
        config: the ``co2_*`` settings (``CO2Config()`` when None). ``co2_fault_tolerance='torchft'``
            needs torchft's communicator (``co2_hf.torchft.TorchFT(config).build``); ``co2_elastic``
            is the Trainer's (on its own, resume elsewhere with ``reshard.load_resharded``).
        optimizer: the inner optimizer; when given, a worker found non-finite has its state cleared.
        process_group: the group of workers; None makes a dedicated group over all ranks of the
            default group (collective: every rank constructs CO2 at the same point), or runs a
            single worker when torch.distributed is not initialised.
        communicator: overrides ``process_group`` with an injected communicator (tests).
        chunk_numel: the most elements one pass over the flat state handles at once (its scratch).
        stage_state: bring the outer state to the compute device a fragment at a time
            (``residency.py``); None: for host-memory state of a GPU model with streaming fragments.
            True on a CPU model stages between two CPU tensors (what the tests check bit for bit).
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
        stage_state: bool | None = None,
    ) -> None:
        self.config = cfg = config if config is not None else CO2Config()
        if not cfg.co2_enabled:
            raise ValueError("co2_enabled=False: train without CO2 (plain data parallel) instead")
        if communicator is None or not communicator.reconfigures:  # before any group is made
            refuse_torchft(cfg, "CO2 without torchft's communicator")
        self.model = model
        device = state_device(model, cfg)
        comm = communicator or make_communicator(
            process_group=process_group,
            state_device=device,
            timeout_s=cfg.co2_timeout_s,
            worker_size=cfg.co2_worker_size,
            sharded_params=has_dtensors(model),
        )
        self._comm = comm  # fixed at construction, shared by every fragment
        self.config = cfg = fit_default_fragments(cfg, FlatLayout.shard_numel_of(model, comm.worker_size))
        self.plan = Plan.resolve(cfg)
        self.num_workers, self.layout = _workers_and_layout(model, cfg, comm, chunk_numel)
        self.device, pinned = device, pin_state(model, device)  # where the outer state lives
        # Host-memory state for a GPU model with streaming fragments is worked on by the GPU, a
        # fragment at a time (residency.py); ``stage_state`` forces that on or off (tests stage on the CPU)
        self._stage = (pinned and self.plan.fragments > 1) if stage_state is None else stage_state
        self.compute_device = compute = _model_device(model, device) if self._stage else device
        self._copy_stream = torch.cuda.Stream(compute) if self._stage and compute.type == "cuda" else None
        # shared by every fragment: one chunk's worth; pinned where host state meets a GPU model
        self._scratch = Scratch(compute, pin_memory=pinned and not self._stage)
        self.live = LiveTensors(self.layout, comm, self._scratch)
        n = self.layout.shard_numel
        zeros = dict(dtype=torch.float32, device=device, pin_memory=pinned)
        self._anchor = torch.zeros(n, **zeros)
        self._momentum = torch.zeros(n, **zeros)
        self.optimizer = optimizer  # a worker found non-finite has its state cleared
        self._tally = Tally(len(self.layout.fragment_edges) - 1, compute)  # what the device counts (tally.py)
        self._nonfinite_seen = [0.0] * (len(self.layout.fragment_edges) - 1)  # per fragment: warned up to here
        self.fragments = self._make_fragments(pinned)
        warn_about_start_rule(self.plan)
        self.progress = Progress(warmup_done=cfg.co2_sync_warmup_steps == 0)
        self._boundaries_run = 0  # by this instance (not saved): the timeout check runs from the third
        self._timeout_checked = False
        self._round_started: float | None = None
        self._take_anchor()

    def _make_fragments(self, pinned: bool) -> list[Fragment]:
        """One `Fragment` per fragment, on its slice of the anchor and the momentum (one in all, the
        whole shard, without fragments), and the pool their buffers come from: sized for the largest
        fragment, one buffer in use at a time (``wire.py``)."""
        edges = self.layout.fragment_edges
        layouts = [self.layout.fragment(f) for f in range(len(edges) - 1)]
        wire_dtype = torch.bfloat16 if self.config.bfloat16_wire else torch.float32
        largest = max(hi - lo for lo, hi in zip(edges[:-1], edges[1:]))
        on_compute = dict(dtype=torch.float32, device=self.compute_device, pin_memory=pinned and not self._stage)
        self._pool = WirePool(largest, self.num_workers, wire_dtype=wire_dtype, **on_compute)
        parts = []
        for f, scale in enumerate(_clip_scales(layouts, self._comm, self.config, self.device)):
            lo, hi = edges[f], edges[f + 1]
            parts.append(
                Fragment(
                    self.config,
                    self.plan,
                    comm=self._comm,
                    layout=layouts[f],
                    anchor=self._anchor[lo:hi],
                    momentum=self._momentum[lo:hi],
                    pool=self._pool,
                    num_workers=self.num_workers,
                    scratch=self._scratch,
                    counts=self._tally.row(f),
                    pin_memory=pinned,
                    copy_stream=self._copy_stream,
                    stage=self._stage,
                    clip_scale=scale,
                    index=f,
                )
            )
        return parts

    @property
    def comm(self) -> Communicator:
        """The communicator every fragment uses, fixed at construction (inject another through
        ``communicator=``)."""
        return self._comm

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
        due = self._due_now()
        if self.comm.reconfigures and any(event is Event.BOUNDARY for event, _ in due):
            self._start_quorum()  # may load a live peer's state, and with it the peer's clock
            due = self._due_now()
        return self._run(due)

    @torch.no_grad()
    def rejoin(self) -> bool:
        """Join the workers of a fault-tolerant transport (``co2_hf/torchft/``) on start-up: the first quorum,
        which loads a live peer's state when the others have trained already, then, if that peer
        sent it from inside a boundary, that boundary (the one the others are running). Returns
        whether a boundary ran. With every worker starting together, from scratch or from one
        checkpoint (whose clock's boundaries ran before it was saved), nothing is due."""
        if not self.comm.reconfigures:
            raise RuntimeError("CO2.rejoin needs a fault-tolerant communicator (co2_hf.torchft)")
        return self._run(self._due_now()) if self._start_quorum() else False

    def _due_now(self) -> list:
        """What is due at the step the clock says, after a quorum that may have loaded a peer's
        state: the boundary that peer was running, or nothing if it was starting (round step 0)."""
        p = self.progress
        return self.plan.due(p.round_step) if p.warmup_done and p.round_step > 0 else []

    @torch.no_grad()
    def _run(self, due: list) -> bool:
        """Run the events the plan says are due now; end the round after its last step. Then learn
        what the device found at these events and earlier ones, as far as it has arrived (`_check`)."""
        for event, f in due:
            if event is Event.BOUNDARY:
                self.fragments[f].boundary(self.progress.inner_steps)
            else:
                self.fragments[f].apply_in_round()
        if self.progress.round_step >= self.config.co2_local_steps:
            self._end_round()
        if due:
            self._tally.mirror.refresh()
        self._check()
        if self._stage:
            self._prefetch()
        return any(event is Event.BOUNDARY for event, _ in due)

    def _prefetch(self) -> None:
        """Host-memory state: the fragments whose boundary comes after the next step start coming to
        the GPU now, while it computes that step (residency.py)."""
        p, tau = self.progress, self.config.co2_local_steps
        if p.warmup_done:
            for event, f in self.plan.due(p.round_step % tau + 1):
                if event is Event.BOUNDARY:
                    self.fragments[f].prefetch()

    def _flush(self) -> None:
        """Host-memory state: every fragment's state back in host memory before the host reads or
        writes it there (checkpoints, evaluation on the anchor, the end): one wait for the copies."""
        for part in self.fragments:
            part.store()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def _check(self) -> None:
        """Act on what the device tallied at the boundaries, once its copy has reached host memory
        (on the CPU at once; on a GPU a step or so later, never waited for): stop on ranks out of
        step or ``co2_max_skipped_rounds`` skips in a row; for a non-finite worker, warn, clear the
        inner optimizer and restart every fragment's round (the NaN reaches every parameter)."""
        rows = self._tally.mirror.poll()
        if rows is None:
            return
        limit = self.config.co2_max_skipped_rounds
        for f, (part, row) in enumerate(zip(self.fragments, rows)):
            if row[OUT_OF_STEP] > 0:  # training stops at the first
                raise RuntimeError(
                    f"CO2: ranks out of step at round {int(row[OUT_OF_STEP_ROUND])}: the outer all-reduce mixed "
                    "different rounds (every rank must call CO2.step() once per inner step)"
                )
            if limit and row[CONSECUTIVE_SKIPPED] >= limit:
                raise RuntimeError(
                    f"CO2: no worker had a finite outer gradient for {int(row[CONSECUTIVE_SKIPPED])} "
                    f"consecutive rounds (co2_max_skipped_rounds={limit}); stopping"
                )
            if row[NONFINITE] > self._nonfinite_seen[f]:
                self._nonfinite_seen[f] = row[NONFINITE]
                self._quarantine(part, int(row[NONFINITE_ROUND]))

    def _quarantine(self, found: Fragment, round_index: int) -> None:
        """This worker's outer gradient was not finite at ``found``'s boundary of ``round_index``: it
        sent zeros there and restarted that fragment (on the device). Its other fragments' steps ran
        on the same faulty values, and so did the inner optimizer's: restart them all, clear it. If
        the host learns of it at a later step (a GPU), ``found``'s steps since are restarted too."""
        logger.warning(
            "CO2: worker %d has a non-finite outer gradient at round %d; it sends nothing this "
            "round, returns to the anchor and clears its inner optimizer state",
            self.comm.worker_index,
            round_index,
        )
        for part in self.fragments:
            if part is not found or found.boundary_step != self.progress.inner_steps:
                part.restart()
        if self.optimizer is not None:
            self.optimizer.state.clear()

    def _start_quorum(self) -> bool:
        """Receive every all-reduce in flight (the transport's group may change with the quorum),
        then start the quorum of the round about to launch (`Communicator.start_quorum`)."""
        for part in self.fragments:
            part.receive()
        return self.comm.start_quorum()

    # ------------------------------------------------------------------ what the plan runs (fragment.py)

    def _end_round(self) -> None:
        """After step tau: the round counter moves on; from the third round on, the first whose
        communication times the host knows without waiting checks the timeout (once)."""
        compute_s = time.perf_counter() - self._round_started if self._round_started is not None else 0.0
        self.progress.round += 1
        self.progress.round_step = 0
        self._boundaries_run += 1
        if self._boundaries_run >= TIMEOUT_CHECK_BOUNDARY and not self._timeout_checked:
            known = [part.last_comm_known() for part in self.fragments]
            if None not in known:
                _check_timeout(self.config.co2_timeout_s, compute_s, sum(known))
                self._timeout_checked = True
        self._round_started = time.perf_counter()

    # ------------------------------------------------------------------ counters and the rest of the API

    inner_steps = property(lambda self: self.progress.inner_steps, doc="Inner steps since construction.")
    round = property(lambda self: self.progress.round, doc="Index t of the current round.")
    round_step = property(lambda self: self.progress.round_step, doc="Inner steps taken in this round.")
    warmup_done = property(lambda self: self.progress.warmup_done, doc="The synchronous warm-up is over.")
    amp_skipped_steps = property(lambda self: self.progress.amp_skipped_steps, doc="Steps AMP skipped.")

    @property
    def skipped_rounds(self) -> int:
        """Rounds whose outer update no worker was finite for (summed over fragments). Counted on the
        device: reading it waits for the device (for logs and tests, not every step)."""
        return int(sum(row[SKIPPED] for row in self._tally.read()))

    @property
    def last_wait_s(self) -> float:
        """Seconds this rank was blocked waiting at the last boundary (exposed communication);
        with fragments, the last wait of each fragment, summed: the exposed wait of a round. On a GPU
        reading it waits for the device."""
        return sum(part.last_wait_s for part in self.fragments)

    @property
    def last_comm_s(self) -> float:
        """Launch-to-completion of the last all-reduce received (summed over fragments: how long
        the link was busy with one round's bytes). On a GPU reading it waits for the device."""
        return sum(part.last_comm_s for part in self.fragments)

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
        p = self.progress
        if not p.warmup_done:
            self._take_anchor()
            p.warmup_done = True
        # fragment by fragment, so that streaming fragments keep sharing one buffer (at most two: the
        # one in flight and the one finishing); each touches its own slice of the outer state only
        for f, part in enumerate(self.fragments):
            if self.plan.steps_since_boundary(f, p.round, p.round_step) > 0:
                part.boundary(p.inner_steps)
            part.finish()
        self._pool.trim()
        self._flush()
        self.live.write_all(lambda chunk: self._anchor[chunk.start : chunk.stop])  # floats too
        p.round = p.round_step = 0
        self._tally.mirror.refresh()
        self._check()

    @torch.no_grad()
    def adopt_model(self) -> None:
        """Take the model's current values as the anchor, on every rank (from the first, as at the end
        of the warm-up): after other weights were loaded into a finalized model (the Trainer's
        ``load_best_model_at_end``), so that saving and evaluating use them. Collective."""
        if self._pending is not None:
            raise RuntimeError("CO2.adopt_model with an outer all-reduce in flight: call finalize() first")
        self._take_anchor()

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
        self._flush()
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
        self._flush()
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
        parts = sum(part.nbytes() for part in self.fragments)
        return sum(t.numel() * t.element_size() for t in tensors) + parts + self._pool.nbytes()

    def pop_metrics(self) -> dict[str, float]:
        """Each per-round metric over the rounds since the last call, plus the running counters.

        With fragments a round is F fragment boundaries, and a logging window need not hold whole
        rounds (every 10 steps at tau 12 holds 10 of the 12 fragments' boundaries): each figure is
        made from the fragments that had a boundary in the window, scaled to a whole round, so that
        it means the same at any logging interval. Seconds: the fragments' mean waits summed and
        scaled by F / (fragments present); norms: the root of their mean squares summed, scaled
        alike; the clip ratio: the fragments' mean; the penalty: its mean over every parameter
        element that received an update in the window (exactly 1 without a penalty).

        The statistics are counted on the device (``tally.py``): this call waits for it once. Call it
        at logging steps; between them the engine never waits for the device."""
        per_part, skipped_rounds = self._metric_means(pop=True)
        present = [m for m in per_part if m]
        out: dict[str, float] = {}
        if present:
            scale = len(self.fragments) / len(present)
            for name in set().union(*present) - set(PENALTY):
                out[f"co2/{name}"] = _combine(name, [m[name] for m in present if name in m], scale)
            elements = sum(m.get("penalty_elements", 0.0) for m in present)
            if elements > 0:
                out["co2/penalty_mean"] = sum(m.get("penalty_sum", 0.0) for m in present) / elements
        if "co2/comm_s" in out and "co2/comm_wait_s" in out and out["co2/comm_s"] > 0:
            out["co2/hidden_frac"] = min(max(1 - out["co2/comm_wait_s"] / out["co2/comm_s"], 0.0), 1.0)
        out["co2/amp_skipped_steps"] = float(self.progress.amp_skipped_steps)
        out["co2/skipped_rounds"] = float(skipped_rounds)
        return out

    def fragment_metrics(self) -> list[dict[str, float]]:
        """Per fragment, each metric's mean over its boundaries since the last `pop_metrics` (what
        `pop_metrics` combines into one round's figures), without starting a new window. Waits for
        the device, as `pop_metrics` does."""
        return self._metric_means(pop=False)[0]

    def _metric_means(self, *, pop: bool) -> tuple[list[dict[str, float]], int]:
        per_part, skipped_rounds = self._tally.metric_means(pop=pop)
        for means, part in zip(per_part, self.fragments):
            comm_s = part.comm_s(pop=pop)
            if comm_s is not None:
                means["comm_s"] = comm_s
        return per_part, skipped_rounds

    # ------------------------------------------------------------------ checkpoints (core/state.py)

    def state_dict(self) -> dict[str, Any]:
        """This rank's CO2 state, without any collective (``core/state.py``). Tensors are references
        (as with ``optimizer.state_dict()``): save or clone them before training continues."""
        self._flush()
        fragments = [part.state_dict() for part in self.fragments]  # each waits for its all-reduce first
        return {
            "format": STATE_FORMAT,
            **self._identity(),
            "anchor": self._anchor,
            "momentum": self._momentum,
            "counters": to_dict(self.progress),
            "fragments": fragments,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore a state saved by this rank in the same setting; raise ``ValueError`` otherwise."""
        if self._pending is not None:
            raise RuntimeError("load_state_dict while an outer all-reduce is in flight")
        saved = upgrade(saved)
        check_compatible(saved, **self._identity())
        self._flush()
        self._anchor.copy_(saved["anchor"])
        self._momentum.copy_(saved["momentum"])
        for part, kept in zip(self.fragments, saved["fragments"], strict=True):
            part.load_state_dict(kept)
        self.progress = from_dict(Progress, saved["counters"])

    @property
    def _pending(self):
        """The all-reduce in flight, if any (one fragment's at most)."""
        return next((part.pending for part in self.fragments if part.in_flight), None)

    def _drain(self) -> None:
        for part in self.fragments:
            part.drain()

    @torch.no_grad()
    def _take_anchor(self) -> None:
        """Broadcast the live tensors from the first rank, then copy them into the anchor."""
        self._flush()
        self.comm.broadcast_([s.tensor.data for s in self.layout.segments])
        for chunk in self.layout.chunks:
            self._anchor[chunk.start : chunk.stop].copy_(self.live.read(chunk))

    def _identity(self) -> dict[str, Any]:
        """What must match between a checkpoint and the run that loads it."""
        return {
            "config": self.config.co2_dict(),
            "layout": self.layout.describe(),
            "num_workers": self.num_workers,
            "worker_index": self.comm.worker_index,
        }


def _model_device(model: nn.Module, fallback: torch.device) -> torch.device:
    """Where the model's parameters are (the device that works on staged host-memory state)."""
    return next((p.device for p in model.parameters()), fallback)


def _workers_and_layout(model: nn.Module, cfg: CO2Config, comm: Communicator, chunk_numel: int):
    """The number of worker processes (checked against the config) and this process's flat layout."""
    if comm.worker_size != cfg.co2_worker_size:
        raise ValueError(
            f"co2_worker_size={cfg.co2_worker_size} but the communicator has {comm.worker_size} process(es) per worker"
        )
    num_workers = cfg.check_world(comm.num_workers * comm.worker_size)
    layout = FlatLayout(
        model,
        worker_size=comm.worker_size,
        shard_index=comm.shard_index,
        chunk_numel=chunk_numel,
        fragments=cfg.fragments,
    )
    if layout.presharded:  # FSDP2 inside the worker, never across workers
        layout.check_sharded_over(comm.worker_ranks())
    return num_workers, layout


def _clip_scales(layouts: list[FlatLayout], comm: Communicator, cfg: CO2Config, device: torch.device) -> list[float]:
    """Per fragment (``layouts``), ``sqrt`` of its share of the worker's parameters: clipping each
    fragment's momentum to ``phi`` times it bounds the whole momentum's norm by ``phi``. 1 for one
    fragment; the shares are summed over the worker's processes (one collective) only when clipping."""
    if len(layouts) == 1 or cfg.co2_clip_threshold is None:
        return [1.0] * len(layouts)
    local = [float(part.param_local) for part in layouts]
    counts = comm.reduce_stats(torch.tensor(local, dtype=torch.float64, device=device))
    return [math.sqrt(float(c) / max(layouts[0].total_param_numel, 1)) for c in counts]


def _combine(name: str, values: list[float], scale: float) -> float:
    """One round's figure from the present fragments' means (``scale``: F / fragments present)."""
    if name in MEAN:
        return sum(values) / len(values)
    if name in ROOT_SUM_SQUARE:
        return math.sqrt(scale * sum(v * v for v in values))
    return scale * sum(values)


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
