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
ends with the same dequantized sum, bit for bit, because it is decoded from the same codes.
Only ``all_to_all_single`` and the single-tensor all-gather are used: gloo and NCCL both have them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

LEVELS = {8: 127, 4: 7}  # largest code magnitude for each width (symmetric: no zero point)


def quantize(
    x: Tensor, *, bits: int, block: int, stochastic: bool, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Codes and per-block scales of a 1-D fp32 ``x`` whose length is a multiple of ``block``.

    Returns ``(codes, scales)``: int8 codes (bits 8) or uint8 bytes of two 4-bit codes (bits 4),
    and one fp32 scale per block. An all-zero block has scale 0 and codes 0."""
    levels = _levels(bits)
    blocks = x.view(-1, block)
    scales = blocks.abs().amax(dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = blocks / safe[:, None]
    if stochastic:  # floor(y + u), u ~ U[0, 1): E[code] = y exactly
        noise = torch.rand(y.shape, generator=generator, dtype=y.dtype, device=y.device)
        codes = y.add_(noise).floor_()
    else:
        codes = y.round_()
    codes = codes.clamp_(-levels, levels).to(torch.int8).view(-1)
    return (_pack4(codes) if bits == 4 else codes), scales


def dequantize(codes: Tensor, scales: Tensor, *, bits: int, block: int) -> Tensor:
    """The fp32 values that ``codes`` and ``scales`` (from `quantize`) stand for."""
    values = _unpack4(codes) if bits == 4 else codes
    return (values.view(-1, block).float() * scales[:, None]).view(-1)


def coded_nbytes(numel: int, *, bits: int, block: int) -> int:
    """Bytes that `quantize` makes of ``numel`` values: the codes plus one fp32 scale per block."""
    return numel * bits // 8 + 4 * (numel // block)


class ErrorFeedback:
    """One rank's residual ``r``: `compress` sends ``Q(x + r)`` and keeps ``r <- x + r - deQ(Q(x + r))``.

    Summed over rounds, what was sent equals what was meant minus the residual still held, so
    quantization error does not accumulate. ``residual`` is state: checkpoint it with the rest."""

    def __init__(self, numel: int, *, device: torch.device | str = "cpu") -> None:
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)

    def compress(self, x: Tensor, **how: Any) -> tuple[Tensor, Tensor]:
        target = self.residual.add_(x)  # x + r, in the residual's memory
        codes, scales = quantize(target, **how)
        target.sub_(dequantize(codes, scales, bits=how["bits"], block=how["block"]))
        return codes, scales


def quantized_all_reduce_(
    x: Tensor,
    group: Any = None,
    *,
    bits: int,
    block: int,
    stochastic: bool = False,
    sent: ErrorFeedback | None = None,
    owned: ErrorFeedback | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """In place, ``x <- deQ(Q(sum over ranks of deQ(Q(x_rank)))``: the sum over ``group`` through
    codes (module docstring). ``len(x)`` must be a multiple of ``G * block``. ``sent`` is this rank's
    residual for its own vector (``len(x)``), ``owned`` its residual for the slice it sums
    (``len(x) / G``); None quantizes without feedback. Blocking; returns ``x``."""
    world = dist.get_world_size(group)
    if x.numel() % (world * block):
        raise ValueError(
            f"quantized all-reduce needs a length divisible by G x block = {world * block}, got {x.numel()}"
        )
    how = dict(bits=_checked_bits(bits), block=block, stochastic=stochastic, generator=generator)
    codes, scales = sent.compress(x, **how) if sent is not None else quantize(x, **how)
    # reduce-scatter as an all-to-all: the j-th slice of every rank's codes goes to rank j
    their_codes, their_scales = torch.empty_like(codes), torch.empty_like(scales)
    dist.all_to_all_single(their_codes, codes, group=group)
    dist.all_to_all_single(their_scales, scales, group=group)
    per_rank = dequantize(their_codes, their_scales, bits=bits, block=block).view(world, -1)
    mine = per_rank.sum(dim=0)  # fp32, in rank order: the same on every rank that decodes it
    codes, scales = owned.compress(mine, **how) if owned is not None else quantize(mine, **how)
    every_codes = codes.new_empty(world * codes.numel())
    every_scales = scales.new_empty(world * scales.numel())
    _all_gather_single(every_codes, codes, group=group)
    _all_gather_single(every_scales, scales, group=group)
    return x.copy_(dequantize(every_codes, every_scales, bits=bits, block=block))


# torch 2.13 renamed all_gather_into_tensor (kept, with a FutureWarning) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _levels(bits: int) -> int:
    return LEVELS[_checked_bits(bits)]


def _checked_bits(bits: int) -> int:
    if bits not in LEVELS:
        raise ValueError(f"bits={bits!r}: allowed values are {sorted(LEVELS)}")
    return bits


def _pack4(codes: Tensor) -> Tensor:
    """Two codes in [-7, 7] per byte: the first in the low nibble."""
    nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
    return nibbles[:, 0] | (nibbles[:, 1] << 4)


def _unpack4(packed: Tensor) -> Tensor:
    low = (packed & 15).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=1).view(-1)
