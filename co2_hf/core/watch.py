"""What the engine does about what the device tallied and the clock measured (``Watch``).

The device counts, per fragment, rounds out of step, skipped rounds and non-finite sends (``tally.py``);
once its copy reaches host memory the engine hands the rows here: training stops on ranks out of
step or on ``co2_max_skipped_rounds`` skips in a row, and a worker found non-finite is quarantined.
The watch also times the rounds, to warn once when ``co2_timeout_s`` leaves too little room.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .tally import CONSECUTIVE_SKIPPED, NONFINITE, NONFINITE_ROUND, OUT_OF_STEP, OUT_OF_STEP_ROUND

# The engine warns under one logger name, whichever module of core/ notices: users filter on it.
logger = logging.getLogger("co2_hf.core.co2")

TIMEOUT_CHECK_BOUNDARY = 3  # co2_timeout_s is compared with the round timed between boundaries 2 and 3


class Watch:
    """One engine's watch over its ``fragments`` (`Fragment`), with its ``config`` and ``comm``."""

    def __init__(self, config: Any, fragments: list, comm: Any) -> None:
        self.config, self.fragments, self.comm = config, fragments, comm
        self.nonfinite_seen = [0.0] * len(fragments)  # per fragment: warned up to here
        self.boundaries_run = 0  # by this instance (not saved): the timeout check runs from the third
        self.timeout_checked = False
        self.round_started: float | None = None

    def act_on(self, rows: list, *, inner_steps: int, optimizer: Any) -> bool:
        """The tallied ``rows`` (one per fragment): stop on ranks out of step or
        ``co2_max_skipped_rounds`` skips in a row; for a non-finite worker, warn, clear the inner
        ``optimizer`` and restart every fragment's round (the NaN reaches every parameter). Returns
        whether it quarantined this worker (and so cleared the optimizer)."""
        limit = self.config.co2_max_skipped_rounds
        quarantined = False
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
            if row[NONFINITE] > self.nonfinite_seen[f]:
                self.nonfinite_seen[f] = row[NONFINITE]
                self._quarantine(part, int(row[NONFINITE_ROUND]), inner_steps=inner_steps, optimizer=optimizer)
                quarantined = True
        return quarantined

    def _quarantine(self, found: Any, round_index: int, *, inner_steps: int, optimizer: Any) -> None:
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
            if part is not found or found.boundary_step != inner_steps:
                part.restart()
        if optimizer is not None:
            optimizer.state.clear()

    def round_ended(self) -> None:
        """After step tau: from the third round on, the first whose communication times the host knows
        without waiting checks the timeout (once)."""
        compute_s = time.perf_counter() - self.round_started if self.round_started is not None else 0.0
        self.boundaries_run += 1
        if self.boundaries_run >= TIMEOUT_CHECK_BOUNDARY and not self.timeout_checked:
            known = [part.last_comm_known() for part in self.fragments]
            if None not in known:
                _check_timeout(self.config.co2_timeout_s, compute_s, sum(known))
                self.timeout_checked = True
        self.round_started = time.perf_counter()


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
