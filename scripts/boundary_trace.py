"""What each of CO2's boundary events costs in operations, host reads and memory traffic, on one process.

    python scripts/boundary_trace.py                       # every setting below
    python scripts/boundary_trace.py --settings streaming paper --width 256 --depth 4

For each setting (tau 12, clipping on) it builds the ~10M-parameter MLP of ``scripts/time_boundary.py``
(one worker: every all-reduce is the identity, so what is counted is the engine's own work), runs one
untimed round, then traces every ``co2.step()`` of the next round with ``co2_hf.testing.DispatchTrace`` and prints one
line per step that ran an event: the events (``B3``: fragment 3's boundary, ``A2``: fragment 2's
in-round apply), the operations dispatched, the host reads (a GPU's host would wait there: the
engine's target is 0), the bytes read and written, and the same traffic in fp32 **words per element**
of the fragments involved, beside the minimum that ``docs/algorithm.md`` ("Passes over the state")
derives for those events: what a single fused kernel would still have to read and write.

The traffic is counted from the tensors each operation takes and returns, views excluded: an upper
bound of what the memory sees (a GPU's caches, or a chunk that fits the CPU's, make it less). The
last line per setting sums the round. ``--json`` prints the rows as JSON lines instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if not __package__:  # run as a file: import the package `scripts` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from co2_hf import CO2, CO2Config  # noqa: E402
from co2_hf.core.schedule import Event, Plan  # noqa: E402
from co2_hf.testing import DispatchTrace  # noqa: E402
from scripts.time_boundary import model_of  # noqa: E402

# at tau 12: the defaults (12 streaming fragments), one fragment, the paper's form, no overlap
SETTINGS = {
    "streaming": {},
    "streaming_nesterov": dict(co2_nesterov=True),
    "one_fragment": dict(co2_fragments=1),
    "paper": dict(co2_fragments=1, co2_start_rule="anchor", co2_gap_penalty=1.0, co2_outer_momentum=0.2),
    "synchronous": dict(co2_fragments=1, co2_overlap=False),
}


def minimum_words(plan: Plan, config: CO2Config, event: Event, *, applies: bool) -> int:
    """The fp32 words per element of a fragment that ``event`` must read and write at least, fused
    into one pass (``docs/algorithm.md``, "Passes over the state"). ``applies``: a received D is
    applied in it (a boundary of full overlap or without overlap, an in-round apply)."""
    offset = plan.start_rule != "anchor"  # the start rule keeps an offset o
    lookahead = plan.start_rule == "lookahead"
    words = 0
    if event is Event.BOUNDARY:
        # d = a - o - x into the buffer, the reset x <- a' - o': R x, a, [o, m]; W d, x, [o]
        words += 4 + (2 if offset else 0) + (1 if lookahead else 0)
    if applies:
        words += 3  # R D, R m, W m: the momentum
        words += 1 if plan.penalty == "gap_aware" else 0  # the per-tensor mean |D| before P: R D once more
        words += 2 if config.co2_clip_threshold is not None else 0  # ||m'|| is known after m' is: R m', W m'
        words += 1  # W a (a boundary reads a already)
        if event is Event.APPLY_IN_ROUND:
            words += 1 + 2 + (2 if offset else 0)  # R a; the shift: R x, W x; R o, W o (cleared)
    return words


def trace_setting(name: str, *, width: int, depth: int) -> list[dict]:
    """One round of ``name``'s events after an untimed round: a row per step that ran any."""
    cfg = CO2Config(**{"co2_local_steps": 12, "co2_clip_threshold": 10.0, **SETTINGS[name]})
    model = model_of(width, depth)
    co2 = CO2(model, cfg)
    params, plan = list(model.parameters()), co2.plan
    edges = co2.layout.fragment_edges
    tau = cfg.co2_local_steps
    rows = []
    for step in range(2 * tau):
        with torch.no_grad():
            torch._foreach_add_(params, 1e-4 * (1 if step % 2 else -1))
        due = plan.due(co2.round_step + 1) if co2.warmup_done else ()
        trace = DispatchTrace()
        trace(co2.step)
        if step < tau or not due:
            continue
        numel = sum(edges[f + 1] - edges[f] for _, f in due)
        applies = [e is Event.APPLY_IN_ROUND or not plan.overlapped or plan.window_steps is None for e, _ in due]
        minimum = sum(
            minimum_words(plan, cfg, event, applies=a) * (edges[f + 1] - edges[f])
            for (event, f), a in zip(due, applies)
        )
        rows.append(
            {
                "setting": name,
                "step": step + 1,
                "events": " ".join(("B" if e is Event.BOUNDARY else "A") + str(f) for e, f in due),
                "ops": len(trace.ops),
                "host_reads": len(trace.reads),
                "mb_read": trace.bytes_read / 1e6,
                "mb_written": trace.bytes_written / 1e6,
                "words_per_element": (trace.bytes_read + trace.bytes_written) / 4 / numel,
                "minimum_words": minimum / numel,
            }
        )
    return rows


def summary(rows: list[dict]) -> dict:
    """The round's totals: operations, host reads, traffic, and the ratio of traffic to the minimum."""
    words = sum(r["words_per_element"] * 1 for r in rows)
    minimum = sum(r["minimum_words"] for r in rows)
    return {
        "setting": rows[0]["setting"] if rows else "",
        "ops": sum(r["ops"] for r in rows),
        "host_reads": sum(r["host_reads"] for r in rows),
        "mb_moved": sum(r["mb_read"] + r["mb_written"] for r in rows),
        "traffic_vs_minimum": words / minimum if minimum else float("nan"),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    args = parser.parse_args(argv)
    out = []
    for name in args.settings:
        rows = trace_setting(name, width=args.width, depth=args.depth)
        out += rows
        for r in rows:
            if args.json:
                print(json.dumps(r))
            else:
                print(
                    f"{name:18} step {r['step']:3} {r['events']:8} ops {r['ops']:4}  host reads {r['host_reads']}  "
                    f"read {r['mb_read']:8.1f} MB  written {r['mb_written']:8.1f} MB  "
                    f"words/element {r['words_per_element']:5.1f} (minimum {r['minimum_words']:4.1f})"
                )
        s = summary(rows)
        print(
            json.dumps(s)
            if args.json
            else f"# {name}: a round: {s['ops']} ops, {s['host_reads']} host reads, "
            f"{s['mb_moved']:.0f} MB moved, {s['traffic_vs_minimum']:.2f} x the minimum traffic"
        )
    return out


if __name__ == "__main__":
    main()
