"""Host-memory outer state (``co2_state_device=cpu``) worked on by the GPU, a fragment at a time.

A model too large for three fp32 copies of itself on its GPU keeps CO2's outer state (anchor,
momentum, the start rule's offset) in pinned host memory. Doing the outer step there, on the CPU,
between two inner steps, leaves the GPU idle (1.68 x a step's time at tau 12 on an H200, issue 41).
With streaming fragments a fragment's state is needed only from its boundary to its in-round apply,
``k = tau / F`` steps later, so each fragment is brought to the GPU just before, worked on there,
and written back after, while the GPU trains (``docs/gpus.md``, "Host-memory state"):

- `fetch` (issued one step before the fragment's boundary): its slices are copied into fresh GPU
  memory on a copy stream, which first waits for what the compute stream queued so far;
- `acquire` (at the boundary, or whenever the fragment needs its state): the compute stream waits
  for that copy, GPU-side; the fragment works on the GPU copies;
- `release` (after the in-round apply): the copy stream waits for the compute stream, copies the
  results back to host memory, and the GPU memory is handed back once that copy is done.

The host never waits, and at most a few fragments (one applying, one at its boundary, one arriving)
are on the GPU: about 3 / F of the state. Reads of the host copy by the host (checkpoints,
``anchor_state``, ``finalize``) `flush` first. On the CPU (tests) the same steps copy between two
CPU tensors, so that the staging is checked bit for bit against state that stays put.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class Residency:
    """One fragment's outer state in host memory (``host``: named slices) and its working copy on
    ``device`` while the fragment works. ``copy_stream``: the engine's side stream (CUDA), None on
    the CPU."""

    def __init__(self, host: dict[str, Tensor], device: torch.device, copy_stream: Any = None) -> None:
        self.host, self.device, self.copy_stream = host, device, copy_stream
        self.working: dict[str, Tensor] | None = None
        self._arrived: Any = None  # CUDA: recorded on the copy stream after the fetch

    @property
    def resident(self) -> bool:
        return self.working is not None

    def fetch(self) -> None:
        """Start copying the state to the device (nothing if it is there already)."""
        if self.working is not None:
            return
        if self.copy_stream is None:
            self.working = {name: tensor.to(self.device, copy=True) for name, tensor in self.host.items()}
            return
        compute = torch.cuda.current_stream(self.device)
        # allocated for the compute stream, which uses it; the copy stream writes it once the compute
        # stream's earlier work (which may have freed this memory) is done
        self.working = {name: torch.empty(t.shape, dtype=t.dtype, device=self.device) for name, t in self.host.items()}
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            for name, tensor in self.host.items():
                self.working[name].copy_(tensor, non_blocking=True)
                self.working[name].record_stream(self.copy_stream)
            self._arrived = torch.cuda.Event()
            self._arrived.record(self.copy_stream)

    def acquire(self) -> dict[str, Tensor]:
        """The working copies, ready for the compute stream (fetched now if they were not)."""
        self.fetch()
        if self._arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(self._arrived)
            self._arrived = None
        return self.working

    def release(self) -> None:
        """Copy the working state back to host memory, without waiting, and let it go."""
        if self.working is None:
            return
        working, self.working = self.working, None
        if self.copy_stream is None:
            for name, tensor in self.host.items():
                tensor.copy_(working[name])
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for name, tensor in self.host.items():
                tensor.copy_(working[name], non_blocking=True)
                working[name].record_stream(self.copy_stream)  # freed once the copy is done
        self._arrived = None


def flush(residencies: list[Residency]) -> None:
    """Every fragment's state back in host memory, and the host may read it: release all, then wait
    for the copies (checkpoints, ``anchor_state``, ``finalize``: not between training steps)."""
    streams = {r.copy_stream for r in residencies if r.copy_stream is not None}
    for residency in residencies:
        residency.release()
    for stream in streams:
        stream.synchronize()
