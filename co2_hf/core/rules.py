"""The rules a boundary applies, as small objects picked once at construction (``docs/algorithm.md``).

- A **start rule** says where a worker's next round starts, as an offset ``o`` from the anchor
  (the round starts at ``a - o``). Its one rule-specific method is ``next_offset_``; the others
  (measure from the start, reset to it, shift it, clear it) are shared. ``anchor`` holds no offset.
- A **penalty** damps a stale averaged outer gradient ``D`` in place. Its methods are ``partials``
  (the local statistics it needs, combined by the engine in one reduction) and ``scale_``.

Adding a rule is one class and one row in `START_RULES` or `PENALTIES`; the engine never asks
which rule it has.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..config import CO2Config
from . import update
from .layout import FlatLayout
from .schedule import Plan

# The engine warns under one logger name, whichever module of core/ notices: users filter on it.
logger = logging.getLogger("co2_hf.core.co2")


# ---------------------------------------------------------------------------------- start rules


class AnchorStart:
    """``anchor``: every round starts at the anchor (``o = 0``); holds nothing, does nothing."""

    offset: Tensor | None = None  # what a checkpoint stores as "own_outer_grad"

    def __init__(self, config: CO2Config, momentum: Tensor, numel: int, **zeros) -> None:
        pass

    def subtract_offset_(self, x: Tensor, lo: int, mid: int) -> None:
        """``x <- x - o[lo:mid]``: turns ``a - x`` into ``start - x``."""

    def add_offset_(self, x: Tensor, lo: int, mid: int, weight: Tensor) -> None:
        """``x <- x + weight * o[lo:mid]`` (``weight``: a 0-d tensor, 0 or 1: whether an update was applied)."""

    def start_point(self, anchor: Tensor, lo: int, mid: int, scratch: Tensor) -> Tensor:
        """Where this chunk's round starts, ``a - o``, from the anchor's chunk (not modified), in
        ``scratch`` where it differs from the anchor."""
        return anchor

    def next_offset_(self, d: Tensor, v: Tensor | None, lo: int, mid: int, *, applied: Tensor) -> None:
        """Set ``o[lo:mid]`` for the next round from ``d`` (this worker's outer gradient just measured)
        and ``v`` (the step whose ``-alpha * v`` moved the anchor; None when none was taken; ``applied``,
        a 0-d 0/1 tensor, says on the device whether it was or was skipped)."""

    def keep_where_(self, finite: Tensor) -> None:
        """``o <- 0`` where ``finite`` (a 0-d bool tensor) is False: a non-finite worker restarts at
        the anchor. Decided on the device: no host read."""

    def clear_where_(self, applied: Tensor) -> None:
        """``o <- 0`` if ``applied`` (0-d, 0 or 1): the round now counts as started at the new anchor."""

    def clear_(self) -> None:
        """``o <- 0``: the round (re)starts at the anchor itself."""

    def load_(self, saved: Tensor | None) -> None:
        """Restore ``o`` from a checkpoint."""

    def bind_(self, *, offset: Tensor | None, momentum: Tensor) -> None:
        """Work on these tensors from now on (host-memory state: the fragment's copies on the GPU
        while it works, its host copies otherwise; ``residency.py``)."""

    def nbytes(self) -> int:
        return 0


class _OffsetStart(AnchorStart):
    """A start rule that keeps one fp32 offset per parameter element of this shard."""

    def __init__(self, config: CO2Config, momentum: Tensor, numel: int, **zeros) -> None:
        self.config, self.momentum = config, momentum
        self.offset = torch.zeros(numel, **zeros)

    def subtract_offset_(self, x: Tensor, lo: int, mid: int) -> None:
        x.sub_(self.offset[lo:mid])

    def add_offset_(self, x: Tensor, lo: int, mid: int, weight: Tensor) -> None:
        x.addcmul_(self.offset[lo:mid], weight)  # x + 1 * o is exactly x + o

    def start_point(self, anchor: Tensor, lo: int, mid: int, scratch: Tensor) -> Tensor:
        split = mid - lo
        torch.sub(anchor[:split], self.offset[lo:mid], out=scratch[:split])
        scratch[split:].copy_(anchor[split:])
        return scratch

    def keep_where_(self, finite: Tensor) -> None:
        update.zero_unless_(self.offset, finite)

    def clear_where_(self, applied: Tensor) -> None:
        self.offset.mul_(1.0 - applied)  # the offset is finite: o * 1 = o, o * 0 = 0

    def clear_(self) -> None:
        self.offset.zero_()

    def load_(self, saved: Tensor | None) -> None:
        self.offset.copy_(saved)

    def bind_(self, *, offset: Tensor | None, momentum: Tensor) -> None:
        self.offset, self.momentum = offset, momentum

    def nbytes(self) -> int:
        return self.offset.numel() * self.offset.element_size()


class EagerStart(_OffsetStart):
    """``eager`` (weight gamma = ``co2_eager_weight``): ``o <- gamma * d + (1 - gamma) * alpha * v``."""

    def next_offset_(self, d: Tensor, v: Tensor | None, lo: int, mid: int, *, applied: Tensor) -> None:
        gamma, own = self.config.co2_eager_weight, self.offset[lo:mid]
        if gamma == 1.0:
            own.copy_(d)
            return
        torch.mul(d, gamma, out=own)
        if v is not None:  # one fused multiply-add, rounded as add_(v, alpha=...) is (tests/test_update.py)
            own.addcmul_(v, applied * ((1.0 - gamma) * self.config.co2_outer_lr))


class LookaheadStart(_OffsetStart):
    """``lookahead``: ``o <- alpha * step(d)``, the move the next boundary would apply if the average
    in flight equalled ``d``: ``m' = beta * m + d``, ``step = m'`` (Nesterov: ``beta * m' + d``), with
    ``m`` the momentum just updated (the coming penalty and clipping are not predicted)."""

    def next_offset_(self, d: Tensor, v: Tensor | None, lo: int, mid: int, *, applied: Tensor) -> None:
        cfg = self.config
        update.lookahead_offset_(
            self.offset[lo:mid], d, self.momentum[lo:mid], cfg.co2_outer_momentum, cfg.co2_nesterov, cfg.co2_outer_lr
        )


class HeldAnchorStart(_OffsetStart):
    """``anchor`` where the engine keeps something in the start (the sparse wire's unsent progress,
    ``co2_sparse_keep_unsent``): ``o <- 0`` at each boundary, and the engine adds to it."""

    def next_offset_(self, d: Tensor, v: Tensor | None, lo: int, mid: int, *, applied: Tensor) -> None:
        self.offset[lo:mid].zero_()


START_RULES = {"anchor": AnchorStart, "eager": EagerStart, "lookahead": LookaheadStart}


def warn_about_start_rule(plan: Plan) -> None:
    """Once per engine: the anchor start with an in-round apply counts steps twice."""
    k = plan.window_steps
    if k is not None and plan.overlapped and plan.start_rule == "anchor":
        knob = f"co2_fragments={plan.fragments}" if plan.fragments > 1 else f"co2_overlap_steps={k}"
        logger.warning(
            "CO2: %s with co2_start_rule='anchor' makes every worker redo the first %d steps of its "
            "last round and count them twice (docs/algorithm.md, 7a); co2_start_rule='eager' avoids it",
            knob,
            k,
        )


def make_start_rule(
    plan: Plan, config: CO2Config, momentum: Tensor, numel: int, *, holds_unsent: bool = False, **zeros
) -> AnchorStart:
    """The start rule the plan resolved (without overlap: ``anchor``); one with an offset where the
    engine holds the sparse wire's unsent progress in it (``holds_unsent``)."""
    rule = START_RULES[plan.start_rule]
    if holds_unsent and rule is AnchorStart:
        rule = HeldAnchorStart
    return rule(config, momentum, numel, **zeros)


# ------------------------------------------------------------------------------------ penalties


class NoPenalty:
    """``P = 1``: penalty off (``co2_gap_penalty = 0``), and every update that is not stale."""

    def partials(self, d: Tensor) -> Tensor:
        """Local partial statistics for `scale_`, with ``||D||^2`` last, in float64."""
        return update.norm_sq(d)

    def scale_(self, d: Tensor, m: Tensor, stats: Tensor) -> Tensor:
        """In place ``d <- P * d`` (``stats``: `partials` summed over the worker, ``||D||^2`` dropped);
        return the local sum of P over parameter elements, a 0-d float64 tensor on ``d``'s device."""
        return d.new_full((), float(d.numel()), dtype=torch.float64)


class ConstantPenalty(NoPenalty):
    """``constant``: ``P = 1 / max(1, lambda)`` everywhere (the authors' released code)."""

    def __init__(self, config: CO2Config, layout: FlatLayout, device: torch.device) -> None:
        self.p = update.constant_penalty(config.co2_gap_penalty)

    def scale_(self, d: Tensor, m: Tensor, stats: Tensor) -> Tensor:
        d.mul_(self.p)
        return d.new_full((), self.p * d.numel(), dtype=torch.float64)


class GapAwarePenalty(NoPenalty):
    """``gap_aware``: elementwise ``P = 1 / max(1, lambda * |alpha * m| / mean|D|)``, the mean taken
    over each whole synchronised tensor.

    Its operations do not grow with the number of tensors (a model of 400 tensors dispatches what one
    of 10 does, tests/test_host_reads.py): the per-tensor sums of ``|D|`` are one ``_foreach_norm``
    over the pieces of every tensor (one fused kernel on a GPU; on the CPU the same sums as one
    ``vector_norm`` per piece, bit for bit), and the mean reaches each element of a chunk through one
    ``repeat_interleave`` of the per-piece means (index tensors made once, on the device)."""

    def __init__(self, config: CO2Config, layout: FlatLayout, device: torch.device) -> None:
        self.lam, self.alpha = config.co2_gap_penalty, config.co2_outer_lr
        self.layout = layout
        pieces = _param_pieces(layout)
        self.piece_lengths = [hi - lo for _, lo, hi in pieces]
        self.piece_segment_ids = torch.tensor([sid for sid, _, _ in pieces], dtype=torch.long, device=device)
        self.segment_numels = layout.segment_numels.to(device)
        # per chunk: (start, stop of its parameters, which pieces, their lengths as a device tensor)
        self.chunks = []
        first = 0
        for chunk in layout.chunks:
            count = chunk.param_pieces
            lengths = torch.tensor(chunk.lengths[:count], dtype=torch.long, device=device)
            self.chunks.append((chunk.start, chunk.param_stop, slice(first, first + count), lengths))
            first += count

    def partials(self, d: Tensor) -> Tensor:
        """Local sums of ``|D|`` per synchronised tensor, then ``||D||^2``, in float64."""
        sums = d.new_zeros(len(self.layout.segments) + 1, dtype=torch.float64)
        if self.piece_lengths:
            pieces = d[: sum(self.piece_lengths)].split(self.piece_lengths)
            norms = torch.stack(torch._foreach_norm(pieces, 1)).double()
            sums.index_add_(0, self.piece_segment_ids, norms)
        sums[-1] = update.norm_sq(d)[0]
        return sums

    def scale_(self, d: Tensor, m: Tensor, stats: Tensor) -> Tensor:
        means = (stats / self.segment_numels).float()
        piece_means = means[self.piece_segment_ids]
        total = d.new_zeros((), dtype=torch.float64)
        for lo, mid, pieces, lengths in self.chunks:
            if mid <= lo:
                continue
            mean = piece_means[pieces].repeat_interleave(lengths, output_size=mid - lo)  # each element's tensor's
            u = m[lo:mid] if self.alpha == 1.0 else m[lo:mid] * self.alpha
            p = update.gap_aware_penalty(d[lo:mid], u, mean, self.lam)
            d[lo:mid].mul_(p)
            total += p.sum(dtype=torch.float64)
        return total


PENALTIES = {"gap_aware": GapAwarePenalty, "constant": ConstantPenalty}


def make_penalty(plan: Plan, config: CO2Config, layout: FlatLayout, device: torch.device) -> NoPenalty:
    """The penalty the plan resolved: a real one only where updates are stale (``plan.stale``) and
    ``co2_gap_penalty > 0``; `NoPenalty` (P = 1) everywhere else."""
    if plan.penalty == "none":
        return NoPenalty()
    return PENALTIES[plan.penalty](config, layout, device)


def _param_pieces(layout: FlatLayout) -> list[tuple[int, int, int]]:
    """Every parameter piece of this shard as (segment id, start, stop) in the flat state; a
    piece is the part of one synchronised tensor inside one chunk."""
    pieces = []
    for chunk in layout.chunks:
        start = chunk.start
        for sid, length in zip(chunk.segment_ids[: chunk.param_pieces], chunk.lengths):
            pieces.append((sid, start, start + length))
            start += length
    return pieces
