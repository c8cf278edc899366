"""`CO2Config`: every ``co2_*`` knob, declared once, with its help text, and what it means to the engine.

The field name is the command-line flag (``--co2_local_steps``), the key in a checkpoint's
``co2_config.json`` and the attribute the engine reads. Integrations (the Trainer's arguments, the
Accelerate helper, the recipes) inherit or wrap this dataclass; none of them declares a knob again.
Which values each knob accepts, alone, together and for a number of processes, is ``allowed.py``'s:
the config and its checks import nothing else of co2_hf.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import typing
from dataclasses import dataclass, field
from typing import Any

from .allowed import (
    CLIP_RANGE,
    CODE_BITS,
    MAX_GAP_PENALTY,
    MAX_LOCAL_STEPS,
    MAX_MOMENT_ROUNDS,
    MAX_OUTER_LR,
    MAX_QUANT_BLOCK,
    MAX_SKIPPED_ROUNDS,
    MAX_SPARSE_BLOCK,  # noqa: F401 (each noqa: a name core/codecs/sparse.py, scripts or tests read from here)
    MAX_STEPS,
    MIN_TIMEOUT_S,
    SPARSE_BITS,  # noqa: F401
    SPARSE_ONLY,
    CommDtype,
    FaultTolerance,
    PenaltyMode,
    QuantRounding,
    StartRule,
    StateDevice,
    bytes_per_value,  # noqa: F401
    check_settings,
    check_world,
    max_paying_workers,  # noqa: F401
    set_without_effect,
)

logger = logging.getLogger(__name__)

# Settings of how a run is hosted, not of what it computes: left out of `CO2Config.co2_dict`, so a
# checkpoint neither records nor compares them. co2_elastic differs by design between the run that
# saved and the elastic run that resumes; a run on torchft resumes a checkpoint of one without (and
# the other way round) with the same outer state. Checkpoints from before they were settings lack them.
HOSTING = ("co2_elastic", "co2_fault_tolerance")


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
    co2_outer_lr: float = _knob(
        1.0, f"alpha: outer learning rate applied to the outer momentum (0 < alpha <= {MAX_OUTER_LR:g})."
    )
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
        f"lambda in [0, {MAX_GAP_PENALTY:g}]: strength of the staleness gap penalty; 0 turns it off. "
        "Full overlap only: an "
        "average applied in-round (co2_overlap_steps, more than one fragment) is not stale.",
    )
    co2_gap_penalty_mode: PenaltyMode = _knob(
        "gap_aware",
        "'gap_aware': elementwise P = 1/max(1, lambda*|alpha*m|/mean|D|); 'constant': P = 1/max(1, lambda).",
    )
    co2_clip_threshold: float | None = _knob(
        None,
        f"phi in [{CLIP_RANGE[0]:g}, {CLIP_RANGE[1]:g}]: clip the global L2 norm of the outer momentum "
        "to phi; unset: no clipping.",
    )
    co2_comm_dtype: CommDtype = _knob(
        "float32",
        "What the outer all-reduce sends: 'float32', 'bfloat16', or block-quantized codes with "
        "error feedback, 'int8' (about 0.26x the bytes of float32) or 'int4' (about 0.13x), or "
        "'sparse': per block, the co2_sparse_density largest values in co2_sparse_bits bits with "
        "error feedback, all-gathered (core/codecs/sparse.py). Outer state stays float32.",
    )
    co2_quant_block: int = _knob(
        128,
        "With co2_comm_dtype int8/int4/sparse: values per block, each block with one float32 "
        f"scale (an even integer in [2, {MAX_QUANT_BLOCK}], at most 256 with 'sparse'; smaller blocks "
        "are more exact and "
        "send more scales).",
    )
    co2_sparse_density: float = _knob(
        SPARSE_ONLY["co2_sparse_density"],
        "With co2_comm_dtype='sparse': the fraction of each block's values sent, in (0, 1]: "
        "round(density * co2_quant_block) values per block (at least 1), its largest magnitudes; at least 1/256.",
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
        "With co2_comm_dtype int8/int4/sparse: round each value to the 'nearest' code or 'stochastic'ally "
        "(unbiased). Error feedback carries what rounding leaves out to the next round either way.",
    )
    co2_sync_warmup_steps: int = _knob(
        0,
        "Inner steps of plain data parallel (gradients averaged every step) before local updating "
        f"(at most {MAX_STEPS:.0e}, and fewer than --max_steps).",
    )
    co2_global_second_moment_every: int | None = _knob(
        None,
        f"K in [1, {MAX_MOMENT_ROUNDS}]: every K rounds the workers all-reduce their Adam(W) moments and "
        "each replaces its second moment by the estimate for the gradient averaged over the workers, "
        "which data parallel's Adam divides by (docs/algorithm.md, 'The inner second "
        "moment'); 2 model sizes in the wire's fp32 or bf16 per exchange, overlapped with the next "
        "round, and up to 4 model sizes of fp32 memory on the parameters' device. Adam/AdamW only. "
        "0: off, each worker's Adam keeps its own. Unset: 4 where it applies (torch Adam or AdamW "
        "without amsgrad, plain tensors, a float32 or bfloat16 wire, no torchft, one process per "
        "worker, state on the parameters' device, no sync warm-up, more than one worker), else 0 with "
        "a WARNING saying why; a checkpoint trained with 0 resumes with 0; elastic resume onto another "
        "world starts its state afresh.",
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
        "Consecutive rounds in which no worker is finite before training stops with an error "
        f"(0: never stop; at most {MAX_SKIPPED_ROUNDS}).",
    )
    co2_timeout_s: float = _knob(
        900.0, f"Seconds to wait for an outer all-reduce before failing with a clear error (>= {MIN_TIMEOUT_S:g})."
    )

    # How the run is hosted, not what it computes (`HOSTING`): CO2Trainer runs both; CO2Accelerate
    # and the engine on its own communicator refuse what they do not run (allowed.refuse_*)
    co2_elastic: bool = _knob(
        False,
        "Allow resume_from_checkpoint from a checkpoint saved by another number of processes or "
        "another co2_worker_size (torchrun --nnodes MIN:MAX): the outer state is re-sharded and every "
        "worker restarts from the anchor; not bit-identical (docs/reliability.md, 'Losing a node'). "
        "False: refused.",
    )
    co2_fault_tolerance: FaultTolerance = _knob(
        "none",
        "'torchft': each replica group (one process, its own launch) joins the torchft job that "
        "TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID and NUM_REPLICA_GROUPS name; a killed one's round is dropped by "
        "the others, who never stop, and its replacement rejoins from a live peer (docs/reliability.md, "
        "'Surviving failures without a restart'). Needs the ft extra. 'none': a lost worker stops every rank.",
    )

    def __post_init__(self) -> None:
        self.validate_co2()

    # Named validate_co2 (not validate) so that a TrainingArguments subclass can mix it in safely.
    def validate_co2(self) -> None:
        """Raise ``ValueError`` naming the field, the value and what is allowed (``allowed.py``).

        Numbers of other numeric types (``numpy.int64(4)``, ``numpy.float64(0.5)``, ``4.0`` for an
        integer) are accepted and stored as the declared Python ``int`` / ``float``, so that the config
        saves as JSON like any other and compares equal to its checkpoint's."""
        self._normalise_numbers()
        check_settings(self)
        if not self.co2_enabled:
            _say_without_effect(tuple(set_without_effect(self, _defaults())))

    def _normalise_numbers(self) -> None:
        """Each number as its field's declared type. An integral float becomes an int (``4.0`` would
        pass ``in (2, 4)`` and be saved as 4.0); bools and non-integral values for an int are left for
        the checks to refuse by name."""
        for name, declared in _number_fields().items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            if declared is float:
                setattr(self, name, float(value))
            elif isinstance(value, numbers.Integral) or float(value).is_integer():
                setattr(self, name, int(value))

    # F and k are resolved here and nowhere else: the engine's `Plan` (core/schedule.py) takes them
    # from these two properties, and the engine reads tau, F and k from its plan
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
        return check_world(self, world_size)

    def co2_dict(self) -> dict[str, Any]:
        """The ``co2_*`` settings as a plain dict: what a checkpoint must match on loading and what
        ``co2_config.json`` and model cards record. Not the `HOSTING` ones: they say how a run is
        hosted, and the run that resumes a checkpoint may be hosted otherwise."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(CO2Config) if f.name not in HOSTING}

    @classmethod
    def from_object(cls, obj: Any) -> CO2Config:
        """Build a config from any object carrying the ``co2_*`` attributes (e.g. training args)."""
        return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})


@functools.cache
def _number_fields() -> dict[str, type]:
    """The fields declared ``int`` or ``float`` (optional or not), with that type."""
    hints = typing.get_type_hints(CO2Config)
    declared = {
        name: {t for t in (typing.get_args(hint) or (hint,)) if t in (int, float)} for name, hint in hints.items()
    }
    return {name: kinds.pop() for name, kinds in declared.items() if len(kinds) == 1}


@functools.cache
def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(CO2Config)}


@functools.cache
def _say_without_effect(names: tuple[str, ...]) -> None:
    """co2_* settings with co2_enabled=False: warned once, not refused, since a recipe's own defaults
    (its co2_local_steps, ...) stand beside a baseline's --co2_enabled false and cannot be told from
    values the user typed."""
    if names:
        logger.warning(
            "CO2: %s ha%s no effect with co2_enabled=False: the plain data-parallel run reads no co2_* setting. "
            "Drop %s, or set co2_enabled=True.",
            ", ".join(names),
            "s" if len(names) == 1 else "ve",
            "it" if len(names) == 1 else "them",
        )
