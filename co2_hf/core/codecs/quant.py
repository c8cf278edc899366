"""Block-quantized outer gradients for slow links: int8 and 4-bit codes with error feedback.

A vector is cut into blocks of ``block`` values; each block gets one fp32 scale (its largest
magnitude over the code range: 127 for int8, 7 for 4-bit) and each value one code, rounded to the
nearest (``stochastic=False``) or stochastically (unbiased: the expected code is the exact value).
4-bit codes travel two per byte. What quantization leaves out is kept per rank as an error-feedback
residual and added to the next vector sent, so that over rounds nothing is lost: the sum of what
was sent equals the sum of what was meant, less the residual still held (`ErrorFeedback`).

`quantized_all_reduce_` sums such vectors over a process group without ever adding codes (which
would overflow): every rank quantizes its vector, an all-to-all hands slice j of every rank to
rank j (a reduce-scatter of codes), rank j dequantizes and sums its slices in fp32, quantizes that
sum again (with a residual of its own) and an all-gather hands every rank every slice's codes.
Each rank sends ``2 (G-1)/G`` times the coded bytes, as a ring all-reduce does with fp32: int8 is
about a quarter of fp32 on the wire, 4-bit an eighth, plus one fp32 scale per block. Every rank
ends with the same dequantized sum, bit for bit, because it is decoded from the same codes. A
small fp32 tensor that must be summed exactly (the engine's header: weights, round bits, waits)
rides along in the all-gather. `QuantizedWire` is the `Codec` (``__init__.py``) the engine keeps per
fragment: the settings and the two residuals (checkpoint keys ``sent`` and ``owned``); the
communicator runs its all-reduce off the main thread (``comm.py``, ``launch_coded``).
Only ``all_to_all_single`` and the single-tensor all-gather are used: gloo and NCCL both have them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .collectives import Collectives, GroupCollectives, round_generator

LEVELS = {8: 127, 4: 7}  # largest code magnitude for each width (symmetric: no zero point)


def quantize(
    x: Tensor, *, bits: int, block: int, stochastic: bool, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Codes and per-block scales of a 1-D fp32 ``x`` whose length is a multiple of ``block``.

    Returns ``(codes, scales)``: int8 codes (bits 8) or uint8 bytes of two 4-bit codes (bits 4),
    and one fp32 scale per block. An all-zero block has scale 0 and codes 0."""
    codes, scales, _ = _quantize(x, bits=bits, block=block, stochastic=stochastic, generator=generator)
    return codes, scales


def _quantize(
    x: Tensor, *, bits: int, block: int, stochastic: bool, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """`quantize`, and the rounded values as fp32 blocks (``codes`` as numbers: what error feedback
    multiplies back by the scales, with no decode of the codes)."""
    levels = _levels(bits)
    blocks = x.view(-1, block)
    # the largest magnitude per block: max(max, -min) is abs().amax() exactly, and ~10x faster on
    # the CPU (two reductions in place of an |x| the size of x)
    scales = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).div_(levels)
    safe = scales.clamp(min=torch.finfo(scales.dtype).tiny)  # an all-zero block: 0 / tiny = code 0
    y = blocks / safe[:, None]  # the one full-size fp32 transient
    if stochastic:  # floor(y + u), u ~ U[0, 1): E[code] = y exactly
        noise = torch.rand(y.shape, generator=generator, dtype=y.dtype, device=y.device)
        y.add_(noise).floor_()
    else:
        y.round_()
    y.clamp_(-levels, levels)
    codes = y.view(-1).to(torch.int8)
    return (_pack4(codes) if bits == 4 else codes), scales, y


def dequantize(codes: Tensor, scales: Tensor, *, bits: int, block: int) -> Tensor:
    """The fp32 values that ``codes`` and ``scales`` (from `quantize`) stand for."""
    values = _unpack4_float(codes) if bits == 4 else codes.to(torch.float32)
    return values.view(-1, block).mul_(scales[:, None]).view(-1)


def coded_nbytes(numel: int, *, bits: int, block: int) -> int:
    """Bytes that `quantize` makes of ``numel`` values: the codes plus one fp32 scale per block."""
    return numel * bits // 8 + 4 * (numel // block)


class ErrorFeedback:
    """One rank's residual ``r``: `compress` sends ``Q(x + r)`` and keeps ``r <- x + r - deQ(Q(x + r))``.

    Summed over rounds, what was sent equals what was meant minus the residual still held, so
    quantization error does not accumulate. ``residual`` is state: checkpoint it with the rest."""

    def __init__(self, numel: int, *, device: torch.device | str = "cpu", pin_memory: bool = False) -> None:
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device, pin_memory=pin_memory)

    def compress(self, x: Tensor, **how: Any) -> tuple[Tensor, Tensor]:
        """Codes of ``x + r``; ``x`` may be shorter than the residual (the rest counts as zeros)."""
        target = self.residual
        target[: x.numel()].add_(x)  # x + r, in the residual's memory
        codes, scales, rounded = _quantize(target, **how)
        # r <- (x + r) - codes * scales: the rounded values times their scales, in their own memory
        # (the same fp32 products as decoding the codes, without decoding them)
        target.view_as(rounded).sub_(rounded.mul_(scales[:, None]))
        return codes, scales


