"""Per-rank run for tests/test_quant.py: the quantized all-reduce against a naive reference."""

from __future__ import annotations

import torch
import torch.distributed as dist

from co2_hf.core.codecs.quant import ErrorFeedback, dequantize, quantized_all_reduce_

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
        header = torch.tensor([1.0, 0.0, 1.0, 0.25 * rank + t])  # summed exactly, beside the codes
        got = quantized_all_reduce_(x.clone(), bits=bits, block=BLOCK, sent=sent, owned=owned, exact=header)
        expected = _reference(every, ref_sent, ref_owned, bits)
        exact_header = torch.tensor([world, 0.0, world, 0.25 * sum(range(world)) + world * t])
        results.append({"got": got, "expected": expected, "header": header, "exact_header": exact_header})
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


def _block(dtype: str, block: int) -> dict:
    """co2_quant_block where the wire reads it: a float32 or bfloat16 wire refuses one (it sends no codes)."""
    return {"co2_quant_block": block} if dtype in ("int8", "int4", "sparse") else {}


def engine_over_the_wire(rank: int, world: int, dtypes: tuple[str, ...], steps: int) -> dict:
    """The engine on TinyNet over gloo for each wire type (streaming defaults, tau 4): its anchors,
    and the names of the threads that ran the coded collectives (they must stay off the main one)."""
    import threading

    from workers import train_engine

    from co2_hf.core.codecs import quant

    threads: list[str] = []
    original = quant.GroupCollectives.all_to_all_

    def recorded(self, output, input):
        threads.append(threading.current_thread().name)
        original(self, output, input)

    quant.GroupCollectives.all_to_all_ = recorded
    try:
        runs = {
            dtype: train_engine(rank, world, dict(co2_local_steps=4, co2_comm_dtype=dtype, **_block(dtype, 8)), steps)
            for dtype in dtypes
        }
    finally:
        quant.GroupCollectives.all_to_all_ = original
    return {"runs": runs, "threads": sorted(set(threads)), "main": threading.main_thread().name}


def hierarchical_over_the_wire(rank: int, world: int, steps: int) -> dict:
    """Workers of 2 processes (co2_worker_size=2) with int8 on the wire: each process sums its own
    slice of the outer gradient through codes."""
    from workers import train_hierarchical

    return train_hierarchical(
        rank, world, dict(co2_local_steps=4, co2_worker_size=2, co2_comm_dtype="int8", co2_quant_block=8), steps
    )


def sparse_rounds(rank: int, world: int, bits: int, rounds: int) -> dict:
    """``rounds`` sparse all-reduces with error feedback over gloo, the bytes each all-gather sent,
    and the same sums computed naively on every rank from every rank's fp32 vectors."""
    from co2_hf.core.codecs.collectives import GroupCollectives
    from co2_hf.core.codecs.sparse import SparseFeedback, decode, sparse_all_reduce_, sparse_padded_numel

    numel, block, keep = 1000, 64, 3  # not whole blocks: coded zero-padded
    padded = sparse_padded_numel(numel, block=block)
    how = dict(block=block, keep=keep, bits=bits)
    collectives, sizes = GroupCollectives(), []
    original = collectives.all_gather_

    def counted(output, input):
        sizes.append(input.numel() * input.element_size())
        original(output, input)

    collectives.all_gather_ = counted
    feedback, refs = SparseFeedback(padded), [SparseFeedback(padded) for _ in range(world)]
    results = []
    for t in range(rounds):
        x = vector(rank, t, numel)
        every = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(every, x)
        header = torch.tensor([1.0, 0.25 * rank + t])
        got = sparse_all_reduce_(x.clone(), collectives, feedback=feedback, exact=header, **how)
        decoded = [decode(*refs[r].compress(every[r], stochastic=False, **how), **how)[:numel] for r in range(world)]
        expected = torch.zeros(numel)
        for d in decoded:  # the reference adds dense vectors, in rank order
            expected += d
        results.append({"got": got, "expected": expected, "header": header})
    return {"rounds": results, "sizes": sizes, "residual": feedback.residual}


def sparse_engine_over_the_wire(rank: int, world: int, steps: int) -> dict:
    """The engine on TinyNet over gloo with the sparse wire (streaming, tau 4): its anchors, and the
    bytes of every all-gather input this rank sent."""
    from workers import train_engine

    from co2_hf.core.codecs import sparse

    sizes: list[int] = []
    original = sparse.GroupCollectives.all_gather_

    def counted(self, output, input):
        sizes.append(input.numel() * input.element_size())
        original(self, output, input)

    sparse.GroupCollectives.all_gather_ = counted
    try:
        cfg = dict(co2_local_steps=4, co2_comm_dtype="sparse", co2_quant_block=16, co2_sparse_density=0.125)
        run = train_engine(rank, world, cfg, steps)
    finally:
        sparse.GroupCollectives.all_gather_ = original
    return {"run": run, "sizes": sizes}
