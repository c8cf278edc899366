"""The flat layout: one fp32 vector over every synchronised tensor, in a fixed named order.

Anchor, momentum and the communication buffer all use this layout. Parameters come first, then
floating-point buffers (which travel as absolute values), then padding up to a multiple of the
worker size so that each process of a worker can own one equal, contiguous shard. A shard is cut
into chunks of at most ``chunk_numel`` elements: the engine streams through chunks so that its
scratch memory stays bounded by one chunk, whatever the model size.

When FSDP2 (``fully_shard``) already shards the parameters over the processes of a worker, the
layout is *pre-sharded*: each process's flat vector is its own local shards, in the same named
order, so the outer state is sharded exactly like the parameters and nothing is sliced or padded.
Statistics that span a tensor still use its global size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

DEFAULT_CHUNK_NUMEL = 1 << 22  # 4M elements: 16 MB of fp32 scratch


@dataclass
class Segment:
    """One synchronised tensor: its state_dict names (several when tied) and its flat range."""

    names: list[str]
    tensor: Tensor  # what CO2 reads and writes: the parameter, or its local shard under FSDP2
    offset: int
    is_param: bool
    dtensor: DTensor | None = None  # the FSDP2 parameter whose local shard ``tensor`` is

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    @property
    def global_numel(self) -> int:
        return self.dtensor.numel() if self.dtensor is not None else self.numel


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
        dtensor = tensor if isinstance(tensor, DTensor) else None
        if dtensor is not None:
            with torch.no_grad():
                tensor = dtensor.to_local()  # the same storage: writes reach the FSDP2 parameter
        if not tensor.is_contiguous():
            raise ValueError(f"CO2 needs contiguous tensors; {name!r} is not (call .contiguous())")
        segment = Segment([name], tensor, 0, is_param, dtensor)
        by_id[id(dtensor if dtensor is not None else tensor)] = segment
        segments.append(segment)
    return segments


def fragment_edges(numel: int, fragments: int) -> list[int]:
    """Where each of ``fragments`` fragments of a shard of ``numel`` elements starts, and the end:
    ``fragments + 1`` offsets, the fragments as equal as integers allow."""
    return [f * numel // fragments for f in range(fragments + 1)]


class FlatLayout:
    """Where each synchronised tensor lives in the flat vector and in this process's shard."""

    def __init__(
        self,
        module: nn.Module,
        *,
        worker_size: int = 1,
        shard_index: int = 0,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        fragments: int = 1,
    ) -> None:
        self.segments = synchronised_tensors(module)
        self.presharded = any(s.dtensor is not None for s in self.segments)
        if self.presharded:
            _check_all_params_sharded(self.segments)
        split = _split(self.segments, worker_size)
        offset = 0
        for segment in self.segments:
            segment.offset = offset
            offset += segment.numel
        self.param_numel = sum(s.numel for s in self.segments if s.is_param)
        # every process's parameters together (of one worker): what per-element means divide by
        self.total_param_numel = sum(s.global_numel for s in self.segments if s.is_param)
        self.numel = offset
        self.shard_numel = _per_process(offset, split)
        self.padded_numel = self.shard_numel * split
        self.worker_size = worker_size
        # the worker all-gathers the anchor to reset its live tensors (flat shards, not FSDP2's)
        self.gathers = split > 1
        self.chunk_numel = chunk_numel
        self.shard_index = shard_index
        if fragments > max(self.shard_numel, 1):
            raise ValueError(
                f"co2_fragments={fragments} is more than the {self.shard_numel} elements of this process's "
                "outer state: allowed values are 1 to that size"
            )
        # fragment f is [edges[f], edges[f+1]) of every shard: balanced by bytes, cut anywhere
        self.fragment_edges = fragment_edges(self.shard_numel, fragments)
        own = shard_index if split > 1 else 0
        self.shard_start = own * self.shard_numel
        self.chunks = self.shard_chunks(own)
        # the shard's parameter region is a prefix, because parameters come first
        self.param_local = min(max(self.param_numel - self.shard_start, 0), self.shard_numel)
        self.segment_numels = torch.tensor([s.global_numel for s in self.segments], dtype=torch.float64)

    @staticmethod
    def shard_numel_of(module: nn.Module, worker_size: int) -> int:
        """``shard_numel`` of the layout of ``module``, without building it: the most fragments it can have."""
        segments = synchronised_tensors(module)
        return _per_process(sum(s.numel for s in segments), _split(segments, worker_size))

    def shard_chunks(self, shard_index: int) -> list[Chunk]:
        """The chunks of shard ``shard_index``, each with the live-tensor pieces inside it."""
        base = shard_index * self.shard_numel
        chunks = []
        for start, stop in self._chunk_ranges():
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

    def _chunk_ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of every chunk of a shard: at most ``chunk_numel`` long, never across
        a fragment edge, so that each fragment is a run of whole chunks."""
        edges = self.fragment_edges
        return [
            (start, min(start + self.chunk_numel, hi))
            for lo, hi in zip(edges[:-1], edges[1:])
            for start in range(lo, hi, self.chunk_numel)
        ]

    def fragment(self, index: int) -> FlatLayout:
        """Fragment ``index`` of this layout as a layout of its own, in its own coordinates: the
        engine runs the phases of a fragment exactly as it runs them on a whole shard. The whole
        layout itself when there is one fragment."""
        if len(self.fragment_edges) == 2:
            return self
        lo, hi = self.fragment_edges[index], self.fragment_edges[index + 1]
        view = FragmentLayout.__new__(FragmentLayout)
        view.__dict__.update(self.__dict__)
        view.whole, view.lo, view.hi = self, lo, hi
        view.shard_numel = hi - lo
        view.param_local = min(max(self.param_local - lo, 0), hi - lo)
        view.fragment_edges = [0, hi - lo]
        view.chunks = view.shard_chunks(shard_index=self.shard_index if self.gathers else 0)
        return view

    def names(self) -> list[list[str]]:
        return [list(s.names) for s in self.segments]

    def check_sharded_over(self, worker_ranks: list[int]) -> None:
        """Pre-sharded layouts: every FSDP2 parameter must be sharded (dim 0) over exactly the
        processes of this worker; FSDP2 over other processes would shard across CO2 workers."""
        for segment in self.segments:
            dtensor = segment.dtensor
            if dtensor is None:
                continue
            mesh = dtensor.device_mesh
            mesh_ranks = dist.get_process_group_ranks(mesh.get_group()) if dist.is_initialized() else [0]
            if mesh.ndim != 1 or sorted(mesh_ranks) != sorted(worker_ranks):
                raise ValueError(
                    f"parameter {segment.names[0]!r} is sharded by FSDP2 over ranks {mesh_ranks}, but this "
                    f"CO2 worker is ranks {worker_ranks}: shard inside each worker only, with "
                    "fully_shard(module, mesh=co2_hf.core.worker_mesh(co2_worker_size))"
                )
            if tuple(dtensor.placements) != (Shard(0),):
                raise ValueError(
                    f"parameter {segment.names[0]!r} has placements {dtensor.placements}; CO2 supports FSDP2's "
                    "default sharding, (Shard(0),)"
                )

    def describe(self) -> dict:
        """What a checkpoint stores to check that it is loaded into the same layout."""
        extra = {
            "presharded": True,
            "global_shapes": [list(s.dtensor.shape) for s in self.segments if s.dtensor is not None],
        }
        return {
            **(extra if self.presharded else {}),
            "names": [s.names[0] for s in self.segments],
            "shapes": [list(s.tensor.shape) for s in self.segments],
            "is_param": [s.is_param for s in self.segments],
            "padded_numel": self.padded_numel,
            "worker_size": self.worker_size,
            "shard_index": self.shard_index,
        }


class FragmentLayout(FlatLayout):
    """One fragment ``[lo, hi)`` of every shard of a `FlatLayout`, re-based to start at 0; made by
    `FlatLayout.fragment`. Its chunks are the whole layout's chunks inside the fragment."""

    whole: FlatLayout
    lo: int
    hi: int

    def shard_chunks(self, shard_index: int) -> list[Chunk]:
        # this process's own chunks are built already; another shard's (an all-gather's) afresh
        whole = self.whole.chunks if shard_index == self.whole.shard_index or not self.gathers else None
        return [
            replace(c, start=c.start - self.lo, stop=c.stop - self.lo, param_stop=c.param_stop - self.lo)
            for c in (whole if whole is not None else self.whole.shard_chunks(shard_index))
            if self.lo <= c.start < self.hi
        ]


def _split(segments: list[Segment], worker_size: int) -> int:
    """How many processes cut one flat vector into shards: none when FSDP2 already sharded it."""
    return 1 if any(s.dtensor is not None for s in segments) else worker_size


def _per_process(numel: int, split: int) -> int:
    return -(-numel // split)


def _check_all_params_sharded(segments: list[Segment]) -> None:
    plain = [s.names[0] for s in segments if s.is_param and s.dtensor is None]
    if plain:
        raise ValueError(
            f"FSDP2 shards some parameters but not {plain[:3]}{' ...' if len(plain) > 3 else ''}: apply "
            "fully_shard to the root module too, so that every trainable parameter is sharded"
        )
