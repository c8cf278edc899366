"""The flat layout: one fp32 vector over every synchronised tensor, in a fixed named order.

Anchor, momentum and the communication buffer all use this layout. Parameters come first, then
floating-point buffers (which travel as absolute values), then padding up to a multiple of the
worker size so that each process of a worker can own one equal, contiguous shard. A shard is cut
into chunks of at most ``chunk_numel`` elements: the engine streams through chunks so that its
scratch memory stays bounded by one chunk, whatever the model size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

DEFAULT_CHUNK_NUMEL = 1 << 22  # 4M elements: 16 MB of fp32 scratch


@dataclass
class Segment:
    """One synchronised tensor: its state_dict names (several when tied) and its flat range."""

    names: list[str]
    tensor: Tensor
    offset: int
    is_param: bool

    @property
    def numel(self) -> int:
        return self.tensor.numel()


@dataclass
class Chunk:
    """A range ``[start, stop)`` of one shard, and the pieces of live tensors that lie in it."""

    start: int
    stop: int
    segment_ids: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    live: list[Tensor] = field(default_factory=list)  # flat views into the live tensors
    param_stop: int = 0  # end of the chunk's parameter part; buffers, then padding, follow it
    param_pieces: int = 0  # how many of the pieces are parameters (they come first)


def synchronised_tensors(module: nn.Module) -> list[Segment]:
    """Parameters with ``requires_grad`` then persistent float buffers, each tensor once."""
    persistent = set(module.state_dict(keep_vars=True).keys())
    by_id: dict[int, Segment] = {}
    segments: list[Segment] = []
    named = [(n, t, True) for n, t in module.named_parameters(remove_duplicate=False) if t.requires_grad]
    named += [
        (n, t, False)
        for n, t in module.named_buffers(remove_duplicate=False)
        if t.is_floating_point() and n in persistent
    ]
    for name, tensor, is_param in named:
        if id(tensor) in by_id:  # tied weights: one segment, several names
            by_id[id(tensor)].names.append(name)
            continue
        if not tensor.is_contiguous():
            raise ValueError(f"CO2 needs contiguous tensors; {name!r} is not (call .contiguous())")
        segment = Segment([name], tensor, 0, is_param)
        by_id[id(tensor)] = segment
        segments.append(segment)
    return segments


class FlatLayout:
    """Where each synchronised tensor lives in the flat vector and in this process's shard."""

    def __init__(
        self,
        module: nn.Module,
        *,
        worker_size: int = 1,
        shard_index: int = 0,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    ) -> None:
        self.segments = synchronised_tensors(module)
        offset = 0
        for segment in self.segments:
            segment.offset = offset
            offset += segment.numel
        self.param_numel = sum(s.numel for s in self.segments if s.is_param)
        self.numel = offset
        self.padded_numel = -(-offset // worker_size) * worker_size
        self.worker_size = worker_size
        self.shard_numel = self.padded_numel // worker_size
        self.chunk_numel = chunk_numel
        self.shard_index = shard_index
        self.shard_start = shard_index * self.shard_numel
        self.chunks = self.shard_chunks(shard_index)
        # the shard's parameter region is a prefix, because parameters come first
        self.param_local = min(max(self.param_numel - self.shard_start, 0), self.shard_numel)
        self.segment_numels = torch.tensor([s.numel for s in self.segments], dtype=torch.float64)

    def shard_chunks(self, shard_index: int) -> list[Chunk]:
        """The chunks of shard ``shard_index``, each with the live-tensor pieces inside it."""
        base = shard_index * self.shard_numel
        chunks = []
        for start in range(0, self.shard_numel, self.chunk_numel):
            stop = min(start + self.chunk_numel, self.shard_numel)
            chunk = Chunk(start, stop)
            lo, hi = base + start, base + stop
            for sid, segment in enumerate(self.segments):
                a, b = max(lo, segment.offset), min(hi, segment.offset + segment.numel)
                if a >= b:
                    continue
                chunk.segment_ids.append(sid)
                chunk.lengths.append(b - a)
                flat = segment.tensor.detach().view(-1)
                chunk.live.append(flat[a - segment.offset : b - segment.offset])
                chunk.param_pieces += int(segment.is_param)
            chunk.param_stop = min(stop, max(start, self.param_numel - base))
            chunks.append(chunk)
        return chunks

    def names(self) -> list[list[str]]:
        return [list(s.names) for s in self.segments]

    def describe(self) -> dict:
        """What a checkpoint stores to check that it is loaded into the same layout."""
        return {
            "names": [s.names[0] for s in self.segments],
            "shapes": [list(s.tensor.shape) for s in self.segments],
            "is_param": [s.is_param for s in self.segments],
            "padded_numel": self.padded_numel,
            "worker_size": self.worker_size,
            "shard_index": self.shard_index,
        }
