"""What a CO2 checkpoint holds, and the checks that it is loaded into the same setting.

Each rank saves its own part (``CO2.state_dict``), which never issues a collective: the outer
tensors it holds (keys ``anchor``, ``momentum``), the engine's clock (`Progress`, key ``counters``)
and, per fragment (key ``fragments``, one entry per fragment, one when ``co2_fragments = 1``): the
fp32 communication buffer with a completed all-reduce result in it (``buffer``), the start rule's
offset or None (``own_outer_grad``), the fragment's `FragmentProgress` (``counters``) and, with a
coded wire, this rank's error-feedback residuals (``residuals``, keyed as the codec names them:
``codecs/``, ``STATE_KEYS``; None or absent with the plain wire). The config and the layout are
checked by `check_compatible`. The caller saves the rank's live
parameters and inner optimizer state beside it. An all-reduce in flight is waited for first and
stored as completed (its values do not depend on when it is waited for), so the fragment's next
event uses it without waiting again and the resumed run continues bit for bit.

Format 2 is the above. Format 1 (one fragment: ``buffer``, ``own_outer_grad`` and every counter at
the top level, three counters under the engine's private attribute names of that time) still loads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

STATE_FORMAT = 2
# Settings that may change on resume: they do not alter the trajectory.
RESUMABLE_CHANGES = ("co2_timeout_s", "co2_max_skipped_rounds")
# Settings added since format 1, with the value every older checkpoint was trained with (a float32
# or bfloat16 wire, where the quantizer's knobs had no effect, read as their defaults; the sparse
# wire's knobs, added with it, had no effect on any wire before it; its fading residual and kept
# unsent progress came later, and their defaults are what it did before).
ADDED_SETTINGS = {
    "co2_fragments": 1,
    "co2_quant_block": 128,
    "co2_quant_rounding": "nearest",
    "co2_sparse_density": 1 / 64,
    "co2_sparse_bits": 2,
    "co2_sparse_feedback_decay": 1.0,
    "co2_sparse_keep_unsent": False,
    "co2_global_second_moment_every": 0,
}
# The hosting settings (co2_elastic, co2_fault_tolerance: `co2_hf.config.HOSTING`) are in no state's
# config, old or new: `CO2Config.co2_dict` leaves them out, so how a run was hosted never stops a resume.
# load_state_dict resumes exactly; another number of workers goes through core/reshard.py
ELSEWHERE = "; to resume on another number of workers, re-shard the state (co2_hf.core.reshard.load_resharded)"
_FORMAT_1_NAMES = {"consecutive_skipped": "_consecutive_skipped", "have_d": "_have_d", "sent_round": "_sent_round"}


@dataclass
class Progress:
    """The engine's clock. A checkpoint saves every field; nothing else about the round."""

    inner_steps: int = 0  # inner steps since construction (all of them, AMP-skipped included)
    round: int = 0  # index t of the current round
    round_step: int = 0  # inner steps taken in the current round
    warmup_done: bool = False
    amp_skipped_steps: int = 0


@dataclass
class FragmentProgress:
    """One fragment's counters (with one fragment: the whole model's)."""

    round: int = 0  # this fragment's boundaries so far: the index its next all-reduce carries
    skipped_rounds: int = 0  # rounds whose outer update was skipped: no worker was finite
    consecutive_skipped: int = 0
    have_d: bool = False  # the communication buffer holds a received mean D, not yet applied
    sent_round: int = 0  # the round whose outer gradients the last launched all-reduce carries


def to_dict(counters: Progress | FragmentProgress) -> dict[str, Any]:
    return asdict(counters)


def from_dict(cls: type, saved: dict[str, Any]) -> Any:
    return cls(**{f.name: saved[f.name] for f in fields(cls)})


def upgrade(saved: dict[str, Any]) -> dict[str, Any]:
    """A format-1 state as format 2 (one fragment); format 2 with every added setting filled in."""
    if saved.get("format") != 1:
        return {**saved, "config": {**ADDED_SETTINGS, **saved["config"]}} if "config" in saved else saved
    counters = {k: saved["counters"][_FORMAT_1_NAMES.get(k, k)] for k in asdict(FragmentProgress())}
    fragment = {"buffer": saved["buffer"], "own_outer_grad": saved["own_outer_grad"], "counters": counters}
    clock = {k: saved["counters"][k] for k in asdict(Progress())}
    config = {**ADDED_SETTINGS, **saved["config"]}
    return {**saved, "format": 2, "config": config, "counters": clock, "fragments": [fragment]}


def check_compatible(
    saved: dict[str, Any], *, config: dict, layout: dict, num_workers: int, worker_index: int
) -> None:
    """Raise ``ValueError`` unless ``saved`` (upgraded to this format) was written by this rank in
    this setting."""
    if saved.get("format") != STATE_FORMAT:
        raise ValueError(f"unknown CO2 checkpoint format {saved.get('format')!r}")
    check_same_config(saved["config"], config)
    _check_same("layout (parameter names and shapes)", saved["layout"], layout)
    _check_same("number of workers", saved["num_workers"], num_workers, ELSEWHERE)
    _check_same("worker index", saved["worker_index"], worker_index)


def check_same_config(
    saved: dict[str, Any], current: dict[str, Any], *, may_change: tuple[str, ...] = RESUMABLE_CHANGES
) -> None:
    """Raise ``ValueError`` naming every setting outside ``may_change`` that differs."""
    changed = {k: (saved.get(k), v) for k, v in current.items() if k not in may_change and saved.get(k) != v}
    if changed:
        detail = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise ValueError(
            f"the CO2 checkpoint was saved with other settings ({detail}); resume with the checkpoint's settings"
        )


def _check_same(what: str, saved: Any, current: Any, hint: str = "") -> None:
    if saved != current:
        raise ValueError(
            f"the CO2 checkpoint does not match this run's {what}: checkpoint {saved!r}, now {current!r}{hint}"
        )
