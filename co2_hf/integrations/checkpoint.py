"""Per-rank CO2 checkpoint files and atomic publishing, shared by the Trainer and Accelerate.

Frameworks save one copy of the model and rank 0's optimizer. Under CO2 that loses data: every
rank has its own local parameters, inner optimizer state (and AMP scaler) and its part of the outer
state. Each rank therefore writes ``co2_rank{r}.pt`` beside the framework's files, while the
framework's model files hold the anchor, the one consistent global model.

A checkpoint becomes visible only when complete (`begin_save`, then `publish`):

1. the leader (global rank 0; with per-node disks, each node's local rank 0) clears
   ``_co2_staging/`` next to the final folder; a barrier;
2. every rank writes its files into ``_co2_staging/<name>``;
3. every rank hashes its own ``co2_rank{r}.pt``; an all-gather of what each rank wrote (file,
   bytes, checksum) doubles as the barrier after writing;
4. the leader checks that every reported file is on its disk, hashes the other files of the folder
   (the framework's model, optimizer, scheduler, RNG and tokenizer files), writes
   ``co2_manifest.json`` (every file with its size and checksum, the world size, the step) and
   renames the folder to its final name;
5. an all-gather of the leaders' outcomes: every rank raises if any leader failed, and returns
   only once the checkpoint is visible.

A process killed at any point leaves the previous checkpoints as they were and, at worst, a
folder in ``_co2_staging/`` that the next save clears. `check_complete` refuses a folder whose
manifest is missing or does not match its files, the world size or the rank.

Checksums (silent corruption: a bad copy or bit rot keeps a file's size). Each file's SHA-256,
streamed in 4 MiB blocks into one buffer (`file_checksum`). Why SHA-256: measured with
``python scripts/checksum_cost.py`` (one core, from the page cache) it hashes at 1.56 GB/s here,
against 0.87 GB/s for BLAKE2b (OpenSSL uses the CPU's SHA instructions, where they exist); it is
in the standard library, and a user can check a file by hand with ``sha256sum``. CRC-32 (zlib) is
twice as fast (3.3 GB/s) but a 32-bit error-detecting code, not a content identity (one damaged
file in 4 billion passes); SHA-1 is as fast as SHA-256 here and broken. 0.64 s per GB hashed.

- Saving: the rank that wrote a ``co2_rank{r}.pt`` hashes it (the rank files are most of a
  checkpoint's bytes, so that cost is spread over the ranks and paid in parallel) and reports it
  with its size; the leader hashes the rest (which the framework wrote from rank 0: they are in
  its page cache) with its own rank file, `HASH_THREADS` files at a time.
- Resuming: each rank verifies the files it reads, before anything is loaded: its own rank file
  and every shared file (the model, optimizer, scheduler, RNG files), not the other ranks' rank
  files. The shared files are verified by every rank because every rank reads them (the Trainer
  and Accelerate load the model and optimizer on every process) and, with per-node disks, each
  node has its own copy; a few files at a time, as at a save. A mismatch raises ValueError
  naming the file, the expected and the found checksum (`agree` makes every rank raise it, not
  just the one that found it); a missing or truncated file is refused by its size first, as before.
- A manifest of format 1 (sizes only, co2_hf before checksums) is still accepted, with a WARNING
  that its files cannot be verified: refusing it would strand every run saved before the upgrade,
  and its sizes are still checked.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..config import CO2Config
from ..core import CO2, reshard

RANK_FILE = "co2_rank{rank}.pt"
CONFIG_FILE = "co2_config.json"
MANIFEST_FILE = "co2_manifest.json"
# Saves in progress. The leading "_" keeps it out of the Trainer's Hub uploads of output_dir, and
# it does not match "checkpoint-*", so neither get_last_checkpoint nor rotation ever sees it.
STAGING_DIR = "_co2_staging"
MANIFEST_FORMAT = 2  # 2: every file with its bytes and sha256; 1: bytes only
CHECKSUM = "sha256"
CHECKSUM_BLOCK = 4 << 20  # bytes read per update: large enough that the hash, not Python, is the cost
HASH_THREADS = 4  # files hashed at once by one rank (the leader's several, or a resume's)

logger = logging.getLogger(__name__)
T = TypeVar("T")


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


def read_rank_state(
    directory: str, rank: int, world_size: int, *, require_manifest: bool = True, verify: bool = True
) -> dict[str, Any]:
    """This rank's file of a checkpoint; refuse clearly when the checkpoint cannot resume exactly.

    ``require_manifest=False`` also accepts a folder written without `publish` (a plain
    ``accelerator.save_state``), checked by counting its rank files. ``verify=False`` skips the
    checksums (sizes are still checked): for a caller that verified this folder just before.
    """
    check_rank_state(directory, rank, world_size, require_manifest=require_manifest, verify=verify)
    return torch.load(rank_file(directory, rank), map_location="cpu", weights_only=False)


def check_rank_state(
    directory: str, rank: int, world_size: int, *, require_manifest: bool = True, verify: bool = True
) -> None:
    """`read_rank_state`'s checks, without loading anything."""
    if require_manifest or os.path.exists(os.path.join(directory, MANIFEST_FILE)):
        check_complete(directory, rank, world_size, verify=verify)
        return
    found = glob.glob(os.path.join(directory, RANK_FILE.format(rank="*")))
    if not found:
        raise ValueError(_no_co2_state(directory))
    _check_world_size(directory, len(found), world_size)


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
            "one with --co2_elastic true: README, 'Losing a node')"
        )


