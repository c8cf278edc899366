"""A fragment of CO2's outer state, and the verbs its owner drives it with.

`CO2` (``co2.py``) splits this process's flat outer state into F fragments (one: the whole shard)
and, after each inner step, tells each fragment what its plan (``schedule.py``) says is due. That
is the whole contract between them; CO2 never reaches inside:

- ``boundary()``: the fragment's round ends: the overlapped sequence (receive, direction,
  exchange, launch, reset) or, without overlap, the synchronous one (exchange, launch, receive,
  direction, apply, reset);
- ``apply_in_round()``: ``k`` steps after a launch, apply its average (receive, direction, apply,
  shift), where the plan has a window or fragments;
- ``finish()``: end of training, after the last boundary: wait, apply, start from the anchor;
- ``drain()``: complete the all-reduce in flight outside a boundary (before a checkpoint);
- ``receive()``: complete it ahead of a boundary, its wait counted as that boundary's (a transport
  that reconfigures its group between rounds, torchft: ``co2_hf/torchft/``);
- ``restart()``: start this round again from its start point (this worker's outer gradient was not
  finite somewhere: the engine restarts every fragment once it learns of it);
- read-only: ``pending`` / ``in_flight``, ``last_wait_s``, ``last_comm_s``, ``wire``, ``boundary_step``;
  ``comm_s()``, ``counters()``, ``state_dict()`` / ``load_state_dict()``, ``nbytes()`` (these, and
  where the state lives while the fragment works, are `FragmentState`'s: ``fragment_state.py``).

The fragment owns its slice of the outer state: views of the engine's anchor and momentum, the
start rule and the penalty (``rules.py``), its counters (`FragmentProgress`, and a row of the
engine's `Tally`), its codec (``codecs/``: None unless the wire is coded), and its `WireLink`
(``wire.py``): the all-reduce in flight, launched plain or through the codec, its bounded wait and
times, and a communication buffer (`WireBuffer`) while the fragment needs one: from its boundary
until its average is applied, taken from the engine's `WirePool`, so that streaming fragments
share one buffer. Each phase (a private method) does one thing, chunk by chunk:

- ``_receive`` / ``_complete``: wait for the all-reduce in flight, tally its header, ``D`` = the mean;
- ``_direction``: ``P``, ``m <- beta*m + P*D``, clip ``m``, the step ``v`` (when a ``D`` came);
- ``_exchange``: ``d = start - x``; ``a <- a - alpha*v`` (when a ``D`` came); buffer <- ``d``;
- ``_launch``: zeros for a non-finite worker, header, then the all-reduce of this round's ``d``;
- ``_apply``: ``a <- a - alpha*v`` alone;
- ``_reset``: ``x <- a - o``; ``_shift``: ``x <- x + (a_new - start)``;
- ``_hold_kept``: ``o <- o + r``, where the codec keeps the worker's unsent progress ``r`` in its
  start (``co2_sparse_keep_unsent``; `Codec.kept_progress`).

**Nothing here reads a device value on the host** (``docs/gpus.md``): whether this worker's ``d`` was
finite, whether any worker was (the header's weight), the clip ratio and every statistic are 0-d
tensors used where they are made. A skipped round (no worker finite) is an update of weight 0 whose
``-alpha`` is ``-0.0`` and whose momentum factor is 1 (exactly nothing moves); a non-finite worker's
zeros and cleared offset are ``where``s. The host learns what it must (a warning, clearing the inner
optimizer, stopping after ``co2_max_skipped_rounds``) from the engine's `Tally` (``tally.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from ..config import CO2Config
from . import tally, update
from .codecs import Codec, make_codec
from .comm import Communicator
from .fragment_state import FragmentState
from .layout import Chunk, FlatLayout
from .live import LiveTensors, Scratch
from .residency import Residency
from .rules import make_penalty, make_start_rule
from .schedule import Plan
from .state import FragmentProgress
from .wire import WireLink, WirePool


class Fragment(FragmentState):
    """The outer state of one fragment of this process's shard (the whole shard with one fragment)
    and the verbs that run its phases. Indices are the fragment's own, from 0; `CO2` makes one per
    fragment, on views of its anchor and momentum, and calls only the public methods."""

    def __init__(
        self,
        config: CO2Config,
        plan: Plan,
        *,
        comm: Communicator,
        layout: FlatLayout,
        anchor: Tensor,
        momentum: Tensor,
        pool: WirePool,
        num_workers: int,
        scratch: Scratch,
        counts: Tensor,
        pin_memory: bool,
        copy_stream: Any = None,
        stage: bool = False,
        clip_scale: float = 1.0,
        index: int = 0,
    ) -> None:
        # the device it computes on: the state's, or the model's when host-memory state is staged
        self.config, self.plan, self.layout, self.device = config, plan, layout, scratch.device
        self._comm = comm  # fixed here: the fragment's all-reduces go through it and nothing else
        self.num_workers = num_workers
        self.live = LiveTensors(layout, comm, scratch)
        zeros = dict(dtype=torch.float32, device=self.device)
        self._anchor, self._momentum = anchor, momentum  # this fragment's views of the engine's
        codec_pinned = pin_memory and not stage
        self.codec: Codec | None = make_codec(config, layout, num_workers, index, self.device, codec_pinned)
        # One fragment keeps its buffer all along (it is in flight across whole rounds, and its
        # checkpoint always holds it); streaming fragments hold one only from their boundary until
        # their average is applied.
        self._keeps_buffer = plan.fragments == 1
        self._link = WireLink(
            comm, self.codec, pool, layout.shard_numel, keep=self._keeps_buffer, timeout_s=config.co2_timeout_s
        )
        # the codec's unsent progress that this worker keeps in its start (None: it keeps nothing of it)
        self._kept = None if self.codec is None else self.codec.kept_progress()
        host = dict(dtype=torch.float32, device=anchor.device, pin_memory=pin_memory)  # where the state lives
        self.start = make_start_rule(
            plan, config, self._momentum, layout.param_local, holds_unsent=self._kept is not None, **host
        )
        # host-memory state worked on by the GPU: the state comes to the device for its events only
        self._residency = Residency(self._state(), self.device, copy_stream) if stage else None
        self.penalty = make_penalty(plan, config, layout, self.device)  # P = 1 unless updates are stale
        # a fragment's momentum is clipped to phi * sqrt(its share of the parameters), so that the
        # whole momentum's norm stays <= phi (1 with one fragment)
        self.clip_threshold = None if config.co2_clip_threshold is None else config.co2_clip_threshold * clip_scale
        self.progress = FragmentProgress()  # the skip counters live in ``counts`` while training
        self._counts = counts  # this fragment's row of the engine's Tally (tally.py)
        # a received D was taken (its step counts as applied from then on): the live tensors take
        # the anchor's news at the next reset or shift (skipped on the device if no worker was finite)
        self._anchor_news = False
        self._decided(weight=torch.ones((), **zeros), finite=torch.ones((), dtype=torch.bool, device=self.device))
        self.boundary_step: int | None = None  # the engine's inner step at this fragment's last boundary

    def _decided(self, *, weight: Tensor | None = None, finite: Tensor | None = None) -> None:
        """The device's decisions, as 0-d tensors: ``weight`` > 0 when the D in the buffer is a mean to
        apply (some worker was finite), ``finite`` whether this worker's last outer gradient was."""
        if weight is not None:
            self._applies = (weight >= 0.5).float()  # 1: apply the D; 0: skip it (no worker was finite)
            self._neg_lr = self._applies * -self.config.co2_outer_lr  # -alpha, or -0.0: nothing moves
            self._takes = self._applies > 0
        if finite is not None:
            self._finite = finite

    # ------------------------------------------------------------------ the contract with CO2

    def boundary(self, step: int) -> None:
        """This fragment's round ends (at the engine's inner step ``step``): the overlapped or the
        synchronous sequence, as the plan says."""
        with record_function("co2/boundary"), self._working(keep=True):  # the in-round apply follows
            if self.plan.overlapped:
                self._overlapped_boundary()
            else:
                self._synchronous_boundary()
            self.progress.round += 1
        self.boundary_step = step

    def apply_in_round(self) -> None:
        """A window or fragments: ``k`` steps after its launch, apply this fragment's average. Its base
        is still the anchor, so nothing is stale (P = 1). Nothing to do before its first round ends."""
        if self.in_flight or self.progress.have_d:
            with record_function("co2/apply_in_round"), self._working(keep=False):
                self._receive()
                self._direction()
                self._apply()
                self._shift()
        elif self._residency is not None:
            self._working_done()
        self._release_if_idle()

    def finish(self) -> None:
        """End of training, after this fragment's last boundary: wait for its all-reduce, apply it
        (with the plan's penalty when updates are stale), and leave its round starting at the anchor.
        The caller then writes the anchor into the live tensors."""
        with self._working(keep=False):
            self.drain()
            self._direction()
            self._apply()
            self.start.clear_()
        self._anchor_news = False
        self._release_if_idle()

    def receive(self) -> None:
        """Wait for the all-reduce in flight now, ahead of the boundary that would (a transport that
        reconfigures its group between rounds needs nothing in flight then: ``CO2.step``). The wait
        counts as this boundary's exposed time, as it would inside it."""
        self._receive()

    def drain(self) -> None:
        """Complete the all-reduce in flight, if any, outside a boundary: the wait is not exposed
        communication of a round (recorded as 0)."""
        self._complete(exposed=False)

    def restart(self) -> None:
        """``x <- a - o``, buffers included: this round starts again from where it started (this
        worker's outer gradient was not finite: its steps since then may carry the same fault)."""
        with self._working(keep=None):
            self.live.write_all(self._start_of)
        self._anchor_news = False

    def prefetch(self) -> None:
        """Host-memory state: start bringing this fragment's state to the device for its boundary at
        the next step (``residency.py``); nothing otherwise."""
        if self._residency is not None:
            self._residency.fetch()

    def store(self) -> None:
        """Host-memory state: put this fragment's state back in host memory (the engine waits for the
        copies before the host reads it); nothing otherwise."""
        if self._residency is not None:
            self._working_done()

    # ------------------------------------------------------------------ the sequences

    def _overlapped_boundary(self) -> None:
        self._receive()  # D_{t-1}: none at round 0
        self._direction()  # its base a_{t-1} is one anchor move old: stale (the plan's penalty)
        finite = self._exchange()  # applies D_{t-1} while writing d_t
        self._hold_kept()  # before the launch: the coded all-reduce changes the residual off-thread
        self._launch(finite)
        self._reset()

    def _synchronous_boundary(self) -> None:
        finite = self._exchange()  # nothing to apply yet: writes d_t
        self._launch(finite)
        self._receive()  # D_t, right away
        self._direction()  # fresh: the plan has no penalty without overlap
        self._apply()
        self._hold_kept()  # what d_t left unsent, now coded
        self._reset()
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        """Streaming fragments give their buffer back once nothing is in flight or waiting in it."""
        if not self.in_flight and not self.progress.have_d:
            self._link.release()

    # ------------------------------------------------------------------ the phases

    def _receive(self) -> None:
        """Wait for the all-reduce in flight, if any; the wait is this boundary's exposed time."""
        self._complete(exposed=True)

    def _complete(self, *, exposed: bool) -> None:
        """Wait for the all-reduce in flight, if any (`WireLink.complete`), and tally it."""
        pending = self._link.complete(self.progress.sent_round, exposed=exposed)
        if pending is None:
            return
        # a fault-tolerant transport may drop the round (a participant died with it in flight):
        # then nothing is applied and the anchor and the momentum stay as they were (co2_hf/torchft/)
        self.progress.have_d = self._comm.commit(pending)
        if self.progress.have_d:
            self._read_mean(pending.senders)

    def _read_mean(self, senders: int | None) -> None:
        """Tally the header (``senders``: how many workers took part; None: all of them) and turn the
        sum into a mean over the finite workers. No worker finite: a D of weight 0, skipped."""
        weight, out_of_step, max_wait = self.wire.unpack(self.progress.sent_round, senders=senders)
        tally.record_receipt_(
            self._counts,
            weight=weight,
            out_of_step=out_of_step,
            max_wait=max_wait,
            round_index=self.progress.sent_round,
        )
        self._decided(weight=weight)
        self.wire.payload.div_(weight.clamp(min=1.0))  # all zeros when no worker was finite

    def _direction(self) -> None:
        """Turn the received D (buffer) into the step v: the penalty, momentum, clip, Nesterov."""
        if not self.progress.have_d:
            return
        cfg, n = self.config, self.layout.param_local
        d, m = self.wire.payload[:n], self._momentum[:n]
        sums = self._comm.reduce_stats(self.penalty.partials(d))
        penalty_sum = self.penalty.scale_(d, m, sums[:-1])
        beta = torch.where(self._takes, cfg.co2_outer_momentum, 1.0)  # 1 for a skipped D (d = 0): m stays
        update.momentum_(m, d, beta)
        # the worker's parameter elements in this fragment ride along, so that the penalty's mean can
        # be weighed by them across fragments (CO2.pop_metrics)
        count = penalty_sum.new_full((), float(n))
        stats = self._comm.reduce_stats(torch.stack([update.norm_sq(m)[0], penalty_sum, count]))
        ratio = torch.where(self._takes, update.clip_ratio(stats[0], self.clip_threshold), 1.0)
        if self.clip_threshold is not None:
            m.mul_(ratio)  # times 1 where nothing is clipped: exactly m
        if cfg.co2_nesterov:
            update.nesterov_direction_(d, m, cfg.co2_outer_momentum)
        norms = torch.stack([sums[-1], stats[0]]).sqrt()
        tally.record_direction_(self._counts, self._applies, norms[0], norms[1] * ratio, ratio, stats[1], stats[2])

    def _exchange(self) -> Tensor:
        """Chunk by chunk: ``d = start - x``; ``a <- a - alpha*v`` when a D is waiting; buffer <- d.

        ``v`` is read before its chunk of the buffer is overwritten (Nesterov: d is made in scratch
        first; else straight in the buffer). Float buffers travel as absolute values. Returns whether
        d is finite on every process of this worker, as a 0-d bool tensor on the device."""
        payload = self._link.hold().payload
        v = self._take_step()
        in_scratch = v is payload
        sums = []
        for chunk in self.layout.chunks:
            lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
            split = mid - lo
            x = self.live.read(chunk)
            d = x if in_scratch else payload[lo:hi]
            torch.sub(self._anchor[lo:mid], x[:split], out=d[:split])  # d = (a - o) - x ...
            self.start.subtract_offset_(d[:split], lo, mid)
            if v is not None:
                self._move_anchor(chunk, v)  # reads v and the buffers' mean before they are overwritten
            if not in_scratch:
                d[split:].copy_(x[split:])  # the buffers' absolute values, and padding
            # One sum per chunk: NaN and Inf propagate through it, and it is ~30x cheaper than
            # isfinite().all(). (A sum of finite values beyond float32's range also counts as
            # non-finite; such an outer gradient is unusable anyway.)
            sums.append(d.sum())
            self.start.next_offset_(d[:split], None if v is None else v[lo:mid], lo, mid, applied=self._applies)
            if in_scratch:
                payload[lo:hi].copy_(x)
        if not sums:
            return torch.ones((), dtype=torch.bool, device=self.device)
        finite = torch.isfinite(torch.stack(sums)).all()
        return self._comm.reduce_stats(finite.double().view(1))[0] >= self._comm.worker_size

    def _apply(self) -> None:
        """``a <- a - alpha*v`` (float buffers: the received mean) when a D is waiting."""
        v = self._take_step()
        if v is not None:
            for chunk in self.layout.chunks:
                self._move_anchor(chunk, v)

    def _launch(self, finite: Tensor) -> None:
        """A non-finite worker sends zeros with weight 0 and restarts (on the device); write the header,
        start the all-reduce of the buffer (plain, or coded: `WireLink.launch`)."""
        self._quarantine_where(finite)
        self.progress.sent_round = self.progress.round
        self._link.launch(finite=finite, round_index=self.progress.round)

    def _reset(self) -> None:
        """``x <- a - o`` in place: parameters, and the float buffers where the anchor has news for them
        (a D was applied) or this worker restarts (it was not finite). Each process of a worker holds 1/k
        of the anchor: the worker all-gathers it chunk by chunk."""
        buffers = ~self._finite
        if self._anchor_news:
            buffers = buffers | self._takes
        self.live.write_params(self._start_of, buffers=buffers)
        self._anchor_news = False

    def _shift(self) -> None:
        """Move each live parameter by (new anchor - where its round started), keeping the steps
        it took since; buffers take the received mean. A round started at ``a - o``; the anchor
        just moved by ``-alpha * v``. Afterwards the round counts as started at the new anchor.
        A skipped D (no worker finite) moves nothing and keeps the start (decided on the device)."""
        if not self._anchor_news:
            return  # the round's average was dropped: nothing moved
        self.live.shift(self._anchor_move, buffers=self._takes)
        self.start.clear_where_(self._applies)
        self._hold_kept(weight=self._applies)  # the all-reduce just received has coded the residual
        self._anchor_news = False

    # ------------------------------------------------------------------ helpers of the phases

    def _hold_kept(self, weight: Tensor | None = None) -> None:
        """``o <- o + r``: the worker's next start keeps its own progress that the codec has not sent
        yet (``r``, `Codec.kept_progress`; ``co2_sparse_keep_unsent``), instead of dropping it from its
        model until it is sent. The anchor does not change; ``d`` is measured from this start, so
        what the worker owes stays ``d + r``. Read only while no coded all-reduce of this fragment is
        in flight (``r`` is its to write). ``weight`` (0-d, 0 or 1) holds it only where an update was
        applied. Nothing without such a codec."""
        if self._kept is not None:
            kept = self._kept[: self.start.offset.numel()]
            if weight is None:
                self.start.offset.add_(kept)
            else:
                self.start.offset.addcmul_(kept, weight)

    def _quarantine_where(self, finite: Tensor) -> None:
        """On the device: where this worker's outer gradient is not finite, it sends zeros (weight 0
        in the header) and restarts from the anchor (offset cleared, buffers restored at the reset).
        The tally tells the host, which warns and clears the inner optimizer (`CO2`)."""
        update.zero_unless_(self.wire.payload, finite)
        self.start.keep_where_(finite)
        tally.record_send_(self._counts, finite=finite, round_index=self.progress.round)
        self._decided(finite=finite)

    def _take_step(self) -> Tensor | None:
        """The step v of the D waiting in the buffer, which counts as applied from now (None: none)."""
        if not self.progress.have_d:
            return None
        self.progress.have_d = False
        self._anchor_news = True
        return self._step_v

    @property
    def _step_v(self) -> Tensor:
        """Where the step v lies once `_direction` ran: the buffer (Nesterov) or the momentum."""
        return self.wire.payload if self.config.co2_nesterov else self._momentum

    def _move_anchor(self, chunk: Chunk, v: Tensor) -> None:
        lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
        update.move_anchor_where_(
            self._anchor[lo:hi], v[lo:hi], self.wire.payload[lo:hi], mid - lo, neg_lr=self._neg_lr, take=self._takes
        )

    def _start_of(self, chunk: Chunk) -> Tensor:
        """Where this chunk's next round starts: ``a - o``."""
        lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
        return self.start.start_point(self._anchor[lo:hi], lo, mid, self.live.scratch(hi - lo, "start"))

    def _anchor_move(self, chunk: Chunk) -> Tensor:
        """What the shift adds to this chunk: ``-alpha * v + o`` on parameters, buffers' new mean
        (times 0 for a skipped D: nothing moves)."""
        lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
        move = self.live.scratch(hi - lo, "move")
        torch.mul(self._step_v[lo:mid], self._neg_lr, out=move[: mid - lo])
        self.start.add_offset_(move[: mid - lo], lo, mid, self._applies)
        if self._kept is not None:
            move[: mid - lo].addcmul_(self._kept[lo:mid], -self._applies)  # ... less the unsent progress kept
        move[mid - lo :].copy_(self._anchor[mid:hi])  # buffers (and padding): set to the mean
        return move
