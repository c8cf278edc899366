"""The GPU check's one table (``scripts/gpu_check.sh``): what CO2 costs per step on one GPU.

    python scripts/gpu_report.py                      # GPT-2 small, sequence 1024, batch 8, bf16, tau 12
    python scripts/gpu_report.py --device cpu --model tiny --seq 32 --batch 2 --rounds 1 --steps 24 --repeats 1

Two parts, each measured side by side in one invocation (ratios of runs interleaved in the same
process, so that a busy device moves them together):

1. **The engine** (`scripts/gpu_overhead.py`, one process, a hand-written loop): plain training, the
   defaults (F = tau = 12 streaming fragments), the F sweep (6, 4, 2, 1), the paper's form (one
   fragment, anchor start, gap-aware penalty) and host-memory state (``co2_state_device=cpu``): time
   per step over whole rounds against plain's.
2. **The Trainer** (`run_trainer`): a GPT-2 small Trainer run on random tokens (no ``datasets``
   needed) with the plain Trainer and with CO2Trainer, both eager and with ``--torch_compile``: time
   per step over the steps after the first round (compilation, first calls), the device synchronised
   at those two steps only.

It needs torch, transformers and accelerate only, and the library on ``PYTHONPATH`` (the GPU image
has its own torch, transformers and accelerate and no ``datasets``): run from the repository root.
The last lines are a markdown table and each row's target (issue 41): <= 1.03 x plain for the
defaults, the paper form and CO2Trainer; <= 1.05 x for host-memory state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: import the package `scripts` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts import gpu_overhead  # noqa: E402

ENGINE_RUNS = ["plain", "co2", "co2_f6", "co2_f4", "co2_f2", "co2_full", "co2_paper", "co2_cpu_state"]
TARGETS = {"co2": 1.03, "co2_paper": 1.03, "co2_cpu_state": 1.05, "co2_trainer": 1.03, "co2_trainer_compiled": 1.03}
LABELS = {
    "co2": "defaults (F = tau streaming, lookahead)",
    "co2_f6": "F = 6",
    "co2_f4": "F = 4",
    "co2_f2": "F = 2",
    "co2_full": "F = 1",
    "co2_paper": "paper form (F = 1, anchor start, gap-aware penalty)",
    "co2_cpu_state": "host-memory state (co2_state_device=cpu), defaults",
    "co2_trainer": "CO2Trainer vs Trainer",
    "co2_trainer_compiled": "CO2Trainer vs Trainer, --torch_compile",
}


class _RandomTokens(torch.utils.data.Dataset):
    """``size`` random sequences of ``seq`` tokens, labels equal to the inputs (a language model's loss)."""

    def __init__(self, size: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (size, seq), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def run_trainer(*, co2: bool, compiled: bool, args: argparse.Namespace) -> dict:
    """Seconds per step of a Trainer run after its first ``tau`` steps (plain Trainer or CO2Trainer)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from co2_hf import CO2Trainer, CO2TrainingArguments

    first, last = args.tau, args.steps

    class Clock(TrainerCallback):
        marks: dict[int, float] = {}

        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step in (first, last):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                self.marks[state.global_step] = time.perf_counter()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=args.seq, **gpu_overhead.SHAPES[args.model])
    model = GPT2LMHeadModel(config)
    data = _RandomTokens(args.batch * args.steps, args.seq, config.vocab_size)
    with tempfile.TemporaryDirectory() as out:
        common = dict(
            output_dir=out,
            max_steps=last,
            per_device_train_batch_size=args.batch,
            learning_rate=1e-4,
            bf16=args.device == "cuda",
            use_cpu=args.device == "cpu",
            torch_compile=compiled,
            logging_steps=10 * last,  # no logging step inside the measured window
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        if co2:
            training = CO2TrainingArguments(**common, co2_local_steps=args.tau)
            trainer = CO2Trainer(model=model, args=training, train_dataset=data, callbacks=[Clock()])
        else:
            trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=data, callbacks=[Clock()])
        trainer.train()
    seconds = (Clock.marks[last] - Clock.marks[first]) / (last - first)
    return {"run": f"{'co2' if co2 else 'plain'}_trainer{'_compiled' if compiled else ''}", "time_per_step_s": seconds}


def trainer_rows(args: argparse.Namespace) -> tuple[list[dict], dict[str, float]]:
    """Plain and CO2 Trainer runs, eager then compiled, ``args.repeats`` times interleaved: the lines,
    and the median ratio of CO2Trainer to the plain Trainer of the same repeat."""
    lines, ratios = [], {}
    for compiled in [False, True] if args.compile else [False]:
        key = "co2_trainer_compiled" if compiled else "co2_trainer"
        pairs = []
        for repeat in range(args.compile_repeats if compiled else args.repeats):
            plain = run_trainer(co2=False, compiled=compiled, args=args)
            ours = run_trainer(co2=True, compiled=compiled, args=args)
            for line in (plain, ours):
                line.update(repeat=repeat, device=args.device, model=args.model)
                print(json.dumps(line), flush=True)
                lines.append(line)
            pairs.append(ours["time_per_step_s"] / plain["time_per_step_s"])
        ratios[key] = statistics.median(pairs)
    return lines, ratios


def table(engine: dict[str, dict], trainer: dict[str, float], device: str) -> str:
    """The markdown table of every row: time per step against plain's, and the target where there is one."""
    rows = ["| run | time per step vs plain | boundary cost per round (steps) | target |", "|---|---|---|---|"]
    for name, s in engine.items():
        if name != "plain":
            ratio, steps = s["vs_plain"], s["boundary_steps"]
            rows.append(f"| {LABELS.get(name, name)} | {ratio:.3f}x | {steps:.2f} | {_verdict(name, ratio)} |")
    for name, ratio in trainer.items():
        rows.append(f"| {LABELS[name]} | {ratio:.3f}x | | {_verdict(name, ratio)} |")
    plain = engine.get("plain", {}).get("time_per_step_s", float("nan"))
    return "\n".join([f"plain training: {plain:.4f} s per step on {device}", *rows])


def _verdict(name: str, ratio: float) -> str:
    target = TARGETS.get(name)
    if target is None:
        return ""
    return f"<= {target:.2f}x: {'met' if ratio <= target else 'missed'}"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=sorted(gpu_overhead.SHAPES), default="small")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tau", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4, help="whole rounds per engine run")
    parser.add_argument("--steps", type=int, default=48, help="Trainer steps per run (the first tau untimed)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the --torch_compile pair")
    parser.add_argument("--compile-repeats", type=int, default=1, help="--torch_compile pairs (each compiles anew)")
    args = parser.parse_args(argv)
    if args.steps <= args.tau:
        parser.error(f"--steps must exceed --tau (got {args.steps} <= {args.tau})")
    common = ["--device", args.device, "--model", args.model, "--seq", str(args.seq), "--batch", str(args.batch)]
    common += ["--tau", str(args.tau), "--rounds", str(args.rounds), "--repeats", str(args.repeats)]
    lines = gpu_overhead.main([*common, "--runs", *ENGINE_RUNS, "--codecs"])
    engine = gpu_overhead.summarize(lines)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(table(engine, {}, device), flush=True)  # the engine's rows now, should the Trainer's run out of time
    _, trainer = trainer_rows(args)
    report = table(engine, trainer, device)
    print(report, flush=True)
    return report


if __name__ == "__main__":
    main()
