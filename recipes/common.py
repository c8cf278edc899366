"""Pieces both recipes share: launch defaults, argument parsing, the loss plot, the results and
the model card."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from transformers import TrainerCallback

from co2_hf.integrations import model_card
from co2_hf.integrations.arguments import parse_or_exit as parse_or_exit  # the recipes parse through it
from co2_hf.integrations.arguments import resolve_resume_from_checkpoint

# What the recipes set when the command line does not: a short CPU-friendly run that evaluates
# and logs often enough for a readable curve. Every one can be overridden by its flag.
TRAINING_DEFAULTS = dict(
    report_to="none",
    logging_steps=10,
    eval_strategy="steps",
    eval_steps=50,
    save_strategy="no",
    lr_scheduler_type="cosine",
    warmup_steps=20,
    seed=42,
)

# the `evaluate` accuracy metric, from disk: evaluate.load("accuracy") would fetch it from the Hub
METRIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics", "accuracy")


def training_defaults() -> dict:
    """TRAINING_DEFAULTS plus the progress bar: shown in an interactive terminal, off when stderr
    is a file or a pipe (CI logs, compare_methods.py), where a bar only adds carriage returns.
    ``--disable_tqdm`` on the command line (or in the JSON file) overrides either way."""
    return {**TRAINING_DEFAULTS, "disable_tqdm": not sys.stderr.isatty()}


def parse_arguments(parser, defaults: dict, argv: list[str] | None):
    """Like run_clm: flags, or a single ``.json`` file holding them. ``defaults`` (the recipe's
    settings) apply to both; the file or the flags override them."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        with open(argv[0]) as f:
            given = json.load(f)
        # parse_dict builds the dataclasses from their own defaults, not the parser's: merge first
        parsed = parser.parse_dict({**defaults, **given})
    else:
        parser.set_defaults(**defaults)
        parsed = parser.parse_args_into_dataclasses(args=argv)
    for args in parsed:
        if hasattr(args, "resume_from_checkpoint"):
            args.resume_from_checkpoint = resolve_resume_from_checkpoint(args.resume_from_checkpoint, args.output_dir)
    return parsed


def load_accuracy():
    import evaluate

    return evaluate.load(METRIC_DIR)


def plot_curves(
    log_history: list[dict], path: str, *, title: str, metric: str = "eval_loss", loss_label: str = "training loss"
) -> str:
    """Training loss and the evaluated metric against optimizer steps, as a PNG; the legend sits
    under the axes, where it covers no point, in as many columns (3 at most) as fit the figure's width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e]
    # the evaluation after training (an entry after the Trainer's train_runtime summary) is of the final
    # model, every worker's last round applied: a point of its own, not the curve's next step
    end = next((i for i, e in enumerate(log_history) if "train_runtime" in e), len(log_history))
    evals = [(e["step"], e[metric]) for e in log_history[:end] if metric in e]
    final = [(e["step"], e[metric]) for e in log_history[end:] if metric in e][-1:]
    fig, ax = plt.subplots(figsize=(7, 5), layout="constrained")  # makes room for the legend
    if train:
        ax.plot(*zip(*train), label=loss_label, alpha=0.6)
    final_label = f"{metric}, final model"
    if metric.endswith("loss"):
        if evals:
            ax.plot(*zip(*evals), marker="o", label=f"{metric} (anchor)")
        if final:
            ax.plot(*zip(*final), marker="*", markersize=12, linestyle="none", color="C3", label=final_label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    if (evals or final) and not metric.endswith("loss"):
        twin = ax.twinx()
        if evals:
            twin.plot(*zip(*evals), marker="o", color="C1", label=f"{metric} (anchor)")
        if final:
            twin.plot(*zip(*final), marker="*", markersize=12, linestyle="none", color="C3", label=final_label)
        twin.set_ylabel(metric)
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.grid(alpha=0.3)
    renderer = fig.canvas.get_renderer()
    for ncol in range(min(len(handles), 3), 0, -1):
        legend = fig.legend(handles, labels, loc="outside lower center", ncol=ncol, frameon=False)
        if ncol == 1 or legend.get_window_extent(renderer).width <= fig.bbox.width:
            break
        legend.remove()  # long labels (a world size, a metric's name): fewer columns, more rows
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def training_loss_label(args) -> str:
    """What the Trainer's logged ``loss`` is: the mean over the launch's processes (it gathers them at
    each logging step), or one process's own; on torchft each replica group is a launch of one, and
    replica group 0's is the one logged and plotted."""
    if getattr(args, "co2_enabled", False) and getattr(args, "co2_fault_tolerance", "none") == "torchft":
        return "training loss (replica group 0's own)"
    if args.world_size > 1:
        return f"training loss (mean over the {args.world_size} processes)"
    return "training loss (one process)"


