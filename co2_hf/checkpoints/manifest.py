"""The manifest of a checkpoint folder: every file with its size and SHA-256, written when a save
is published (``publish.py``) and checked before anything of the folder is read on resume.

What the manifest guarantees: **damage, not tampering.** It sits in the folder it describes, so it
catches a truncated, missing or corrupted file (a bad copy, bit rot), and a save that did not finish;
whoever can write the folder can rewrite the manifest too. What makes a folder from elsewhere safe to
resume from is that nothing in it is unpickled: every file CO2, the Trainer and Accelerate read on
resume is loaded with ``weights_only=True`` or is safetensors/JSON. `read_manifest` validates the
manifest itself before using it (structure, relative names of regular files inside the folder, a
checksum for each); `check_files` checks the files' sizes and that nothing unlisted is there, `verify_checksums` the
checksums of the files a rank reads; ``agreement.py`` makes every rank refuse when one does.

Checksums: SHA-256, streamed in 4 MiB blocks (``python scripts/checksum_cost.py``: 1.56 GB/s on one
core here, against 0.87 GB/s for BLAKE2b; in the standard library, and ``sha256sum`` checks a file by
hand; CRC-32 is twice as fast but an error-detecting code, not a content identity).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import bounded

MANIFEST_FILE = "co2_manifest.json"
MANIFEST_FORMAT = 2  # every file with its bytes and sha256 (format 1, bytes only, is refused)
CHECKSUM = "sha256"
CHECKSUM_BLOCK = 4 << 20  # bytes read per update: large enough that the hash, not Python, is the cost
HASH_THREADS = 4  # files hashed at once by one rank (the leader's several, or a resume's)
MAX_MANIFEST_BYTES = 16 << 20  # a real one is a few KB; more is not a manifest (or /dev/zero)
MANIFEST_NEEDS = "about 200 bytes per file listed: 16 MiB is some 80,000 files"
RUN_ID = re.compile(r"[0-9a-f]{16}")  # a run's id, and a save's (publish.py, "Runs")
_HEX = re.compile(r"[0-9a-f]{64}")


# ---------------------------------------------------------------------- writing


def write_manifest(staging: str, ranks: list[dict], *, world_size: int, step: int, run: str) -> None:
    """``co2_manifest.json`` of a fully written ``staging`` folder, flushed with every file and folder
    in it. ``ranks``: what each rank publishing through this leader reported of the file it wrote
    (its size, and its checksum when it hashed it itself)."""
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
        "files": describe_files(staging, reported),  # flushes every file it hashes
    }
    tmp = os.path.join(staging, MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(staging, MANIFEST_FILE))
    for folder, _, _ in os.walk(staging):  # the entries (names) are data too
        fsync_dir(folder)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    fsync_file(directory)  # a folder is flushed through a read-only descriptor too (POSIX)


# ---------------------------------------------------------------------- reading


def read_manifest(directory: str) -> dict[str, Any]:
    """The validated manifest of ``directory``; ``ValueError`` naming the problem otherwise."""
    # the manifest has no checksum of its own: its size, depth and syntax are checked as it is read
    manifest = bounded.read_json(directory, MANIFEST_FILE, max_bytes=MAX_MANIFEST_BYTES, why=MANIFEST_NEEDS)
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise ValueError(
            f"checkpoint {directory}: its {MANIFEST_FILE} is not a valid co2_hf manifest ({problem}); it is "
            "written by co2_hf when a save completes, and is never edited by hand"
        )
    return manifest


def saved_run(directory: str) -> str | None:
    """The run that saved ``directory`` (``publish.py``, "Runs"); None when the folder has no manifest
    (a plain ``accelerator.save_state``) or its co2_hf did not record runs."""
    if not os.path.lexists(os.path.join(directory, MANIFEST_FILE)):
        return None
    return read_manifest(directory).get("run")


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
    if not is_count(manifest["step"], 0) or not is_count(manifest["world_size"], 1):
        return "step must be an integer >= 0 and world_size an integer >= 1"
    if "run" in manifest and not (isinstance(manifest["run"], str) and RUN_ID.fullmatch(manifest["run"])):
        return "run must be 16 hexadecimal digits"
    files, ranks = manifest["files"], manifest["ranks"]
    if not isinstance(files, dict) or not files:
        return "files must be a non-empty object"
    for name, entry in files.items():
        if not safe_name(name):
            return f"file name {name!r} is not a relative path inside the folder"
        if not (isinstance(entry, dict) and is_count(entry.get("bytes"), 0) and _is_sha(entry.get(CHECKSUM))):
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


def is_count(value: Any, minimum: int) -> bool:
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
    unlisted = sorted(files_under(directory, hidden=False) - set(files) - {MANIFEST_FILE})
    links = [name for name in unlisted if os.path.islink(os.path.join(directory, name))]
    if links:
        target = os.path.realpath(os.path.join(directory, links[0]))
        raise ValueError(
            f"checkpoint {directory}: {links[0]} is a link to {target} that its {MANIFEST_FILE} does not list "
            f"(links: {', '.join(links[:3])}): a checkpoint holds its own files, and what a link reaches could "
            "be loaded on resume unverified. Remove the link, or resume from a copy of the checkpoint as it was saved"
        )
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


def describe(path: str) -> dict[str, Any]:
    """Size and checksum of a file this rank wrote, once it is on disk (flushed first)."""
    fsync_file(path)
    return {"bytes": os.path.getsize(path), CHECKSUM: file_checksum(path)}


def describe_files(directory: str, reported: dict[str, dict]) -> dict[str, dict]:
    """Every file under ``directory``, with its size and checksum: as its rank reported it, or
    flushed and hashed here."""
    names = sorted(files_under(directory, hidden=True))
    todo = [name for name in names if CHECKSUM not in reported.get(name, {})]
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        described = dict(zip(todo, pool.map(lambda name: describe(os.path.join(directory, name)), todo)))
    return {name: described[name] if name in described else reported[name] for name in names}


def files_under(directory: str, *, hidden: bool) -> set[str]:
    """Relative names of the files and links under ``directory``, links to folders included (os.walk
    lists them as folders and does not enter them: ``extra -> /etc`` would otherwise go unseen);
    ``hidden=False`` skips names and folders starting with "." (a Hub download's .cache,
    .gitattributes), which nothing loads."""
    found = set()
    for root, dirs, files in os.walk(directory):
        if not hidden:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files = [f for f in files if not f.startswith(".")]
        linked = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        found.update(os.path.relpath(os.path.join(root, f), directory).replace(os.sep, "/") for f in files + linked)
    return found
