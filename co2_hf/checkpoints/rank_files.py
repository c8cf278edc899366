"""Per-rank CO2 checkpoint files, shared by the Trainer and Accelerate.

Frameworks save one copy of the model and rank 0's optimizer. Under CO2 that loses data: every
rank has its own local parameters, inner optimizer state (and AMP scaler) and its part of the outer
state. Each rank therefore writes ``co2_rank{r}.pt`` beside the framework's files, while the
framework's model files hold the anchor, the one consistent global model. A checkpoint folder is
published whole, with a manifest of every file's size and SHA-256 (`saving`: ``publish.py``,
``manifest.py``), the same way for both frameworks.

Loading: a rank file holds tensors, numbers, strings and containers only, and is read with
``torch.load(..., weights_only=True)``: a rank file from elsewhere that carries anything else (a
pickled payload) is refused naming the file, before anything in it runs; and before ``torch.load``
reads any file, ``bounded.py`` checks that nothing in it can expand past the file's own size. Before
it is read, its checkpoint's manifest is validated and the files this rank reads are verified
(`check_complete`):
its own rank file and every shared file (the model, optimizer, scheduler, RNG, trainer state and
``co2_config.json``), not the other ranks' rank files, which their ranks verify; `agreement.agree`
makes every rank refuse when one does. The shared files are verified by every rank because every
rank reads them and, with per-node disks, each node has its own copy.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..core import CO2
from . import bounded, publish  # publish's functions by attribute: scripts/soak.py strikes inside them
from .manifest import MANIFEST_FILE, check_files, read_manifest, verify_checksums

RANK_FILE = "co2_rank{rank}.pt"


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, RANK_FILE.format(rank=rank))


def save_leader(rank: int, local_rank: int, *, per_node: bool) -> int:
    """The rank that publishes this rank's checkpoint files: 0 on a shared disk, the node's local
    rank 0 with per-node disks (``save_on_each_node``)."""
    return rank - local_rank if per_node else 0


@contextlib.contextmanager
def saving(
    final_dir: str,
    *,
    rank: int,
    leader: int,
    run: str,
    world_size: int,
    step: int,
    leftovers: str | None = None,
    sole_run: bool = False,
) -> Iterator[str]:
    """One save of a CO2 checkpoint, as the Trainer and Accelerate both make it; collective.

    Yields the staging folder (`publish.begin_save`) into which the block writes the framework's
    files and this rank's (`save_rank_state`); a full disk there says so (`publish.writing`). When
    the block ends without an error the folder is published as ``final_dir`` with its manifest
    (`publish.publish`); after one, nothing is. ``sole_run``: see `publish.begin_save`.
    """
    staging = publish.begin_save(final_dir, rank=rank, leader=leader, run=run, leftovers=leftovers, sole_run=sole_run)
    with publish.writing(final_dir, staging):
        yield staging
    own = RANK_FILE.format(rank=rank)
    ran = dict(world_size=world_size, step=step, own=own, run=run, sole_run=sole_run)
    publish.publish(staging, final_dir, rank=rank, leader=leader, **ran)


def save_rank_state(
    directory: str, rank: int, *, co2: CO2, model: nn.Module, optimizer: Any, scaler: Any = None
) -> str:
    """Write this rank's local parameters, inner optimizer, scaler and CO2 state (no collective);
    return the file's name."""
    os.makedirs(directory, exist_ok=True)
    state = {
        "co2": co2.state_dict(),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
    }
    torch.save(state, rank_file(directory, rank))
    return RANK_FILE.format(rank=rank)


def read_rank_state(
    directory: str, rank: int, world_size: int, *, require_manifest: bool = True, verify: bool = True
) -> dict[str, Any]:
    """This rank's file of a checkpoint; refuse clearly when the checkpoint cannot resume exactly.

    ``require_manifest=False`` also accepts a folder written without `publish` (a plain
    ``accelerator.save_state``), checked by counting its rank files. ``verify=False`` skips the
    checksums (sizes are still checked): for a caller that verified this folder just before.
    """
    check_rank_state(directory, rank, world_size, require_manifest=require_manifest, verify=verify)
    return load_rank_file(directory, rank)


def load_rank_file(directory: str, rank: int, *, mmap: bool = False) -> dict[str, Any]:
    """``torch.load`` of a rank file with ``weights_only=True``; ``ValueError`` naming it when it holds
    anything but tensors and plain data (a pickled object would run code: it is never unpickled).
    ``mmap``: map the tensors' bytes instead of reading them (`check_complete` checks the structure
    of the file so, at the cost of its small pickle only)."""
    path = rank_file(directory, rank)
    bounded.check_torch_file(path, where=f"checkpoint {directory}")  # nothing it could expand to is read
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"checkpoint {directory}: {os.path.basename(path)} holds something other than tensors and plain data "
            f"(a CO2 rank file never does), so it is not loaded: nothing in it was run. {publish.first_line(error)}"
        ) from None
    if not (isinstance(state, dict) and {"co2", "model", "optimizer", "scaler"} <= set(state)):
        raise ValueError(f"checkpoint {directory}: {os.path.basename(path)} is not a CO2 rank file")
    return state


