"""A fragment of CO2's outer state, and the verbs its owner drives it with.

`CO2` (``co2.py``) splits this process's flat outer state into F fragments (one: the whole shard)
and, after each inner step, tells each fragment what its plan (``schedule.py``) says is due. That
is the whole contract between them; CO2 never reaches inside:

- ``boundary()``: the fragment's round ends: the overlapped sequence (receive, direction,
  exchange, launch, reset) or, without overlap, the synchronous one (exchange, launch, receive,
  direction, apply, reset); returns whether this worker's outer gradient was finite;
- ``apply_in_round()``: ``k`` steps after a launch, apply its average (receive, direction, apply,
  shift), where the plan has a window or fragments;
- ``finish()``: end of training, after the last boundary: wait, apply, start from the anchor;
- ``drain()``: complete the all-reduce in flight outside a boundary (before a checkpoint);
- ``receive()``: complete it ahead of a boundary, its wait counted as that boundary's (a transport
  that reconfigures its group between rounds, torchft: ``core/ft.py``);
- ``restart()``: start this round again from its start point (another fragment of this worker
  found a non-finite outer gradient);
- read-only: ``pending`` / ``in_flight``, ``last_wait_s``, ``last_comm_s``, ``metrics``, ``wire``;
  ``pop_metric_means()``, ``state_dict()`` / ``load_state_dict()``, ``nbytes()``.

The fragment owns its slice of the outer state: views of the engine's anchor and momentum, the
start rule and the penalty (``rules.py``), its counters (`FragmentProgress`), its quantizer, and a
communication buffer (`WireBuffer`) while it needs one: from its boundary until its average is
applied, taken from the engine's `WirePool`, so that streaming fragments share one buffer. Each
phase (a private method) does one thing, chunk by chunk:

- ``_receive`` / ``_drain``: wait for the all-reduce in flight, read its header, ``D`` = the mean;
- ``_direction``: ``P``, ``m <- beta*m + P*D``, clip ``m``, the step ``v`` (when a ``D`` came);
- ``_exchange``: ``d = start - x``; ``a <- a - alpha*v`` (when a ``D`` came); buffer <- ``d``;
- ``_launch``: header, then the all-reduce of this round's ``d`` (as codes with an int8/int4/sparse wire);
- ``_apply``: ``a <- a - alpha*v`` alone;
- ``_reset``: ``x <- a - o``; ``_shift``: ``x <- x + (a_new - start)``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from ..config import CO2Config
from . import update
from .comm import Communicator, Pending
from .layout import Chunk, FlatLayout
from .live import LiveTensors
from .quant import QuantizedWire
from .rules import make_penalty, make_start_rule
from .schedule import Plan
from .sparse import SparseWire
from .state import FragmentProgress, from_dict, to_dict
from .wire import WireBuffer, WirePool

# The engine warns under one logger name, whichever module of core/ notices: users filter on it.
logger = logging.getLogger("co2_hf.core.co2")


class Fragment:
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
        optimizer: torch.optim.Optimizer | None,
        pin_memory: bool,
        clip_scale: float = 1.0,
        index: int = 0,
    ) -> None:
        self.config, self.plan, self.layout, self.device = config, plan, layout, anchor.device
        self._comm = comm  # fixed here: the fragment's all-reduces go through it and nothing else
        self.num_workers, self.optimizer = num_workers, optimizer
        self.live = LiveTensors(layout, comm, self.device, pin_memory=pin_memory)
        n = layout.shard_numel
        zeros = dict(dtype=torch.float32, device=self.device, pin_memory=pin_memory)
        self._anchor, self._momentum = anchor, momentum  # this fragment's views of the engine's
        # One fragment keeps its buffer all along (it is in flight across whole rounds, and its
        # checkpoint always holds it); streaming fragments hold one only from their boundary until
        # their average is applied.
        self._pool = pool
        self._keeps_buffer = plan.fragments == 1
        self._wire: WireBuffer | None = pool.acquire(n) if self._keeps_buffer else None
        self.codec = _codec(config, layout, num_workers, index, self.device, pin_memory)
        self._holds_unsent = isinstance(self.codec, SparseWire) and config.co2_sparse_keep_unsent
        self.start = make_start_rule(
            plan, config, self._momentum, layout.param_local, holds_unsent=self._holds_unsent, **zeros
        )
        self.penalty = make_penalty(plan, config, layout, self.device)  # P = 1 unless updates are stale
        # a fragment's momentum is clipped to phi * sqrt(its share of the parameters), so that the
        # whole momentum's norm stays <= phi (1 with one fragment)
        self.clip_threshold = None if config.co2_clip_threshold is None else config.co2_clip_threshold * clip_scale
        self.progress = FragmentProgress()
        self._pending: Pending | None = None
        # the anchor has values the live tensors must take in full at the next reset or shift: a
        # step moved it (float buffers got a new mean), or this worker restarts from it
        self._anchor_news = False
        self._last_wait_s = 0.0
        self._last_comm_s = 0.0  # launch-to-completion of the last all-reduce received (this rank)
        self._metrics: dict[str, list[float]] = defaultdict(list)

    # ------------------------------------------------------------------ the contract with CO2

    def boundary(self) -> bool:
        """This fragment's round ends: the overlapped or the synchronous sequence, as the plan says.
        Returns whether this worker's outer gradient was finite (False: it sent nothing and
        restarts; the caller restarts the worker's other fragments)."""
        with record_function("co2/boundary"):
            finite = self._overlapped_boundary() if self.plan.overlapped else self._synchronous_boundary()
            self.progress.round += 1
        return finite

    def apply_in_round(self) -> None:
        """A window or fragments: ``k`` steps after its launch, apply this fragment's average. Its base
        is still the anchor, so nothing is stale (P = 1). Nothing to do before its first round ends."""
        if self._pending is not None or self.progress.have_d:
            with record_function("co2/apply_in_round"):
                self._receive()
                self._direction()
                self._apply()
                self._shift()
        self._release_if_idle()

    def finish(self) -> None:
        """End of training, after this fragment's last boundary: wait for its all-reduce, apply it
        (with the plan's penalty when updates are stale), and leave its round starting at the anchor.
        The caller then writes the anchor into the live tensors."""
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
        if self._complete() is not None:
            self._last_wait_s = 0.0

    def restart(self) -> None:
        """``x <- a - o``, buffers included: this round starts again from where it started (another
        fragment of this worker was non-finite; its steps since then may carry the same fault)."""
        self.live.write_all(self._start_of)
        self._anchor_news = False

    @property
    def pending(self) -> Pending | None:
        """The all-reduce in flight, if any."""
        return self._pending

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    @property
    def wire(self) -> WireBuffer | None:
        """The communication buffer this fragment holds now (None: it needs none until its boundary)."""
        return self._wire

    @property
    def last_wait_s(self) -> float:
        """Seconds this rank waited at this fragment's last boundary (exposed communication)."""
        return self._last_wait_s

    @property
    def last_comm_s(self) -> float:
        """Launch-to-completion of the last all-reduce received (this rank)."""
        return self._last_comm_s

    @property
    def metrics(self) -> dict[str, tuple[float, ...]]:
        """Each metric's values over this fragment's boundaries since the last `pop_metric_means` (a copy)."""
        return {name: tuple(values) for name, values in self._metrics.items()}

    def pop_metric_means(self) -> dict[str, float]:
        """Each metric's mean over this fragment's boundaries since the last call (none: absent);
        the penalty's sum and elements are summed instead, so that their ratio is the mean P."""
        means = {
            name: sum(values) / (1 if name.startswith("penalty_") else len(values))
            for name, values in self._metrics.items()
            if values
        }
        self._metrics.clear()
        return means

    def state_dict(self) -> dict[str, Any]:
        """This fragment's part of a checkpoint (``core/state.py``), its all-reduce waited for first.
        ``buffer`` is held only where it means something: one fragment's (always), or a fragment's
        with a received D in it (``have_d``); None otherwise."""
        self.drain()
        saved = self._keeps_buffer or self.progress.have_d
        return {
            "buffer": self._wire.fp32 if saved else None,
            "own_outer_grad": self.start.offset,  # None under the anchor start rule
            "counters": to_dict(self.progress),
            "residuals": None if self.codec is None else self.codec.state(),  # int8/int4/sparse wires
        }

    def load_state_dict(self, kept: dict[str, Any]) -> None:
        """Restore `state_dict`'s output (or a format-2 fragment of an older version, whose buffer of a
        fragment without a received D is not needed and not read)."""
        self.progress = from_dict(FragmentProgress, kept["counters"])
        if self._keeps_buffer or self.progress.have_d:
            self._hold().fp32.copy_(kept["buffer"])
        self._release_if_idle()
        self.start.load_(kept["own_outer_grad"])
        if self.codec is not None:
            self.codec.load_(kept["residuals"])

    def nbytes(self) -> int:
        """Persistent bytes of its own: the start rule's offset and the quantizer's residuals (the
        buffer belongs to the pool)."""
        return self.start.nbytes() + (0 if self.codec is None else self.codec.nbytes())

    # ------------------------------------------------------------------ the sequences

    def _overlapped_boundary(self) -> bool:
        self._receive()  # D_{t-1}: none at round 0
        self._direction()  # its base a_{t-1} is one anchor move old: stale (the plan's penalty)
        finite = self._exchange()  # applies D_{t-1} while writing d_t
        self._hold_unsent()  # before the launch: the coded all-reduce changes the residual off-thread
        self._launch(finite)
        self._reset()
        return finite

    def _synchronous_boundary(self) -> bool:
        finite = self._exchange()  # nothing to apply yet: writes d_t
        self._launch(finite)
        self._receive()  # D_t, right away
        self._direction()  # fresh: the plan has no penalty without overlap
        self._apply()
        self._hold_unsent()  # what d_t left unsent, now coded
        self._reset()
        self._release_if_idle()
        return finite

    def _hold(self) -> WireBuffer:
        """The buffer, taken from the pool if this fragment holds none."""
        if self._wire is None:
            self._wire = self._pool.acquire(self.layout.shard_numel)
        return self._wire

    def _release_if_idle(self) -> None:
        """Streaming fragments give their buffer back once nothing is in flight or waiting in it."""
        idle = self._pending is None and not self.progress.have_d
        if idle and not self._keeps_buffer and self._wire is not None:
            self._pool.release(self._wire)
            self._wire = None

    # ------------------------------------------------------------------ the phases

    def _receive(self) -> None:
        """Wait for the all-reduce in flight, if any; the wait is this boundary's exposed time."""
        waited = self._complete()
        if waited is not None:
            self._last_wait_s = waited

    def _complete(self) -> float | None:
        """Wait for the all-reduce in flight and read it; the seconds waited (None: none in flight)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        start = time.perf_counter()
        with record_function("co2/wait"):
            try:
                self._comm.wait(pending, self.config.co2_timeout_s)
            except RuntimeError as error:
                raise self._peer_failure(error) from error
        waited = pending.wait_seconds(since=start)  # CUDA: the compute stream's stall (comm.py)
        self._last_comm_s = pending.comm_seconds()
        self._metrics["comm_s"].append(self._last_comm_s)
        # a fault-tolerant transport may drop the round (a participant died with it in flight):
        # then nothing is applied and the anchor and the momentum stay as they were (core/ft.py)
        self.progress.have_d = self._comm.commit(pending) and self._read_mean(pending.senders)
        return waited

    def _read_mean(self, senders: int | None) -> bool:
        """Check the header; turn the sum into a mean over finite workers (False: none was).
        ``senders``: how many workers took part (None: all of them)."""
        count, max_wait = self._wire.unpack(self.progress.sent_round, senders=senders)
        self._metrics["comm_wait_s"].append(max_wait)
        p = self.progress
        if count < 0.5:  # no worker was finite: skip this outer update
            p.skipped_rounds += 1
            p.consecutive_skipped += 1
            limit = self.config.co2_max_skipped_rounds
            if limit and p.consecutive_skipped >= limit:
                raise RuntimeError(
                    f"CO2: no worker had a finite outer gradient for {p.consecutive_skipped} "
                    f"consecutive rounds (co2_max_skipped_rounds={limit}); stopping"
                )
            return False
        p.consecutive_skipped = 0
        self._wire.payload.div_(count)
        return True

    def _direction(self) -> None:
        """Turn the received D (buffer) into the step v: the penalty, momentum, clip, Nesterov."""
        if not self.progress.have_d:
            return
        cfg, n = self.config, self.layout.param_local
        d, m = self._wire.payload[:n], self._momentum[:n]
        sums = self._comm.reduce_stats(self.penalty.partials(d))
        self._metrics["outer_grad_norm"].append(float(sums[-1]) ** 0.5)
        penalty_sum = self.penalty.scale_(d, m, sums[:-1])

        def clip(m: Tensor) -> None:
            # the worker's parameter elements in this fragment ride along, so that the penalty's
            # mean can be weighed by them across fragments (CO2.pop_metrics)
            count = torch.tensor(float(n), dtype=penalty_sum.dtype, device=penalty_sum.device)
            stats = self._comm.reduce_stats(torch.stack([update.norm_sq(m)[0], penalty_sum, count]))
            ratio = update.clip_ratio(float(stats[0]), self.clip_threshold)
            if ratio < 1.0:
                m.mul_(ratio)
            self._metrics["momentum_norm"].append(float(stats[0]) ** 0.5 * ratio)
            self._metrics["clip_ratio"].append(ratio)
            self._metrics["penalty_sum"].append(float(stats[1]))
            self._metrics["penalty_elements"].append(float(stats[2]))

        update.outer_step_(m, d, cfg.co2_outer_momentum, cfg.co2_nesterov, rescale=clip)

    def _exchange(self) -> bool:
        """Chunk by chunk: ``d = start - x``; ``a <- a - alpha*v`` when a D is waiting; buffer <- d.

        ``v`` is read before its chunk of the buffer is overwritten. Float buffers travel as
        absolute values. Returns whether d is finite on every process of this worker."""
        self._hold()
        v = self._take_step()
        sums = []
        for chunk in self.layout.chunks:
            lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
            # d = (a - o) - x, in place in the live copy
            x = self.live.read(chunk)
            torch.sub(self._anchor[lo:mid], x[: mid - lo], out=x[: mid - lo])
            self.start.subtract_offset_(x[: mid - lo], lo, mid)
            # One sum per chunk: NaN and Inf propagate through it, and it is ~30x cheaper than
            # isfinite().all(). (A sum of finite values beyond float32's range also counts as
            # non-finite; such an outer gradient is unusable anyway.) Stays on device: no sync.
            sums.append(x.sum())
            if v is not None:
                self._move_anchor(chunk, v)
            self.start.next_offset_(x[: mid - lo], None if v is None else v[lo:mid], lo, mid)
            self._wire.payload[lo:hi].copy_(x)
        finite = torch.isfinite(torch.stack(sums)).all() if sums else torch.ones((), dtype=torch.bool)
        return bool(self._comm.reduce_stats(finite.double().view(1).to(self.device)) >= self._comm.worker_size)

    def _apply(self) -> None:
        """``a <- a - alpha*v`` (float buffers: the received mean) when a D is waiting."""
        v = self._take_step()
        if v is not None:
            for chunk in self.layout.chunks:
                self._move_anchor(chunk, v)

    def _launch(self, finite: bool) -> None:
        """Quarantine a non-finite worker, write the header, start the all-reduce of the buffer."""
        if not finite:
            self._quarantine()
        p = self.progress
        tensor = self._wire.pack_header(
            finite=finite, round_index=p.round, wait_s=self._last_wait_s, worker_index=self._comm.worker_index
        )
        p.sent_round = p.round
        with record_function("co2/launch"):
            try:
                if self.codec is None:
                    self._pending = self._comm.launch(tensor)
                else:  # a non-finite worker's zeros leave its own residual for a later round
                    coded = functools.partial(
                        self.codec.all_reduce_,
                        self._wire.payload,
                        self._wire.header,
                        feedback=finite,
                        round_index=p.round,
                    )
                    self._pending = self._comm.launch_coded(tensor, coded)
            except RuntimeError as error:  # a transport may already know that a peer is gone
                raise self._peer_failure(error) from error

    def _reset(self) -> None:
        """``x <- a - o`` in place: parameters, and float buffers when the anchor has news for them.
        Each process of a worker holds 1/k of the anchor: the worker all-gathers it chunk by chunk."""
        if self._anchor_news:
            self.live.write_all(self._start_of)
        else:
            self.live.write_params(self._start_of)
        self._anchor_news = False

    def _shift(self) -> None:
        """Move each live parameter by (new anchor - where its round started), keeping the steps
        it took since; buffers take the received mean. A round started at ``a - o``; the anchor
        just moved by ``-alpha * v``. Afterwards the round counts as started at the new anchor."""
        if not self._anchor_news:
            return  # the round's average was skipped: nothing moved
        self.live.shift(self._anchor_move)
        self.start.clear_()
        self._hold_unsent()  # the all-reduce just received has coded the residual
        self._anchor_news = False

    # ------------------------------------------------------------------ helpers of the phases

    def _hold_unsent(self) -> None:
        """``o <- o + r``: with ``co2_sparse_keep_unsent`` the worker's next start keeps its own progress
        that the sparse wire has not sent yet (its error-feedback residual ``r``), instead of
        dropping it from its model until top-k picks it. The anchor does not change; ``d`` is
        measured from this start, so what the worker owes stays ``d + r``. Read only while no coded
        all-reduce of this fragment is in flight (the residual is its to write)."""
        if self._holds_unsent:
            self.start.offset.add_(self.codec.unsent[: self.start.offset.numel()])

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
        return self._wire.payload if self.config.co2_nesterov else self._momentum

    def _move_anchor(self, chunk: Chunk, v: Tensor) -> None:
        lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
        update.move_anchor_(
            self._anchor[lo:hi], v[lo:hi], self._wire.payload[lo:hi], mid - lo, self.config.co2_outer_lr
        )

    def _start_of(self, chunk: Chunk) -> Tensor:
        """Where this chunk's next round starts: ``a - o``."""
        return self.start.start_point(self._anchor[chunk.start : chunk.stop], chunk.start, chunk.param_stop)

    def _anchor_move(self, chunk: Chunk) -> Tensor:
        """What the shift adds to this chunk: ``-alpha * v + o`` on parameters, buffers' new mean."""
        lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
        move = self.live.scratch(hi - lo)
        torch.mul(self._step_v[lo:mid], -self.config.co2_outer_lr, out=move[: mid - lo])
        self.start.add_offset_(move[: mid - lo], lo, mid)
        if self._holds_unsent:
            move[: mid - lo].sub_(self.codec.unsent[lo:mid])  # ... less the unsent progress kept
        move[mid - lo :].copy_(self._anchor[mid:hi])  # buffers (and padding): set to the mean
        return move

    def _quarantine(self) -> None:
        """A worker whose outer gradient is not finite sends zeros with weight 0 and restarts."""
        logger.warning(
            "CO2: worker %d has a non-finite outer gradient at round %d; it sends nothing this "
            "round, returns to the anchor and clears its inner optimizer state",
            self._comm.worker_index,
            self.progress.round,
        )
        self._wire.payload.zero_()
        self.start.clear_()
        self._anchor_news = True  # the reset restores the float buffers too
        if self.optimizer is not None:
            self.optimizer.state.clear()

    def _peer_failure(self, error: Exception) -> RuntimeError:
        return RuntimeError(
            f"CO2's outer all-reduce of round {self.progress.sent_round} failed or did not finish within "
            f"co2_timeout_s={self.config.co2_timeout_s}s (a peer may have died or stalled): {error}"
        )


