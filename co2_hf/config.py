"""`CO2Config`: every ``co2_*`` knob, declared once, with its help text and its validation.

The field name is the command-line flag (``--co2_local_steps``), the key in a checkpoint's
``co2_config.json`` and the attribute the engine reads. Integrations (the Trainer's arguments, the
Accelerate helper, the recipes) inherit or wrap this dataclass; none of them declares a knob again.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

# each choice's allowed values, once: the field's type (what HfArgumentParser offers as choices) and
# the tuple the checks name in their errors
StartRule = Literal["anchor", "eager", "lookahead"]
PenaltyMode = Literal["gap_aware", "constant"]
CommDtype = Literal["float32", "bfloat16", "int8", "int4", "sparse"]
QuantRounding = Literal["nearest", "stochastic"]
StateDevice = Literal["same", "cpu"]
START_RULES = get_args(StartRule)
PENALTY_MODES = get_args(PenaltyMode)
COMM_DTYPES = get_args(CommDtype)
QUANT_ROUNDINGS = get_args(QuantRounding)
CODE_BITS = {"int8": 8, "int4": 4}  # the wire types sent as block-quantized codes (core/quant.py)
SPARSE_BITS = (2, 4)  # value widths of the sparse wire (core/sparse.py)
MAX_SPARSE_BLOCK = 256  # the sparse wire sends a kept value's position within its block as one byte
STATE_DEVICES = get_args(StateDevice)

# The round-index check travels in bfloat16 when the wire is bfloat16; its per-bit sums are exact
# only while they stay <= 256 (bfloat16 has 8 significant bits).
MAX_BF16_WORKERS = 256
# co2_timeout_s becomes process-group timeouts (datetime.timedelta, milliseconds in c10d) and thread
# waits (threading.TIMEOUT_MAX): a year is far inside all of them and longer than any real wait.
MAX_TIMEOUT_S = 365 * 24 * 3600.0
# ... and at least a second: c10d truncates a wait's timedelta to whole milliseconds (pybind11's
# duration_cast), and 0 ms is its "no timeout", so 0.0001 s waited for the group's timeout instead;
# ddp_timeout follows it in whole seconds, and an all-reduce across machines takes longer anyway.
MIN_TIMEOUT_S = 1.0
# Rounds of at most this many inner steps. The default co2_fragments is one fragment per inner step,
# each with its own all-reduce and state, and the engine's start-up grows faster than linearly with
# their number (7 s for 10,000 on a 1M-parameter model here); a longer round would mix the workers
# a handful of times in a whole run. Published local-SGD runs use tens to a few thousand steps.
MAX_LOCAL_STEPS = 10_000
# Settings read by the sparse wire only, with their defaults: another value with another wire would
# be accepted and have no effect.
SPARSE_ONLY = {
    "co2_sparse_density": 1 / 64,
    "co2_sparse_bits": 2,
    "co2_sparse_keep_unsent": False,
    "co2_sparse_feedback_decay": 1.0,
}


def bytes_per_value(*, block: int, keep: int, bits: int) -> float:
    """Sparse wire payload bytes per value, padding aside (core/sparse.py's layout: per block, ``keep``
    uint8 indices, ``keep`` codes of ``bits`` and one fp32 scale). Here, not in core/sparse.py, so
    that the settings check needs nothing from the engine (this module imports no other of ours)."""
    return (keep + keep * bits / 8 + 4) / block


def max_paying_workers(*, block: int, keep: int, bits: int, int4_block: int) -> int:
    """The most workers G at which the all-gather of sparse payloads, ``(G-1) S`` bytes sent per rank,
    still sends fewer bytes than the dense int4 ring all-reduce, ``2 (G-1)/G x B4``: ``G < 2 B4 / S``."""
    int4 = (int4_block / 2 + 4) / int4_block
    ratio = 2 * int4 / bytes_per_value(block=block, keep=keep, bits=bits)
    limit = int(ratio)
    return limit - 1 if limit == ratio else limit


def _knob(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


# kw_only: mixed into TrainingArguments (CO2TrainingArguments), these fields must come after all of
# TrainingArguments' own, so that ``CO2TrainingArguments("out")`` is ``output_dir="out"`` as with
# ``TrainingArguments("out")``; a dataclass puts a base's keyword-only fields last in __init__.
@dataclass(kw_only=True)
class CO2Config:
    """Settings of CO2 (arXiv 2401.16265), as defined in ``docs/algorithm.md``. Keyword arguments only."""

    co2_enabled: bool = _knob(
        True, "Train with CO2. False: plain data parallel through the same script (the baseline)."
    )
    co2_local_steps: int = _knob(
        12, f"tau: inner optimizer steps per round, between two outer all-reduces (1 to {MAX_LOCAL_STEPS})."
    )
    co2_outer_lr: float = _knob(1.0, "alpha: outer learning rate applied to the outer momentum (> 0).")
    co2_outer_momentum: float = _knob(0.2, "beta: outer momentum coefficient (0 <= beta < 1).")
    co2_nesterov: bool = _knob(False, "Use the Nesterov form of the outer momentum.")
    co2_overlap: bool = _knob(
        True,
        "Overlap the outer all-reduce with the next round's compute (CO2). False: blocking outer "
        "all-reduce (local SGD / SlowMo / DiLoCo family).",
    )
    co2_overlap_steps: int | None = _knob(
        None,
        "k in [1, tau): apply each round's average after k inner steps of the next round, shifting "
        "the local models in place by the anchor's move (partial overlap: the all-reduce must hide "
        "behind k steps). Unset: at the next boundary, a full round of overlap (CO2).",
    )
    co2_fragments: int | None = _knob(
        None,
        "F >= 1, dividing tau: split the outer state into F fragments whose rounds are offset by "
        "tau/F steps (streaming CO2): every tau/F steps one fragment launches its all-reduce (1/F "
        "of the bytes) and its average is applied tau/F steps later, mid-round. 1: the whole model "
        "in one round. Unset: F = tau (one fragment after every inner step), or 1 where a window "
        "(co2_overlap_steps) or co2_overlap=False is set.",
    )
    co2_start_rule: StartRule = _knob(
        "lookahead",
        "Where a round starts: 'anchor' (every worker at the shared anchor), 'eager' (the anchor "
        "minus the worker's own last outer gradient, applied at once) or 'lookahead' (where the "
        "anchor will be once the in-flight average is applied, predicted with the worker's own "
        "outer gradient through the outer momentum). Only matters with overlap.",
    )
    co2_eager_weight: float = _knob(
        1.0,
        "gamma in [0, 1], with co2_start_rule='eager': a round starts at the anchor minus gamma times the "
        "worker's own last outer gradient minus (1 - gamma) times the anchor's last move (the last "
        "average standing in for the one in flight). 1: plain eager.",
    )
    co2_gap_penalty: float = _knob(
        0.0,
        "lambda >= 0: strength of the staleness gap penalty; 0 turns it off. Full overlap only: an "
        "average applied in-round (co2_overlap_steps, more than one fragment) is not stale.",
    )
    co2_gap_penalty_mode: PenaltyMode = _knob(
        "gap_aware",
        "'gap_aware': elementwise P = 1/max(1, lambda*|alpha*m|/mean|D|); 'constant': P = 1/max(1, lambda).",
    )
    co2_clip_threshold: float | None = _knob(
        None, "phi > 0: clip the global L2 norm of the outer momentum to phi; unset: no clipping."
    )
    co2_comm_dtype: CommDtype = _knob(
        "float32",
        "What the outer all-reduce sends: 'float32', 'bfloat16', or block-quantized codes with "
        "error feedback, 'int8' (about 0.26x the bytes of float32) or 'int4' (about 0.13x), or "
        "'sparse': per block, the co2_sparse_density largest values in co2_sparse_bits bits with "
        "error feedback, all-gathered (core/sparse.py). Outer state stays float32.",
    )
    co2_quant_block: int = _knob(
        128,
        "With co2_comm_dtype int8/int4/sparse: values per block, each block with one float32 "
        "scale (an even integer >= 2, at most 256 with 'sparse'; smaller blocks are more exact and "
        "send more scales).",
    )
    co2_sparse_density: float = _knob(
        SPARSE_ONLY["co2_sparse_density"],
        "With co2_comm_dtype='sparse': the fraction of each block's values sent, in (0, 1]: "
        "round(density * co2_quant_block) values per block (at least 1), its largest magnitudes.",
    )
    co2_sparse_bits: int = _knob(
        SPARSE_ONLY["co2_sparse_bits"],
        "With co2_comm_dtype='sparse': bits per sent value, 2 or 4 (one float32 scale per block).",
    )
    co2_sparse_keep_unsent: bool = _knob(
        SPARSE_ONLY["co2_sparse_keep_unsent"],
        "With co2_comm_dtype='sparse': each worker's model keeps its own progress that top-k has not "
        "sent yet (its error-feedback residual) instead of returning to the anchor's values until it "
        "is sent. The average is the same rule; the workers train faster but the anchor (the model "
        "you get) can lag them where the wire cannot keep up: measure before you switch it on "
        "(docs/algorithm.md, section 18).",
    )
    co2_sparse_feedback_decay: float = _knob(
        SPARSE_ONLY["co2_sparse_feedback_decay"],
        "With co2_comm_dtype='sparse': in (0, 1], what the error-feedback residual (the values not "
        "yet sent) is multiplied by before each round's outer gradient joins it: 1 sends all of it "
        "eventually; below 1 old leftovers fade (SparseLoCo uses 0.95).",
    )
    co2_quant_rounding: QuantRounding = _knob(
        "nearest",
        "With co2_comm_dtype int8/int4: round each value to the 'nearest' code or 'stochastic'ally "
        "(unbiased). Error feedback carries what rounding leaves out to the next round either way.",
    )
    co2_sync_warmup_steps: int = _knob(
        0, "Inner steps of plain data parallel (gradients averaged every step) before local updating."
    )
    co2_worker_size: int = _knob(
        1,
        "Processes per worker: k consecutive ranks train as one data-parallel worker over a fast "
        "link; CO2 runs between workers. Must divide the world size.",
    )
    co2_state_device: StateDevice = _knob(
        "same",
        "Where anchor, momentum and buffer live: 'same' as the parameters, or 'cpu' (host memory, worked on by the "
        "GPU a fragment at a time with streaming fragments: docs/gpus.md).",
    )
    co2_max_skipped_rounds: int = _knob(
        3,
        "Consecutive rounds in which no worker is finite before training stops with an error (0: never stop).",
    )
    co2_timeout_s: float = _knob(
        900.0, f"Seconds to wait for an outer all-reduce before failing with a clear error (>= {MIN_TIMEOUT_S:g})."
    )

    def __post_init__(self) -> None:
        self.validate_co2()

    # Named validate_co2 (not validate) so that a TrainingArguments subclass can mix it in safely.
    def validate_co2(self) -> None:
        """Raise ``ValueError`` naming the field, the value and what is allowed.

        Numbers of other numeric types (``numpy.int64(4)``, ``numpy.float32(0.5)``) are accepted and
        stored as Python ``int`` / ``float``, so that the config saves as JSON like any other."""
        self._normalise_numbers()
        for name in ("co2_enabled", "co2_nesterov", "co2_overlap", "co2_sparse_keep_unsent"):
            _check(name, getattr(self, name), isinstance(getattr(self, name), bool), "True or False")
        _check_int(self, "co2_local_steps", minimum=1)
        _check(
            "co2_local_steps",
            self.co2_local_steps,
            self.co2_local_steps <= MAX_LOCAL_STEPS,
            f"an integer in [1, {MAX_LOCAL_STEPS}] (a longer round would average the workers only a few times "
            "in a run, and its default co2_fragments, one per inner step, would make the start-up slow)",
        )
        _check_int(self, "co2_sync_warmup_steps", minimum=0)
        _check_int(self, "co2_worker_size", minimum=1)
        _check_int(self, "co2_max_skipped_rounds", minimum=0)
        _check_int(self, "co2_quant_block", minimum=2)
        _check("co2_quant_block", self.co2_quant_block, self.co2_quant_block % 2 == 0, "an even integer >= 2")
        alpha = self.co2_outer_lr
        _check("co2_outer_lr", alpha, _is_real(alpha) and alpha > 0, "a finite number > 0")
        beta = self.co2_outer_momentum
        _check("co2_outer_momentum", beta, _is_real(beta) and 0 <= beta < 1, "a number in [0, 1)")
        gamma = self.co2_eager_weight
        _check("co2_eager_weight", gamma, _is_real(gamma) and 0 <= gamma <= 1, "a number in [0, 1]")
        if gamma != 1 and self.co2_start_rule != "eager":
            raise ValueError(
                f"co2_eager_weight={gamma} is not allowed with co2_start_rule={self.co2_start_rule!r} (it weighs "
                "the 'eager' start only): allowed value here is 1.0"
            )
        lam = self.co2_gap_penalty
        _check("co2_gap_penalty", lam, _is_real(lam) and lam >= 0, "a finite number >= 0 (0: off)")
        phi = self.co2_clip_threshold
        _check(
            "co2_clip_threshold",
            phi,
            phi is None or (_is_real(phi) and phi > 0),
            "a finite number > 0, or None for no clipping",
        )
        window = self.co2_overlap_steps
        _check(
            "co2_overlap_steps",
            window,
            window is None or (isinstance(window, int) and not isinstance(window, bool) and 1 <= window),
            "an integer >= 1 and < co2_local_steps, or None for a full round of overlap",
        )
        if window is not None and window >= self.co2_local_steps:
            raise ValueError(
                f"co2_overlap_steps={window} is not allowed with co2_local_steps={self.co2_local_steps}: it "
                "must be < co2_local_steps (None gives a full round of overlap)"
            )
        if window is not None and not self.co2_overlap:
            raise ValueError(
                f"co2_overlap_steps={window} needs co2_overlap=True (with co2_overlap=False the average is "
                "applied at once): allowed value here is None"
            )
        self._validate_fragments()
        self._validate_sparse()
        timeout = self.co2_timeout_s
        _check(
            "co2_timeout_s",
            timeout,
            _is_real(timeout) and MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S,
            f"a finite number of seconds >= {MIN_TIMEOUT_S:g} and <= {MAX_TIMEOUT_S:.0f} (one year); gloo and "
            "NCCL count timeouts in whole milliseconds, where 0 means none",
        )
        for name, allowed in (
            ("co2_start_rule", START_RULES),
            ("co2_gap_penalty_mode", PENALTY_MODES),
            ("co2_comm_dtype", COMM_DTYPES),
            ("co2_quant_rounding", QUANT_ROUNDINGS),
            ("co2_state_device", STATE_DEVICES),
        ):
            value = getattr(self, name)
            _check(name, value, value in allowed, "one of " + ", ".join(repr(a) for a in allowed))

    def _normalise_numbers(self) -> None:
        for f in dataclasses.fields(CO2Config):
            value = getattr(self, f.name)
            if isinstance(value, bool) or value is None or isinstance(value, (int, float, str)):
                continue
            if isinstance(value, numbers.Integral):
                setattr(self, f.name, int(value))
            elif isinstance(value, numbers.Real):
                setattr(self, f.name, float(value))

    def _validate_sparse(self) -> None:
        density, bits = self.co2_sparse_density, self.co2_sparse_bits
        _check("co2_sparse_density", density, _is_real(density) and 0 < density <= 1, "a number in (0, 1]")
        _check("co2_sparse_bits", bits, bits in SPARSE_BITS and not isinstance(bits, bool), "2 or 4")
        decay = self.co2_sparse_feedback_decay
        _check("co2_sparse_feedback_decay", decay, _is_real(decay) and 0 < decay <= 1, "a number in (0, 1]")
        if not self.sparse_wire:
            for name, default in SPARSE_ONLY.items():
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} has no effect with co2_comm_dtype={self.co2_comm_dtype!r}: "
                        f"only co2_comm_dtype='sparse' reads it. Drop it (allowed value here is {default!r}), or set "
                        "co2_comm_dtype='sparse'"
                    )
        block = self.co2_quant_block
        if self.co2_comm_dtype == "sparse" and block > MAX_SPARSE_BLOCK:
            raise ValueError(
                f"co2_quant_block={block} is not allowed with co2_comm_dtype='sparse' (a kept value's "
                f"position in its block travels as one byte): it must be an even integer in [2, {MAX_SPARSE_BLOCK}]"
            )

    def _validate_fragments(self) -> None:
        fragments, tau = self.co2_fragments, self.co2_local_steps
        if fragments is None:
            return
        _check_int(self, "co2_fragments", minimum=1)
        if tau % fragments:
            raise ValueError(
                f"co2_fragments={fragments} must divide co2_local_steps={tau} (one fragment reaches its "
                f"boundary every tau/F steps): allowed values are {_divisors(tau)}"
            )
        if fragments > 1 and self.co2_overlap_steps is not None:
            raise ValueError(
                f"co2_overlap_steps={self.co2_overlap_steps} cannot be combined with co2_fragments={fragments}: "
                f"each fragment's average is applied co2_local_steps / co2_fragments = {tau // fragments} "
                "steps after its launch. Allowed value here is None"
            )

    @property
    def fragments(self) -> int:
        """F, with the default resolved: tau fragments, or one where a window or no overlap is set."""
        if self.co2_fragments is not None:
            return self.co2_fragments
        if self.co2_overlap_steps is not None or not self.co2_overlap:
            return 1
        return self.co2_local_steps

    # What the engine asks of the string settings, answered here, where their values are validated:
    # the engine compares no setting as a string.
    @property
    def bfloat16_wire(self) -> bool:
        """The all-reduce travels as a bfloat16 copy of the fp32 buffer (``co2_comm_dtype='bfloat16'``)."""
        return self.co2_comm_dtype == "bfloat16"

    @property
    def stochastic_rounding(self) -> bool:
        """A quantized wire rounds stochastically (``co2_quant_rounding='stochastic'``)."""
        return self.co2_quant_rounding == "stochastic"

    @property
    def state_on_host(self) -> bool:
        """Anchor, momentum and buffers live in host memory (``co2_state_device='cpu'``)."""
        return self.co2_state_device == "cpu"

    @property
    def code_bits(self) -> int | None:
        """Bits per value of a quantized wire (8 or 4); None for float32 and bfloat16."""
        return CODE_BITS.get(self.co2_comm_dtype)

    @property
    def sparse_wire(self) -> bool:
        """The outer gradient travels as block-local top-k codes (``co2_comm_dtype='sparse'``)."""
        return self.co2_comm_dtype == "sparse"

    @property
    def sparse_keep(self) -> int:
        """Values the sparse wire sends per block: ``round(co2_sparse_density * co2_quant_block)``, >= 1."""
        return max(1, round(self.co2_sparse_density * self.co2_quant_block))

    @property
    def window_steps(self) -> int | None:
        """k: inner steps between a launch and the in-round apply of its average; None: applied at
        the next boundary (a full round of overlap). Fragments: tau / F, the gap between two
        fragments' boundaries."""
        if self.fragments > 1:
            return self.co2_local_steps // self.fragments
        return self.co2_overlap_steps

    def check_world(self, world_size: int) -> int:
        """Check what depends on the number of processes; return the number of workers G.

        Integrations call this before creating any process group, so a bad launch fails at once.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
        k = self.co2_worker_size
        if world_size % k:
            raise ValueError(
                f"co2_worker_size={k} must divide the world size {world_size}: allowed values are "
                f"the divisors of {world_size}: {_divisors(world_size)}"
            )
        workers = world_size // k
        if self.co2_comm_dtype == "bfloat16" and workers > MAX_BF16_WORKERS:
            raise ValueError(
                f"co2_comm_dtype='bfloat16' supports at most {MAX_BF16_WORKERS} workers (its round "
                f"check is exact only up to there); got {workers}. Use co2_comm_dtype='float32'."
            )
        if self.sparse_wire:
            self._check_sparse_pays(workers)
        return workers

    def _check_sparse_pays(self, workers: int) -> None:
        """The sparse all-gather sends (G-1) payloads per rank: past `max_paying_workers` the dense
        int4 all-reduce sends fewer bytes, so such a launch is refused (docs/algorithm.md)."""
        block, keep, bits = self.co2_quant_block, self.sparse_keep, self.co2_sparse_bits
        limit = max_paying_workers(block=block, keep=keep, bits=bits, int4_block=block)
        if workers > limit:
            raise ValueError(
                f"co2_comm_dtype='sparse' with co2_sparse_density={self.co2_sparse_density}, "
                f"co2_sparse_bits={bits} and co2_quant_block={block} sends more bytes than "
                f"co2_comm_dtype='int4' beyond {limit} workers (an all-gather of every worker's payload "
                f"grows with G); got {workers}. Use co2_comm_dtype='int4', or a lower co2_sparse_density."
            )

    def co2_dict(self) -> dict[str, Any]:
        """The ``co2_*`` fields as a plain dict (what checkpoints and model cards store)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(CO2Config)}

    @classmethod
    def from_object(cls, obj: Any) -> CO2Config:
        """Build a config from any object carrying the ``co2_*`` attributes (e.g. training args)."""
        return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed: it must be {allowed}")


def _check_int(config: CO2Config, name: str, *, minimum: int) -> None:
    value = getattr(config, name)
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    _check(name, value, ok, f"an integer >= {minimum}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
