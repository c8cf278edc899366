"""What checkpoint checksums cost on this machine: seconds per GB hashed, and their share of a save
and of a load of a checkpoint file of realistic size.

    python scripts/checksum_cost.py --mb 1024 --repeats 3    # a table, then one JSON line

A file of ``--mb`` MB of fp32 tensors (like a ``co2_rank{r}.pt``) is written with ``torch.save``,
hashed, loaded with ``torch.load`` and hashed again, ``--repeats`` times, the candidate hashes
interleaved in each repeat (the fastest repeat is reported: the machine's other load only slows
runs down). The file is read from the page cache right after it was written, as ``publish`` does
at a save; a resume from a cold cache reads it from disk, where each hash adds one read of the
file at the disk's speed (dropping the cache needs root; not measured here).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import tempfile
import time
import zlib

import torch

from co2_hf.checkpoints import manifest

CANDIDATES = ("sha256", "blake2b", "sha1", "crc32")


def streamed(path: str, algorithm: str) -> str:
    """The same streaming as `manifest.file_checksum`, for each candidate."""
    buffer = bytearray(manifest.CHECKSUM_BLOCK)
    view = memoryview(buffer)
    crc, digest = 0, None if algorithm == "crc32" else hashlib.new(algorithm)
    with open(path, "rb", buffering=0) as f:
        while read := f.readinto(buffer):
            if digest is None:
                crc = zlib.crc32(view[:read], crc)
            else:
                digest.update(view[:read])
    return f"{crc:08x}" if digest is None else digest.hexdigest()


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def measure(directory: str, mb: int, repeats: int) -> dict:
    tensors = max(1, mb // 64)  # 64 MB tensors, like a model's larger parameters
    state = {f"t{i}": torch.randn(mb * 2**20 // 4 // tensors) for i in range(tensors)}
    path = os.path.join(directory, "co2_rank0.pt")
    best: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, float("inf")), seconds)

    for _ in range(repeats):
        keep("torch.save", timed(torch.save, state, path))
        keep("file_checksum after save", timed(manifest.file_checksum, path))
        for algorithm in CANDIDATES:
            keep(algorithm, timed(streamed, path, algorithm))
        keep("torch.load", timed(torch.load, path, "cpu"))
        keep("file_checksum after load", timed(manifest.file_checksum, path))
    size_gb = os.path.getsize(path) / 1e9
    # the leader also hashes the model (4 bytes per parameter in fp32, against about 24 in a rank
    # file) and rank 0's AdamW state (8): one after the other, or a few at a time (`_checksums`)
    names = ["co2_rank0.pt", "model.safetensors", "optimizer.pt"]
    for name, share in zip(names[1:], (4 / 24, 8 / 24)):
        torch.save({k: v[: int(v.numel() * share)].clone() for k, v in state.items()}, os.path.join(directory, name))
    for _ in range(repeats):
        keep("leader, one at a time", sum(timed(manifest.file_checksum, os.path.join(directory, n)) for n in names))
        keep("leader, threaded", timed(manifest._checksums, directory, names))
    leader_gb = sum(os.path.getsize(os.path.join(directory, n)) for n in names) / 1e9
    for name in names:
        os.remove(os.path.join(directory, name))
    hash_s = best["file_checksum after save"]
    return {
        "file_gb": round(size_gb, 3),
        "repeats": repeats,
        "cpu": platform.processor() or platform.machine(),
        "s_per_gb": {a: round(best[a] / size_gb, 3) for a in CANDIDATES},
        "mb_per_s": {a: round(size_gb * 1e3 / best[a]) for a in CANDIDATES},
        "chosen": manifest.CHECKSUM,
        "save_s": round(best["torch.save"], 3),
        "hash_s": round(hash_s, 3),
        "save_overhead": round(hash_s / best["torch.save"], 3),
        "load_s": round(best["torch.load"], 3),
        "verify_s": round(best["file_checksum after load"], 3),
        "load_overhead": round(best["file_checksum after load"] / best["torch.load"], 3),
        "leader_files_gb": round(leader_gb, 3),
        "leader_sequential_s": round(best["leader, one at a time"], 3),
        "leader_threaded_s": round(best["leader, threaded"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=1024, help="size of the checkpoint file, MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write it (default: the temp folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        result = measure(directory, args.mb, args.repeats)
    for algorithm in CANDIDATES:
        print(f"{algorithm:8s} {result['mb_per_s'][algorithm]:6d} MB/s  {result['s_per_gb'][algorithm]:.3f} s/GB")
    print(
        f"{result['file_gb']} GB file: torch.save {result['save_s']} s + {manifest.CHECKSUM} {result['hash_s']} s "
        f"({100 * result['save_overhead']:.0f}%); torch.load {result['load_s']} s + verify {result['verify_s']} s "
        f"({100 * result['load_overhead']:.0f}%)"
    )
    print(
        f"leader's rank file + model + optimizer ({result['leader_files_gb']} GB): one at a time "
        f"{result['leader_sequential_s']} s, {manifest.HASH_THREADS} threads {result['leader_threaded_s']} s"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
