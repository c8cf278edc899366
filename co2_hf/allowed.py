"""What each ``co2_*`` setting may be: the allowed values, the bounds with why, and the checks.

`CO2Config` (config.py) declares the knobs and what they mean; this module says which values it
accepts, alone and in combination, and raises ``ValueError`` naming the field, the value and what
is allowed. It imports nothing else of co2_hf (config.py imports it), so the settings' checks need
nothing from the engine. The checks read a config by its ``co2_*`` attributes only.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

# each choice's allowed values, once: the field's type (what HfArgumentParser offers as choices) and
# the tuple the checks name in their errors
StartRule = Literal["anchor", "eager", "lookahead"]
PenaltyMode = Literal["gap_aware", "constant"]
CommDtype = Literal["float32", "bfloat16", "int8", "int4", "sparse"]
QuantRounding = Literal["nearest", "stochastic"]
StateDevice = Literal["same", "cpu"]
FaultTolerance = Literal["none", "torchft"]
START_RULES = get_args(StartRule)
PENALTY_MODES = get_args(PenaltyMode)
COMM_DTYPES = get_args(CommDtype)
QUANT_ROUNDINGS = get_args(QuantRounding)
STATE_DEVICES = get_args(StateDevice)
FAULT_TOLERANCES = get_args(FaultTolerance)
CODE_BITS = {"int8": 8, "int4": 4}  # the wire types sent as block-quantized codes (core/codecs/quant.py)
SPARSE_BITS = (2, 4)  # value widths of the sparse wire (core/codecs/sparse.py)
MAX_SPARSE_BLOCK = 256  # the sparse wire sends a kept value's position within its block as one byte

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
# Bounds on the numbers that had none: each is the edge past which a value means nothing more than the
# bound does (or overflows float32, the outer state's type), so a larger one is a typo, refused by name.
# No run takes a billion optimizer steps (a trillion tokens at a million tokens per step is a million
# steps): co2_sync_warmup_steps beyond it would be data parallel for the whole run without saying so.
MAX_STEPS = 10**9
# alpha > 1 extrapolates past the workers' average; published runs use 0.7 (DiLoCo) to 1 (CO2). Ten
# times the average's move already overshoots it by far; larger alphas throw the anchor out of range.
MAX_OUTER_LR = 10.0
# lambda: P = 1/max(1, lambda x gap). At 1e4 a gap of 1e-4 of mean |D| already halves the update; a
# larger lambda only drives P to 0 (the outer step frozen), and lambda x gap overflows float32 past 3.4e38.
MAX_GAP_PENALTY = 1e4
# phi clips the outer momentum's global L2 norm (float32): below 1e-8 it scales every update to about 0
# (1e-300 is 0 in float32: a division by zero), above 1e8 no model's round of parameter changes reaches it,
# so it never clips (leave it unset for that).
CLIP_RANGE = (1e-8, 1e8)
# One float32 scale per block: at 4096 values the scales are under 0.1% of int8's bytes, so a larger
# block saves nothing, quantizes coarser, and pads every fragment by up to block - 1 values.
MAX_QUANT_BLOCK = 4096
# A thousand rounds in a row in which no worker is finite is a diverged run: past that, say "never stop"
# (0) instead of a number that means it.
MAX_SKIPPED_ROUNDS = 1000
MAX_MOMENT_ROUNDS = 10_000  # co2_global_second_moment_every: beyond it Adam's beta2 has forgotten the estimate
# No sparse block holds more than MAX_SPARSE_BLOCK values, so a lower density keeps less than one value
# in every block, and the wire sends one per block whatever it says (1e-9 would send 1/256 of them).
MIN_SPARSE_DENSITY = 1 / MAX_SPARSE_BLOCK
# Settings read by coded wires only (their defaults, and the wires that read them): another value with
# another wire would be accepted and have no effect. Sparse rounds its codes too (core/codecs/sparse.py).
CODED_ONLY = {"co2_quant_block": 128, "co2_quant_rounding": "nearest"}
CODED_WIRES = ("int8", "int4", "sparse")
# Settings read by the sparse wire only, with their defaults: another value with another wire would
# be accepted and have no effect.
SPARSE_ONLY = {
    "co2_sparse_density": 1 / 64,
    "co2_sparse_bits": 2,
    "co2_sparse_keep_unsent": False,
    "co2_sparse_feedback_decay": 1.0,
}
BOOLEANS = ("co2_enabled", "co2_nesterov", "co2_overlap", "co2_sparse_keep_unsent", "co2_elastic")
CHOICES = {
    "co2_start_rule": START_RULES,
    "co2_gap_penalty_mode": PENALTY_MODES,
    "co2_comm_dtype": COMM_DTYPES,
    "co2_quant_rounding": QUANT_ROUNDINGS,
    "co2_state_device": STATE_DEVICES,
}


def bytes_per_value(*, block: int, keep: int, bits: int) -> float:
    """Sparse wire payload bytes per value, padding aside (core/codecs/sparse.py's layout: per block, ``keep``
    uint8 indices, ``keep`` codes of ``bits`` and one fp32 scale). Here, not in core/codecs/sparse.py, so
    that the settings check needs nothing from the engine."""
    return (keep + keep * bits / 8 + 4) / block


def max_paying_workers(*, block: int, keep: int, bits: int, int4_block: int) -> int:
    """The most workers G at which the all-gather of sparse payloads, ``(G-1) S`` bytes sent per rank,
    still sends fewer bytes than the dense int4 ring all-reduce, ``2 (G-1)/G x B4``: ``G < 2 B4 / S``."""
    int4 = (int4_block / 2 + 4) / int4_block
    ratio = 2 * int4 / bytes_per_value(block=block, keep=keep, bits=bits)
    limit = int(ratio)
    return limit - 1 if limit == ratio else limit


# ---------------------------------------------------------------------- each setting, and combinations


def check_settings(config: Any) -> None:
    """Every check that needs no world: each value alone, then the combinations."""
    for name in BOOLEANS:
        _check(name, getattr(config, name), isinstance(getattr(config, name), bool), "True or False")
    _check_int(config, "co2_local_steps", minimum=1)
    _check(
        "co2_local_steps",
        config.co2_local_steps,
        config.co2_local_steps <= MAX_LOCAL_STEPS,
        f"an integer in [1, {MAX_LOCAL_STEPS}] (a longer round would average the workers only a few times "
        "in a run, and its default co2_fragments, one per inner step, would make the start-up slow)",
    )
    _check_int(config, "co2_sync_warmup_steps", minimum=0, maximum=MAX_STEPS)
    _check_int(config, "co2_worker_size", minimum=1)  # bounded by the world size: check_world
    _check_int(config, "co2_max_skipped_rounds", minimum=0, maximum=MAX_SKIPPED_ROUNDS, zero="0: never stop")
    _check_int(config, "co2_quant_block", minimum=2, maximum=MAX_QUANT_BLOCK)
    block = config.co2_quant_block
    _check("co2_quant_block", block, block % 2 == 0, f"an even integer in [2, {MAX_QUANT_BLOCK}]")
    _check_outer_step(config)
    _check_window(config)
    _check_fragments(config)
    _check_sparse(config)
    _check_second_moment(config)
    timeout = config.co2_timeout_s
    _check(
        "co2_timeout_s",
        timeout,
        _is_real(timeout) and MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S,
        f"a finite number of seconds >= {MIN_TIMEOUT_S:g} and <= {MAX_TIMEOUT_S:.0f} (one year); gloo and "
        "NCCL count timeouts in whole milliseconds, where 0 means none",
    )
    for name, allowed in CHOICES.items():
        value = getattr(config, name)
        _check(name, value, value in allowed, "one of " + ", ".join(repr(a) for a in allowed))
    _check_coded_only(config)
    _check_hosting(config)


def _check_outer_step(config: Any) -> None:
    alpha = config.co2_outer_lr
    _check(
        "co2_outer_lr",
        alpha,
        _is_real(alpha) and 0 < alpha <= MAX_OUTER_LR,
        f"a finite number > 0 and <= {MAX_OUTER_LR:g} (published runs use 0.7 to 1)",
    )
    beta = config.co2_outer_momentum
    _check("co2_outer_momentum", beta, _is_real(beta) and 0 <= beta < 1, "a number in [0, 1)")
    gamma = config.co2_eager_weight
    _check("co2_eager_weight", gamma, _is_real(gamma) and 0 <= gamma <= 1, "a number in [0, 1]")
    if gamma != 1 and config.co2_start_rule != "eager":
        raise ValueError(
            f"co2_eager_weight={gamma} is not allowed with co2_start_rule={config.co2_start_rule!r} (it weighs "
            "the 'eager' start only): allowed value here is 1.0"
        )
    lam = config.co2_gap_penalty
    _check(
        "co2_gap_penalty",
        lam,
        _is_real(lam) and 0 <= lam <= MAX_GAP_PENALTY,
        f"a finite number >= 0 and <= {MAX_GAP_PENALTY:g} (0: off; a larger one only freezes the outer step)",
    )
    phi, (low, high) = config.co2_clip_threshold, CLIP_RANGE
    _check(
        "co2_clip_threshold",
        phi,
        phi is None or (_is_real(phi) and low <= phi <= high),
        f"a finite number in [{low:g}, {high:g}] (below it every update is scaled to about 0, above it "
        "nothing is ever clipped), or None for no clipping",
    )


def _check_window(config: Any) -> None:
    window = config.co2_overlap_steps
    _check(
        "co2_overlap_steps",
        window,
        window is None or (isinstance(window, int) and not isinstance(window, bool) and 1 <= window),
        "an integer >= 1 and < co2_local_steps, or None for a full round of overlap",
    )
    if window is not None and window >= config.co2_local_steps:
        raise ValueError(
            f"co2_overlap_steps={window} is not allowed with co2_local_steps={config.co2_local_steps}: it "
            "must be < co2_local_steps (None gives a full round of overlap)"
        )
    if window is not None and not config.co2_overlap:
        raise ValueError(
            f"co2_overlap_steps={window} needs co2_overlap=True (with co2_overlap=False the average is "
            "applied at once): allowed value here is None"
        )


def _check_fragments(config: Any) -> None:
    fragments, tau = config.co2_fragments, config.co2_local_steps
    if fragments is None:
        return
    _check_int(config, "co2_fragments", minimum=1)
    if tau % fragments:
        raise ValueError(
            f"co2_fragments={fragments} must divide co2_local_steps={tau} (one fragment reaches its "
            f"boundary every tau/F steps): allowed values are {divisors(tau)}"
        )
    if fragments > 1 and config.co2_overlap_steps is not None:
        raise ValueError(
            f"co2_overlap_steps={config.co2_overlap_steps} cannot be combined with co2_fragments={fragments}: "
            f"each fragment's average is applied co2_local_steps / co2_fragments = {tau // fragments} "
            "steps after its launch. Allowed value here is None"
        )


def _check_second_moment(config: Any) -> None:
    """``co2_global_second_moment_every``: unset (the default, resolved by the engine:
    ``moments.fit_default_every``) or a number of rounds, and refused where it is not built
    (`second_moment_conflicts`)."""
    name, every = "co2_global_second_moment_every", config.co2_global_second_moment_every
    if every is None:
        return
    _check_int(config, name, minimum=0, maximum=MAX_MOMENT_ROUNDS, zero="0: off; unset: the default")
    for other, allowed in second_moment_conflicts(config) if every > 0 else []:
        raise ValueError(
            f"{name}={every} with {other}={getattr(config, other)!r}: "
            f"allowed is {other}={allowed} (not built for it), or {name}=0"
        )


def second_moment_conflicts(config: Any) -> list[tuple[str, str]]:
    """(setting, what it allows) for each setting of ``config`` that rules the inner second moment's
    exchange out: its all-reduce would share the outer group with a coded wire's background thread, a
    torchft quorum could change the workers between its launch and its apply, and its state is not
    sharded inside a worker (on another world, re-sharding starts it afresh: ``reshard.py``)."""
    conflicts = {
        "co2_comm_dtype": (config.co2_comm_dtype in CODED_WIRES, "'float32' or 'bfloat16'"),
        "co2_fault_tolerance": (config.co2_fault_tolerance != "none", "'none'"),
        "co2_worker_size": (config.co2_worker_size != 1, "1"),
    }
    return [(name, allowed) for name, (refused, allowed) in conflicts.items() if refused]


def _check_sparse(config: Any) -> None:
    density, bits = config.co2_sparse_density, config.co2_sparse_bits
    _check(
        "co2_sparse_density",
        density,
        _is_real(density) and MIN_SPARSE_DENSITY <= density <= 1,
        f"a number in (0, 1], at least 1/{MAX_SPARSE_BLOCK} (below it no block keeps even one value, and the "
        "wire sends one per block anyway)",
    )
    _check("co2_sparse_bits", bits, bits in SPARSE_BITS and not isinstance(bits, bool), "2 or 4")
    decay = config.co2_sparse_feedback_decay
    _check("co2_sparse_feedback_decay", decay, _is_real(decay) and 0 < decay <= 1, "a number in (0, 1]")
    if config.co2_comm_dtype != "sparse":
        for name, default in SPARSE_ONLY.items():
            if getattr(config, name) != default:
                raise ValueError(
                    f"{name}={getattr(config, name)!r} has no effect with co2_comm_dtype={config.co2_comm_dtype!r}: "
                    f"only co2_comm_dtype='sparse' reads it. Drop it (allowed value here is {default!r}), or set "
                    "co2_comm_dtype='sparse'"
                )
    block = config.co2_quant_block
    if config.co2_comm_dtype == "sparse" and block > MAX_SPARSE_BLOCK:
        raise ValueError(
            f"co2_quant_block={block} is not allowed with co2_comm_dtype='sparse' (a kept value's "
            f"position in its block travels as one byte): it must be an even integer in [2, {MAX_SPARSE_BLOCK}]"
        )


def _check_coded_only(config: Any) -> None:
    """The block and the rounding of codes, set where the wire sends no codes: refused naming both."""
    if config.co2_comm_dtype in CODED_WIRES:
        return
    for name, default in CODED_ONLY.items():
        if getattr(config, name) != default:
            raise ValueError(
                f"{name}={getattr(config, name)!r} has no effect with co2_comm_dtype={config.co2_comm_dtype!r}: "
                f"only co2_comm_dtype {', '.join(map(repr, CODED_WIRES))} read it. Drop it (allowed value here is "
                f"{default!r}), or set one of those"
            )


def set_without_effect(config: Any, defaults: dict[str, Any]) -> list[str]:
    """``name=value`` of each setting other than its default where ``co2_enabled=False`` makes every
    co2_* setting useless (the plain Trainer or Accelerate loop runs)."""
    return [
        f"{name}={getattr(config, name)!r}"
        for name, default in defaults.items()
        if name != "co2_enabled" and getattr(config, name) != default
    ]


def run_length_warning(config: Any, max_steps: int) -> str | None:
    """What depends on the run's length, where it is known (the Trainer's ``max_steps`` > 0; with
    epochs it is not known before the data loader is). A run CO2 never starts in, or in which no round
    completes before the end, is well defined (data parallel throughout; or one partial round that
    ``finalize()`` averages at the end): the plain Trainer's short runs (``max_steps=3``) stay valid, so
    it is said, not refused. Returns the warning, or None."""
    if max_steps <= 0:
        return None
    warmup, tau = config.co2_sync_warmup_steps, config.co2_local_steps
    if warmup >= max_steps:
        return (
            f"CO2: co2_sync_warmup_steps={warmup} >= max_steps={max_steps}: the whole run is plain data parallel "
            "(gradients averaged at every step) and CO2's rounds never start. Pass co2_sync_warmup_steps < "
            f"{max_steps} to use them, or --co2_enabled false"
        )
    if warmup + tau > max_steps:
        return (
            f"CO2: co2_local_steps={tau} with max_steps={max_steps} and co2_sync_warmup_steps={warmup}: no round "
            f"completes before the end (the first would end after step {warmup + tau}); each worker trains on "
            "its own data until then and the workers are averaged once, at the end of training. Pass "
            f"co2_local_steps <= {max_steps - warmup} for rounds during the run"
        )
    return None


def check_ddp_timeout(config: Any, ddp_timeout: int) -> None:
    """A ``ddp_timeout`` the user set below ``co2_timeout_s``: a rank behind a dead or slow peer would be
    stopped by the Trainer's group with a bare timeout before CO2's own wait could say which round and
    peer; refused naming both."""
    if ddp_timeout < config.co2_timeout_s:
        raise ValueError(
            f"ddp_timeout={ddp_timeout} is not allowed with co2_timeout_s={config.co2_timeout_s:g}: the default "
            "group's collectives would time out first, without CO2's message. Allowed: ddp_timeout >= "
            f"{math.ceil(config.co2_timeout_s)}, or leave ddp_timeout unset (it then follows co2_timeout_s)"
        )


def _check_hosting(config: Any) -> None:
    """How the run is hosted: the fault tolerance, and what it cannot be combined with. What a front
    door does not run, it refuses itself (`refuse_elastic`, `refuse_torchft`)."""
    value = config.co2_fault_tolerance
    if value not in FAULT_TOLERANCES:
        raise ValueError(f"co2_fault_tolerance={value!r}: allowed are {', '.join(map(repr, FAULT_TOLERANCES))}")
    if value == "none":
        return
    flag = "co2_fault_tolerance='torchft'"
    if not config.co2_enabled:
        raise ValueError(f"{flag} needs co2_enabled=True")
    if config.co2_elastic:
        raise ValueError(f"co2_elastic=True with {flag}: allowed is False (torchft replaces a lost worker live)")


def refuse_elastic(config: Any, front_door: str) -> None:
    """``co2_elastic=True`` where ``front_door`` does not resume on another world: refused, naming
    where it is supported, before any process group starts."""
    if config.co2_elastic:
        raise ValueError(
            f"co2_elastic=True is not supported by {front_door}: allowed is False. Resuming on another number "
            "of processes is supported by CO2Trainer (--co2_elastic true); with the bare engine, load the "
            "saved states through co2_hf.core.reshard.load_resharded"
        )


def refuse_torchft(config: Any, front_door: str) -> None:
    """``co2_fault_tolerance='torchft'`` where ``front_door`` does not run on torchft: refused, naming
    the allowed values and where it is supported, before any process group starts."""
    if config.co2_fault_tolerance != "none":
        raise ValueError(
            f"co2_fault_tolerance={config.co2_fault_tolerance!r} is not supported by {front_door}: allowed is "
            f"'none' there (of {', '.join(map(repr, FAULT_TOLERANCES))}). torchft is supported by CO2Trainer "
            "(--co2_fault_tolerance torchft) and, for the bare engine, by co2_hf.torchft.TorchFT(config).build"
        )


# ---------------------------------------------------------------------- what depends on the world


def check_world(config: Any, world_size: int) -> int:
    """What depends on the number of processes (`CO2Config.check_world`); returns the workers G."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    k = config.co2_worker_size
    if world_size % k:
        raise ValueError(
            f"co2_worker_size={k} must divide the world size {world_size}: allowed values are "
            f"the divisors of {world_size}: {divisors(world_size)}"
        )
    workers = world_size // k
    if config.co2_comm_dtype == "bfloat16" and workers > MAX_BF16_WORKERS:
        raise ValueError(
            f"co2_comm_dtype='bfloat16' supports at most {MAX_BF16_WORKERS} workers (its round "
            f"check is exact only up to there); got {workers}. Use co2_comm_dtype='float32'."
        )
    if config.co2_comm_dtype == "sparse":
        _check_sparse_pays(config, workers)
    return workers