def padded_numel(numel: int, *, world: int, block: int) -> int:
    """The length `quantized_all_reduce_` codes ``numel`` values as: a multiple of ``world * block``
    (every rank sums whole blocks of one slice), zero-padded."""
    return -(-numel // (world * block)) * world * block


def quantized_all_reduce_(
    x: Tensor,
    collectives: Collectives | None = None,
    *,
    bits: int,
    block: int,
    stochastic: bool = False,
    sent: ErrorFeedback | None = None,
    owned: ErrorFeedback | None = None,
    generator: torch.Generator | None = None,
    exact: Tensor | None = None,
) -> Tensor:
    """In place, ``x <- deQ(Q(sum over ranks of deQ(Q(x_rank)))``: the sum over ``collectives``
    (default: the default process group) through codes (module docstring). Any length: ``x`` is
    coded zero-padded to `padded_numel`. ``sent`` is this rank's residual for its own vector (of the
    padded length), ``owned`` its residual for the slice it sums (the padded length / world size);
    None quantizes without feedback. ``exact``, a small fp32 tensor (the engine's header), is summed
    exactly in place: every rank's travels with its slice in the all-gather and is added up in rank
    order. Two collectives in all, each of one byte tensor (codes and scales packed together), so
    that a thread running this waits for the interpreter as few times as possible. Blocking."""
    collectives = collectives if collectives is not None else GroupCollectives()
    world, n = collectives.world_size, x.numel()
    how = dict(bits=_checked_bits(bits), block=block, stochastic=stochastic, generator=generator)
    if sent is not None:  # its residual has the padded length: x is added into it
        codes, scales = sent.compress(x, **how)
    else:
        padded = x.new_zeros(padded_numel(n, world=world, block=block))
        padded[:n].copy_(x)
        codes, scales = quantize(padded, **how)
    # reduce-scatter as an all-to-all: row j (slice j's codes, then its scales) goes to rank j
    rows = _pack(codes.view(world, -1), scales.view(world, -1))
    theirs = torch.empty_like(rows)
    collectives.all_to_all_(theirs.view(-1), rows.view(-1))
    per_rank = _unpack(theirs, codes.numel() // world, bits=bits, block=block).view(world, -1)
    mine = per_rank.sum(dim=0)  # fp32, in rank order: the same on every rank that decodes it
    codes, scales = owned.compress(mine, **how) if owned is not None else quantize(mine, **how)
    extra = [exact.view(1, -1)] if exact is not None else []
    row = _pack(codes.view(1, -1), scales.view(1, -1), *extra)
    every = row.new_empty(world, row.shape[1])
    collectives.all_gather_(every.view(-1), row.view(-1))
    coded = every[:, : row.shape[1] - 4 * (exact.numel() if exact is not None else 0)]
    x.copy_(_unpack(coded, codes.numel(), bits=bits, block=block)[:n])
    if exact is not None:
        headers = every[:, coded.shape[1] :].contiguous().view(torch.float32)
        exact.copy_(headers.sum(dim=0))
    return x


def _pack(codes: Tensor, scales: Tensor, *extra: Tensor) -> Tensor:
    """Per row, the bytes of its codes, then of its fp32 scales (and of any fp32 ``extra``)."""
    return torch.cat([codes.view(torch.uint8), *(t.contiguous().view(torch.uint8) for t in (scales, *extra))], dim=1)


def _unpack(rows: Tensor, code_bytes: int, *, bits: int, block: int) -> Tensor:
    """The fp32 values of `_pack`'s rows, end to end."""
    codes = rows[:, :code_bytes].contiguous().view(-1)
    scales = rows[:, code_bytes:].contiguous().view(torch.float32).view(-1)
    return dequantize(codes if bits == 4 else codes.view(torch.int8), scales, bits=bits, block=block)


class QuantizedWire:
    """One fragment's outer gradients on the wire as codes (``co2_comm_dtype`` int8 or int4), a
    `Codec`: the quantizer's settings and this rank's two error-feedback residuals, which are
    checkpoint state (`state` / `load_`: ``sent``, its own vector's, and ``owned``, the slice of the
    sum it codes). Rounding noise (``stochastic``) is drawn from `round_generator`."""

    STATE_KEYS = ("sent", "owned")

    def __init__(
        self,
        numel: int,
        num_workers: int,
        *,
        bits: int,
        block: int,
        stochastic: bool,
        seed: int,
        device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        self.bits, self.block, self.stochastic, self.seed = _checked_bits(bits), block, stochastic, seed
        self.numel, self._zeros = numel, dict(device=device, pin_memory=pin_memory)
        self._make_residuals(num_workers)
        # the slice of the sum that ``owned`` belongs to: the world and this rank's place in it at the
        # last all-reduce (None until then: a residual loaded from a checkpoint is the slice of the
        # rank that resumes it, since a checkpoint is resumed by the rank that wrote it)
        self._rank: int | None = None

    def _make_residuals(self, world: int) -> None:
        padded = padded_numel(self.numel, world=world, block=self.block)
        self.world = world
        self.sent = ErrorFeedback(padded, **self._zeros)
        self.owned = ErrorFeedback(padded // world, **self._zeros)

    def _regroup(self, world: int, rank: int) -> None:
        """The all-reduce's group is not the one the residuals were made for (a torchft quorum,
        ``co2_hf/torchft/``, or residuals loaded from one): this rank now sums another slice, of
        another length. What ``owned`` kept of its old slice is added into ``sent`` at that slice's
        place, so that this rank sends it next round and the sum over rounds loses nothing; both
        residuals then take the new lengths (``sent`` keeps its values: those past ``numel`` are
        padding and mean nothing)."""
        old_rank = rank if self._rank is None else self._rank
        owned, sent = self.owned.residual, self.sent.residual
        sent[old_rank * owned.numel() : (old_rank + 1) * owned.numel()].add_(owned)
        self._make_residuals(world)
        kept = min(sent.numel(), self.sent.residual.numel())
        self.sent.residual[:kept].copy_(sent[:kept])

    def all_reduce_(
        self, x: Tensor, exact: Tensor, collectives: Collectives, *, feedback: bool | Tensor, round_index: int
    ) -> None:
        """`Codec.all_reduce_`: ``x`` through codes (`quantized_all_reduce_`), ``exact`` exactly. A
        group of another size or rank than the residuals' regroups them first (`_regroup`)."""
        feedback = bool(feedback)
        if collectives.world_size != self.world or (self._rank is not None and collectives.rank != self._rank):
            self._regroup(collectives.world_size, collectives.rank)
        self._rank = collectives.rank
        generator = round_generator(self.seed, collectives.rank, round_index, x.device) if self.stochastic else None
        quantized_all_reduce_(
            x,
            collectives,
            bits=self.bits,
            block=self.block,
            stochastic=self.stochastic,
            sent=self.sent if feedback else None,
            owned=self.owned,
            generator=generator,
            exact=exact,
        )

    def sent_nbytes(self, world: int, header_numel: int) -> float:
        """Bytes this rank sends per all-reduce over ring collectives, for ``world`` workers: the
        all-to-all and the all-gather of the codes (each ``(G-1)/G`` of them), the header to ``G - 1`` peers."""
        coded = coded_nbytes(padded_numel(self.numel, world=world, block=self.block), bits=self.bits, block=self.block)
        return 2 * (world - 1) / world * coded + (world - 1) * 4 * header_numel

    def nbytes(self) -> int:
        return 4 * (self.sent.residual.numel() + self.owned.residual.numel())

    def kept_progress(self) -> None:
        """Nothing of the worker's progress is kept in its start (a residual holds one round's rounding)."""
        return None

    def state(self) -> dict[str, Tensor]:
        return {"sent": self.sent.residual, "owned": self.owned.residual}

    def load_(self, saved: dict[str, Tensor]) -> None:
        """Restore `state`. Residuals saved over a group of another size (a torchft quorum's) keep
        their lengths, which say that size; the next all-reduce regroups them (`_regroup`)."""
        world = saved["sent"].numel() // saved["owned"].numel()
        if world != self.world:
            self._make_residuals(world)
        self.sent.residual.copy_(saved["sent"])
        self.owned.residual.copy_(saved["owned"])

    @staticmethod
    def carried(saved: dict[str, Tensor], numel: int) -> None:
        """Nothing follows a re-shard: both residuals are reset, as the start rule's offsets are (what
        an old rank's codes left out is at most one round's rounding, and the slices are cut anew)."""
        return None

    @staticmethod
    def resharded(fresh: dict[str, Tensor], carried: Tensor | None) -> dict[str, Tensor]:
        """This rank's residuals after a re-shard: zeros of its own lengths (``fresh``: its `state`)."""
        return {key: torch.zeros_like(value) for key, value in fresh.items()}


def _levels(bits: int) -> int:
    return LEVELS[_checked_bits(bits)]


def _checked_bits(bits: int) -> int:
    if bits not in LEVELS:
        raise ValueError(f"bits={bits!r}: allowed values are {sorted(LEVELS)}")
    return bits


def _pack4(codes: Tensor) -> Tensor:
    """Two codes in [-7, 7] per byte: the first in the low nibble. ``codes`` (int8) is consumed."""
    nibbles = codes.add_(8).view(torch.uint8).view(-1, 2)
    packed = nibbles[:, 1] << 4
    return packed.bitwise_or_(nibbles[:, 0])


def _unpack4_float(packed: Tensor) -> Tensor:
    """The codes of `_pack4`'s bytes as fp32 numbers, written straight into one fp32 tensor."""
    values = torch.empty(packed.numel(), 2, dtype=torch.float32, device=packed.device)
    values[:, 0] = packed & 15
    values[:, 1] = packed >> 4
    return values.sub_(8).view(-1)
