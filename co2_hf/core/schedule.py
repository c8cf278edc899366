"""The plan: a run's round schedule, resolved once from its settings (``docs/algorithm.md``).

Three knobs interact: ``co2_overlap``, ``co2_overlap_steps`` (a window ``k``) and ``co2_fragments``
(``F``). `Plan.resolve` turns them, with the model's size, into what actually runs, and every part
of the engine reads the plan instead of the knobs (tau and F included):

- ``local_steps``: tau, ``co2_local_steps``;
- ``fragments``: F, as `CO2Config.fragments` resolves an unset ``co2_fragments`` (the one place
  that rule is written), once `fit_default_fragments` has fitted that default to the model;
- ``window_steps``: k, as `CO2Config.window_steps` resolves it from F and ``co2_overlap_steps``;
- ``start_rule``: ``co2_start_rule`` with overlap; ``anchor`` without (no average is in flight
  when a round starts, so there is nothing to start ahead of);
- ``stale``: whether an average is applied after the anchor already moved once since its base
  (full overlap, one fragment, no window): the only case the gap penalty acts on;
- ``penalty``: ``co2_gap_penalty_mode`` where ``stale`` and ``co2_gap_penalty > 0``, else ``none``.

After each inner step, `Plan.due` says what runs on which fragment. Fragment ``f`` reaches its
boundary at step ``(f + 1) tau / F`` of every round; with a window its average is applied ``k``
steps after that (mod tau), before any boundary due at the same step. With F > 1 and k = tau / F,
the apply of fragment ``f`` meets the boundary of ``f + 1``: one fragment's all-reduce is in
flight at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any

# The engine warns under one logger name, whichever module of core/ notices: users filter on it.
logger = logging.getLogger("co2_hf.core.co2")


class Event(Enum):
    APPLY_IN_ROUND = "apply_in_round"  # wait for a fragment's last average and apply it mid-round
    BOUNDARY = "boundary"  # a fragment's round ends: the overlapped or synchronous boundary runs


@dataclass(frozen=True)
class Plan:
    """What a run's settings resolve to (see the module docstring); `describe` is what the model
    card and ``co2_config.json`` record beside the settings."""

    local_steps: int
    fragments: int
    window_steps: int | None
    overlapped: bool
    start_rule: str
    stale: bool
    penalty: str

    @classmethod
    def resolve(cls, config: Any) -> Plan:
        """The plan of ``config`` (a `CO2Config`, its default fragments fitted to the model first:
        `fit_default_fragments`)."""
        overlapped = config.co2_overlap
        stale = overlapped and config.window_steps is None
        penalized = stale and config.co2_gap_penalty > 0
        if config.co2_gap_penalty > 0 and not stale:
            _say_once(
                f"CO2: co2_gap_penalty={config.co2_gap_penalty} has no effect: it scales only averages applied a full "
                "round late (co2_overlap=True, co2_fragments=1, co2_overlap_steps unset), and here "
                f"{_why_not_stale(config)}."
            )
        if config.co2_start_rule == "eager" and not overlapped:
            _say_once(
                "CO2: co2_start_rule='eager' has no effect with co2_overlap=False: without overlap no average is in "
                "flight when a round starts, so every round starts at the anchor (co2_start_rule='anchor'). Drop it, "
                "or set co2_overlap=True."
            )
        return cls(
            local_steps=config.co2_local_steps,
            fragments=config.fragments,
            window_steps=config.window_steps,
            overlapped=overlapped,
            start_rule=config.co2_start_rule if overlapped else "anchor",
            stale=stale,
            penalty=config.co2_gap_penalty_mode if penalized else "none",
        )

    def __post_init__(self) -> None:
        # only the steps where something runs: at most 2F of them, whatever tau
        tau, k = self.local_steps, self.window_steps
        table: dict[int, list[tuple[Event, int]]] = {}
        for f in range(self.fragments):
            at = self.boundary_step(f)
            if k is not None:
                table.setdefault((at + k - 1) % tau + 1, []).insert(0, (Event.APPLY_IN_ROUND, f))
            table.setdefault(at, []).append((Event.BOUNDARY, f))
        object.__setattr__(self, "_due", {step: tuple(events) for step, events in table.items()})

    def boundary_step(self, fragment: int) -> int:
        """The inner step of every round (1-based) after which ``fragment`` reaches its boundary."""
        return (fragment + 1) * self.local_steps // self.fragments

    def due(self, round_step: int) -> tuple[tuple[Event, int], ...]:
        """The (event, fragment index) pairs after inner step ``round_step`` (1-based) of a round,
        in the order they run."""
        return self._due.get(round_step, ())

    def steps_since_boundary(self, fragment: int, round_index: int, round_step: int) -> int:
        """Inner steps a fragment has taken since its last boundary (or since the round counter
        started, when it has had none)."""
        at = self.boundary_step(fragment)
        if round_step >= at:
            return round_step - at
        return round_step + (self.local_steps - at if round_index > 0 else 0)

    def describe(self) -> dict[str, Any]:
        """The resolved values, for the model card and ``co2_config.json``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def settings(self, config: Any) -> dict[str, Any]:
        """``config``'s ``co2_*`` settings as they ran: ``co2_fragments`` is the F of this plan (the
        default resolved), the rest as given."""
        return {**config.co2_dict(), "co2_fragments": self.fragments}


def _why_not_stale(config: Any) -> str:
    """Why no average is applied a full round late under ``config``, and what would change that."""
    if not config.co2_overlap:
        return "co2_overlap=False applies every average at once (no average is ever stale): drop it"
    if config.co2_overlap_steps is not None:
        window = config.co2_overlap_steps
        return f"co2_overlap_steps={window} applies each average inside its round: unset co2_overlap_steps, or drop it"
    unset = (
        ""
        if config.co2_fragments is not None
        else f" (unset: one per inner step of co2_local_steps={config.co2_local_steps})"
    )
    return (
        f"co2_fragments={config.fragments}{unset} applies each fragment's average inside the round: set "
        "co2_fragments=1 for the penalty to act, or drop it"
    )


@functools.cache
def _say_once(message: str) -> None:
    """A setting the plan leaves without effect: said once per process, not at every plan resolved (a
    recipe's defaults combined with another method's flags may hold one; refusing would break them)."""
    logger.warning(message)


def fit_default_fragments(config: Any, shard_numel: int) -> Any:
    """``co2_fragments`` unset means one fragment per inner step; a model with fewer elements per
    process than that gets the most fragments it can hold (a divisor of tau), with a WARNING. A value
    the user set is never changed: `FlatLayout` refuses it if it does not fit. Returns the config
    with the fitted value set, or ``config`` itself when nothing changes."""
    if config.co2_fragments is not None or config.fragments == 1 or config.fragments <= shard_numel:
        return config
    tau = config.co2_local_steps
    fitted = max(d for d in range(1, tau + 1) if tau % d == 0 and d <= max(shard_numel, 1))
    logger.warning(
        "CO2: co2_fragments is not set, and its default (one fragment per inner step: co2_local_steps=%d) "
        "is more than the %d element(s) of outer state each process holds; using co2_fragments=%d, the most "
        "that fit and divide co2_local_steps. Set co2_fragments to choose.",
        tau,
        shard_numel,
        fitted,
    )
    return dataclasses.replace(config, co2_fragments=fitted)
