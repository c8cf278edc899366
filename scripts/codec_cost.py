"""What the coded wires compute per round, in ns per value: the dense codecs before and after the cost
cut (paired, interleaved in one invocation), and the sparse codec.

    python scripts/codec_cost.py                            # 10.3M values (the slow-link benchmark's model)
    python scripts/codec_cost.py --numel 1000000 --repeats 5

One round of one rank of a 2-worker world, transport left out: the collectives hand each rank's own
rows back as if both ranks had sent them (`Mirror`), so every pass a rank makes runs on real sizes:
int8/int4 quantize with error feedback, decode and sum 2 slices, re-quantize the owned slice with
its residual, decode the gathered codes; sparse top-k with its residual, decode and scatter-add 2
rows; and what keeping the unsent progress (``co2_sparse_keep_unsent``) adds on the compute thread.
``old`` is the dense codec as it was before the cost cut (kept here, verbatim in what it
computes), ``new`` is ``co2_hf.core.codecs.quant``; the two must give identical bits, checked every repeat.
Repeats alternate old and new so that a busy machine slows both alike; the median and the fastest
round are reported (on a shared machine the fastest is closest to the codec's own cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
if not __package__:
    sys.path.insert(0, str(ROOT))

from co2_hf.core.codecs import quant, sparse  # noqa: E402


class Mirror:
    """`Collectives` of a 2-rank world in which the other rank sent what this one did."""

    world_size, rank = 2, 0

    def all_to_all_(self, output: Tensor, input: Tensor) -> None:
        output.copy_(input)

    def all_gather_(self, output: Tensor, input: Tensor) -> None:
        output.view(2, -1).copy_(input.view(1, -1).expand(2, -1))


# ------------------------------------------------------------------ the dense codec before the cut


def _old_quantize(x, *, bits, block, stochastic, generator=None):
    levels = quant.LEVELS[bits]
    blocks = x.view(-1, block)
    scales = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()) / levels
    safe = scales.clamp(min=torch.finfo(scales.dtype).tiny)
    y = blocks / safe[:, None]
    codes = y.round_()
    codes = codes.clamp_(-levels, levels).to(torch.int8).view(-1)
    if bits == 4:
        nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
        codes = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return codes, scales


def _old_dequantize(codes, scales, *, bits, block):
    if bits == 4:
        low = (codes & 15).to(torch.int8) - 8
        high = (codes >> 4).to(torch.int8) - 8
        codes = torch.stack([low, high], dim=1).view(-1)
    return codes.view(-1, block).to(torch.float32).mul_(scales[:, None]).view(-1)


def _old_compress(residual, x, **how):
    residual[: x.numel()].add_(x)
    codes, scales = _old_quantize(residual, **how)
    residual.sub_(_old_dequantize(codes, scales, bits=how["bits"], block=how["block"]))
    return codes, scales


def _old_unpack(rows, code_bytes, *, bits, block):
    codes = rows[:, :code_bytes].contiguous().view(-1)
    scales = rows[:, code_bytes:].contiguous().view(torch.float32).view(-1)
    return _old_dequantize(codes if bits == 4 else codes.view(torch.int8), scales, bits=bits, block=block)


def old_all_reduce_(x, collectives, *, bits, block, sent, owned, exact):
    """`quant.quantized_all_reduce_` as it was, with nearest rounding and both residuals."""
    world, n = collectives.world_size, x.numel()
    how = dict(bits=bits, block=block, stochastic=False)
    codes, scales = _old_compress(sent, x, **how)
    rows = quant._pack(codes.view(world, -1), scales.view(world, -1))
    theirs = torch.empty_like(rows)
    collectives.all_to_all_(theirs.view(-1), rows.view(-1))
    mine = _old_unpack(theirs, codes.numel() // world, bits=bits, block=block).view(world, -1).sum(dim=0)
    codes, scales = _old_compress(owned, mine, **how)
    row = quant._pack(codes.view(1, -1), scales.view(1, -1), exact.view(1, -1))
    every = row.new_empty(world, row.shape[1])
    collectives.all_gather_(every.view(-1), row.view(-1))
    coded = every[:, : row.shape[1] - 4 * exact.numel()]
    x.copy_(_old_unpack(coded, codes.numel(), bits=bits, block=block)[:n])
    exact.copy_(every[:, coded.shape[1] :].contiguous().view(torch.float32).sum(dim=0))
    return x


# ------------------------------------------------------------------ timing


def _dense_round(version: str, bits: int, x: Tensor, state: dict) -> float:
    block, y, header = 128, x.clone(), torch.ones(37)
    start = time.perf_counter()
    if version == "old":
        old_all_reduce_(y, Mirror(), bits=bits, block=block, sent=state["sent"], owned=state["owned"], exact=header)
    else:
        quant.quantized_all_reduce_(
            y, Mirror(), bits=bits, block=block, sent=state["fb_sent"], owned=state["fb_owned"], exact=header
        )
    seconds = time.perf_counter() - start
    state[f"out_{version}"] = y
    return seconds


def _sparse_round(bits: int, keep: int, x: Tensor, feedback: sparse.SparseFeedback) -> float:
    y, header = x.clone(), torch.ones(37)
    start = time.perf_counter()
    sparse.sparse_all_reduce_(y, Mirror(), block=256, keep=keep, bits=bits, feedback=feedback, exact=header)
    return time.perf_counter() - start


def _hold_round(offset: Tensor, move: Tensor, unsent: Tensor) -> float:
    """co2_sparse_keep_unsent's work on the compute thread per fragment round: the residual added to
    the start offset at the boundary and at the in-round apply, and taken from the apply's move."""
    start = time.perf_counter()
    offset.add_(unsent)
    move.sub_(unsent)
    offset.add_(unsent)
    return time.perf_counter() - start