def apply_rank_state(state: dict[str, Any], *, co2: CO2, model: nn.Module, optimizer: Any, scaler: Any = None) -> None:
    """Restore what `save_rank_state` wrote; CO2's own checks refuse other settings first."""
    co2.load_state_dict(state["co2"])
    model.load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])


# ---------------------------------------------------------------------- another world size


def saved_world(directory: str) -> tuple[int, int]:
    """(world size, ``co2_worker_size``) of the run that saved ``directory``, from its config file."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(path):
        raise ValueError(
            f"checkpoint {directory} has no {CONFIG_FILE}, which records the world that saved it: it can "
            "only be resumed on the same world size"
        )
    with open(path) as f:
        saved = json.load(f)
    return saved["world_size"], saved["co2_worker_size"]


def elastic_sources(directory: str, rank: int, world_size: int, worker_size: int) -> list[int] | None:
    """The saved ranks whose files rank ``rank`` reads to resume on ``world_size`` processes of
    ``worker_size`` per worker: the processes of old worker ``w mod G`` for new worker ``w``
    (``core/reshard.py``). None when the checkpoint was saved by this very world: an exact resume."""
    saved_size, saved_k = saved_world(directory)
    if (saved_size, saved_k) == (world_size, worker_size):
        return None
    return reshard.source_ranks(saved_size // saved_k, saved_k, rank // worker_size)


def read_states(directory: str, ranks: list[int]) -> list[dict[str, Any]]:
    """The rank files of ``ranks`` (checked before by `check_complete` with ``sources=ranks``)."""
    return [torch.load(rank_file(directory, r), map_location="cpu", weights_only=False) for r in ranks]


def apply_resharded_state(states: list[dict[str, Any]], *, co2: CO2, optimizer: Any, scaler: Any = None) -> None:
    """Resume this rank from the files of another world's ranks (`elastic_sources`): CO2's state
    re-sharded, every live tensor restarted from the anchor with the received average applied (the
    saved local parameters are not used), the inner optimizer state of the source worker re-sharded,
    the first source rank's AMP scaler. Collective inside the worker."""
    reshard.load_resharded(co2, [s["co2"] for s in states])
    if optimizer is not None and states[0]["optimizer"] is not None:
        optimizer.load_state_dict(reshard.resharded_optimizer_state([s["optimizer"] for s in states], optimizer))
    if scaler is not None and states[0]["scaler"] is not None:
        scaler.load_state_dict(states[0]["scaler"])


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
    if os.path.exists(own):  # hashed by its writer: the ranks hash their files in parallel; the
        # leader's own is hashed with the framework's files, concurrently (`_describe_files`)
        mine["files"][os.path.basename(own)] = {"bytes": os.path.getsize(own)} if rank == leader else _describe(own)
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
    rank_files, reported = {}, {}
    for report in ranks:
        for name, entry in report["files"].items():
            path, size = os.path.join(staging, name), entry["bytes"]
            if not os.path.exists(path) or os.path.getsize(path) != size:
                raise ValueError(
                    f"rank {report['rank']}'s {name} ({size} bytes) is not in {staging} as seen from "
                    "here; if the nodes have their own disks, pass save_on_each_node=True so that "
                    "each node publishes its own copy"
                )
            rank_files[str(report["rank"])] = {"file": name, "bytes": size}
            reported[name] = entry
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "world_size": world_size,
        "ranks": rank_files,
        "files": _describe_files(staging, reported),
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


