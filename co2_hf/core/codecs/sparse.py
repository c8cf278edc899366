"""Sparse low-bit outer gradients for very slow links: block-local top-k, 2- or 4-bit values, error feedback.

A vector is cut into blocks of ``block`` values (at most 256, so that a position within its block
fits in one byte). Each block keeps its ``keep`` largest magnitudes: one uint8 index per kept value,
one ``bits``-wide code per kept value (2 or 4 bits, packed 4 or 2 per byte) and one fp32 scale per
block. Codes sit on a grid without zero (mid-rise: ``(code - (L-1)/2) * scale``, ``L = 2**bits``),
because a kept value is never small: 2 bits give ``+-scale/2, +-3 scale/2``. Everything not kept,
and each kept value's rounding error, stays in this rank's error-feedback residual and is added to
the next round's vector (`SparseFeedback`), as in ``quant.py``: over rounds nothing is lost.

`sparse_all_reduce_` sums such vectors over a process group without adding codes: an all-gather
hands every rank every rank's payload (indices, codes, scales), and each rank decodes them and adds
them up in rank order (scatter-add into fp32), so every rank holds the same sum bit for bit. The
engine's header, and a fragment's float buffers (which travel as absolute values and must not be
sparsified: a mean of their top-k would be nonsense), ride along in fp32 and are summed exactly.

What it costs: a ring all-gather sends ``(G-1)`` payloads per rank, against the dense int4 ring
all-reduce's ``2 (G-1)/G`` coded vectors. So sparse pays while ``G < 2 x int4 bytes / sparse
bytes`` (`co2_hf.config.max_paying_workers`; docs/algorithm.md, the sparse wire), and ``CO2Config.check_world``
refuses a launch past it, naming ``co2_sparse_density``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...config import MAX_SPARSE_BLOCK, SPARSE_BITS
from .collectives import Collectives, GroupCollectives, round_generator

BLOCK_MULTIPLE = 4  # blocks per vector: a multiple of 4, so that 2-bit codes fill whole bytes


def payload_nbytes(numel: int, *, block: int, keep: int, bits: int) -> int:
    """Bytes `encode` makes of ``numel`` values padded to `sparse_padded_numel`: per block, ``keep``
    uint8 indices, ``keep`` codes of ``bits`` and one fp32 scale."""
    blocks = sparse_padded_numel(numel, block=block) // block
    return blocks * (keep + 4) + blocks * keep * bits // 8


def sparse_padded_numel(numel: int, *, block: int) -> int:
    """The length a vector is coded as: whole blocks, a multiple of `BLOCK_MULTIPLE` of them."""
    unit = block * BLOCK_MULTIPLE
    return max(1, -(-numel // unit)) * unit


def encode(
    x: Tensor, *, block: int, keep: int, bits: int, stochastic: bool, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(indices, codes, scales)`` of a 1-D fp32 ``x`` of `sparse_padded_numel` length: per block
    the positions (uint8) of its ``keep`` largest magnitudes, their codes (uint8 bytes, packed) and
    one fp32 scale (the largest kept magnitude over ``(L-1)/2``; an all-zero block has scale 0)."""
    _check(block=block, keep=keep, bits=bits)
    blocks = x.view(-1, block)
    top, index = blocks.abs().topk(keep, dim=1, sorted=False)
    values = blocks.gather(1, index)
    half = (2**bits - 1) / 2
    scales = top.amax(dim=1) / half
    safe = scales.clamp(min=torch.finfo(scales.dtype).tiny)
    y = values.div_(safe[:, None]).add_(half)  # in [0, L-1]
    if stochastic:  # floor(y + u): the expected code is y
        noise = torch.rand(y.shape, generator=generator, dtype=y.dtype, device=y.device)
        y = y.add_(noise).floor_()
    else:
        y = y.round_()
    codes = y.clamp_(0, 2 * half).to(torch.uint8)
    return index.to(torch.uint8).view(-1), _pack(codes.view(-1), bits), scales


def decode_values(codes: Tensor, scales: Tensor, *, keep: int, bits: int) -> Tensor:
    """The fp32 kept values, one row of ``keep`` per block, of `encode`'s codes and scales."""
    half = (2**bits - 1) / 2
    values = _unpack(codes, bits).view(-1, keep).to(torch.float32).sub_(half)
    return values.mul_(scales[:, None])


def decode(indices: Tensor, codes: Tensor, scales: Tensor, *, block: int, keep: int, bits: int) -> Tensor:
    """The dense fp32 vector `encode`'s payload stands for (zeros where nothing was kept)."""
    out = torch.zeros(scales.numel(), block, dtype=torch.float32, device=scales.device)
    values = decode_values(codes, scales, keep=keep, bits=bits)
    return out.scatter_(1, indices.view(-1, keep).long(), values).view(-1)


