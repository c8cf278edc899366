"""What the engine counts on the device, and how the host learns it without waiting for the device.

On a GPU every read of a device value by the host (``float(t)``, ``bool(t)``, ``t.item()``, a blocking
copy to or from host memory) stops the host until the GPU has caught up, so the GPU then idles
while the host queues the next step's kernels. The engine's boundaries therefore decide everything
on the device (``docs/gpus.md``, "No host reads between logging steps") and keep what the host must
eventually know in one small float64 table, a row per fragment, the `Tally`:

- **health** (kept across logging steps): rounds skipped because no worker was finite (total and
  consecutive: ``co2_max_skipped_rounds``), the times this worker's outer gradient was not finite
  (and the last such round), the times the all-reduce mixed rounds (and which). The engine copies
  the table into host memory without waiting (`HostMirror`) after its events, and reads the copy
  once the device has written it: on the CPU at once, on a GPU a step or so later. That is when it
  warns, clears the inner optimizer of a non-finite worker, or stops training.
- **metrics** since the last logging step: sums and counts, read (a wait, once) by ``pop_metrics``
  and then zeroed.

`Seconds` is a duration that the host knows now (its own clock) or once two CUDA events have
completed: timings on a GPU are read when the metrics are, never in between.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Health: kept until the engine is checkpointed or reset.
SKIPPED = 0  # rounds whose outer update no worker was finite for
CONSECUTIVE_SKIPPED = 1
NONFINITE = 2  # boundaries at which this worker's outer gradient was not finite (it sent weight 0)
NONFINITE_ROUND = 3  # the fragment round of the last of them
OUT_OF_STEP = 4  # all-reduces whose round bits did not agree (ranks out of step)
OUT_OF_STEP_ROUND = 5  # the round this rank sent in the last of them
HEALTH_COLUMNS = 6
# Metrics: sums since the last pop_metrics.
RECEIVED = 6  # averages received (each with a header)
COMM_WAIT = 7  # the longest exposed wait any worker reported in the header, summed over them
APPLIED = 8  # averages applied (a worker was finite): the count the next five are summed over
OUTER_GRAD_NORM = 9
MOMENTUM_NORM = 10
CLIP_RATIO = 11
PENALTY_SUM = 12
PENALTY_ELEMENTS = 13
COLUMNS = 14
DIRECTION_COLUMNS = slice(OUTER_GRAD_NORM, COLUMNS)  # what `Fragment._direction` adds, in this order
METRICS = {"comm_wait_s": (COMM_WAIT, RECEIVED)} | {
    name: (column, APPLIED)
    for name, column in [
        ("outer_grad_norm", OUTER_GRAD_NORM),
        ("momentum_norm", MOMENTUM_NORM),
        ("clip_ratio", CLIP_RATIO),
        ("penalty_sum", PENALTY_SUM),
        ("penalty_elements", PENALTY_ELEMENTS),
    ]
}
SUMMED = ("penalty_sum", "penalty_elements")  # pop_metrics takes their ratio: summed, not averaged


class Tally:
    """The engine's device-side counters: one float64 row of `COLUMNS` per fragment."""

    def __init__(self, fragments: int, device: torch.device) -> None:
        self.values = torch.zeros(fragments, COLUMNS, dtype=torch.float64, device=device)
        self.mirror = HostMirror(self.values)

    def row(self, fragment: int) -> Tensor:
        """Fragment ``fragment``'s row (a view the fragment adds to)."""
        return self.values[fragment]

    def read(self) -> list[list[float]]:
        """The table now, waiting for the device (logging steps, checkpoints, explicit queries)."""
        return self.values.cpu().tolist()

    def metric_means(self, *, pop: bool) -> tuple[list[dict[str, float]], int]:
        """Per fragment, each metric's mean over its events since the last pop (penalty sums: summed;
        absent where it had none), and the rounds skipped so far; ``pop`` then zeroes the metrics.
        One wait for the device."""
        rows = self.read()
        if pop:
            self.values[:, HEALTH_COLUMNS:].zero_()
        return [_means(row) for row in rows], int(sum(row[SKIPPED] for row in rows))


