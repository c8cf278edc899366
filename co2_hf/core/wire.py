"""The buffer the outer all-reduce sums, and its named regions (``docs/algorithm.md``, section 10).

```
[ payload: flat d (params, then absolute buffer values, then padding) | weight | 32 round bits | G wait times ]
```

`WireBuffer` makes these regions as views in one place; nothing else indexes the header. The fp32
buffer is the engine's working memory (it holds ``D``, then ``P * D``, then the Nesterov step,
then the next ``d``); with ``co2_comm_dtype='bfloat16'`` a bf16 copy is what travels; with int8 or
int4 the payload travels as codes (``quant.py``) and the header as it is, in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

ROUND_BITS = 32  # the round index travels as bits: any disagreement gives a bit sum in (0, G)


class WireBuffer:
    """The fp32 communication buffer with named views: ``payload``, ``weight``, ``round_bits``, ``waits``."""

    def __init__(self, payload_numel: int, num_workers: int, *, wire_dtype: torch.dtype, **zeros) -> None:
        n = payload_numel
        self.fp32 = torch.zeros(n + 1 + ROUND_BITS + num_workers, **zeros)
        self.payload = self.fp32[:n]
        self.header = self.fp32[n:]  # what a quantized wire still sums exactly, in fp32
        self.weight = self.fp32[n]  # 1 from a finite worker, 0 otherwise; summed: how many were finite
        self.round_bits = self.fp32[n + 1 : n + 1 + ROUND_BITS]
        self.waits = self.fp32[n + 1 + ROUND_BITS :]  # worker i's last exposed wait, in slot i
        self.num_workers = num_workers
        # what the all-reduce carries: the fp32 buffer itself, or a copy in the wire's dtype
        self.wire = self.fp32 if wire_dtype == torch.float32 else self.fp32.to(wire_dtype)

    def nbytes(self) -> int:
        wire = self.wire.numel() * self.wire.element_size() if self.wire is not self.fp32 else 0
        return self.fp32.numel() * self.fp32.element_size() + wire

    def pack_header(self, *, finite: bool, round_index: int, wait_s: float, worker_index: int) -> Tensor:
        """Write this worker's header and return the tensor to all-reduce (the payload is written)."""
        self.weight.fill_(1.0 if finite else 0.0)
        self.round_bits.copy_((round_index >> torch.arange(ROUND_BITS)) & 1)
        self.waits.zero_()
        self.waits[worker_index] = wait_s
        if self.wire is not self.fp32:
            self.wire.copy_(self.fp32)
        return self.wire

    def unpack(self, sent_round: int) -> tuple[float, float]:
        """After the all-reduce: check that every worker sent round ``sent_round``; return (how many
        workers were finite, the longest wait any worker reported)."""
        if self.wire is not self.fp32:
            self.fp32.copy_(self.wire)
        expected = ((sent_round >> torch.arange(ROUND_BITS)) & 1).to(self.round_bits) * self.num_workers
        if not torch.equal(self.round_bits, expected.to(self.round_bits.device)):
            raise RuntimeError(
                f"CO2: ranks out of step at round {sent_round}: the outer all-reduce mixed "
                "different rounds (every rank must call CO2.step() once per inner step)"
            )
        return float(self.weight), float(self.waits.max())
