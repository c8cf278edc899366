"""Checkpointing of the CO2 engine: a local ``state_dict`` that never issues a collective.

Each rank saves its own part: the outer state it holds (anchor, momentum, the completed all-reduce
result and its flag, the eager rule's own outer gradient), the counters, the config and the layout.
The caller saves the rank's live parameters and inner optimizer state beside it. An all-reduce in
flight is waited for first and stored as completed (its values do not depend on when it is waited
for), so the next boundary uses it without waiting again and the resumed run continues bit for bit.
"""

from __future__ import annotations

from typing import Any

STATE_FORMAT = 1
# Settings that may change on resume: they do not alter the trajectory.
RESUMABLE_CHANGES = ("co2_timeout_s", "co2_max_skipped_rounds")
COUNTERS = (
    "inner_steps",
    "round",
    "round_step",
    "warmup_done",
    "amp_skipped_steps",
    "skipped_rounds",
    "_consecutive_skipped",
    "_have_d",
    "_sent_round",
)


class CheckpointMixin:
    """``state_dict`` / ``load_state_dict`` for `CO2` (kept apart from the algorithm)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's CO2 state. Tensors are references (as with ``optimizer.state_dict()``):
        save or clone them before training continues."""
        self._receive(record=False)
        return {
            "format": STATE_FORMAT,
            "config": self.config.co2_dict(),
            "layout": self.layout.describe(),
            "num_workers": self.num_workers,
            "worker_index": self.comm.worker_index,
            "anchor": self._anchor,
            "momentum": self._momentum,
            "buffer": self._buf,
            "own_outer_grad": self._own,
            "counters": {name: getattr(self, name) for name in COUNTERS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by this rank in the same setting; raise ``ValueError`` otherwise."""
        if self._pending is not None:
            raise RuntimeError("load_state_dict while an outer all-reduce is in flight")
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown CO2 checkpoint format {state.get('format')!r}")
        _check_same_config(state["config"], self.config.co2_dict())
        _check_same("layout (parameter names and shapes)", state["layout"], self.layout.describe())
        _check_same("number of workers", state["num_workers"], self.num_workers)
        _check_same("worker index", state["worker_index"], self.comm.worker_index)
        self._anchor.copy_(state["anchor"])
        self._momentum.copy_(state["momentum"])
        self._buf.copy_(state["buffer"])
        if self._own is not None:
            self._own.copy_(state["own_outer_grad"])
        for name in COUNTERS:
            setattr(self, name, state["counters"][name])


def _check_same_config(saved: dict[str, Any], current: dict[str, Any]) -> None:
    changed = {k: (saved.get(k), v) for k, v in current.items() if k not in RESUMABLE_CHANGES and saved.get(k) != v}
    if changed:
        detail = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise ValueError(
            f"the CO2 checkpoint was saved with other settings ({detail}); resume with the checkpoint's settings"
        )


def _check_same(what: str, saved: Any, current: Any) -> None:
    if saved != current:
        raise ValueError(f"the CO2 checkpoint does not match this run's {what}: checkpoint {saved!r}, now {current!r}")