def record_receipt_(row: Tensor, *, weight: Tensor, out_of_step: Tensor, max_wait: Tensor, round_index: int) -> None:
    """A received all-reduce's header into a fragment's row: the skip counters (``weight``: the
    finite workers, 0 = skipped), a disagreement of the round bits, the longest reported wait."""
    skipped = (weight < 0.5).double()
    row[RECEIVED].add_(1.0)
    row[COMM_WAIT].add_(max_wait.double())
    row[SKIPPED].add_(skipped)
    row[CONSECUTIVE_SKIPPED].add_(1.0).mul_(skipped)  # back to 0 at the first update applied
    row[OUT_OF_STEP].add_(out_of_step.double())
    row[OUT_OF_STEP_ROUND].masked_fill_(out_of_step, float(round_index))


def record_send_(row: Tensor, *, finite: Tensor, round_index: int) -> None:
    """A launch: whether this worker's outer gradient was finite (else it sent zeros with weight 0)."""
    row[NONFINITE].add_((~finite).double())
    row[NONFINITE_ROUND].masked_fill_(~finite, float(round_index))


def record_direction_(row: Tensor, applied: Tensor, *values: Tensor) -> None:
    """An average turned into a step: ``values`` are the `DIRECTION_COLUMNS` (norm of D, norm of the
    clipped momentum, clip ratio, penalty sum and elements), counted where ``applied`` (0 or 1)."""
    applied = applied.double()
    row[APPLIED].add_(applied)
    row[DIRECTION_COLUMNS].add_(torch.stack(values).double() * applied)


def _means(row: list[float]) -> dict[str, float]:
    means = {}
    for name, (column, count_column) in METRICS.items():
        count = row[count_column]
        if count > 0:
            means[name] = row[column] if name in SUMMED else row[column] / count
    return means


class HostMirror:
    """A copy of a small device tensor in host memory, refreshed without waiting for the device.

    `refresh` queues the copy (pinned memory and ``non_blocking`` on a GPU; on the CPU the copy is
    simply made) unless the last one is still on its way; `poll` returns the copy's values once the
    device has written them, else None. Reading that host memory is no wait: the host only looks
    whether the copy's event has completed. The host tensor is marked ``_co2_host_mirror`` so that
    the engine's host-read guard (tests/test_host_reads.py) can tell it from a read of device data."""

    def __init__(self, source: Tensor) -> None:
        self.source = source
        self.host = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
        self.host._co2_host_mirror = True
        self._event: Any = None
        self._in_flight = False
        self._stale = False  # the source changed while a copy was on its way: copy again after it

    def refresh(self) -> None:
        if self._in_flight:
            self._stale = True
            return
        self.host.copy_(self.source, non_blocking=True)
        if self.source.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.source.device))
        self._in_flight, self._stale = True, False

    def poll(self) -> list | None:
        """The values of the copy, once (None: none arrived since the last poll)."""
        if not self._in_flight or (self._event is not None and not self._event.query()):
            return None
        self._in_flight = False
        values = self.host.tolist()
        if self._stale:
            self.refresh()
        return values


class Seconds:
    """A duration: known now (``value``, from the host's clock) or once the CUDA events ``events``
    (start, end) have completed. `ready` never waits; `get` may (logging steps)."""

    __slots__ = ("value", "events")

    def __init__(self, value: float | None = None, *, events: tuple[Any, Any] | None = None) -> None:
        self.value, self.events = value, events

    def ready(self) -> bool:
        return self.value is not None or self.events[1].query()

    def get(self) -> float:
        if self.value is None:
            start, end = self.events
            end.synchronize()
            self.value, self.events = start.elapsed_time(end) / 1e3, None
        return self.value
