"""What every coded all-reduce runs on: the two blocking collectives over a group (`Collectives`), and
the random draws of one rank in one round (`round_generator`).

Apart from both the transport (``comm.py``, which hands the collectives to a coded all-reduce it runs
off the main thread) and the codecs (``quant.py``, ``sparse.py``, which run on them), so that neither
depends on the other.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class Collectives(Protocol):
    """The two collectives the coded all-reduces need, over ``world_size`` ranks (a process group:
    `GroupCollectives`; the simulated network of ``co2_hf.testing`` and a torchft quorum have their
    own). Both block."""

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


def round_generator(seed: int, rank: int, round_index: int, device: torch.device) -> torch.Generator:
    """The generator a codec's stochastic rounding draws from in round ``round_index`` on ``rank`` of
    the collectives: seeded by the codec's ``seed`` (its fragment), the rank and the round, so that
    ranks draw apart and a resumed run draws the same noise."""
    generator = torch.Generator(device=device)
    generator.manual_seed(hash((seed, rank, round_index)) & (2**62 - 1))
    return generator


# torch 2.13 renamed all_gather_into_tensor (kept, with a FutureWarning) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