def check_complete(
    directory: str,
    rank: int,
    world_size: int,
    *,
    step: int | None = None,
    verify: bool = True,
    sources: list[int] | None = None,
) -> dict[str, Any]:
    """Refuse, with a message saying why, a checkpoint that cannot resume this rank exactly.

    ``verify``: also compare the checksums of the files this rank reads (see the module docstring).
    ``sources``: resuming on another world size (`elastic_sources`), the saved ranks whose files this
    rank reads instead of its own; the world size may then differ.
    """
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.exists(path):
        if not glob.glob(os.path.join(directory, RANK_FILE.format(rank="*"))):
            raise ValueError(_no_co2_state(directory))
        raise ValueError(
            f"checkpoint {directory} is incomplete: it has no {MANIFEST_FILE}, so its save did not "
            "finish (or it was copied from a staging folder). Resume from an earlier checkpoint."
        )
    with open(path) as f:
        try:
            manifest = json.load(f)
        except ValueError as error:  # not UTF-8 or not JSON: the manifest has no checksum of its own
            message = f"checkpoint {directory} is corrupted: its {MANIFEST_FILE} is not valid JSON ({error})"
            raise ValueError(message) from error
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
    files = {name: entry if isinstance(entry, dict) else {"bytes": entry} for name, entry in manifest["files"].items()}
    for name, entry in files.items():  # sizes first: cheap, and a truncated file says so
        file = os.path.join(directory, name)
        actual = os.path.getsize(file) if os.path.exists(file) else None
        if actual != entry["bytes"]:
            found = "is missing" if actual is None else f"has {actual} bytes"
            raise ValueError(
                f"checkpoint {directory} is incomplete or was changed after it was saved: {name} "
                f"{found}, its {MANIFEST_FILE} says {entry['bytes']} bytes"
            )
    if verify:
        old = manifest.get("format", 1) < 2
        _verify(directory, files, others=_other_rank_files(manifest, reads), old=old, rank=rank)
    return manifest


def _other_rank_files(manifest: dict[str, Any], reads: list[int]) -> set[str]:
    """The rank files this rank does not read (the ranks that read them verify them)."""
    return {entry["file"] for r, entry in manifest["ranks"].items() if int(r) not in reads}


def _verify(directory: str, files: dict[str, dict], *, others: set[str], old: bool, rank: int) -> None:
    if old:  # format 1: sizes only; say so rather than pass silently
        if rank == 0:
            logger.warning(
                "CO2: checkpoint %s has a %s of format 1 (sizes only, saved before co2_hf recorded "
                "checksums): its files are checked by size but a same-size corruption cannot be "
                "detected. The next checkpoints saved will carry %s checksums.",
                directory,
                MANIFEST_FILE,
                CHECKSUM,
            )
        return
    mine = [name for name in files if name not in others]
    for name, found in zip(mine, _checksums(directory, mine)):
        entry = files[name]
        if found != entry[CHECKSUM]:
            raise ValueError(
                f"checkpoint {directory} is corrupted: {name} has {CHECKSUM} {found} but its "
                f"{MANIFEST_FILE} says {entry[CHECKSUM]} (same size, other bytes: a bad copy or a "
                "disk error). Resume from another checkpoint, or copy this one again from its source."
            )


def agree(check: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``check(*args, **kwargs)`` on every rank; when it raises ValueError on any, raise on every rank.

    Collective. A rank that refused a checkpoint alone would leave the others to train into their
    first collective and stop only at the timeout, with an error that says nothing of the file.
    """
    try:
        result, error = check(*args, **kwargs), None
    except ValueError as refused:
        result, error = None, str(refused)
    errors = [(r, e) for r, e in enumerate(_all_gather(error)) if e is not None]
    if error is not None:
        raise ValueError(error)
    if errors:
        r, other = errors[0]
        raise ValueError(f"rank {r} refused the checkpoint: {other}")
    return result


def file_checksum(path: str) -> str:
    """The file's `CHECKSUM`, hex, read in `CHECKSUM_BLOCK` blocks into one reused buffer."""
    digest = hashlib.new(CHECKSUM)
    buffer = bytearray(CHECKSUM_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while read := f.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def _checksums(directory: str, names: list[str]) -> list[str]:
    """`file_checksum` of each file, a few at a time: hashlib releases the GIL while it hashes, so
    the rank file, the model and the optimizer cost the largest of them, not their sum."""
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        return list(pool.map(lambda name: file_checksum(os.path.join(directory, name)), names))


def _describe(path: str) -> dict[str, Any]:
    return {"bytes": os.path.getsize(path), CHECKSUM: file_checksum(path)}


def _describe_files(directory: str, reported: dict[str, dict]) -> dict[str, dict]:
    """Every file under ``directory``, with its size and checksum: as its rank reported it, or
    hashed here."""
    names = sorted(
        os.path.relpath(os.path.join(root, name), directory) for root, _, files in os.walk(directory) for name in files
    )
    todo = [name for name in names if CHECKSUM not in reported.get(name, {})]
    hashed = dict(zip(todo, _checksums(directory, todo)))
    return {
        name: {"bytes": os.path.getsize(os.path.join(directory, name)), CHECKSUM: hashed[name]}
        if name in hashed
        else reported[name]
        for name in names
    }


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
