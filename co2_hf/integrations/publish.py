"""Publishing a checkpoint folder atomically and durably, and the manifest that guards it on resume.

Framework-neutral: the Trainer (``trainer.py``) and Accelerate (``accelerate.py``) both save through
it; what goes into the folder is theirs and ``checkpoint.py``'s. A save is collective:

1. `begin_save`: the leader (global rank 0; with per-node disks each node's local rank 0) checks
   the target (absent, empty, or a checkpoint of this same run holding only the files its manifest
   lists: anything else is refused, as CO2 would replace it whole), clears what killed saves of the
   same run left, and makes a staging folder unique to this run and save beside the target, on its
   filesystem: ``<parent>/_co2_staging/<name>.<run>.<token>/<name>``; every rank learns the folder,
   or the leader's error, from one all-gather;
2. every rank writes its files there;
3. `publish`: each rank flushes its own rank file to disk and hashes it (the rank files are most of
   the bytes: the hashing is spread over the ranks); an all-gather of what each wrote; the leader
   flushes and hashes the other files, writes ``co2_manifest.json`` (every file with its size and
   SHA-256, the step, the world size, each rank's file, the run), flushes the folder, renames it to its final
   name (an older copy of the same checkpoint moved aside first, removed after) and flushes the
   parent; an all-gather of the outcome, so that every rank raises if the leader failed.

A process killed or a machine losing power at any point leaves the previous checkpoints as they
were; the Trainer's rotation deletes an older checkpoint only after `publish` returned, that is once
the new one is on disk. Nothing is ever removed that CO2 did not write: a target folder holding
other files is refused, and only this run's own staged folders (``<pattern>.<run>.<token>``) are
cleared.

Runs. A run is a training run across its launches: a random id (`new_run_id`), which a resume takes
over from the checkpoint it resumes (the manifest records it). Two runs that share a folder leave
each other alone: each clears only its own killed saves (another run's save in progress is never
touched), and neither publishes over a checkpoint the other wrote (refused, naming both runs).

What the manifest guarantees: **damage, not tampering.** It sits in the folder it describes, so it
catches a truncated, missing or corrupted file (a bad copy, bit rot), and a save that did not finish;
whoever can write the folder can rewrite the manifest too. What makes a folder from elsewhere safe to
resume from is that nothing in it is unpickled: every file CO2, the Trainer and Accelerate read on
resume is loaded with ``weights_only=True`` or is safetensors/JSON. `read_manifest` validates the
manifest itself before using it (structure, relative names of regular files inside the folder, a
checksum for each); `check_files` checks the files' sizes and that nothing unlisted is there, `verify_checksums` the
checksums of the files a rank reads; `agree`
makes every rank refuse when one does, at once; `agree_on_checkpoint` makes the ranks resume from the
same step and the same manifest.

Checksums: SHA-256, streamed in 4 MiB blocks (``python scripts/checksum_cost.py``: 1.56 GB/s on one
core here, against 0.87 GB/s for BLAKE2b; in the standard library, and ``sha256sum`` checks a file by
hand; CRC-32 is twice as fast but an error-detecting code, not a content identity).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch.distributed as dist

MANIFEST_FILE = "co2_manifest.json"
# Saves in progress. The leading "_" keeps it out of the Trainer's Hub uploads of output_dir, and it
# does not match "checkpoint-*", so neither get_last_checkpoint nor rotation ever sees it.
STAGING_DIR = "_co2_staging"
MANIFEST_FORMAT = 2  # every file with its bytes and sha256 (format 1, bytes only, is refused)
CHECKSUM = "sha256"
CHECKSUM_BLOCK = 4 << 20  # bytes read per update: large enough that the hash, not Python, is the cost
HASH_THREADS = 4  # files hashed at once by one rank (the leader's several, or a resume's)
MAX_MANIFEST_BYTES = 16 << 20  # a real one is a few KB; more is not a manifest (or /dev/zero)
REPLACED = ".replaced"  # an older copy of the target, moved aside during the rename
_TOKEN = re.compile(r"[0-9a-f]{16}")  # a run's id, and a save's
_HEX = re.compile(r"[0-9a-f]{64}")

logger = logging.getLogger(__name__)
T = TypeVar("T")


# ---------------------------------------------------------------------- saving


def new_run_id() -> str:
    """The id of a new run (see the module docstring, "Runs")."""
    return uuid.uuid4().hex[:16]


def begin_save(final_dir: str, *, rank: int, leader: int, run: str, leftovers: str | None = None) -> str:
    """Check the target, clear this run's leftovers, stage; return the folder every rank writes into.

    Collective. ``leader``: the rank that publishes this rank's copy (see the module docstring).
    ``run``: this run's id (`new_run_id`, or the one of the checkpoint it resumed). ``leftovers``: a
    glob of the names whose staged saves of this run are cleared, when a killed save left them
    (default: ``final_dir``'s own name only). Raises ``ValueError`` on every rank, saying why, when
    the target cannot be replaced or the staging folder cannot be made.
    """
    parent, name = os.path.split(os.path.abspath(final_dir))
    outcome: tuple[str, str]
    if rank == leader:
        try:
            check_replaceable(final_dir, run=run)
            area = os.path.join(parent, STAGING_DIR)
            _clear_leftovers(area, leftovers or glob_escape(name), run=run)
            staging = os.path.join(area, f"{name}.{run}.{new_run_id()}", name)
            os.makedirs(staging)
            outcome = ("ok", staging)
        except ValueError as error:
            outcome = ("error", str(error))
        except OSError as error:
            outcome = ("error", _cannot_stage(final_dir, parent, error))
    else:
        outcome = ("follower", "")
    status, value = _all_gather(outcome)[leader]
    if status == "error":
        raise ValueError(value)
    if rank != leader:
        os.makedirs(value, exist_ok=True)  # with per-node disks it is made on this node's own
    return value


@contextlib.contextmanager
def writing(final_dir: str, staging: str) -> Iterator[None]:
    """Around the writing of a save's files into ``staging``: a full disk (or quota) says so, naming
    the folder, instead of the writer's own words (``torch.save``'s is ``[enforce fail at
    inline_container.cc:672] unexpected pos``). Nothing is published, so the previous checkpoints stay
    as they were; the partial save is this run's to clear at its next save."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        free = _free_bytes(staging)
        if not (_no_space(error) or (free is not None and free < FULL_BYTES)):
            raise
        raise OSError(
            errno.ENOSPC,
            f"CO2 could not save {final_dir}: the disk that holds it is full ({free} bytes free; "
            f"{type(error).__name__}: {first_line(error)}). Nothing was published: the previous checkpoints "
            f"are untouched; the partial save is in {os.path.dirname(staging)} (delete it, or let a later save of "
            "this run clear it). Free some space (save_total_limit keeps fewer checkpoints), or save elsewhere",
        ) from error


