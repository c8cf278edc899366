"""The buffer the outer all-reduce sums, and its named regions (``docs/algorithm.md``, section 10).

```
[ payload: flat d (params, then absolute buffer values, then padding) | weight | 32 round bits | G wait times ]
```

`WireBuffer` makes these regions as views in one place; nothing else indexes the header. The fp32
buffer is the engine's working memory (it holds ``D``, then ``P * D``, then the Nesterov step,
then the next ``d``); with ``co2_comm_dtype='bfloat16'`` a bf16 copy is what travels; with int8 or
int4 or sparse the payload travels as codes (``codecs/``) and the header as it is, in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

ROUND_BITS = 32  # the round index travels as bits: any disagreement gives a bit sum in (0, G)


def header_numel(num_workers: int) -> int:
    """Values after the payload: the weight, the round bits and one wait per worker."""
    return 1 + ROUND_BITS + num_workers


class WireBuffer:
    """The fp32 communication buffer with named views: ``payload``, ``weight``, ``round_bits``, ``waits``.

    ``fp32`` is the memory it works in (``payload_numel`` plus `header_numel` values); ``wire``, when
    given, the copy in the wire's dtype that travels (bfloat16). Both may be views of larger tensors
    (`WirePool` hands out such views)."""

    def __init__(self, fp32: Tensor, num_workers: int, *, wire: Tensor | None = None) -> None:
        n = fp32.numel() - header_numel(num_workers)
        self.fp32 = fp32
        self.payload = self.fp32[:n]
        self.header = self.fp32[n:]  # what a quantized wire still sums exactly, in fp32
        self.weight = self.fp32[n]  # 1 from a finite worker, 0 otherwise; summed: how many were finite
        self.round_bits = self.fp32[n + 1 : n + 1 + ROUND_BITS]
        self.waits = self.fp32[n + 1 + ROUND_BITS :]  # worker i's last exposed wait, in slot i
        self.num_workers = num_workers
        # what the all-reduce carries: the fp32 buffer itself, or a copy in the wire's dtype
        self.wire = self.fp32 if wire is None else wire
        self._shifts = torch.arange(ROUND_BITS, device=fp32.device)  # bit k of a round index: (t >> k) & 1

    @classmethod
    def zeros(cls, payload_numel: int, num_workers: int, *, wire_dtype: torch.dtype, **zeros) -> WireBuffer:
        """A buffer of its own, zero-filled, for ``payload_numel`` values."""
        fp32 = torch.zeros(payload_numel + header_numel(num_workers), **zeros)
        return cls(fp32, num_workers, wire=None if wire_dtype == torch.float32 else fp32.to(wire_dtype))

    def nbytes(self) -> int:
        wire = self.wire.numel() * self.wire.element_size() if self.wire is not self.fp32 else 0
        return self.fp32.numel() * self.fp32.element_size() + wire

    def pack_header(self, *, finite: Tensor, round_index: int, wait_s: float, worker_index: int) -> Tensor:
        """Write this worker's header and return the tensor to all-reduce (the payload is written).
        ``finite`` is a 0-d bool tensor on the buffer's device: the weight is set from it there."""
        self.weight.copy_(finite)
        self.round_bits.copy_((round_index >> self._shifts) & 1)
        self.waits.zero_()
        self.waits[worker_index].fill_(wait_s)
        if self.wire is not self.fp32:
            self.wire.copy_(self.fp32)
        return self.wire

    def unpack(self, sent_round: int, *, senders: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """After the all-reduce, on the device: (how many workers were finite, whether the round bits
        disagree with round ``sent_round`` sent by every worker that took part (``senders``; None: all
        ``num_workers``), the longest wait any worker reported), as 0-d tensors. Nothing is read by
        the host: the engine tallies them (``tally.py``)."""
        if self.wire is not self.fp32:
            self.fp32.copy_(self.wire)
        senders = self.num_workers if senders is None else senders
        expected = ((sent_round >> self._shifts) & 1) * senders
        return self.weight.clone(), (self.round_bits != expected).any(), self.waits.max()


class WirePool:
    """The communication buffers of a run's fragments, held only while a fragment needs one.

    A fragment holds a buffer from its boundary (``d`` written, launched) until its average ``D``
    has been applied; with streaming fragments that is one fragment at a time, so one buffer of the
    largest fragment's size serves them all and the outer state is anchor, momentum and 1/F of a
    buffer instead of a whole one (``docs/algorithm.md``, section 9). A buffer released is kept for
    the next fragment, and so is each fragment-sized view of it: nothing is allocated while training."""

    def __init__(self, payload_numel: int, num_workers: int, *, wire_dtype: torch.dtype, **zeros) -> None:
        self._numel, self._num_workers, self._wire_dtype, self._zeros = payload_numel, num_workers, wire_dtype, zeros
        self._free: list[WireBuffer] = []
        self._made: list[WireBuffer] = []
        self._views: dict[tuple[int, int], WireBuffer] = {}  # (buffer's index in _made, payload) -> view
        self._make()  # the one every run needs, made up front so that memory is known from the start

    def _make(self) -> None:
        whole = WireBuffer.zeros(self._numel, self._num_workers, wire_dtype=self._wire_dtype, **self._zeros)
        self._made.append(whole)
        self._free.append(whole)

    def acquire(self, payload_numel: int) -> WireBuffer:
        """A buffer for ``payload_numel`` values (at most the pool's size): views of a free one."""
        if payload_numel > self._numel:
            raise ValueError(f"CO2 internal error: a buffer of {payload_numel} values from a pool of {self._numel}")
        if not self._free:  # finalize: a fragment finishes while another is in flight
            self._make()
        whole = self._free.pop()
        key = (self._made.index(whole), payload_numel)
        if key not in self._views:
            stop = payload_numel + header_numel(self._num_workers)
            wire = None if whole.wire is whole.fp32 else whole.wire[:stop]
            self._views[key] = WireBuffer(whole.fp32[:stop], self._num_workers, wire=wire)
        return self._views[key]

    def release(self, buffer: WireBuffer) -> None:
        """Give back a buffer from `acquire` (its views start where the whole buffer starts)."""
        whole = next(made for made in self._made if made.fp32.data_ptr() == buffer.fp32.data_ptr())
        self._free.append(whole)

    def trim(self) -> None:
        """Keep the first buffer and drop the others (``finalize`` may have needed two at once)."""
        if len(self._made) > 1 and len(self._free) == len(self._made):
            self._made, self._free = self._made[:1], self._made[:1]
            self._views = {key: view for key, view in self._views.items() if key[0] == 0}

    def nbytes(self) -> int:
        return sum(buffer.nbytes() for buffer in self._made)