def check_rank_state(
    directory: str, rank: int, world_size: int, *, require_manifest: bool = True, verify: bool = True
) -> None:
    """`read_rank_state`'s checks, without reading the tensors (the rank file's structure is checked)."""
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint {directory} does not exist (or is not a folder)")
    if require_manifest or os.path.lexists(os.path.join(directory, MANIFEST_FILE)):
        check_complete(directory, rank, world_size, verify=verify)
        return
    found = glob.glob(os.path.join(directory, RANK_FILE.format(rank="*")))
    if not found:
        raise ValueError(_no_co2_state(directory))
    _check_world_size(directory, len(found), world_size)
    bounded.check_torch_files(directory, sorted(os.listdir(directory)))  # Accelerate's files too
    load_rank_file(directory, rank, mmap=True)


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
            f"{world_size}: an exact CO2 resume needs the same world size (the Trainer resumes on another "
            "one with --co2_elastic true: docs/reliability.md, 'Losing a node')"
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


def anchor_under_keys(keys: Any, anchor: dict[str, Tensor]) -> OrderedDict[str, Tensor]:
    """The anchor (`anchor_for_saving`) under a wrapped model's state-dict ``keys`` (DDP's
    ``module.`` prefix), as an OrderedDict like a module's state dict: a framework that drops tied
    duplicates from one (Accelerate) then does so here too."""
    return OrderedDict((key, anchor[_unwrapped_key(key, anchor)]) for key in keys)


def _unwrapped_key(key: str, anchor: dict) -> str:
    """State-dict key of the wrapped model (``module.`` from DDP) -> key of the unwrapped one."""
    while key not in anchor and "." in key:
        key = key.split(".", 1)[1]
    return key


# ---------------------------------------------------------------------- checks before resuming


def check_shared(directory: str, *, verify: bool = True) -> dict[str, Any]:
    """The validated manifest of ``directory``, every listed file's size, and (``verify``) the checksums
    of the files every rank reads (all but the rank files); ``ValueError`` naming the problem."""
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint {directory} does not exist (or is not a folder)")
    if not os.path.lexists(os.path.join(directory, MANIFEST_FILE)):
        if not glob.glob(os.path.join(directory, RANK_FILE.format(rank="*"))):
            raise ValueError(_no_co2_state(directory))
        raise ValueError(
            f"checkpoint {directory} is incomplete: it has no {MANIFEST_FILE}, so its save did not "
            "finish (or it was copied from a staging folder). Resume from an earlier checkpoint."
        )
    manifest = read_manifest(directory)
    for key, entry in manifest["ranks"].items():
        if entry["file"] != RANK_FILE.format(rank=key):
            named = entry["file"]
            raise ValueError(f"checkpoint {directory}: its {MANIFEST_FILE} names {named!r} as rank {key}'s file")
    check_files(directory, manifest)
    rank_files = {entry["file"] for entry in manifest["ranks"].values()}
    shared = [name for name in manifest["files"] if name not in rank_files]
    if verify:
        verify_checksums(directory, manifest, shared)
    bounded.check_torch_files(directory, shared)  # the framework's files, before the framework loads them
    return manifest


def check_complete(
    directory: str,
    rank: int,
    world_size: int,
    *,
    step: int | None = None,
    verify: bool = True,
    sources: list[int] | None = None,
    manifest: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Refuse, with a message saying why, a checkpoint that cannot resume this rank exactly, or whose
    rank files hold anything but tensors and plain data (read with ``weights_only=True``, mapped).

    ``verify``: also compare the checksums of the files this rank reads (see the module docstring).
    ``sources``: resuming on another world size (`elastic_sources`), the saved ranks whose files this
    rank reads instead of its own; the world size may then differ. ``manifest``: `check_shared`'s,
    when the caller ran it already (the shared files are then not checked again).
    """
    if manifest is None:
        manifest = check_shared(directory, verify=verify)
    if sources is None:
        _check_world_size(directory, manifest["world_size"], world_size)
    if not manifest["ranks"]:
        raise ValueError(_no_co2_state(directory))
    reads = [rank] if sources is None else sources
    missing = [r for r in reads if str(r) not in manifest["ranks"]]
    if missing:
        raise ValueError(
            f"checkpoint {directory} holds the CO2 state of ranks {sorted(map(int, manifest['ranks']))} "
            f"only, not of rank(s) {missing} that rank {rank} reads: with save_on_each_node every node "
            "keeps its own ranks' files; resume with the same ranks on the same nodes"
            + ("" if sources is None else ", or gather every node's co2_rank files into one folder first")
        )
    if step is not None and manifest["step"] != step:
        raise ValueError(f"checkpoint {directory} mixes steps: its manifest says {manifest['step']}, not {step}")
    if verify:
        verify_checksums(directory, manifest, [manifest["ranks"][str(r)]["file"] for r in reads])
    for r in reads:  # here, so that a hostile file is refused on every rank before anything loads
        load_rank_file(directory, r, mmap=True)
    return manifest