FULL_BYTES = 1 << 20  # free space below which a failed write is taken for a full disk


def _no_space(error: BaseException) -> bool:
    """``ENOSPC`` or ``EDQUOT`` anywhere in the exception's chain (``torch.save`` reports no errno: a
    full disk is then told by the free space left, `FULL_BYTES`)."""
    chain: BaseException | None = error
    while chain is not None:
        if isinstance(chain, OSError) and chain.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        chain = chain.__cause__ or chain.__context__
    return False


def _free_bytes(folder: str) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def first_line(error: BaseException) -> str:
    """An error's message, its first line only (torch's carry a C++ trace after it)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _cannot_stage(final_dir: str, parent: str, error: OSError) -> str:
    return (
        f"CO2 cannot save {final_dir}: it writes a checkpoint into {os.path.join(parent, STAGING_DIR)} "
        f"(beside it, on the same filesystem) and renames it into place once complete, and that failed: "
        f"{error}. Make {parent} writable, or save into a folder whose parent is."
    )


def check_replaceable(final_dir: str, *, run: str) -> None:
    """Refuse a target that publishing would replace with loss: anything but nothing, an empty
    folder, or a CO2 checkpoint of run ``run`` whose files are all listed in its manifest."""
    if not os.path.lexists(final_dir):
        return
    if os.path.islink(final_dir) or not os.path.isdir(final_dir):
        kind = "a symbolic link" if os.path.islink(final_dir) else "a file"
        raise ValueError(f"CO2 cannot save into {final_dir}: it is {kind}; pass a folder path")
    if os.path.ismount(final_dir):
        raise ValueError(
            f"CO2 cannot save into {final_dir}: it is a mount point, and CO2 publishes a checkpoint by "
            "renaming a complete folder onto its path; save into a folder inside it"
        )
    present = _files_under(final_dir, hidden=True)
    if not present:
        return
    try:
        manifest = read_manifest(final_dir)
    except ValueError:
        manifest = None
    listed = set(manifest["files"]) | {MANIFEST_FILE} if manifest is not None else set()
    others = sorted(present - listed)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ValueError(
            f"CO2 will not save into {final_dir}: it holds files CO2 did not write there ({shown}), and a "
            "checkpoint is published by replacing the whole folder. Save into a new or empty folder, or "
            "move those files out"
        )
    if manifest.get("run") != run:
        raise ValueError(_another_runs(final_dir, manifest, run))


def _another_runs(final_dir: str, manifest: dict[str, Any], run: str) -> str:
    theirs = f"run {manifest['run']}" if "run" in manifest else "a run of a co2_hf that did not record runs"
    return (
        f"CO2 will not save {final_dir}: it is a checkpoint of another run ({theirs}, step {manifest['step']}), "
        f"and this is run {run}. Two runs writing into one folder would replace each other's checkpoints: give "
        "each run its own output folder, resume this run from that checkpoint (it then continues that run), "
        "or move the checkpoint out"
    )


def _clear_leftovers(area: str, pattern: str, *, run: str) -> None:
    """Remove staged folders ``<name>.<run>.<token>`` of this run whose name matches ``pattern``:
    its saves killed before they were published (nothing else in the staging area is touched)."""
    if not os.path.isdir(area):
        return
    for entry in os.listdir(area):
        name, owner, token = staged_parts(entry)
        if owner == run and fnmatch.fnmatchcase(name, pattern):
            shutil.rmtree(os.path.join(area, entry), ignore_errors=True)


def staged_parts(entry: str) -> tuple[str, str | None, str | None]:
    """(name, run, token) of a staged folder's name ``<name>.<run>.<token>``; (entry, None, None) for
    anything else."""
    name, _, rest = entry.rpartition(".")
    name, _, owner = name.rpartition(".")
    if name and _TOKEN.fullmatch(owner) and _TOKEN.fullmatch(rest):
        return name, owner, rest
    return entry, None, None


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def publish(
    staging: str, final_dir: str, *, rank: int, leader: int, world_size: int, step: int, own: str, run: str
) -> None:
    """Make a fully written staging folder visible as ``final_dir``; collective (module docstring).
    ``own``: the name of the file this rank wrote and hashes itself (absent: nothing to report);
    ``run``: the run `begin_save` staged it for."""
    path = os.path.join(staging, own)
    mine = {"rank": rank, "leader": leader, "files": {}}
    if os.path.exists(path):
        # the leader hashes its own with the framework's files, concurrently (`_describe_files`)
        mine["files"][own] = {"bytes": os.path.getsize(path)} if rank == leader else _describe(path)
    reports = _all_gather(mine)
    outcome = "ok"
    if rank == leader:
        try:
            ranks = [r for r in reports if r["leader"] == rank]
            _write_manifest(staging, ranks, world_size=world_size, step=step, run=run)
            _rename(staging, final_dir, run=run)
        except (OSError, ValueError) as error:
            outcome = f"CO2: the checkpoint {final_dir} was not published by rank {rank}: {error}"
    failures = [o for o in _all_gather(outcome) if o != "ok"]
    if failures:
        raise RuntimeError(failures[0])


def _write_manifest(staging: str, ranks: list[dict], *, world_size: int, step: int, run: str) -> None:
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
        "run": run,
        "ranks": rank_files,
        "files": _describe_files(staging, reported),  # flushes every file it hashes
    }
    tmp = os.path.join(staging, MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(staging, MANIFEST_FILE))
    for folder, _, _ in os.walk(staging):  # the entries (names) are data too
        fsync_dir(folder)


def _rename(staging: str, final_dir: str, *, run: str) -> None:
    """``staging`` -> ``final_dir``. A checkpoint of this run already there (a re-save of the same
    step) is moved aside first and removed after: between the two renames only the older checkpoints
    exist."""
    check_replaceable(final_dir, run=run)  # again: the folder may have changed (another run published)
    token_dir = os.path.dirname(staging)
    replaced = None
    if os.path.lexists(final_dir):
        replaced = staging + REPLACED
        os.replace(final_dir, replaced)
    os.replace(staging, final_dir)
    fsync_dir(os.path.dirname(os.path.abspath(final_dir)))
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(token_dir)
        os.rmdir(os.path.dirname(token_dir))  # other saves may still be staged there


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    fsync_file(directory)  # a folder is flushed through a read-only descriptor too (POSIX)


# ---------------------------------------------------------------------- resuming


def read_manifest(directory: str) -> dict[str, Any]:
    """The validated manifest of ``directory``; ``ValueError`` naming the problem otherwise."""
    path = os.path.join(directory, MANIFEST_FILE)
    try:
        mode = os.lstat(path)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {directory} has no {MANIFEST_FILE}") from None
    if not stat.S_ISREG(mode.st_mode) or mode.st_size > MAX_MANIFEST_BYTES:
        raise ValueError(f"checkpoint {directory}: its {MANIFEST_FILE} is not a regular file of a manifest's size")
    with open(path, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    try:
        manifest = json.loads(raw)
    except ValueError as error:  # not UTF-8 or not JSON: the manifest has no checksum of its own
        message = f"checkpoint {directory} is corrupted: its {MANIFEST_FILE} is not valid JSON ({error})"
        raise ValueError(message) from None
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise ValueError(
            f"checkpoint {directory}: its {MANIFEST_FILE} is not a valid co2_hf manifest ({problem}); it is "
            "written by co2_hf when a save completes, and is never edited by hand"
        )
    return manifest


def _manifest_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    missing = [k for k in ("format", "step", "world_size", "ranks", "files") if k not in manifest]
    if missing:
        return f"no {', '.join(missing)}"
    if manifest["format"] == 1:
        return (
            "format 1 lists sizes without checksums (co2_hf before checksums), so its files cannot be verified: "
            "resume it with the co2_hf release that saved it, or start a new run from its model with from_pretrained"
        )
    if manifest["format"] != MANIFEST_FORMAT:
        return f"format {manifest['format']!r}; this co2_hf reads format {MANIFEST_FORMAT}"
    if not _is_count(manifest["step"], 0) or not _is_count(manifest["world_size"], 1):
        return "step must be an integer >= 0 and world_size an integer >= 1"
    if "run" in manifest and not (isinstance(manifest["run"], str) and _TOKEN.fullmatch(manifest["run"])):
        return "run must be 16 hexadecimal digits"
    files, ranks = manifest["files"], manifest["ranks"]
    if not isinstance(files, dict) or not files:
        return "files must be a non-empty object"
    for name, entry in files.items():
        if not safe_name(name):
            return f"file name {name!r} is not a relative path inside the folder"
        if not (isinstance(entry, dict) and _is_count(entry.get("bytes"), 0) and _is_sha(entry.get(CHECKSUM))):
            return f"{name!r} needs its bytes and its {CHECKSUM}"
    if not isinstance(ranks, dict):
        return "ranks must be an object"
    for key, entry in ranks.items():
        if not (key.isdigit() and int(key) < manifest["world_size"] and isinstance(entry, dict)):
            return f"rank {key!r} is not a rank of a world of {manifest['world_size']}"
        name = entry.get("file")
        if not (isinstance(name, str) and name in files and files[name]["bytes"] == entry.get("bytes")):
            return f"rank {key}'s file {name!r} is not among the files, with the same bytes"
    return None


def safe_name(name: Any) -> bool:
    """A relative, normalised path with no way out of its folder."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name or name.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _is_count(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_sha(value: Any) -> bool:
    return isinstance(value, str) and _HEX.fullmatch(value) is not None


