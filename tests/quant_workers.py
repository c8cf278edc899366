"""Per-rank run for tests/test_quant.py: the quantized all-reduce against a naive reference."""

from __future__ import annotations

import torch
import torch.distributed as dist

from co2_hf.core.quant import ErrorFeedback, dequantize, quantized_all_reduce_

BLOCK = 8


def vector(rank: int, round_: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + round_)
    return torch.randn(numel, generator=g) * (1 + rank)


def quantized_rounds_every_width(rank: int, world: int, widths: tuple[int, ...], rounds: int) -> dict:
    """`quantized_rounds` for each width in one launch (starting processes is what costs)."""
    return {bits: quantized_rounds(rank, world, bits, rounds) for bits in widths}


def quantized_rounds(rank: int, world: int, bits: int, rounds: int) -> dict:
    """``rounds`` quantized all-reduces with error feedback, and the same computed naively on every
    rank from every rank's vectors (all-gathered in fp32): each rank's result must equal it bitwise."""
    numel = world * BLOCK * 5
    sent, owned = ErrorFeedback(numel), ErrorFeedback(numel // world)
    # the reference simulates every rank's two residuals in one process
    ref_sent = [ErrorFeedback(numel) for _ in range(world)]
    ref_owned = [ErrorFeedback(numel // world) for _ in range(world)]
    results, exact_sums = [], []
    for t in range(rounds):
        x = vector(rank, t, numel)
        every = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(every, x)
        got = quantized_all_reduce_(x.clone(), bits=bits, block=BLOCK, sent=sent, owned=owned)
        expected = _reference(every, ref_sent, ref_owned, bits)
        results.append({"got": got, "expected": expected})
        exact_sums.append(torch.stack(every).sum(0))
    return {"rounds": results, "exact": exact_sums, "owned_residual": owned.residual, "sent_residual": sent.residual}


def _reference(every: list[torch.Tensor], ref_sent, ref_owned, bits: int) -> torch.Tensor:
    world = len(every)
    how = dict(bits=bits, block=BLOCK, stochastic=False)
    decoded = []
    for r in range(world):
        codes, scales = ref_sent[r].compress(every[r], **how)
        decoded.append(dequantize(codes, scales, bits=bits, block=BLOCK))
    slices = []
    for j in range(world):
        total = torch.stack([decoded[r].view(world, -1)[j] for r in range(world)]).sum(0)
        codes, scales = ref_owned[j].compress(total, **how)
        slices.append(dequantize(codes, scales, bits=bits, block=BLOCK))
    return torch.cat(slices)


