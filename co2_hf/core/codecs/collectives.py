"""The two blocking collectives a coded all-reduce is made of (``quant.py``), over a process group.

Apart from both the transport (``comm.py``, which hands them to a coded all-reduce it runs off the
main thread) and the codec (``quant.py``, which runs on them), so that neither depends on the other.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist
from torch import Tensor


class Collectives(Protocol):
    """The two collectives the quantized all-reduce needs, over ``world_size`` ranks (a process
    group: `GroupCollectives`; the simulated network of ``co2_hf.testing`` has its own). Both block."""

    world_size: int
    rank: int

    def all_to_all_(self, output: Tensor, input: Tensor) -> None: ...

    def all_gather_(self, output: Tensor, input: Tensor) -> None: ...


class GroupCollectives:
    """`Collectives` over a torch.distributed process group (None: the default group)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def all_to_all_(self, output: Tensor, input: Tensor) -> None:
        dist.all_to_all_single(output, input, group=self.group)

    def all_gather_(self, output: Tensor, input: Tensor) -> None:
        _all_gather_single(output, input, group=self.group)


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
