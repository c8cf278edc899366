"""What a hostile checkpoint file costs to load, and what refusing it costs (co2_hf/checkpoints/bounded.py).

Two files of the forms issue 42 found: a zip whose pickle entry is deflate-compressed zeros (it
inflates to ``--inflate_mib``), and a stored zip whose pickle is ``--pickle_mib`` of opcodes that each
build an object. Each is loaded the way CO2 loaded a rank file before the check
(``torch.load(..., weights_only=True, mmap=True)``) and checked by `bounded.check_torch_file`, each in
a fresh process, which reports its seconds and its peak memory (max RSS). Prints one JSON line.

    python scripts/bounded_load_cost.py --inflate_mib 1024 --pickle_mib 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile

MEASURE = """
import resource, sys, time
action, path = sys.argv[1], sys.argv[2]
import torch
from co2_hf.checkpoints import bounded
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
try:
    if action == "load":
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    else:
        bounded.check_torch_file(path, where="measured")
    outcome = "loaded"
except Exception as error:
    outcome = type(error).__name__
seconds = time.perf_counter() - start
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(f"{outcome} {seconds:.3f} {grown:.0f}")
"""


def write_inflating(path: str, mib: int) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("bomb/data.pkl", "w", force_zip64=True) as f:
            for _ in range(mib):
                f.write(bytes(1 << 20))
        archive.writestr("bomb/version", "3\n")


def write_pickle(path: str, mib: int) -> None:
    size = mib << 20
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("bomb/data.pkl", b"\x80\x02(" + b"]" * (size - 5) + b"l.")  # MARK, EMPTY_LISTs, LIST
        archive.writestr("bomb/version", "3\n")


def measure(action: str, path: str) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, action, path], capture_output=True, text=True, check=True)
    outcome, seconds, grown = done.stdout.split()
    return {"outcome": outcome, "seconds": float(seconds), "peak_mb_above_start": float(grown)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inflate_mib", type=int, default=1024)
    parser.add_argument("--pickle_mib", type=int, default=8)
    a = parser.parse_args(argv)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, write, mib in (
            ("inflating", write_inflating, a.inflate_mib),
            ("pickle", write_pickle, a.pickle_mib),
        ):
            path = os.path.join(tmp, f"{name}.pt")
            write(path, mib)
            result[name] = {"file_bytes": os.path.getsize(path), "mib": mib}
            result[name].update({action: measure(action, path) for action in ("load", "check")})
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