def _codec(
    config: CO2Config, layout: FlatLayout, num_workers: int, index: int, device: torch.device, pin_memory: bool
) -> QuantizedWire | SparseWire | None:
    """The fragment's codec with a coded wire (``co2_comm_dtype`` int8/int4: `QuantizedWire`; sparse:
    `SparseWire`, whose float buffers travel exactly) over more than one worker; None otherwise (one
    worker sends nothing, so nothing is coded)."""
    if num_workers == 1 or not (config.code_bits or config.sparse_wire):
        return None
    numel, how = layout.shard_numel, dict(stochastic=config.stochastic_rounding, seed=index, device=device)
    if config.sparse_wire:
        _say_sparse_density(config.co2_sparse_density, config.sparse_keep, config.co2_quant_block)
        return SparseWire(
            numel,
            block=config.co2_quant_block,
            keep=config.sparse_keep,
            bits=config.co2_sparse_bits,
            decay=config.co2_sparse_feedback_decay,
            dense=numel - layout.param_local,
            pin_memory=pin_memory,
            **how,
        )
    return QuantizedWire(
        numel, num_workers, bits=config.code_bits, block=config.co2_quant_block, pin_memory=pin_memory, **how
    )


@functools.cache
def _say_sparse_density(density: float, keep: int, block: int) -> None:
    """co2_sparse_density is rounded to whole values per block: say so once where that changes it."""
    if keep != density * block:
        logger.warning(
            "CO2: co2_sparse_density=%s keeps round(%s x co2_quant_block=%d) = %d values per block: "
            "the wire's density is %.6g",
            density,
            density,
            block,
            keep,
            keep / block,
        )
