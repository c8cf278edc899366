"""The coded wires of the outer all-reduce, behind one contract: `Codec`.

A codec sums a fragment's buffer over the workers through codes instead of its fp32 values, and keeps
what its codes left out as error-feedback residuals, sent in later rounds:

- ``quant.py``: int8 / int4 block-quantized codes (`QuantizedWire`, ``co2_comm_dtype`` int8, int4);
- ``sparse.py``: block-local top-k of 2- or 4-bit values (`SparseWire`, ``co2_comm_dtype='sparse'``);
- ``collectives.py``: the two blocking collectives both run on, and their random draws' seeding.

`make_codec` builds the one a config asks for, or None: a float32 or bfloat16 wire sends the
buffer as it is, and a single worker sends nothing. A `Fragment` (``fragment.py``) holds it and knows
it only through `Codec`; a re-shard onto another number of workers (``reshard.py``) only through
`carried_residual` and `resharded_residuals`. A checkpoint holds a codec's `state` as it is (keys
``sent`` and ``owned`` for int8/int4, ``unsent`` for sparse): those keys are known in the codec
modules only, each codec listing its own (``STATE_KEYS``).
"""

from __future__ import annotations

import functools
import logging
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from ...config import CO2Config
from ..layout import FlatLayout
from .collectives import Collectives
from .quant import QuantizedWire
from .sparse import SparseWire

# The engine warns under one logger name, whichever module of core/ notices: users filter on it.
logger = logging.getLogger("co2_hf.core.co2")

CODECS = (QuantizedWire, SparseWire)


class Codec(Protocol):
    """One fragment's coded wire on this rank: its settings and its residuals (checkpoint state)."""

    STATE_KEYS: ClassVar[tuple[str, ...]]  # the keys of `state`, the same for every instance

    def all_reduce_(
        self, x: Tensor, exact: Tensor, collectives: Collectives, *, feedback: bool | Tensor, round_index: int
    ) -> None:
        """In place: ``x`` (the fragment's payload) summed over the ranks of ``collectives`` through
        codes (encode, exchange, decode), and ``exact`` (the header) summed exactly; every rank ends
        with the same values, bit for bit. Blocking: the communicator runs it off the main thread
        (``comm.py``, ``launch_coded``). ``feedback`` False (a non-finite worker, which sends zeros)
        leaves this rank's own residual for a later round; a 0-d bool tensor (the engine's, decided on
        the device) is read here, off the compute path. Stochastic rounding draws from
        `round_generator` of the codec's seed, the rank and ``round_index``. The group may differ from
        the last call's (a torchft quorum): a codec whose residuals depend on it adapts them here."""

    def state(self) -> dict[str, Tensor]:
        """The residuals, keyed by ``STATE_KEYS``: this rank's checkpoint state (the tensors themselves)."""

    def load_(self, saved: dict[str, Tensor]) -> None:
        """Restore `state`'s output."""

    def nbytes(self) -> int:
        """Bytes of the residuals held."""

    def sent_nbytes(self, world: int, header_numel: int) -> float:
        """Bytes this rank sends per all-reduce over ring collectives, for ``world`` workers."""

    def kept_progress(self) -> Tensor | None:
        """Progress of the worker's own that the codec has not sent and the worker keeps in its start
        (``o <- o + r``, by position in the fragment's parameters; ``co2_sparse_keep_unsent``), or
        None: the start keeps nothing of the codec's. Read only while no all-reduce is in flight."""

    @staticmethod
    def carried(saved: dict[str, Tensor], numel: int) -> Tensor | None:
        """What of a saved `state` follows the fragment's positions onto another number of workers,
        by position in its payload of ``numel`` values (fp32, on the CPU): what this worker still owes
        the average; None: nothing (the residuals are reset)."""

    @staticmethod
    def resharded(fresh: dict[str, Tensor], carried: Tensor | None) -> dict[str, Tensor]:
        """A re-sharded rank's `state`: ``fresh`` (its own) reset, holding ``carried`` (its cut of the
        re-sharded `carried`, None: nothing) where the codec carries something."""


def make_codec(
    config: CO2Config, layout: FlatLayout, num_workers: int, index: int, device: torch.device, pin_memory: bool
) -> Codec | None:
    """Fragment ``index``'s codec with a coded wire (``co2_comm_dtype`` int8/int4: `QuantizedWire`;
    sparse: `SparseWire`, whose float buffers travel exactly) over more than one worker; None
    otherwise (the buffer travels as it is; one worker sends nothing, so nothing is coded)."""
    if num_workers == 1 or not (config.code_bits or config.sparse_wire):
        return None
    numel = layout.shard_numel
    how = dict(stochastic=config.stochastic_rounding, seed=index, device=device, pin_memory=pin_memory)
    if config.sparse_wire:
        _say_sparse_density(config.co2_sparse_density, config.sparse_keep, config.co2_quant_block)
        return SparseWire(
            numel,
            block=config.co2_quant_block,
            keep=config.sparse_keep,
            bits=config.co2_sparse_bits,
            decay=config.co2_sparse_feedback_decay,
            dense=numel - layout.param_local,
            keep_unsent=config.co2_sparse_keep_unsent,
            **how,
        )
    return QuantizedWire(numel, num_workers, bits=config.code_bits, block=config.co2_quant_block, **how)


def carried_residual(saved: dict[str, Tensor] | None, numel: int) -> Tensor | None:
    """`Codec.carried` of the codec that saved ``saved`` (a fragment's ``residuals`` in a checkpoint;
    None: no codec saved any)."""
    codec = _codec_of(saved)
    return None if codec is None else codec.carried(saved, numel)


def resharded_residuals(fresh: dict[str, Tensor] | None, carried: Tensor | None) -> dict[str, Tensor] | None:
    """`Codec.resharded` of the codec whose `state` ``fresh`` is (None: this rank codes nothing, and
    whatever was carried is not held)."""
    codec = _codec_of(fresh)
    return None if codec is None else codec.resharded(fresh, carried)


def _codec_of(state: dict[str, Tensor] | None) -> type[Codec] | None:
    """The codec whose `state` ``state`` is, told by its keys."""
    if state is None:
        return None
    for codec in CODECS:
        if set(state) == set(codec.STATE_KEYS):
            return codec
    raise ValueError(f"CO2 checkpoint: residuals with keys {sorted(state)} belong to no coded wire")


@functools.cache
def _say_sparse_density(density: float, keep: int, block: int) -> None:
    """co2_sparse_density is rounded to whole values per block: say so once where that changes it."""
    if keep != density * block:
        logger.warning(
            "CO2: co2_sparse_density=%s keeps round(%s x co2_quant_block=%d) = %d values per block: "
            "the wire's density is %.6g",
            density,
            density,
            block,
            keep,
            keep / block,
        )


__all__ = ["CODECS", "Codec", "carried_residual", "make_codec", "resharded_residuals"]
