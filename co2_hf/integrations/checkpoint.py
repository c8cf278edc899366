"""Per-rank CO2 checkpoint files and atomic publishing, shared by the Trainer and Accelerate.

Frameworks save one copy of the model and rank 0's optimizer. Under CO2 that loses data: every
rank has its own local parameters, inner optimizer state (and AMP scaler) and its part of the outer
state. Each rank therefore writes ``co2_rank{r}.pt`` beside the framework's files, while the
framework's model files hold the anchor, the one consistent global model.

A checkpoint becomes visible only when complete (`begin_save`, then `publish`):

1. the leader (global rank 0; with per-node disks, each node's local rank 0) clears
   ``_co2_staging/`` next to the final folder; a barrier;
2. every rank writes its files into ``_co2_staging/<name>``;
3. an all-gather of what each rank wrote (file, bytes) doubles as the barrier after writing;
4. the leader checks that every reported file is on its disk, writes ``co2_manifest.json`` (every
   file with its size, the world size, the step) and renames the folder to its final name;
5. an all-gather of the leaders' outcomes: every rank raises if any leader failed, and returns
   only once the checkpoint is visible.

A process killed at any point leaves the previous checkpoints as they were and, at worst, a
folder in ``_co2_staging/`` that the next save clears. `check_complete` refuses a folder whose
manifest is missing or does not match its files, the world size or the rank.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..config import CO2Config
from ..core import CO2

RANK_FILE = "co2_rank{rank}.pt"
CONFIG_FILE = "co2_config.json"
MANIFEST_FILE = "co2_manifest.json"
# Saves in progress. The leading "_" keeps it out of the Trainer's Hub uploads of output_dir, and
# it does not match "checkpoint-*", so neither get_last_checkpoint nor rotation ever sees it.
STAGING_DIR = "_co2_staging"
MANIFEST_FORMAT = 1


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


def read_rank_state(directory: str, rank: int, world_size: int, *, require_manifest: bool = True) -> dict[str, Any]:
    """This rank's file of a checkpoint; refuse clearly when the checkpoint cannot resume exactly.

    ``require_manifest=False`` also accepts a folder written without `publish` (a plain
    ``accelerator.save_state``), checked by counting its rank files.
    """
    if require_manifest or os.path.exists(os.path.join(directory, MANIFEST_FILE)):
        check_complete(directory, rank, world_size)
    else:
        found = glob.glob(os.path.join(directory, RANK_FILE.format(rank="*")))
        if not found:
            raise ValueError(_no_co2_state(directory))
        _check_world_size(directory, len(found), world_size)
    return torch.load(rank_file(directory, rank), map_location="cpu", weights_only=False)


def _no_co2_state(directory: str) -> str:
    return (
        f"checkpoint {directory} has no CO2 state ({RANK_FILE.format(rank='<r>')}): it was saved "
        "without CO2 or with --save_only_model, so training cannot resume exactly from it. To "
        "start a new run from its model (the anchor), load that folder with from_pretrained "
        "instead of resuming."
    )


def _check_world_size(directory: str, saved: int, world_size: int) -> None:
    if saved != world_size:
        raise ValueError(
            f"checkpoint {directory} was saved by {saved} processes and this run has "
            f"{world_size}: an exact CO2 resume needs the same world size"
        )


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

    Under FSDP2 each sharded tensor is all-gathered inside the worker: every rank must call this.

    The anchor's views all share one flat storage, which serialisers would take for tied weights.
    """
    copies: dict[int, Tensor] = {}
    state = {}
    for name, value in co2.anchor_state().items():
        if id(value) not in copies:
            whole = value.full_tensor() if isinstance(value, DTensor) else value  # FSDP2: gathered in the worker
            copies[id(value)] = whole.detach().to("cpu", copy=True)
        state[name] = copies[id(value)]
    return state


def write_co2_config(directory: str, config: CO2Config, *, world_size: int) -> None:
    payload = {**config.co2_dict(), "world_size": world_size}
    payload["num_workers"] = world_size // config.co2_worker_size
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)


# ---------------------------------------------------------------------- atomic publishing


def staging_dir(final_dir: str) -> str:
    """Where the checkpoint that will be called ``final_dir`` is written until it is complete."""
    parent, name = os.path.split(os.path.normpath(final_dir))
    return os.path.join(parent, STAGING_DIR, name)


