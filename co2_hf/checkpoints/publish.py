"""Publishing a checkpoint folder atomically and durably.

Framework-neutral: the Trainer (``integrations/trainer.py``) and Accelerate
(``integrations/accelerate.py``) both save through it (`saving`); what goes into the folder is
theirs and ``rank_files.py``'s. A save is collective:

1. `begin_save`: the leader (global rank 0; with per-node disks each node's local rank 0) checks
   the target (absent, empty, or a checkpoint of this same run holding only the files its manifest
   lists: anything else is refused, as CO2 would replace it whole), clears what killed saves of the
   same run left, and makes a staging folder unique to this run and save beside the target, on its
   filesystem: ``<parent>/_co2_staging/<name>.<run>.<token>/<name>``; every rank learns the folder,
   or the leader's error, from one all-gather;
2. every rank writes its files there;
3. `publish`: each rank flushes its own rank file to disk and hashes it (the rank files are most of
   the bytes: the hashing is spread over the ranks); an all-gather of what each wrote; the leader
   flushes and hashes the other files, writes ``co2_manifest.json`` (``manifest.py``: every file
   with its size and SHA-256, the step, the world size, each rank's file, the run), flushes the
   folder, renames it to its final name (an older copy of the same checkpoint moved aside first,
   removed after) and flushes the parent; an all-gather of the outcome, so that every rank raises if the leader failed.

A process killed or a machine losing power at any point leaves the previous checkpoints as they
were; the Trainer's rotation deletes an older checkpoint only after `publish` returned, that is once
the new one is on disk. Nothing is ever removed that CO2 did not write: a target folder holding
other files is refused, and only this run's own staged folders (``<pattern>.<run>.<token>``) are
cleared.

Runs. A run is a training run across its launches: a random id (`new_run_id`), which a resume takes
over from the checkpoint it resumes (the manifest records it). Two runs that share a folder leave
each other alone: each clears only its own killed saves (another run's save in progress is never
touched), and neither publishes over a checkpoint the other wrote (refused, naming both runs),
unless the saving run holds the folder's lease (``lease.py``: ``sole_run``), which proves the other
is no longer alive: a rerun into a folder replaces the checkpoints it saves over, as the Trainer's.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

from .agreement import all_gather
from .manifest import MANIFEST_FILE, RUN_ID, describe, files_under, fsync_dir, read_manifest, write_manifest

# Saves in progress. The leading "_" keeps it out of the Trainer's Hub uploads of output_dir, and it
# does not match "checkpoint-*", so neither get_last_checkpoint nor rotation ever sees it.
STAGING_DIR = "_co2_staging"
REPLACED = ".replaced"  # an older copy of the target, moved aside during the rename


def new_run_id() -> str:
    """The id of a new run (see the module docstring, "Runs")."""
    return uuid.uuid4().hex[:16]


def begin_save(
    final_dir: str, *, rank: int, leader: int, run: str, leftovers: str | None = None, sole_run: bool = False
) -> str:
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
            check_replaceable(final_dir, run=run, sole_run=sole_run)
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
    status, value = all_gather(outcome)[leader]
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


def check_replaceable(final_dir: str, *, run: str, sole_run: bool = False) -> None:
    """Refuse a target that publishing would replace with loss: anything but nothing, an empty
    folder, or a CO2 checkpoint whose files are all listed in its manifest, of run ``run`` (or, with
    ``sole_run``, of a run that is no longer alive: a rerun replaces it, as the Trainer does)."""
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
    present = files_under(final_dir, hidden=True)
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
    if manifest.get("run") != run and not sole_run:
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
    if name and RUN_ID.fullmatch(owner) and RUN_ID.fullmatch(rest):
        return name, owner, rest
    return entry, None, None


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def publish(
    staging: str,
    final_dir: str,
    *,
    rank: int,
    leader: int,
    world_size: int,
    step: int,
    own: str,
    run: str,
    sole_run: bool = False,
) -> None:
    """Make a fully written staging folder visible as ``final_dir``; collective (module docstring).
    ``own``: the name of the file this rank wrote and hashes itself (absent: nothing to report);
    ``run``, ``sole_run``: as `begin_save` staged it."""
    path = os.path.join(staging, own)
    mine = {"rank": rank, "leader": leader, "files": {}}
    if os.path.exists(path):
        # the leader hashes its own with the framework's files, concurrently (`describe_files`)
        mine["files"][own] = {"bytes": os.path.getsize(path)} if rank == leader else describe(path)
    reports = all_gather(mine)
    outcome = "ok"
    if rank == leader:
        try:
            ranks = [r for r in reports if r["leader"] == rank]
            write_manifest(staging, ranks, world_size=world_size, step=step, run=run)
            _rename(staging, final_dir, run=run, sole_run=sole_run)
        except (OSError, ValueError) as error:
            outcome = f"CO2: the checkpoint {final_dir} was not published by rank {rank}: {error}"
    failures = [o for o in all_gather(outcome) if o != "ok"]
    if failures:
        raise RuntimeError(failures[0])


def _rename(staging: str, final_dir: str, *, run: str, sole_run: bool) -> None:
    """``staging`` -> ``final_dir``. A checkpoint of this run already there (a re-save of the same
    step) is moved aside first and removed after: between the two renames only the older checkpoints
    exist."""
    # again: the folder may have changed (another run published)
    check_replaceable(final_dir, run=run, sole_run=sole_run)
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
