"""Time `CO2` round boundaries on one process: what the engine itself costs, without any network.

A ~10M-parameter MLP, a single worker (every all-reduce is the identity, so the figure is the
boundary's own compute: the chunked passes over anchor, momentum and buffer, the penalty and the
resets), ``co2_local_steps=1`` so that every ``step()`` runs a boundary (``streaming``: the default
tau 12 in 12 fragments, every ``step()`` one fragment's apply and boundary). Between boundaries the
live parameters take a small deterministic step outside the timed region, so every boundary has a
non-zero outer gradient. One JSON line per setting: the median seconds per boundary.

``--against TREE`` compares with another checkout of the project (e.g. ``git worktree add
/tmp/engine_old <commit>``): its ``co2_hf`` is loaded under another name in the same process, and
the two engines run their boundaries alternately, one each per iteration, on identical models, so
that the load of a shared machine falls on both alike; a second pass builds them in the other
order (the engine built first measured up to ~8% slower against an identical copy of itself).
Each line then gives both medians and the median of the paired ratios (this tree's boundary /
the other's boundary run next to it)::

    python scripts/time_boundary.py --against /tmp/engine_old --boundaries 30
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import co2_hf

SETTINGS = {
    "anchor": dict(co2_start_rule="anchor"),
    "eager": dict(co2_start_rule="eager"),
    "eager_gamma": dict(co2_start_rule="eager", co2_eager_weight=0.5),
    "lookahead": dict(co2_start_rule="lookahead", co2_outer_momentum=0.5),
    "constant_nesterov": dict(co2_gap_penalty_mode="constant", co2_gap_penalty=2.0, co2_nesterov=True),
    "synchronous": dict(co2_overlap=False, co2_outer_momentum=0.5),
    # the default: tau 12 in 12 fragments, so every step() is one fragment's apply and boundary
    "streaming": dict(co2_local_steps=12),
}


def model_of(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def load_other(tree: str):
    """The ``co2_hf`` package of another checkout, imported as ``co2_hf_other``."""
    init = Path(tree) / "co2_hf" / "__init__.py"
    spec = importlib.util.spec_from_file_location("co2_hf_other", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["co2_hf_other"] = module
    spec.loader.exec_module(module)
    return module


def time_setting(name: str, packages: list, *, width: int, depth: int, boundaries: int) -> list[list[float]]:
    """Seconds of each boundary of each package's engine, their boundaries alternating."""
    engines = []
    for package in packages:
        model = model_of(width, depth)
        cfg = package.CO2Config(**{"co2_local_steps": 1, "co2_clip_threshold": 10.0, **SETTINGS[name]})
        engines.append((package.CO2(model, cfg), [p for p in model.parameters()], []))
    # the first round and one more boundary warm up (no average yet, allocations)
    warm = max(2, cfg.co2_local_steps + 1)
    for i in range(boundaries + warm):
        for co2, params, seconds in engines if i % 2 else engines[::-1]:  # who goes first alternates
            with torch.no_grad():
                torch._foreach_add_(params, 1e-4 * (1 if i % 2 else -1))
            start = time.perf_counter()
            co2.step()
            seconds.append(time.perf_counter() - start)
    return [seconds[warm:] for _, _, seconds in engines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=10)  # 10 x (1024^2 + 1024): 10.5M parameters
    parser.add_argument("--boundaries", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--against", help="another checkout whose engine runs alternately (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    packages = [co2_hf] + ([load_other(args.against)] if args.against else [])
    params = sum(p.numel() for p in model_of(args.width, args.depth).parameters())
    for name in args.settings:
        sizes = dict(width=args.width, depth=args.depth, boundaries=args.boundaries)
        times = time_setting(name, packages, **sizes)
        if args.against:  # a second pass builds the other engine first: which is built first matters
            swapped = time_setting(name, packages[::-1], **sizes)
            times = [times[0] + swapped[1], times[1] + swapped[0]]
        row = {"setting": name, "params": params, "boundaries": len(times[0])}
        row["median_s"] = statistics.median(times[0])
        if args.against:  # each boundary against the other engine's boundary next to it in time
            paired = statistics.median(a / b for a, b in zip(*times))
            row.update(against=args.against, against_median_s=statistics.median(times[1]), paired_ratio=paired)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
