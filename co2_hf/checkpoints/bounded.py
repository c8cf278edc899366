"""Bounded loads: what ``torch.load`` may read from a checkpoint file, checked before it reads it.

The manifest (``publish.py``) fixes each file's size on disk, but a file's size says nothing of what
it expands to (issue 42: a 2 MB ``optimizer.pt`` whose zip entry is deflate-compressed inflated to 2
GiB on each rank, and a 98 KB ``co2_rank1.pt`` whose ``data.pkl`` inflated to 100 MB of pickle
opcodes kept `checkpoint.check_complete` busy for 123 s and 1.1 GB while the other ranks waited).
``torch.save`` writes a zip of *stored* (uncompressed) entries, so what it wrote never expands:
`check_torch_file` refuses, from the zip's central directory alone (nothing is inflated or
unpickled), any file ``torch.load`` would read that is not such a zip, whose entries are compressed,
whose entries add up to more than the file holds (overlapping entries: the same bytes loaded many
times over), or whose pickle is larger than its entries need (`PICKLE_BASE_BYTES`,
`PICKLE_BYTES_PER_ENTRY`).

Every file CO2, the Trainer or Accelerate loads with ``torch.load`` goes through it before anything
of the checkpoint is loaded (`TORCH_FILES`: the rank files, ``optimizer.pt``, ``scheduler.pt``, the
RNG states, ``scaler.pt``, Accelerate's ``*.bin`` and ``random_states_*.pkl``).

Every JSON file CO2 reads from a checkpoint (``co2_manifest.json``, ``co2_config.json``, and
``trainer_state.json`` before the Trainer reads it) goes through `read_json` (issue 49: a 36 MB
``trainer_state.json`` took 1.43 GB per rank, and a deeply nested one a bare RecursionError): a
regular file no larger than the cap its caller derives from what the file can hold, nested no deeper
than `MAX_JSON_DEPTH` (counted on the text, without recursion, before it is parsed).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import stat
import zipfile
from typing import Any

# the names the Trainer, Accelerate and CO2 read with torch.load (safetensors and JSON bound themselves)
TORCH_FILES = ("*.pt", "*.pth", "*.bin", "*.pkl")
# A pickle holds the structure: names, numbers and one small record per tensor, each with a storage
# entry of its own in the zip (86 bytes a tensor measured for a model and its AdamW state, names
# included; 118 per fragment for CO2's state with 2,000 fragments). So a pickle may take 1 MiB plus 1
# KiB per entry: a hostile one can then cost no more than the file's own entries pay for (a 98 KB file
# about 2 MiB), where the weights-only unpickler spends 1-2 s per MiB of hostile opcodes and some 70
# bytes of memory per byte here (`python scripts/bounded_load_cost.py`: 8 MiB took 9.0 s and 594 MB).
PICKLE_BASE_BYTES = 1 << 20
PICKLE_BYTES_PER_ENTRY = 1 << 10


def is_torch_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(os.path.basename(name), pattern) for pattern in TORCH_FILES)


def check_torch_file(path: str, *, where: str) -> None:
    """Refuse, with a ``ValueError`` naming ``where`` and the file, a file that ``torch.load`` could
    expand past its own size (see the module docstring); read nothing but its zip directory."""
    name, size = os.path.basename(path), os.path.getsize(path)
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"{where}: {name} is not a zip of torch.save (the only format CO2 loads: an older or foreign "
            "format can declare tensors of any size), so it is not loaded"
        )
    with zipfile.ZipFile(path) as archive:
        entries = archive.infolist()
    total, pickle_cap = 0, PICKLE_BASE_BYTES + PICKLE_BYTES_PER_ENTRY * len(entries)
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.compress_size != entry.file_size:
            raise ValueError(
                f"{where}: {name} holds a compressed entry ({entry.filename}: {entry.compress_size} bytes that "
                f"would expand to {entry.file_size}); torch.save stores its entries uncompressed, so this file was "
                "not written by it, and it is not loaded: nothing was inflated"
            )
        if entry.filename.endswith("data.pkl") and entry.file_size > pickle_cap:
            raise ValueError(
                f"{where}: {name}'s pickle ({entry.filename}) is {entry.file_size} bytes, more than the {pickle_cap} "
                f"the structure of {len(entries)} entries needs, so it is not read"
            )
        total += entry.file_size
    if total > size:
        raise ValueError(
            f"{where}: {name}'s entries add up to {total} bytes but the file holds {size}: entries overlap (the same "
            "bytes would be loaded again and again), so it is not loaded"
        )


def check_torch_files(directory: str, names: list[str]) -> None:
    """`check_torch_file` of each of ``names`` (relative to ``directory``) that ``torch.load`` reads."""
    for name in names:
        if is_torch_file(name):
            check_torch_file(os.path.join(directory, name), where=f"checkpoint {directory}")


# The files CO2 writes nest 4 levels at most (the manifest's files, a Trainer state's callbacks'
# arguments); 32 leaves room for a callback's own state and stays far from the parser's recursion.
MAX_JSON_DEPTH = 32
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a string's brackets are not nesting
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


def read_json(directory: str, name: str, *, max_bytes: int, why: str) -> Any:
    """``name`` of checkpoint ``directory``, parsed: a ``ValueError`` naming both where it is not a
    regular file, is over ``max_bytes`` (``why``: what the file can need), nests deeper than
    `MAX_JSON_DEPTH` or is not JSON."""
    path, where = os.path.join(directory, name), f"checkpoint {directory}: its {name}"
    try:
        mode = os.lstat(path)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {directory} has no {name}") from None
    if not stat.S_ISREG(mode.st_mode):
        raise ValueError(f"{where} is not a regular file, so it is not read")
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"{where} is over {max_bytes} bytes, more than it can need ({why}), so it is not read")
    if _nesting(raw) > MAX_JSON_DEPTH:
        raise ValueError(
            f"{where} nests deeper than {MAX_JSON_DEPTH} levels (CO2 and the Trainer write 4 at most), so it "
            "is not parsed"
        )
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:  # not UTF-8 or not JSON
        raise ValueError(f"checkpoint {directory} is corrupted: its {name} is not valid JSON ({error})") from None


def _nesting(raw: bytes) -> int:
    """How deep ``raw``'s brackets nest outside strings (stops counting past `MAX_JSON_DEPTH`)."""
    depth = 0
    for bracket in _JSON_BRACKET.finditer(_JSON_STRING.sub(b'""', raw)):
        depth += 1 if bracket.group() in (b"[", b"{") else -1
        if depth > MAX_JSON_DEPTH:
            break
    return depth
