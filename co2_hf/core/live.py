"""Reading and writing the live tensors through the flat layout, one chunk at a time.

The engine's phases work on chunks of this process's shard (``layout.py``). Reading a chunk copies
the live pieces inside it into fp32 scratch; writing one puts a chunk-shaped fp32 source back into
the live tensors, in place (the optimizer, DDP buckets and compiled graphs keep pointing at them).
When the processes of a worker split one flat vector between them (``co2_worker_size > 1`` without
FSDP2), a write first all-gathers the chunk over the worker, so that every process updates its
whole replica; pre-sharded by FSDP2, each process writes its own shards only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..config import CO2Config
from .comm import Communicator
from .layout import Chunk, FlatLayout


class Scratch:
    """Reusable fp32 working memory, one buffer per use (``"read"``, ``"start"``, ``"move"``), shared by
    the engine and its fragments: a boundary allocates nothing. Freshly allocated memory costs more
    than the copy into it on the CPU (the pages are touched for the first time at every boundary) and
    a pinned host allocation on a GPU machine. Each buffer grows to the largest request (one chunk)."""

    def __init__(self, device: torch.device, *, pin_memory: bool = False) -> None:
        self.device, self.pin_memory = device, pin_memory
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, numel: int) -> Tensor:
        """``numel`` uninitialised fp32 values of buffer ``name`` (valid until its next use)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=torch.float32, device=self.device, pin_memory=self.pin_memory)
            self._buffers[name] = buffer
        return buffer[:numel]


class LiveTensors:
    """The live tensors seen through the flat layout of this process's shard."""

    def __init__(self, layout: FlatLayout, comm: Communicator, scratch: Scratch) -> None:
        self.layout, self.comm, self.device = layout, comm, scratch.device
        self._scratch = scratch  # pinned where the state is, for a GPU model: full PCIe speed both ways
        # chunk c of every shard of this worker, in shard order: what an all-gather of chunk c fills
        # (pre-sharded by FSDP2: this process's own chunks only, nothing is gathered)
        shards = [layout.chunks]
        if layout.gathers:
            shards = [
                layout.chunks if j == layout.shard_index else layout.shard_chunks(j) for j in range(layout.worker_size)
            ]
        self._every_shard = list(zip(*shards))

    def scratch(self, numel: int, name: str = "move") -> Tensor:
        """Uninitialised fp32 scratch on the state's device (`Scratch`: valid until its next use)."""
        return self._scratch.get(name, numel)

    def read(self, chunk: Chunk) -> Tensor:
        """An fp32 copy of the live values in ``chunk`` (zeros in its padding), in the ``"read"`` scratch."""
        x = self._scratch.get("read", chunk.stop - chunk.start)
        covered = sum(chunk.lengths)
        if chunk.live:
            torch._foreach_copy_(list(x[:covered].split(chunk.lengths)), chunk.live)
        x[covered:].zero_()
        return x

    def grads(self) -> list[Tensor]:
        """The gradient of every synchronised parameter as a plain tensor (its local shard under
        FSDP2), zeros where a parameter got none."""
        grads = []
        for segment in self.layout.segments:
            if not segment.is_param:
                continue
            param = segment.dtensor if segment.dtensor is not None else segment.tensor
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
            grads.append(grad.to_local() if segment.dtensor is not None else grad)
        return grads

    def write_params(self, source: Callable[[Chunk], Tensor], *, buffers: Tensor | None = None) -> None:
        """Chunk by chunk, set the live parameters to ``source(chunk)``; the float buffers too where
        ``buffers`` (a 0-d bool tensor, decided on the device) is True, else they keep their values."""
        for chunk, every_shard in self._chunks():
            for part, piece in zip(self._worker_parts(source(chunk)), every_shard):
                _scatter(piece, part, piece.param_pieces)
                if buffers is not None and piece.param_pieces < len(piece.live):
                    self._write_buffers_where(piece, part, buffers)

    def write_all(self, source: Callable[[Chunk], Tensor]) -> None:
        """Chunk by chunk, set the live parameters and float buffers to ``source(chunk)``."""
        for chunk, every_shard in self._chunks():
            for part, piece in zip(self._worker_parts(source(chunk)), every_shard):
                _scatter(piece, part, len(piece.live))

    def shift(self, move: Callable[[Chunk], Tensor], *, buffers: Tensor) -> None:
        """Chunk by chunk, add ``move(chunk)`` to the live parameters, in place, and set the buffers to
        its buffer part where ``buffers`` (0-d bool, on the device) is True (``move`` holds parameter
        moves first, then absolute buffer values)."""
        for chunk, every_shard in self._chunks():
            for part, piece in zip(self._worker_parts(move(chunk)), every_shard):
                count = piece.param_pieces
                if count:
                    lengths = piece.lengths[:count]
                    torch._foreach_add_(piece.live[:count], list(part[: sum(lengths)].split(lengths)))
                if count < len(piece.live):
                    self._write_buffers_where(piece, part, buffers)

    def gather_flat(self, shard: Tensor) -> Tensor:
        """The whole flat vector of which ``shard`` is this process's slice (all-gathered, k > 1)."""
        pinned = self._scratch.pin_memory
        full = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.device, pin_memory=pinned)
        size = self.layout.shard_numel
        for chunk in self.layout.chunks:
            for j, part in enumerate(self.comm.all_gather(shard[chunk.start : chunk.stop])):
                full[j * size + chunk.start : j * size + chunk.stop].copy_(part)
        return full

    def _write_buffers_where(self, piece: Chunk, part: Tensor, take: Tensor) -> None:
        """The live float buffers of ``piece`` become ``part``'s buffer values where ``take`` is True
        (``part`` is not modified: it may be the anchor itself)."""
        first, n = piece.param_pieces, piece.param_stop - piece.start
        lengths, live = piece.lengths[first:], piece.live[first:]
        values = self._scratch.get("read", sum(lengths))
        pieces = list(values.split(lengths))
        torch._foreach_copy_(pieces, live)
        torch.where(take, part[n : n + values.numel()], values, out=values)
        torch._foreach_copy_(live, pieces)

    def _chunks(self) -> Iterator[tuple[Chunk, tuple[Chunk, ...]]]:
        return zip(self.layout.chunks, self._every_shard)

    def _worker_parts(self, chunk: Tensor) -> list[Tensor]:
        """This chunk from every process of the worker (all-gathered over its fast link) when the
        flat state is split between them; just this one when each process owns what it writes."""
        return self.comm.all_gather(chunk) if self.layout.gathers else [chunk]


def _scatter(chunk: Chunk, src: Tensor, count: int) -> None:
    """Copy the first ``count`` pieces of a chunk-shaped fp32 ``src`` into the live tensors."""
    if count:
        pieces = list(src[: sum(chunk.lengths[:count])].split(chunk.lengths[:count]))
        torch._foreach_copy_(chunk.live[:count], pieces)


def reshard_fsdp(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def has_dtensors(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def pin_state(model: nn.Module, state_device: torch.device) -> bool:
    """Host-memory state for a model on a GPU is pinned: the boundary's copies between the two
    then run at full PCIe speed. Nothing to pin when everything lives on the CPU."""
    return state_device.type == "cpu" and any(p.device.type == "cuda" for p in model.parameters())


def state_device(model: nn.Module, config: CO2Config) -> torch.device:
    """Where the outer state lives: ``co2_state_device``, "same" meaning the parameters' device."""
    if config.state_on_host:
        return torch.device("cpu")
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")