def check_files(directory: str, manifest: dict[str, Any]) -> None:
    """Every listed file is a regular file inside ``directory`` with its size, and no file that is
    not listed could be loaded instead; ``ValueError`` naming the file."""
    files, real = manifest["files"], os.path.realpath(directory)
    for name, entry in files.items():  # sizes first: cheap, and a truncated file says so
        path = os.path.join(directory, name)
        if os.path.lexists(path) and os.path.realpath(path) != os.path.join(real, name):
            target = os.path.realpath(path)
            raise ValueError(f"checkpoint {directory}: {name} is a link to {target}, not a file of the folder")
        mode = os.lstat(path) if os.path.lexists(path) else None
        if mode is not None and not stat.S_ISREG(mode.st_mode):
            raise ValueError(f"checkpoint {directory}: {name} is not a regular file")
        if mode is None or mode.st_size != entry["bytes"]:
            found = "is missing" if mode is None else f"has {mode.st_size} bytes"
            raise ValueError(
                f"checkpoint {directory} is incomplete or was changed after it was saved: {name} "
                f"{found}, its {MANIFEST_FILE} says {entry['bytes']} bytes"
            )
    unlisted = sorted(_files_under(directory, hidden=False) - set(files) - {MANIFEST_FILE})
    if unlisted:
        raise ValueError(
            f"checkpoint {directory} has files its {MANIFEST_FILE} does not list ({', '.join(unlisted[:3])}): they "
            "were added after the save, and could be loaded on resume unverified. Remove them, or resume from "
            "a copy of the checkpoint as it was saved"
        )


