"""What a hostile or careless party does to a checkpoint folder, for the tests that check CO2
refuses it (tests/test_trust.py, tests/test_accelerate.py, tests/test_reliability.py): a payload
that runs code when unpickled, and a manifest rewritten to match a changed folder."""

from __future__ import annotations

import copy
import json
import os
import zipfile

from co2_hf.checkpoints.manifest import MANIFEST_FILE, file_checksum


class Payload:
    """Unpickled, it creates the folder ``marker``: the proof that code from a checkpoint ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def rewrite_manifest(folder: str, change) -> None:
    """What an attacker (or a careless script) does: change the folder, then make the manifest match."""
    path = os.path.join(folder, MANIFEST_FILE)
    with open(path) as f:
        manifest = json.load(f)
    manifest = change(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)


def rehash(folder: str):
    """A manifest change that records every listed file's current size and checksum."""

    def change(manifest):
        for name in manifest["files"]:
            path = os.path.join(folder, name)
            manifest["files"][name] = {"bytes": os.path.getsize(path), "sha256": file_checksum(path)}
        for entry in manifest["ranks"].values():
            entry["bytes"] = manifest["files"][entry["file"]]["bytes"]
        return manifest

    return change


def deflated(path: str, *, inflate_to: int = 0) -> None:
    """Rewrite a torch.save file with its entries deflate-compressed, and (``inflate_to``) its pickle
    padded with that many bytes of zeros, which deflate to almost nothing: a zip bomb."""
    with zipfile.ZipFile(path) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            with archive.open(name, "w", force_zip64=True) as f:
                f.write(data)
                for _ in range(inflate_to >> 20 if name.endswith("data.pkl") else 0):
                    f.write(bytes(1 << 20))


def pickle_bomb(path: str, size: int) -> None:
    """A stored (uncompressed) torch zip whose pickle is ``size`` bytes of opcodes, each building an
    object: cheap to store, slow and large to unpickle."""
    body = b"\x80\x02(" + b"]" * (size - 5) + b"l."  # MARK, many EMPTY_LIST, LIST, STOP
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("bomb/data.pkl", body)
        archive.writestr("bomb/byteorder", "little")
        archive.writestr("bomb/version", "3\n")


def overlapping(path: str, *, copies: int) -> None:
    """Make the largest entry of a zip appear ``copies`` times: the central directory gets records under
    new names that point at the same bytes (a loader would read them again and again)."""
    with zipfile.ZipFile(path, "a") as archive:
        largest = max(archive.infolist(), key=lambda info: info.file_size)
        for i in range(1, copies):
            alias = copy.copy(largest)
            alias.filename = alias.orig_filename = f"{largest.filename}_{i}"
            archive.filelist.append(alias)
            archive.NameToInfo[alias.filename] = alias
        archive._didModify = True  # rewrite the central directory on close, the aliases in it
