"""The round schedule: which of the engine's phase sequences run after a given inner step.

This is the one place that maps "inner step ``s`` of the round" to work. Today the whole flat state
forms one part with one round of ``tau = co2_local_steps`` steps: with a partial-overlap window
(``co2_overlap_steps = k``) the average in flight is applied ``k`` steps into the round, and the
boundary runs at step ``tau``. A later split of the state into fragments with offset rounds
(Streaming DiLoCo style) would return, per step, which fragment reaches which event.
"""

from __future__ import annotations

from enum import Enum


class Event(Enum):
    APPLY_IN_ROUND = "apply_in_round"  # wait for the last round's average and apply it mid-round
    BOUNDARY = "boundary"  # the round ends: the overlapped or synchronous boundary runs


class RoundSchedule:
    """``due(s)``: the events after inner step ``s`` (1-based) of the current round, in order."""

    def __init__(self, local_steps: int, overlap_steps: int | None) -> None:
        self.local_steps, self.overlap_steps = local_steps, overlap_steps

    def due(self, round_step: int) -> tuple[Event, ...]:
        events = ()
        if round_step == self.overlap_steps:
            events += (Event.APPLY_IN_ROUND,)
        if round_step >= self.local_steps:
            events += (Event.BOUNDARY,)
        return events