def verify_checksums(directory: str, manifest: dict[str, Any], names: list[str]) -> None:
    """The files ``names`` (checked by `check_files` before) have their listed checksums."""
    files = manifest["files"]
    for name, found in zip(names, _checksums(directory, names)):
        expected = files[name][CHECKSUM]
        if found != expected:
            raise ValueError(
                f"checkpoint {directory} is corrupted: {name} has {CHECKSUM} {found} but its "
                f"{MANIFEST_FILE} says {expected} (same size, other bytes: a bad copy or a "
                "disk error). Resume from another checkpoint, or copy this one again from its source."
            )


def manifest_digest(directory: str) -> str:
    """SHA-256 of the manifest's bytes: the identity of a checkpoint, which the ranks compare."""
    return file_checksum(os.path.join(directory, MANIFEST_FILE))


def agree(check: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``check(*args, **kwargs)`` on every rank; when it raises on any rank, raise ``ValueError`` on
    every rank, at once.

    Collective. A rank that refused a checkpoint alone would leave the others to train into their
    first collective and stop only at the timeout, with an error that says nothing of the file. Any
    exception counts (a file that cannot be read is as final as one that does not verify)."""
    try:
        result, error = check(*args, **kwargs), None
    except ValueError as refused:
        result, error = None, str(refused)
    except Exception as failed:  # noqa: BLE001 - reported on every rank, with its type
        result, error = None, f"{type(failed).__name__}: {failed}"
    errors = [(r, e) for r, e in enumerate(_all_gather(error)) if e is not None]
    if error is not None:
        raise ValueError(error)
    if errors:
        r, other = errors[0]
        raise ValueError(f"rank {r} refused the checkpoint: {other}")
    return result


def agree_on_checkpoint(directory: str, *, step: int | None, digest: str, leader: int) -> None:
    """Every rank resumes from the same step, and the ranks of one leader (one disk) from the same
    manifest; else ``ValueError`` on every rank. Per-node disks can hold different checkpoints under
    one name. Collective."""
    seen = _all_gather((step, digest, leader))
    steps = {s for s, _, _ in seen}
    if len(steps) > 1:
        where = ", ".join(f"rank {r}: step {s}" for r, (s, _, _) in enumerate(seen))
        raise ValueError(
            f"the ranks would resume {directory} from different steps ({where}): each disk holds another checkpoint"
        )
    for r, (_, other, lead) in enumerate(seen):
        if lead == leader and other != digest:
            raise ValueError(
                f"the ranks would resume {directory} from different checkpoints: rank {r}'s {MANIFEST_FILE} "
                "differs from this rank's, although they share a disk"
            )


# ---------------------------------------------------------------------- checksums and files


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
    """Size and checksum of a file this rank wrote, once it is on disk (flushed first)."""
    fsync_file(path)
    return {"bytes": os.path.getsize(path), CHECKSUM: file_checksum(path)}


def _describe_files(directory: str, reported: dict[str, dict]) -> dict[str, dict]:
    """Every file under ``directory``, with its size and checksum: as its rank reported it, or
    flushed and hashed here."""
    names = sorted(_files_under(directory, hidden=True))
    todo = [name for name in names if CHECKSUM not in reported.get(name, {})]
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        described = dict(zip(todo, pool.map(lambda name: _describe(os.path.join(directory, name)), todo)))
    return {name: described[name] if name in described else reported[name] for name in names}


def _files_under(directory: str, *, hidden: bool) -> set[str]:
    """Relative names of the files (and links) under ``directory``; ``hidden=False`` skips names
    and folders starting with "." (a Hub download's .cache, .gitattributes), which nothing loads."""
    found = set()
    for root, dirs, files in os.walk(directory):
        if not hidden:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files = [f for f in files if not f.startswith(".")]
        found.update(os.path.relpath(os.path.join(root, f), directory).replace(os.sep, "/") for f in files)
    return found


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