def begin_save(final_dir: str, *, is_leader: bool) -> str:
    """Clear what killed saves left in the staging area (leader), then a barrier; return the
    folder every rank writes into. Collective: every rank calls it."""
    staging = staging_dir(final_dir)
    if is_leader:
        shutil.rmtree(os.path.dirname(staging), ignore_errors=True)
    _barrier()
    os.makedirs(staging, exist_ok=True)
    return staging


def publish(staging: str, final_dir: str, *, rank: int, leader: int, world_size: int, step: int) -> None:
    """Make a fully written staging folder visible as ``final_dir``; collective (see the module
    docstring). ``leader`` is the rank that renames this rank's copy: 0 on a shared disk, the
    node's local rank 0 with per-node disks."""
    own = rank_file(staging, rank)
    mine = {"rank": rank, "leader": leader, "files": {}}
    if os.path.exists(own):
        mine["files"][os.path.basename(own)] = os.path.getsize(own)
    reports = _all_gather(mine)
    outcome = "ok"
    if rank == leader:
        try:
            ranks = [r for r in reports if r["leader"] == rank]
            _write_manifest(staging, ranks, world_size=world_size, step=step)
            _rename(staging, final_dir)
        except (OSError, ValueError) as error:
            outcome = f"CO2: the checkpoint {final_dir} was not published by rank {rank}: {error}"
    failures = [o for o in _all_gather(outcome) if o != "ok"]
    if failures:
        raise RuntimeError(failures[0])


def _write_manifest(staging: str, ranks: list[dict], *, world_size: int, step: int) -> None:
    rank_files = {}
    for report in ranks:
        for name, size in report["files"].items():
            path = os.path.join(staging, name)
            if not os.path.exists(path) or os.path.getsize(path) != size:
                raise ValueError(
                    f"rank {report['rank']}'s {name} ({size} bytes) is not in {staging} as seen from "
                    "here; if the nodes have their own disks, pass save_on_each_node=True so that "
                    "each node publishes its own copy"
                )
            rank_files[str(report["rank"])] = {"file": name, "bytes": size}
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "world_size": world_size,
        "ranks": rank_files,
        "files": _file_sizes(staging),
    }
    tmp = os.path.join(staging, MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(staging, MANIFEST_FILE))


def _rename(staging: str, final_dir: str) -> None:
    """``staging`` -> ``final_dir``. A folder already there (a re-save of the same step) is moved
    aside first and removed after: between the two renames only the older checkpoints exist."""
    replaced = None
    if os.path.exists(final_dir):
        replaced = staging + ".replaced"
        os.replace(final_dir, replaced)
    os.replace(staging, final_dir)
    _fsync_dir(os.path.dirname(os.path.normpath(final_dir)))
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    with contextlib.suppress(OSError):  # other saves may still be staged there
        os.rmdir(os.path.dirname(staging))


def check_complete(directory: str, rank: int, world_size: int, *, step: int | None = None) -> dict[str, Any]:
    """Refuse, with a message saying why, a checkpoint that cannot resume this rank exactly."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.exists(path):
        if not glob.glob(os.path.join(directory, RANK_FILE.format(rank="*"))):
            raise ValueError(_no_co2_state(directory))
        raise ValueError(
            f"checkpoint {directory} is incomplete: it has no {MANIFEST_FILE}, so its save did not "
            "finish (or it was copied from a staging folder). Resume from an earlier checkpoint."
        )
    with open(path) as f:
        manifest = json.load(f)
    _check_world_size(directory, manifest["world_size"], world_size)
    if not manifest["ranks"]:
        raise ValueError(_no_co2_state(directory))
    if str(rank) not in manifest["ranks"]:
        raise ValueError(
            f"checkpoint {directory} holds the CO2 state of ranks {sorted(map(int, manifest['ranks']))} "
            f"only, not of rank {rank}: with save_on_each_node every node keeps its own ranks' files; "
            "resume with the same ranks on the same nodes"
        )
    if step is not None and manifest["step"] != step:
        raise ValueError(f"checkpoint {directory} mixes steps: its manifest says {manifest['step']}, not {step}")
    for name, size in manifest["files"].items():
        file = os.path.join(directory, name)
        actual = os.path.getsize(file) if os.path.exists(file) else None
        if actual != size:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise ValueError(
                f"checkpoint {directory} is incomplete or was changed after it was saved: {name} "
                f"{found}, its {MANIFEST_FILE} says {size} bytes"
            )
    return manifest


def _file_sizes(directory: str) -> dict[str, int]:
    sizes = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    return dict(sorted(sizes.items()))


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
