"""Tables and plots of sim_sweep.py results.

    python scripts/plot_sweep.py results/screen_micro_600.jsonl --plot results/screen_micro_600.png

Prints a Markdown table (mean and spread over seeds of the final validation loss, ratio to the
SlowMo-style run of the same tau and model) and plots validation loss against step for the best
configuration of each family beside data parallel and SlowMo-style.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

FAMILIES = {  # prefix -> family label; the best of each family is plotted
    "dp": "data parallel",
    "slowmo": "SlowMo-style (sync)",
    "local_sgd": "local SGD (sync)",
    "diloco": "DiLoCo-style (sync)",
    "co2_": "overlapped, anchor start",
    "eager": "overlapped, eager start",
    "look": "overlapped, lookahead start (ours)",
    "win": "partial overlap window (ours)",
    "f": "streaming fragments (ours)",
}


def family(config: str) -> str:
    for prefix, label in FAMILIES.items():
        if config.startswith(prefix):
            return label
    return config


def load(paths: list[Path]) -> dict[tuple, list[dict]]:
    """Runs grouped by (model, steps, tau, config); a (config, seed) met twice (a screening file and
    a finalists file) counts once, the later line winning."""
    by_seed: dict[tuple, dict] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            run = json.loads(line)
            by_seed[(run["model"], run["steps"], run["tau"], run["config"], run["seed"])] = run
    runs = defaultdict(list)
    for key, run in by_seed.items():
        runs[key[:4]].append(run)
    return runs


def table(runs: dict[tuple, list[dict]]) -> str:
    rows = [
        "| model | steps | tau | config | final val loss (mean) | spread (min-max) | seeds | vs SlowMo "
        "| vs best sync | vs dp |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def mean_of(key) -> float:
        return statistics.fmean(r["final_val_loss"] for r in runs[key]) if key in runs else float("nan")

    for key in sorted(runs, key=lambda k: (k[0], k[1], k[2], statistics.fmean(r["final_val_loss"] for r in runs[k]))):
        model, steps, tau, config = key
        losses = [r["final_val_loss"] for r in runs[key]]
        mean = statistics.fmean(losses)
        # the better synchronous method of the cell: local SGD or SlowMo-style, whichever is lower
        sync = min((mean_of((model, steps, tau, m)) for m in ("slowmo", "local_sgd")), key=lambda v: (v != v, v))
        ratios = [mean / mean_of((model, steps, tau, m)) for m in ("slowmo",)] + [mean / sync]
        ratios.append(mean / mean_of((model, steps, tau, "dp")))
        rows.append(
            f"| {model} | {steps} | {tau} | {config} | {mean:.4f} | "
            f"{min(losses):.3f}-{max(losses):.3f} | {len(losses)} | " + " | ".join(f"{r:.3f}" for r in ratios) + " |"
        )
    return "\n".join(rows)


def plot(runs: dict[tuple, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({k[:3] for k in runs})
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 4.8), squeeze=False)
    for ax, (model, steps, tau) in zip(axes[0], groups):
        best: dict[str, tuple[float, str]] = {}
        for key, group in runs.items():
            if key[:3] != (model, steps, tau):
                continue
            mean = statistics.fmean(r["final_val_loss"] for r in group)
            label = family(key[3])
            if label not in best or mean < best[label][0]:
                best[label] = (mean, key[3])
        for i, (label, (_, config)) in enumerate(sorted(best.items())):
            group = runs[(model, steps, tau, config)]
            steps_axis = [s for s, _ in group[0]["history"]]
            mean = [statistics.fmean(r["history"][j][1] for r in group) for j in range(len(steps_axis))]
            ax.plot(steps_axis, mean, marker=".", color=f"C{i}", label=f"{label}: {config} (n={len(group)})")
        ax.set_xlabel("inner step")
        ax.set_ylabel("validation loss of the global model (nats/token)")
        ax.set_title(f"GPT-2 {model}, 4 simulated workers, tau {tau}, {steps} steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
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
