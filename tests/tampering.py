"""What a hostile or careless party does to a checkpoint folder, for the tests that check CO2
refuses it (tests/test_trust.py, tests/test_accelerate.py, tests/test_reliability.py): a payload
that runs code when unpickled, and a manifest rewritten to match a changed folder."""

from __future__ import annotations

import json
import os

from co2_hf.integrations import publish


class Payload:
    """Unpickled, it creates the folder ``marker``: the proof that code from a checkpoint ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def rewrite_manifest(folder: str, change) -> None:
    """What an attacker (or a careless script) does: change the folder, then make the manifest match."""
    path = os.path.join(folder, publish.MANIFEST_FILE)
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
            manifest["files"][name] = {"bytes": os.path.getsize(path), "sha256": publish.file_checksum(path)}
        for entry in manifest["ranks"].values():
            entry["bytes"] = manifest["files"][entry["file"]]["bytes"]
        return manifest

    return change
