"""The buffer the outer all-reduce sums, its named regions (``docs/algorithm.md``, section 10), and
one fragment's all-reduce of it (`WireLink`).

```
[ payload: flat d (params, then absolute buffer values, then padding) | weight | 32 round bits | G wait times ]
```

`WireBuffer` makes these regions as views in one place; nothing else indexes the header. The fp32
buffer is the engine's working memory (it holds ``D``, then ``P * D``, then the Nesterov step,
then the next ``d``); with ``co2_comm_dtype='bfloat16'`` a bf16 copy is what travels; with int8,
int4 or sparse the payload travels as codes (``codecs/``) and the header as it is, in fp32.
`WirePool` hands fragments their buffers; `WireLink` launches a fragment's all-reduce through the
communicator, waits for it and times it.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import Tensor
from torch.profiler import record_function

from .codecs import Codec
from .comm import Communicator, Pending
from .tally import Seconds

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


class WireLink:
    """One fragment's outer all-reduce, round after round: its buffer (taken from the pool while the
    fragment needs one: `hold` / `release`), the all-reduce of it in flight (``pending``), launched
    through the communicator plain or coded by the fragment's codec (``codecs/``; None: the buffer
    travels as it is), the wait for it bounded by ``timeout_s`` (the config's ``co2_timeout_s``), and its times:
    ``last_wait`` (exposed), ``last_comm`` (launch to completion) and those since the last `comm_s` pop."""

    def __init__(
        self, comm: Communicator, codec: Codec | None, pool: WirePool, numel: int, *, keep: bool, timeout_s: float
    ) -> None:
        self.comm, self.codec, self.timeout_s = comm, codec, timeout_s
        self._pool, self._numel, self._keep = pool, numel, keep  # keep: hold the buffer all along
        self.buffer: WireBuffer | None = pool.acquire(numel) if keep else None
        self.pending: Pending | None = None
        self.last_wait, self.last_comm = Seconds(0.0), Seconds(0.0)
        self._known_wait_s = 0.0  # the newest exposed wait the host knows without waiting: the header's
        self._comm_times: list[Seconds] = []  # launch to completion of each all-reduce since the last pop

    def hold(self) -> WireBuffer:
        """The buffer, taken from the pool if none is held."""
        if self.buffer is None:
            self.buffer = self._pool.acquire(self._numel)
        return self.buffer

    def release(self) -> None:
        """Give the buffer back to the pool (the fragment has nothing in flight or waiting in it), unless
        it is kept all along."""
        if not self._keep and self.buffer is not None:
            self._pool.release(self.buffer)
            self.buffer = None

    def launch(self, *, finite: Tensor, round_index: int) -> None:
        """Write this worker's header (``finite``: a 0-d bool tensor) and start the all-reduce of the
        buffer (its payload written)."""
        buffer = self.buffer
        tensor = buffer.pack_header(
            finite=finite, round_index=round_index, wait_s=self._header_wait_s(), worker_index=self.comm.worker_index
        )
        with record_function("co2/launch"):
            try:
                if self.codec is None:
                    self.pending = self.comm.launch(tensor)
                else:  # a non-finite worker's zeros leave its own residual for a later round
                    coded = functools.partial(
                        self.codec.all_reduce_, buffer.payload, buffer.header, feedback=finite, round_index=round_index
                    )
                    self.pending = self.comm.launch_coded(tensor, coded)
            except RuntimeError as error:  # a transport may already know that a peer is gone
                raise self._peer_failure(error, round_index) from error

    def complete(self, round_index: int, *, exposed: bool) -> Pending | None:
        """Wait for the all-reduce in flight (of round ``round_index``; None: none was) and time it: the
        wait is a boundary's exposed wait, or recorded as 0 outside one (``exposed`` False)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        start = time.perf_counter()
        with record_function("co2/wait"):
            try:
                self.comm.wait(pending, self.timeout_s)
            except RuntimeError as error:
                raise self._peer_failure(error, round_index) from error
        waited = pending.wait_time(since=start)  # CUDA: the compute stream's stall, read later (comm.py)
        self.last_wait = waited if exposed else Seconds(0.0)
        self.last_comm = pending.comm_time()
        self._comm_times.append(self.last_comm)
        return pending

    def comm_s(self, *, pop: bool) -> float | None:
        """The mean launch-to-completion time of the all-reduces completed since the last pop (None:
        none was); ``pop`` starts the next window. On a GPU this waits for their CUDA events."""
        times = self._comm_times
        if pop:
            self._comm_times = []
        return sum(t.get() for t in times) / len(times) if times else None

    def _header_wait_s(self) -> float:
        """This rank's last exposed wait, as far as the host knows it without waiting for the device
        (on a GPU the events of the newest wait may not have completed yet: then the one before)."""
        if self.last_wait.ready():
            self._known_wait_s = self.last_wait.get()
        return self._known_wait_s

    def _peer_failure(self, error: Exception, round_index: int) -> RuntimeError:
        return RuntimeError(
            f"CO2's outer all-reduce of round {round_index} failed or did not finish within "
            f"co2_timeout_s={self.timeout_s}s (a peer may have died or stalled): {error}"
        )
