"""Run the training methods of one recipe on the same budget and seeds, and compare them.

    python scripts/compare_methods.py --recipe gpt --max_steps 400 --seeds 0 1 2 --out results/gpt
    python scripts/compare_methods.py --recipe vit --methods dp local_sgd co2 --seeds 0 1 2 --out results/vit
    python scripts/compare_methods.py --recipe gpt --method "co2_no_penalty=--co2_gap_penalty 0" ...

Every run is a real ``accelerate launch`` of the recipe (2 CPU processes by default) with the method's
flags; everything else (data order, seed, budget, extra flags after ``--``) is shared. Writes one JSON
line per run to ``<out>/runs.jsonl`` (final validation loss and perplexity or accuracy, tokens or
samples per second, wall time) and ``<out>/curves.png``: validation metric against steps and against
wall-clock time, one line per method, mean over seeds with the min-max band.

The table and plots cover every run recorded in ``<out>/runs.jsonl``, so methods run in separate
invocations into one folder end up side by side (a rerun of a method and seed replaces its earlier
line); ``--plot_only`` redraws them without training.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"gpt": ROOT / "recipes/pretrain_gpt.py", "vit": ROOT / "recipes/finetune_vit.py"}
# The family of docs/algorithm.md, section 4: one engine, different flags (recipes/README.md)
METHODS = {
    "dp": "--co2_enabled false",
    "local_sgd": "--co2_overlap false --co2_outer_lr 1.0 --co2_outer_momentum 0.0",
    "slowmo": "--co2_overlap false --co2_outer_lr 1.0 --co2_outer_momentum 0.5",
    "diloco": "--co2_overlap false --co2_nesterov true --co2_outer_lr 0.7 --co2_outer_momentum 0.9",
    "co2": "",  # the library's CO2 defaults: streaming fragments (co2_fragments = tau)
    # full overlap, the whole model in one round: the GPT recipe's CO2 before fragments existed
    "co2_full": "--co2_fragments 1 --co2_start_rule eager --co2_outer_momentum 0.0 --co2_gap_penalty 0.0",
    # the SPEC's (the paper's) form: full overlap, anchor start, beta 0.2, gap-aware penalty
    "co2_paper": "--co2_fragments 1 --co2_start_rule anchor --co2_outer_momentum 0.2 --co2_gap_penalty 1.0",
}
LABELS = {
    "dp": "data parallel (AdamW)",
    "local_sgd": "local SGD",
    "slowmo": "SlowMo-style",
    "diloco": "DiLoCo-style",
    "co2": "CO2 (the recipe's defaults)",  # streaming since fragments; full overlap in older runs
    "co2_full": "CO2, full overlap",
    "co2_paper": "CO2, the paper's form",
}


def parse_methods(names: list[str], custom: list[str]) -> dict[str, str]:
    methods = {}
    for name in names:
        if name not in METHODS:
            raise SystemExit(f"--methods: unknown method {name!r}; allowed: {', '.join(METHODS)}")
        methods[name] = METHODS[name]
    for spec in custom:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"--method expects NAME=FLAGS, got {spec!r}")
        methods[name] = flags
    return methods


def launch(args, recipe: Path, output_dir: Path, flags: str, seed: int) -> None:
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(args.accelerate_config),
        "--num_processes",
        str(args.nproc),
        "--main_process_port",
        str(args.port),
        str(recipe),
        "--output_dir",
        str(output_dir),
        "--seed",
        str(seed),
        "--max_steps",
        str(args.max_steps),
        *shlex.split(flags),
        *args.recipe_args,
    ]
    log = output_dir.with_suffix(".log")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        done = subprocess.run(
            command,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=args.timeout_s,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    if done.returncode != 0:
        raise SystemExit(f"run failed ({log}):\n" + log.read_text()[-3000:])


def summarise(recipe: str, method: str, seed: int, output_dir: Path) -> dict:
    results = json.loads((output_dir / "all_results.json").read_text())
    summary = json.loads((output_dir / "run_summary.json").read_text())
    steps = json.loads((output_dir / "trainer_state.json").read_text())["global_step"]
    line = {"recipe": recipe, "method": method, "seed": seed, "max_steps": steps}
    line["eval_loss"] = results["eval_loss"]
    if "perplexity" in results:
        line["perplexity"] = results["perplexity"]
    if "eval_accuracy" in results:
        line["eval_accuracy"] = results["eval_accuracy"]
    runtime = results["train_runtime"]
    per_step = summary.get("tokens_per_step") or summary.get("samples_per_step")
    unit = "tokens_per_s" if "tokens_per_step" in summary else "samples_per_s"
    line[unit] = per_step * line["max_steps"] / runtime
    line.update(train_runtime_s=runtime, wall_time_s=summary["wall_time_s"], world_size=summary["world_size"])
    return line


def curves(output_dir: Path, metric: str) -> list[tuple[int, float, float]]:
    points = json.loads((output_dir / "wall_clock.json").read_text())
    return [(p["step"], p["wall_s"], p[metric]) for p in points if metric in p]


def plot(runs: dict[str, list[Path]], metric: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, (method, dirs) in enumerate(runs.items()):
        series = [curves(d, metric) for d in dirs]
        length = min(len(s) for s in series)
        steps = [series[0][k][0] for k in range(length)]
        wall = [statistics.fmean(s[k][1] for s in series) for k in range(length)]
        values = [[s[k][2] for s in series] for k in range(length)]
        mean = [statistics.fmean(v) for v in values]
        low, high = [min(v) for v in values], [max(v) for v in values]
        label = f"{LABELS.get(method, method)} (n={len(dirs)})"
        for ax, x in zip(axes, (steps, wall)):
            ax.plot(x, mean, marker=".", color=f"C{i}", label=label)
            ax.fill_between(x, low, high, color=f"C{i}", alpha=0.15)
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("wall-clock time since training began (s)")
    ylabel = "validation accuracy (fraction)" if metric == "eval_accuracy" else "validation loss (nats/token)"
    axes[0].set_ylabel(ylabel)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title + " — mean over seeds, band: min to max")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def co2_metric_series(output_dir: Path, key: str) -> list[tuple[int, float]]:
    """A logged CO2 metric (e.g. ``co2/momentum_norm``) against the step it was logged at; with
    ``--logging_steps`` equal to tau each point is one round."""
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [(e["step"], e[key]) for e in history if key in e]


def plot_co2_metric(runs: dict[str, list[Path]], key: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (method, dirs) in enumerate(runs.items()):
        for j, d in enumerate(dirs):
            points = co2_metric_series(d, key)
            if points:
                label = LABELS.get(method, method) if j == 0 else None
                ax.plot(*zip(*points), marker=".", color=f"C{i}", alpha=0.8, label=label)
    ax.set_xlabel("optimizer step (one point per logging window)")
    ax.set_ylabel(key + (" (L2 norm, parameter units)" if key.endswith("norm") else ""))
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_dir(out: Path, method: str, seed: int) -> Path:
    """Where one run of a method and seed writes its model folder (and, beside it, its .log)."""
    return out / f"{method}_seed{seed}"


def recorded_runs(out: Path) -> list[dict]:
    """The runs of ``out/runs.jsonl`` whose output folder still exists, the last line of each
    (method, seed) winning, in first-seen order of methods."""
    path = out / "runs.jsonl"
    latest: dict[tuple[str, int], dict] = {}
    if path.exists():
        for text in path.read_text().splitlines():
            if text.strip():
                line = json.loads(text)
                latest[(line["method"], line["seed"])] = line
    return [line for (method, seed), line in latest.items() if run_dir(out, method, seed).is_dir()]


def table(lines: list[dict], metric: str) -> str:
    """Markdown: mean and standard deviation of the final metric per method, and the mean against
    SlowMo-style and data parallel when they ran."""
    by_method: dict[str, list[float]] = {}
    for line in lines:
        by_method.setdefault(line["method"], []).append(line[metric])
    means = {m: statistics.fmean(v) for m, v in by_method.items()}
    refs = [r for r in ("slowmo", "dp") if r in means]
    head = f"| method | runs | {metric} mean | std |" + "".join(f" / {r} |" for r in refs)
    rows = [head, "|---" * (4 + len(refs)) + "|"]
    for method, values in by_method.items():
        std = statistics.stdev(values) if len(values) > 1 else float("nan")
        ratios = "".join(f" {means[method] / means[r]:.3f} |" for r in refs)
        rows.append(f"| {LABELS.get(method, method)} | {len(values)} | {means[method]:.4f} | {std:.4f} |{ratios}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=sorted(RECIPES), required=True)
    parser.add_argument("--methods", nargs="*", default=list(METHODS), help=f"from: {', '.join(METHODS)}")
    parser.add_argument("--method", action="append", default=[], help="extra NAME=FLAGS (e.g. ablations)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max_steps", type=int, required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--accelerate_config", type=Path, default=ROOT / "recipes/accelerate_configs/cpu_2proc.yaml")
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--timeout_s", type=float, default=3600, help="bound on each run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--plot_co2_metric", default=None, help="also plot this logged metric per run, e.g. co2/momentum_norm"
    )
    parser.add_argument(
        "--plot_only", action="store_true", help="no training: redraw the table and plots of --out's runs.jsonl"
    )
    parser.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: flags for every run")
    args = parser.parse_args()
    args.recipe_args = [a for a in args.recipe_args if a != "--"]
    methods = parse_methods(args.methods, args.method)
    metric = "eval_accuracy" if args.recipe == "vit" else "eval_loss"
    args.out.mkdir(parents=True, exist_ok=True)
    for method, flags in ({} if args.plot_only else methods).items():
        for seed in args.seeds:
            output_dir = run_dir(args.out, method, seed)
            launch(args, RECIPES[args.recipe], output_dir, flags, seed)
            line = summarise(args.recipe, method, seed, output_dir)
            print(json.dumps(line), flush=True)
            with open(args.out / "runs.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
    lines = recorded_runs(args.out)
    if not lines:
        raise SystemExit(f"no finished runs recorded in {args.out / 'runs.jsonl'}")
    runs: dict[str, list[Path]] = {}
    for line in lines:
        runs.setdefault(line["method"], []).append(run_dir(args.out, line["method"], line["seed"]))
    title = f"{args.recipe.upper()} recipe, {args.nproc} workers, {args.max_steps} steps"
    plot(runs, metric, args.out / "curves.png", title)
    print(table(lines, metric))
    print(f"plot: {args.out / 'curves.png'}")
    if args.plot_co2_metric:
        path = args.out / (args.plot_co2_metric.replace("/", "_") + ".png")
        plot_co2_metric(runs, args.plot_co2_metric, path, f"{title}: {args.plot_co2_metric}")
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