class SparseFeedback:
    """One rank's residual ``r``: `compress` sends ``S(x + c r)`` and keeps ``r <- x + c r - deS(S(x + c r))``
    (the values not kept, and the kept values' rounding errors), with ``c = decay``: 1 loses nothing
    over rounds; below 1 a leftover that top-k keeps passing over fades instead of waiting to be sent
    stale (SparseLoCo's error feedback). ``residual`` is checkpoint state."""

    def __init__(
        self, numel: int, *, decay: float = 1.0, device: torch.device | str = "cpu", pin_memory: bool = False
    ) -> None:
        self.decay = decay
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device, pin_memory=pin_memory)

    def compress(self, x: Tensor, *, block: int, keep: int, bits: int, **how) -> tuple[Tensor, Tensor, Tensor]:
        """The payload of ``x + c r``; ``x`` may be shorter than the residual (the rest counts as zeros)."""
        target = self.residual
        if self.decay != 1.0:
            target.mul_(self.decay)
        target[: x.numel()].add_(x)  # x + c r, in the residual's memory
        indices, codes, scales = encode(target, block=block, keep=keep, bits=bits, **how)
        sent = decode_values(codes, scales, keep=keep, bits=bits)
        # only the kept positions change: subtract what was sent there (no dense copy of it)
        target.view(-1, block).scatter_add_(1, indices.view(-1, keep).long(), sent.neg_())
        return indices, codes, scales


