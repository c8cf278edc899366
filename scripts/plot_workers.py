"""The worker-count study: final loss against data parallel's, per method and number of workers.

    python scripts/plot_workers.py results/workers_micro_600.jsonl --plot results/workers_micro_600.png

Reads sim_sweep.py lines (each names its ``workers``) and prints a Markdown table per (model, steps,
tau): for each config and worker count the mean final validation loss over seeds and its ratio to
data parallel at the same global batch and AdamW lr ("dp") and to the best data-parallel run of the
cell (dp and the dp_lr* learning rates: the tuned baseline). The plot draws both ratios against the
number of workers (the tuned one only where a learning-rate grid ran), one line per config run at
two counts or more.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path


def load(paths: list[Path]) -> dict[tuple, list[float]]:
    """Final losses grouped by (model, steps, tau, workers, config); a (config, seed) met twice
    counts once, the later line winning."""
    by_seed: dict[tuple, float] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            run = json.loads(line)
            key = (run["model"], run["steps"], run["tau"], run.get("workers", 4), run["config"], run["seed"])
            by_seed[key] = run["final_val_loss"]
    runs = defaultdict(list)
    for key, loss in by_seed.items():
        runs[key[:5]].append(loss)
    return runs


def baselines(runs: dict[tuple, list[float]], cell: tuple) -> tuple[float, float]:
    """(dp at lr 1e-3, the best data-parallel learning rate) of one (model, steps, tau, workers); the
    best is NaN where no other learning rate ran, since dp alone is not a tuned baseline."""
    dp = {c: statistics.fmean(v) for (*k, c), v in runs.items() if tuple(k) == cell and c.startswith("dp")}
    return dp.get("dp", float("nan")), min(dp.values()) if len(dp) > 1 else float("nan")


def ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def table(runs: dict[tuple, list[float]]) -> str:
    out = []
    for setting in sorted({k[:3] for k in runs}):
        counts = sorted({k[3] for k in runs if k[:3] == setting})
        configs = sorted({k[4] for k in runs if k[:3] == setting})
        model, steps, tau = setting
        out.append(f"\n{model}, {steps} steps, tau {tau}: final validation loss, and / dp | / best dp lr")
        out.append("| config | " + " | ".join(f"{w} workers" for w in counts) + " |")
        out.append("|---|" + "---|" * len(counts))
        for config in configs:
            cells = []
            for w in counts:
                losses = runs.get((*setting, w, config))
                if not losses:
                    cells.append("")
                    continue
                dp, best = baselines(runs, (*setting, w))
                mean = statistics.fmean(losses)
                cells.append(f"{mean:.4f} ({ratio(mean / dp)} / {ratio(mean / best)}, n={len(losses)})")
            out.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def ratios(runs: dict[tuple, list[float]], setting: tuple, config: str, which: int) -> list[tuple[int, float]]:
    """(workers, mean loss / baseline) of one config, by worker count; ``which`` picks the baseline of
    `baselines` (0: dp, 1: tuned); counts where that baseline is missing are left out."""
    points = []
    for (*k, w, c), losses in sorted(runs.items()):
        base = baselines(runs, (*setting, w))[which] if tuple(k) == setting and c == config else math.nan
        if not math.isnan(base):
            points.append((w, statistics.fmean(losses) / base))
    return points


def plot(runs: dict[tuple, list[float]], path: Path) -> None:
    """One column per (model, steps, tau); the top row against dp at the same learning rate, the
    bottom against the tuned baseline (cells without a learning-rate grid are left out there)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({k[:3] for k in runs})
    fig, axes = plt.subplots(
        2, len(settings), figsize=(7 * len(settings), 9), squeeze=False, sharex=True, layout="constrained"
    )
    for column, setting in enumerate(settings):
        configs = sorted({k[4] for k in runs if k[:3] == setting})
        for which, label in enumerate(("dp (same learning rate)", "best data parallel")):
            ax = axes[which][column]
            for i, config in enumerate(configs):
                points = ratios(runs, setting, config, which)
                if len(points) < 2:  # a config run at one count only (a screen) is in the table, not drawn
                    continue
                # ten colours, then the same ten dashed: more lines than colours stay apart
                ax.plot(*zip(*points), marker="o", color=f"C{i % 10}", ls="-" if i < 10 else "--", label=config)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_ylabel(f"final validation loss / {label}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="upper left")
        axes[0][column].set_title(f"GPT-2 {setting[0]}, {setting[1]} steps, tau {setting[2]}")
        axes[1][column].set_xlabel("workers")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    runs = load(args.results)
    print(table(runs))
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
