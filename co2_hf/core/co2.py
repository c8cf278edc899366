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

Beside the engine, in their own modules: what it reports (its clock, waits, bytes and metrics:
`Reports`, ``reports.py``) and evaluation on the anchor (`AnchorViews`, ``anchor.py``), both mixed
into `CO2`; what it does about the device's tally and the rounds' timing (`Watch`, ``watch.py``);
with ``co2_global_second_moment_every``, the inner Adam's second moment at round ends
(`GlobalSecondMoment`, ``moments.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
from torch import nn

from ..allowed import refuse_torchft
from ..config import CO2Config
from .anchor import AnchorViews
from .comm import Communicator
from .fragment import Fragment
from .groups import make_communicator
from .layout import DEFAULT_CHUNK_NUMEL, FlatLayout
from .live import LiveTensors, Scratch, has_dtensors, pin_state, state_device
from .moments import FLAG as MOMENT_FLAG
from .moments import GlobalSecondMoment, fit_default_every
from .reports import Reports
from .rules import warn_about_start_rule
from .schedule import Event, Plan, fit_default_fragments
from .state import STATE_FORMAT, Progress, check_compatible, from_dict, to_dict, upgrade
from .tally import Tally
from .watch import Watch
from .wire import WirePool

logger = logging.getLogger("co2_hf.core.co2")


class CO2(Reports, AnchorViews):
    """CO2 data-parallel training around an ``nn.Module``; call ``step()`` after each optimizer step.

    Args:
        model: the module to train; construct CO2 after moving it to its device.
        config: the ``co2_*`` settings (``CO2Config()`` when None). ``co2_fault_tolerance='torchft'``
            needs torchft's communicator (``co2_hf.torchft.TorchFT(config).build``); ``co2_elastic``
            is the Trainer's (on its own, resume elsewhere with ``reshard.load_resharded``).
        optimizer: the inner optimizer; when given, a worker found non-finite has its state cleared.
            Needed by ``co2_global_second_moment_every`` (torch Adam or AdamW: ``moments.py``).
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
        self.num_workers, self.layout = _workers_and_layout(model, cfg, comm, chunk_numel, self.plan.fragments)
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
        self._default_moments = cfg.co2_global_second_moment_every is None  # a checkpoint's value may replace it
        self.config = cfg = fit_default_every(cfg, optimizer, self.num_workers)
        self._moments = _second_moment(cfg, optimizer, comm)
        self._tally = Tally(len(self.layout.fragment_edges) - 1, compute)  # what the device counts (tally.py)
        self.fragments = self._make_fragments(pinned)
        warn_about_start_rule(self.plan)
        self.progress = Progress(warmup_done=cfg.co2_sync_warmup_steps == 0)
        self._watch = Watch(cfg, self.fragments, comm)  # stops, quarantines, times rounds (watch.py)
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
        if self.progress.round_step >= self.plan.local_steps:
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
        p, tau = self.progress, self.plan.local_steps
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
        (on the CPU at once; on a GPU a step or so later, never waited for): `Watch.act_on`."""
        rows = self._tally.mirror.poll()
        if rows is not None:
            quarantined = self._watch.act_on(rows, inner_steps=self.progress.inner_steps, optimizer=self.optimizer)
            if quarantined and self._moments is not None:  # it cleared the inner optimizer (moments.py)
                self._moments.restart()

    def _start_quorum(self) -> bool:
        """Receive every all-reduce in flight (the transport's group may change with the quorum),
        then start the quorum of the round about to launch (`Communicator.start_quorum`)."""
        for part in self.fragments:
            part.receive()
        return self.comm.start_quorum()

    # ------------------------------------------------------------------ what the plan runs (fragment.py)

    def _end_round(self) -> None:
        """After step tau: the round counter moves on, and the watch times the round."""
        self.progress.round += 1
        self.progress.round_step = 0
        self._watch.round_ended()
        if self._moments is not None:
            self._moments.round_ended(self.progress.round)

    # ------------------------------------------------------------ the rest of the API (and reports.py, anchor.py)

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
        if self._moments is not None:
            self._moments.finish()
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
            "second_moment": None if self._moments is None else self._moments.state_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore a state saved by this rank in the same setting; raise ``ValueError`` otherwise."""
        if self._pending is not None:
            raise RuntimeError("load_state_dict while an outer all-reduce is in flight")
        saved = upgrade(saved)
        self.adopt_checkpoint_defaults(saved)
        check_compatible(saved, **self._identity())
        self._flush()
        self._anchor.copy_(saved["anchor"])
        self._momentum.copy_(saved["momentum"])
        for part, kept in zip(self.fragments, saved["fragments"], strict=True):
            part.load_state_dict(kept)
        if self._moments is not None:
            self._moments.load_state_dict(saved["second_moment"])  # the config matched: it was saved
        self.progress = from_dict(Progress, saved["counters"])

    def adopt_checkpoint_defaults(self, saved: dict[str, Any]) -> None:
        """Before ``saved`` (an upgraded state) is checked: an unset ``co2_global_second_moment_every``
        resumes a checkpoint trained without the exchange (0: every checkpoint from before it was the
        default) without it, with a WARNING, so that an upgrade never stops a resume."""
        saved_every = saved.get("config", {}).get(MOMENT_FLAG)
        if not self._default_moments or saved_every != 0 or self.config.co2_global_second_moment_every == 0:
            return
        logger.warning(
            "CO2: resuming a checkpoint trained with %s=0; it goes on without the exchange (the default, "
            "%d, would change its trajectory). Set %s to choose.",
            MOMENT_FLAG,
            self.config.co2_global_second_moment_every,
            MOMENT_FLAG,
        )
        self.config = dataclasses.replace(self.config, co2_global_second_moment_every=0)
        self._moments = None

    def check_peer_state(self, sent: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming what differs unless ``sent`` (another worker's `state_dict`,
        from a live peer) comes from a worker of this run: the same settings, model layout and
        number of workers (its worker index is its own)."""
        saved = upgrade(sent)
        check_compatible({**saved, "worker_index": self.comm.worker_index}, **self._identity())

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


def _second_moment(cfg: CO2Config, optimizer: Any, comm: Communicator) -> GlobalSecondMoment | None:
    """``co2_global_second_moment_every``'s exchange (``moments.py``), or None where it is off."""
    if cfg.co2_global_second_moment_every == 0:
        return None
    wire_dtype = torch.bfloat16 if cfg.bfloat16_wire else torch.float32  # the moments travel as the outer gradient
    return GlobalSecondMoment(
        optimizer, comm, every=cfg.co2_global_second_moment_every, timeout_s=cfg.co2_timeout_s, wire_dtype=wire_dtype
    )


def _model_device(model: nn.Module, fallback: torch.device) -> torch.device:
    """Where the model's parameters are (the device that works on staged host-memory state)."""
    return next((p.device for p in model.parameters()), fallback)


def _workers_and_layout(model: nn.Module, cfg: CO2Config, comm: Communicator, chunk_numel: int, fragments: int):
    """The number of worker processes (checked against the config) and this process's flat layout, cut
    into the plan's ``fragments``."""
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
        fragments=fragments,
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