def sparse_all_reduce_(
    x: Tensor,
    collectives: Collectives | None = None,
    *,
    block: int,
    keep: int,
    bits: int,
    stochastic: bool = False,
    feedback: SparseFeedback | None = None,
    generator: torch.Generator | None = None,
    exact: Tensor | None = None,
) -> Tensor:
    """In place, ``x <- sum over ranks of deS(S(x_rank + r_rank))`` over ``collectives`` (default: the
    default group): one all-gather of every rank's payload and ``exact`` (a small fp32 tensor summed
    exactly, in place, in rank order); each rank decodes and scatter-adds them in rank order.
    ``feedback=None`` codes ``x`` alone (a non-finite worker's zeros). Blocking."""
    collectives = collectives if collectives is not None else GroupCollectives()
    world, n = collectives.world_size, x.numel()
    how = dict(block=block, keep=keep, bits=bits, stochastic=stochastic, generator=generator)
    if feedback is not None:
        indices, codes, scales = feedback.compress(x, **how)
    else:
        padded = x.new_zeros(sparse_padded_numel(n, block=block))
        padded[:n].copy_(x)
        indices, codes, scales = encode(padded, **how)
    tail = [exact.reshape(-1)] if exact is not None else []
    row = torch.cat([indices, codes, *(t.contiguous().view(torch.uint8) for t in (scales, *tail))])
    every = row.new_empty(world, row.numel())
    collectives.all_gather_(every.view(-1), row.view(-1))
    cuts = [indices.numel(), codes.numel(), 4 * scales.numel(), 4 * sum(t.numel() for t in tail)]
    total = torch.zeros(scales.numel(), block, dtype=torch.float32, device=x.device)
    sums = torch.zeros(cuts[3] // 4, dtype=torch.float32, device=x.device)
    for rank in range(world):  # in rank order: the same fp32 additions on every rank
        their_indices, their_codes, their_scales, their_tail = every[rank].split(cuts)
        # a section may start at any byte: its fp32 values are read from an aligned copy
        values = decode_values(their_codes, their_scales.clone().view(torch.float32), keep=keep, bits=bits)
        total.scatter_add_(1, their_indices.view(-1, keep).long(), values)
        sums.add_(their_tail.clone().view(torch.float32))
    x.copy_(total.view(-1)[:n])
    if exact is not None:
        exact.copy_(sums.view_as(exact))
    return x


def sent_nbytes(numel: int, *, world: int, block: int, keep: int, bits: int, exact_numel: int = 0) -> int:
    """Bytes one rank sends in `sparse_all_reduce_` over a ring all-gather: its row to ``world - 1`` peers."""
    return (world - 1) * (payload_nbytes(numel, block=block, keep=keep, bits=bits) + 4 * exact_numel)


class SparseWire:
    """One fragment's outer gradients on the wire as block-local top-k (``co2_comm_dtype='sparse'``),
    a `Codec`: the settings and this rank's error-feedback residual (`state` / `load_`, key
    ``unsent``). The last ``dense`` values of the payload (the fragment's float buffers) travel
    exactly, beside the header. Stochastic rounding draws from `round_generator`. With
    ``keep_unsent`` (``co2_sparse_keep_unsent``) the worker keeps the residual's progress in its
    start (`kept_progress`)."""

    STATE_KEYS = ("unsent",)

    def __init__(
        self,
        numel: int,
        *,
        block: int,
        keep: int,
        bits: int,
        stochastic: bool,
        seed: int,
        dense: int,
        device: torch.device,
        decay: float = 1.0,
        keep_unsent: bool = False,
        pin_memory: bool = False,
    ) -> None:
        _check(block=block, keep=keep, bits=bits)
        self.block, self.keep, self.bits, self.stochastic, self.seed = block, keep, bits, stochastic, seed
        self.sparse_numel, self.dense, self.keep_unsent = numel - dense, dense, keep_unsent
        padded = sparse_padded_numel(self.sparse_numel, block=block)
        self.feedback = SparseFeedback(padded, decay=decay, device=device, pin_memory=pin_memory)

    def all_reduce_(
        self, x: Tensor, exact: Tensor, collectives: Collectives, *, feedback: bool | Tensor, round_index: int
    ) -> None:
        """`Codec.all_reduce_`: ``x``'s parameters as sparse codes (`sparse_all_reduce_`), its buffers
        and ``exact`` exactly. The residual has one length in any group: nothing to regroup."""
        feedback = bool(feedback)
        generator = round_generator(self.seed, collectives.rank, round_index, x.device) if self.stochastic else None
        m = self.sparse_numel
        both = torch.cat([x[m:], exact.view(-1)])  # buffers then header, summed exactly
        sparse_all_reduce_(
            x[:m],
            collectives,
            block=self.block,
            keep=self.keep,
            bits=self.bits,
            stochastic=self.stochastic,
            feedback=self.feedback if feedback else None,
            generator=generator,
            exact=both,
        )
        x[m:].copy_(both[: self.dense])
        exact.view(-1).copy_(both[self.dense :])

    @property
    def unsent(self) -> Tensor:
        """What this rank has not sent yet of its outer gradients (the error-feedback residual), by
        position in the fragment's parameters (then padding). Written by `all_reduce_`."""
        return self.feedback.residual

    def kept_progress(self) -> Tensor | None:
        """With ``keep_unsent``: `unsent`, which the worker's start keeps (``o <- o + r``: its model
        keeps its own progress that top-k has not sent yet, instead of dropping it until top-k picks
        it); None otherwise. Read only while no all-reduce of this codec is in flight."""
        return self.feedback.residual if self.keep_unsent else None

    def sent_nbytes(self, world: int, header_numel: int) -> int:
        """Bytes this rank sends per all-reduce (ring all-gather), for ``world`` workers."""
        how = dict(block=self.block, keep=self.keep, bits=self.bits)
        return sent_nbytes(self.sparse_numel, world=world, exact_numel=self.dense + header_numel, **how)

    def nbytes(self) -> int:
        return 4 * self.feedback.residual.numel()

    def state(self) -> dict[str, Tensor]:
        return {"unsent": self.feedback.residual}

    def load_(self, saved: dict[str, Tensor]) -> None:
        self.feedback.residual.copy_(saved["unsent"])

    @staticmethod
    def carried(saved: dict[str, Tensor], numel: int) -> Tensor:
        """What follows a re-shard: the residual (most of each outer gradient, still owed to the
        average), by position in the fragment's payload of ``numel`` values (fp32, on the CPU)."""
        return _fit(saved["unsent"], numel)

    @staticmethod
    def resharded(fresh: dict[str, Tensor], carried: Tensor | None) -> dict[str, Tensor]:
        """This rank's residual after a re-shard: ``carried`` (its cut of the re-sharded residual,
        None: zeros) in ``fresh``'s length, dtype and device (``fresh``: its `state`)."""
        own = fresh["unsent"]
        return {"unsent": torch.zeros_like(own) if carried is None else _fit(carried, own.numel()).to(own)}


def _check(*, block: int, keep: int, bits: int) -> None:
    if bits not in SPARSE_BITS:
        raise ValueError(f"bits={bits!r}: allowed values are {list(SPARSE_BITS)}")
    if not 1 <= keep <= block <= MAX_SPARSE_BLOCK:
        raise ValueError(f"keep={keep}, block={block}: need 1 <= keep <= block <= {MAX_SPARSE_BLOCK}")


def _pack(codes: Tensor, bits: int) -> Tensor:
    """``8 // bits`` codes per byte, the first in the lowest bits."""
    per = 8 // bits
    grouped = codes.view(-1, per)
    packed = grouped[:, 0].clone()
    for j in range(1, per):
        packed |= grouped[:, j] << (bits * j)
    return packed


def _unpack(packed: Tensor, bits: int) -> Tensor:
    per, mask = 8 // bits, 2**bits - 1
    return torch.stack([(packed >> (bits * j)) & mask for j in range(per)], dim=1).view(-1)


def _fit(values: Tensor, numel: int) -> Tensor:
    """``values`` cut or zero-padded to ``numel``, fp32 on the CPU (a residual is padded to whole
    blocks; past the fragment's parameters it holds zeros)."""
    out = torch.zeros(numel, dtype=torch.float32)
    m = min(numel, values.numel())
    out[:m] = values[:m].float().cpu()
    return out
