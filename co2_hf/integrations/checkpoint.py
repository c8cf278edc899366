"""Per-rank CO2 checkpoint files, shared by the Trainer and Accelerate integrations.

Frameworks save one copy of the model and rank 0's optimizer. Under CO2 that loses data: every
rank has its own local parameters, inner optimizer state (and AMP scaler) and its part of the outer
state. Each rank therefore writes ``co2_rank{r}.pt`` beside the framework's files, while the
framework's model files hold the anchor, the one consistent global model.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
from torch import Tensor, nn

from ..config import CO2Config
from ..core import CO2

RANK_FILE = "co2_rank{rank}.pt"
CONFIG_FILE = "co2_config.json"


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, RANK_FILE.format(rank=rank))


def save_rank_state(
    directory: str, rank: int, *, co2: CO2, model: nn.Module, optimizer: Any, scaler: Any = None
) -> None:
    """Write this rank's local parameters, inner optimizer, scaler and CO2 state (no collective)."""
    os.makedirs(directory, exist_ok=True)
    state = {
        "co2": co2.state_dict(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
    }
    torch.save(state, rank_file(directory, rank))


def read_rank_state(directory: str, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's file of a checkpoint; refuse clearly when the checkpoint cannot resume exactly."""
    found = sorted(glob.glob(os.path.join(directory, RANK_FILE.format(rank="*"))))
    if not found:
        raise ValueError(
            f"checkpoint {directory} has no CO2 state ({RANK_FILE.format(rank='<r>')}): it was saved "
            "without CO2 or with --save_only_model, so training cannot resume exactly from it. To "
            "start a new run from its model (the anchor), load that folder with from_pretrained "
            "instead of resuming."
        )
    if len(found) != world_size:
        raise ValueError(
            f"checkpoint {directory} was saved by {len(found)} processes and this run has "
            f"{world_size}: an exact CO2 resume needs the same world size"
        )
    return torch.load(rank_file(directory, rank), map_location="cpu", weights_only=False)


def apply_rank_state(state: dict[str, Any], *, co2: CO2, model: nn.Module, optimizer: Any, scaler: Any = None) -> None:
    """Restore what `save_rank_state` wrote; CO2's own checks refuse other settings first."""
    co2.load_state_dict(state["co2"])
    model.load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])


def anchor_for_saving(co2: CO2) -> dict[str, Tensor]:
    """The anchor as a state dict of independent CPU tensors (tied names keep sharing one).

    The anchor's views all share one flat storage, which serialisers would take for tied weights.
    """
    copies: dict[int, Tensor] = {}
    state = {}
    for name, value in co2.anchor_state().items():
        if id(value) not in copies:
            copies[id(value)] = value.detach().to("cpu", copy=True)
        state[name] = copies[id(value)]
    return state


def write_co2_config(directory: str, config: CO2Config, *, world_size: int) -> None:
    payload = {**config.co2_dict(), "world_size": world_size}
    payload["num_workers"] = world_size // config.co2_worker_size
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
