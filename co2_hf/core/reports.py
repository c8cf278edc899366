"""What the engine reports, read-only: its clock, the last waits, the bytes it holds and the metrics.

`Reports` is mixed into `CO2` (``co2.py``), whose attributes it reads: ``progress`` (the clock,
``state.py``), ``fragments``, ``_tally`` (what the device counted, ``tally.py``), ``_anchor``,
``_momentum`` and ``_pool``. Nothing here changes the engine's state but the metrics' window.
"""

from __future__ import annotations

import math

from .tally import SKIPPED

# How pop_metrics combines a round's per-fragment means into one figure per metric (default: sum:
# seconds add up over a round's fragments)
ROOT_SUM_SQUARE = ("outer_grad_norm", "momentum_norm")  # norms of the whole outer vectors
MEAN = ("clip_ratio",)
PENALTY = ("penalty_sum", "penalty_elements")  # summed over the window: penalty_mean is their ratio


class Reports:
    """`CO2`'s counters, waits, bytes and metrics (see the module docstring)."""

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

    def outer_state_nbytes(self) -> int:
        """Bytes of persistent outer state held by this process (anchor, momentum, buffers, and the
        second moment's offset)."""
        tensors = (self._anchor, self._momentum)
        parts = sum(part.nbytes() for part in self.fragments)
        moments = 0 if self._moments is None else self._moments.nbytes()  # co2_global_second_moment_every
        return sum(t.numel() * t.element_size() for t in tensors) + parts + self._pool.nbytes() + moments

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
        moment_wait = None if self._moments is None else self._moments.pop_wait_s()
        if moment_wait is not None:  # co2_global_second_moment_every: its exchange's exposed wait
            out["co2/second_moment_wait_s"] = moment_wait
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


def _combine(name: str, values: list[float], scale: float) -> float:
    """One round's figure from the present fragments' means (``scale``: F / fragments present)."""
    if name in MEAN:
        return sum(values) / len(values)
    if name in ROOT_SUM_SQUARE:
        return math.sqrt(scale * sum(v * v for v in values))
    return scale * sum(values)