def _check_sparse_pays(config: Any, workers: int) -> None:
    """The sparse all-gather sends (G-1) payloads per rank: past `max_paying_workers` the dense
    int4 all-reduce sends fewer bytes, so such a launch is refused (docs/algorithm.md)."""
    block, keep, bits = config.co2_quant_block, config.sparse_keep, config.co2_sparse_bits
    limit = max_paying_workers(block=block, keep=keep, bits=bits, int4_block=block)
    if workers > limit:
        raise ValueError(
            f"co2_comm_dtype='sparse' with co2_sparse_density={config.co2_sparse_density}, "
            f"co2_sparse_bits={bits} and co2_quant_block={block} sends more bytes than "
            f"co2_comm_dtype='int4' beyond {limit} workers (an all-gather of every worker's payload "
            f"grows with G); got {workers}. Use co2_comm_dtype='int4', or a lower co2_sparse_density."
        )


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed: it must be {allowed}")


def _check_int(config: Any, name: str, *, minimum: int, maximum: int | None = None, zero: str = "") -> None:
    value = getattr(config, name)
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    ok = ok and (maximum is None or value <= maximum)
    allowed = f"an integer >= {minimum}" + ("" if maximum is None else f" and <= {maximum}")
    _check(name, value, ok, allowed + (f" ({zero})" if zero else ""))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
