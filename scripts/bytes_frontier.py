"""The bytes frontier: final loss against bytes sent per worker per step, for every method and wire.

    python scripts/bytes_frontier.py --run --jobs 2          # run what is missing, then plot
    python scripts/bytes_frontier.py                        # plot from results/*.jsonl as they are

One command: with ``--run`` it runs, through scripts/sim_sweep.py (micro model, tau 12, 4 workers),
every (configuration, seed, budget) of `FRONTIER` that no results/*.jsonl line holds yet, appending
to results/frontier_micro.jsonl; then it writes docs/bytes_frontier.png (one panel per budget, bytes
on a log axis) and docs/bytes_frontier.md (the table). Losses are the mean over the seeds found.

Bytes are what one worker sends per inner step over ring collectives, computed from the engine's own
fragments for the micro model (`wire_bytes_per_step`): data parallel all-reduces the fp32 gradients
every step (``2 (G-1)/G x 4 P``); the outer methods one fp32, bf16 or coded outer gradient per tau
steps (the int8/int4 codes and the sparse payloads as ``core/codecs/`` sends them, with
the header; the sparse all-gather sends its payload to ``G - 1`` peers). tests/test_sparse.py checks
the sparse prediction against the bytes counted on the wire.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import multiprocessing as mp
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not __package__:
    sys.path.insert(0, str(ROOT))

from scripts import sim_sweep  # noqa: E402

# (label, sweep configuration) in the plot's legend order. f12_look_b2 is CO2Config() itself under
# another name (sim_sweep reproduces one with the other bit for bit), so its runs count as "co2".
FRONTIER = [
    ("data parallel", "dp"),
    ("blocking local SGD", "local_sgd"),
    ("SlowMo-style", "slowmo"),
    ("CO2 fp32", "co2"),
    ("CO2 bf16", "co2_bf16"),
    ("CO2 int8", "co2_int8"),
    ("CO2 int4", "co2_int4"),
    # the sparse wire with plain error feedback (co2_sparse_keep_unsent=False) ...
    ("CO2 sparse 2/256 2-bit, plain EF", "co2_sparse_k2_b2"),
    ("CO2 sparse 4/256 2-bit, plain EF", "co2_sparse_k4_b2"),
    ("CO2 sparse 4/256 4-bit, plain EF", "co2_sparse_k4_b4"),
    ("CO2 sparse 8/256 2-bit, plain EF", "co2_sparse_k8_b2"),
    ("CO2 sparse 4/256 2-bit, plain EF, beta 0", "co2_sparse_k4_b2_m0"),
    # ... and with each worker's model keeping its unsent progress (co2_sparse_keep_unsent=True)
    ("CO2 sparse 2/256 2-bit, keep unsent", "co2_sparse_k2_b2_keep"),
    ("CO2 sparse 3/256 2-bit, keep unsent", "co2_sparse_k3_b2_keep"),
    ("CO2 sparse 4/256 2-bit, keep unsent", "co2_sparse_k4_b2_keep"),
    ("CO2 sparse 8/256 2-bit, keep unsent", "co2_sparse_k8_b2_keep"),
]
ALIASES = {"f12_look_b2": "co2"}
BUDGETS = {600: 50, 2400: 200}  # steps -> eval_every, as the earlier sweeps ran them
SEEDS, TAU, WORKERS, MODEL = (0, 1, 2), 12, 4, "micro"


def wire_bytes_per_step(config_name: str, *, workers: int = WORKERS, tau: int = TAU) -> float:
    """Bytes one worker sends per inner step with ``config_name`` on the micro model (module docstring)."""
    from co2_hf import CO2Config
    from co2_hf.core import CO2
    from co2_hf.core.wire import header_numel
    from co2_hf.testing import FakeCommunicator

    model = sim_sweep.make_task(MODEL, 10, 0).build_model(0)
    ring = 2 * (workers - 1) / workers
    overrides = sim_sweep.CONFIGS[config_name]
    if overrides is None:  # data parallel: the fp32 gradients, every step
        return ring * 4 * sum(p.numel() for p in model.parameters())
    config = CO2Config(**{"co2_local_steps": tau, **overrides})
    engine = CO2(model, config, communicator=FakeCommunicator(num_workers=workers))
    h, per_round = header_numel(workers), 0.0
    for fragment in engine.fragments:
        n, codec = fragment.layout.shard_numel, fragment.codec
        if codec is None:  # fp32 or bf16: the buffer, header included, all-reduced
            per_round += ring * (2 if config.bfloat16_wire else 4) * (n + h)
        else:  # int8/int4: all-to-all and all-gather of the codes, the header; sparse: an all-gather
            per_round += codec.sent_nbytes(workers, h)
    return per_round / tau


def load_runs(paths: list[str]) -> dict[tuple[str, int], dict[int, float]]:
    """(configuration, steps) -> {seed: final loss} over every line of ``paths`` at tau 12, 4 workers, micro."""
    runs: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for path in paths:
        for line in open(path):
            run = json.loads(line)
            if (run.get("tau"), run.get("workers"), run.get("model")) != (TAU, WORKERS, MODEL):
                continue
            name = ALIASES.get(run["config"], run["config"])
            runs[(name, run["steps"])].setdefault(run["seed"], run["final_val_loss"])
    return runs


def run_missing(runs: dict, jobs: int, out: Path) -> None:
    """Run every frontier (configuration, seed, budget) not in ``runs``, appending to ``out``."""
    todo = [
        dict(config=name, seed=seed, steps=steps, tau=TAU, workers=WORKERS, model=MODEL, eval_every=every)
        for steps, every in BUDGETS.items()
        for _, name in FRONTIER
        for seed in SEEDS
        if seed not in runs.get((name, steps), {})
    ]
    print(f"{len(todo)} runs missing", flush=True)
    sim_sweep.corpus_blocks()
    with mp.get_context("spawn").Pool(jobs) as pool:
        for line in pool.imap_unordered(sim_sweep.run_one, todo):
            with open(out, "a") as f:
                f.write(json.dumps(line) + "\n")
            print(json.dumps({k: line[k] for k in ("config", "seed", "steps", "final_val_loss")}), flush=True)


def table(runs: dict, nbytes: dict[str, float]) -> str:
    fp32 = nbytes["co2"]
    lines = [
        "| method | bytes / worker / step | vs CO2 fp32 | "
        + " | ".join(f"{s} steps: loss (seeds) | vs CO2 fp32" for s in BUDGETS)
        + " |",
        "|---|---|---|" + "---|---|" * len(BUDGETS),
    ]
    for label, name in FRONTIER:
        ratio = fp32 / nbytes[name]
        versus = "1" if name == "co2" else (f"{ratio:.1f}x fewer" if ratio >= 1 else f"{1 / ratio:.1f}x more")
        cells = [label, f"{nbytes[name]:,.0f}", versus]
        for steps in BUDGETS:
            mine, base = runs.get((name, steps), {}), runs.get(("co2", steps), {})
            if not mine:
                cells += ["not run", "-"]
                continue
            mean = sum(mine.values()) / len(mine)
            shared = [s for s in mine if s in base]  # paired seeds only
            ratio = sum(mine[s] for s in shared) / sum(base[s] for s in shared) if shared else math.nan
            cells += [f"{mean:.4f} ({len(mine)})", f"{ratio:.4f}" if shared else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: dict, nbytes: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(BUDGETS), figsize=(12, 7.5))
    for ax, steps in zip(axes, BUDGETS):
        for index, (label, name) in enumerate(FRONTIER):
            mine = runs.get((name, steps), {})
            if not mine:
                continue
            losses = list(mine.values())
            mean = sum(losses) / len(losses)
            marker = "o"
            if "sparse" in name:
                marker = "D" if name.endswith("_keep") else "s"
            elif name in ("dp", "local_sgd", "slowmo"):
                marker = "^"
            ax.errorbar(
                nbytes[name],
                mean,
                yerr=[[mean - min(losses)], [max(losses) - mean]],
                fmt=marker,
                capsize=3,
                color=plt.cm.tab20(index),  # one colour per method in both panels
                label=f"{label} ({len(losses)} seeds)",
            )
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per worker per inner step (log)")
        ax.set_ylabel("final validation loss")
        ax.set_title(f"{steps} steps, tau {TAU}, {WORKERS} workers (micro GPT-2)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)  # no point hidden
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="store_true", help="run the missing (configuration, seed, budget) first")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--results", nargs="+", default=sorted(glob.glob(str(ROOT / "results" / "*.jsonl"))))
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "frontier_micro.jsonl")
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "bytes_frontier.png")
    parser.add_argument("--table", type=Path, default=ROOT / "docs" / "bytes_frontier.md")
    args = parser.parse_args()
    runs = load_runs(args.results)
    if args.run:
        run_missing(runs, args.jobs, args.out)
        runs = load_runs(sorted(set(args.results) | {str(args.out)}))
    nbytes = {name: wire_bytes_per_step(name) for _, name in FRONTIER}
    text = table(runs, nbytes)
    args.table.write_text(
        "# The bytes frontier (micro GPT-2, tau 12, 4 simulated workers)\n\n"
        "Written by `python scripts/bytes_frontier.py` from results/*.jsonl; the plot is "
        "docs/bytes_frontier.png. Loss: mean over the seeds run (in brackets); vs CO2 fp32: the ratio of "
        "summed final losses over the seeds both have.\n\n" + text
    )
    plot(runs, nbytes, args.png)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