def write_run_summary(output_dir: str, args, extra: dict) -> None:
    """``run_summary.json``: what compare_methods.py reads (settings, wall time, world size)."""
    summary = {"co2": {k: v for k, v in vars(args).items() if k.startswith("co2_")}, **extra}
    with open(os.path.join(output_dir, "run_summary.json"), "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True, default=str)


def train_and_report(trainer, *, start: float, per_step: dict, title: str, metric: str, card: dict) -> dict:
    """run_clm's ending: train, save the model (the anchor), ``train_results.json`` and the trainer
    state; evaluate the final model, ``eval_results.json``; ``all_results.json`` holds both. Then
    the model card (``card``: ``create_model_card``'s arguments), run_summary.json and the curve;
    ``per_step`` is e.g. ``{"tokens_per_step": n}``."""
    args = trainer.args
    train_result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    train_metrics = {**train_result.metrics, "n_parameters": sum(p.numel() for p in trainer.model.parameters())}
    trainer.log_metrics("train", train_metrics)
    trainer.save_metrics("train", train_metrics)
    trainer.save_state()  # trainer_state.json: the log history compare_methods.py reads
    # after finalize: the anchor with every worker's last round applied (not the last in-training eval)
    eval_metrics = trainer.evaluate()
    if metric == "eval_loss":
        loss = eval_metrics["eval_loss"]
        eval_metrics["perplexity"] = math.exp(loss) if loss < 50 else float("inf")
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("eval", eval_metrics)
    write_model_card(trainer, card)
    if trainer.is_world_process_zero():
        summary = {"world_size": args.world_size, "wall_time_s": time.time() - start, **per_step}
        summary["fsdp2_inside_workers"] = type(trainer.model).__name__.startswith("FSDP")
        write_run_summary(args.output_dir, args, summary)
        curve = os.path.join(args.output_dir, "loss_curve.png")
        plot = plot_curves(
            trainer.state.log_history, curve, title=title, metric=metric, loss_label=training_loss_label(args)
        )
        print(
            f"{metric} {eval_metrics[metric]:.4f}"
            + (f", perplexity {eval_metrics['perplexity']:.1f}" if "perplexity" in eval_metrics else "")
        )
        print(f"model and metrics: {args.output_dir}; curves: {plot}")
    # Tear the process groups down on every rank together: left to interpreter exit, gloo's
    # threads can abort a rank that finishes first ("terminate called without an active exception").
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return {**train_metrics, **eval_metrics}


def write_model_card(trainer, card: dict) -> None:
    """The card, written after the final evaluation so that it reports that one. As run_clm does:
    ``push_to_hub`` writes it and uploads, else ``create_model_card``; then the corrections the
    Trainer's card needs (model_card.complete_card: "trained from scratch", pipeline_tag)."""
    card = dict(card)
    pipeline_tag = card.pop("pipeline_tag")
    if trainer.args.push_to_hub:
        trainer.push_to_hub(**card)  # CO2Trainer's card goes through model_card.add_co2_section
        return
    trainer.create_model_card(**card)
    if trainer.is_world_process_zero():
        path = os.path.join(trainer.args.output_dir, "README.md")
        model_card.complete_card(path, base_model=card.get("finetuned_from"), pipeline_tag=pipeline_tag)


def card_fields(task: str, model_args, data_args, *, files: list[str | None], default: str) -> dict:
    """``create_model_card``'s arguments for a recipe of ``task`` (its pipeline tag): the base model,
    the license, and the data (`dataset_card_fields`)."""
    return {
        "finetuned_from": model_args.model_name_or_path,
        "tasks": task,
        "pipeline_tag": task,
        "license": model_args.license,
        **dataset_card_fields(data_args.dataset_name, data_args.dataset_config_name, files, default=default),
    }


def dataset_card_fields(name: str | None, config_name: str | None, files: list[str | None], default: str) -> dict:
    """``create_model_card``'s dataset arguments: a Hub dataset by id (listed in the card's
    ``datasets`` metadata), local files by name, else the recipe's offline default."""
    if name:
        shown = f"{name} {config_name}" if config_name else name
        return {"dataset_tags": name, "dataset_args": config_name, "dataset": shown}
    local = [f for f in files if f]
    # no Hub tags: the Trainer would list its builder ("imagefolder", "text") as a Hub dataset
    return {"dataset_tags": [], "dataset": ", ".join(local) if local else default}


class LRSpike(TrainerCallback):
    """Multiplies the inner learning rate by ``factor`` for every step of one round (steps
    ``round * tau`` to ``(round + 1) * tau - 1``): the disturbance of the clipping ablation
    (recipes/README.md). The scheduler sets the rate anew after each step, so the spike ends with
    the round."""

    def __init__(self, round_index: int, factor: float, tau: int) -> None:
        self.first, self.last, self.factor = round_index * tau, (round_index + 1) * tau - 1, factor

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and self.first <= state.global_step <= self.last:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * self.factor


class WallClock(TrainerCallback):
    """Writes ``wall_clock.json``: seconds since training began at each evaluation, so
    compare_methods.py can plot quality against time as well as against steps."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir, self.start, self.points = output_dir, None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.start is not None:  # not the evaluations after training
            self.points.append(
                {"step": state.global_step, "wall_s": time.perf_counter() - self.start, **(metrics or {})}
            )

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            with open(os.path.join(self.output_dir, "wall_clock.json"), "w") as f:
                json.dump(self.points, f, indent=1)