def measure(numel: int, repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(numel, generator=g) * 1e-3 for _ in range(repeats + 1)]
    padded = quant.padded_numel(numel, world=2, block=128)
    lines = []
    for bits in (8, 4):
        state = {
            "sent": torch.zeros(padded),
            "owned": torch.zeros(padded // 2),
            "fb_sent": quant.ErrorFeedback(padded),
            "fb_owned": quant.ErrorFeedback(padded // 2),
        }
        times = {"old": [], "new": []}
        for r, x in enumerate(xs):  # the first round is untimed (first calls, allocator)
            for version in ("old", "new") if r % 2 else ("new", "old"):
                t = _dense_round(version, bits, x, state)
                if r:
                    times[version].append(t)
            same = torch.equal(state["out_old"], state["out_new"]) and torch.equal(
                state["sent"], state["fb_sent"].residual
            )
            if not same:
                raise AssertionError(f"int{bits}: the new codec's bits differ from the old one's at round {r}")
        for version, ts in times.items():
            lines.append(_line(f"int{bits}", version, numel, ts))
    for bits, keep in ((2, 4), (4, 4), (2, 2)):
        feedback = sparse.SparseFeedback(sparse.sparse_padded_numel(numel, block=256))
        ts = [_sparse_round(bits, keep, x, feedback) for x in xs][1:]
        lines.append(_line(f"sparse k{keep}/256 {bits}-bit", "new", numel, ts))
    offset, move, unsent = torch.zeros(numel), torch.zeros(numel), feedback.residual[:numel]
    ts = [_hold_round(offset, move, unsent) for _ in xs][1:]
    lines.append(_line("sparse keep unsent (compute thread)", "new", numel, ts))
    return lines


def _line(codec: str, version: str, numel: int, times: list[float]) -> dict:
    """Median and fastest round: on a machine others share, the fastest is the codec's own cost."""
    median, fastest = statistics.median(times), min(times)
    return {
        "codec": codec,
        "version": version,
        "numel": numel,
        "ns_per_value_median": round(1e9 * median / numel, 2),
        "ns_per_value_min": round(1e9 * fastest / numel, 2),
        "repeats": len(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=10_293_504)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the transfer thread's share)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for line in measure(args.numel, args.repeats):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
