"""The round schedule: which of the engine's phase sequences run after a given inner step, on which fragment.

This is the one place that maps "inner step ``s`` of the round" to work. A round has
``tau = co2_local_steps`` steps.

- One fragment (the whole flat state): the boundary runs at step ``tau``; with a partial-overlap
  window (``co2_overlap_steps = k``) the average in flight is applied ``k`` steps into the round.
- ``co2_fragments = F > 1`` (streaming): fragment ``f`` reaches its boundary at step ``(f + 1) k``
  of every round, ``k = tau / F``, and its average is applied ``k`` steps after its launch, when the
  next fragment reaches its boundary. So after step ``j k`` the previous fragment's average is
  applied, then fragment ``j - 1`` launches: one fragment's all-reduce is in flight at a time, and
  fragment ``F - 1``'s is applied at step ``k`` of the next round.
"""

from __future__ import annotations

from enum import Enum


class Event(Enum):
    APPLY_IN_ROUND = "apply_in_round"  # wait for a fragment's last average and apply it mid-round
    BOUNDARY = "boundary"  # a fragment's round ends: the overlapped or synchronous boundary runs


class RoundSchedule:
    """``due(s)``: the (event, fragment index) pairs after inner step ``s`` (1-based) of the
    current round, in the order they run."""

    def __init__(self, local_steps: int, window_steps: int | None, fragments: int = 1) -> None:
        self.local_steps, self.window_steps, self.fragments = local_steps, window_steps, fragments

    def due(self, round_step: int) -> tuple[tuple[Event, int], ...]:
        if self.fragments > 1:
            k = self.window_steps
            if round_step % k:
                return ()
            j = round_step // k  # 1 .. F
            return ((Event.APPLY_IN_ROUND, (j - 2) % self.fragments), (Event.BOUNDARY, j - 1))
        events = ()
        if round_step == self.window_steps:
            events += ((Event.APPLY_IN_ROUND, 0),)
        if round_step >= self.local_steps:
            events += ((Event.BOUNDARY, 0),)
        return events

    def steps_since_boundary(self, fragment: int, round_index: int, round_step: int) -> int:
        """Inner steps a fragment has taken since its last boundary (or since the round counter
        started, when it has had none)."""
        at = (fragment + 1) * self.local_steps // self.fragments  # its boundary's step in a round
        if round_step >= at:
            return round_step - at
        return round_step + (self.local_steps - at if round_index > 0 else 0)
