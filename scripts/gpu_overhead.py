"""CO2's cost per step on one device: the round boundary (and host-memory state) against plain training.

    python scripts/gpu_overhead.py --device cuda                    # GPT-2 small, sequence 1024, bf16
    python scripts/gpu_overhead.py --device cpu --model tiny --steps 26 --seq 64 --batch 2   # a smoke run

One process, so the outer all-reduce is the identity and what is measured is CO2's own work: at every
tau-th step the boundary's passes over the flat fp32 state (penalty, momentum, exchange, reset) and,
with ``co2_state_device=cpu``, the copies between the GPU and host memory. Runs, interleaved
``--repeats`` times in one invocation so that a busy device moves them together: ``plain`` (no CO2),
``co2`` (SPEC defaults), ``co2_recipe`` (the recipes' eager start, no momentum, no penalty) and
``co2_cpu_state``. Prints one JSON line per run and a summary: median step time over the steps after
round 0 (the boundary step included, as the issue's target counts it), and its ratio to ``plain``.
The issue's target: GPT-2 small, sequence 1024, tau 12, overhead <= 3%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SHAPES = {"small": dict(n_embd=768, n_layer=12, n_head=12), "tiny": dict(n_embd=64, n_layer=2, n_head=2)}
RUNS = {
    "plain": None,
    "co2": dict(),
    "co2_recipe": dict(co2_start_rule="eager", co2_outer_momentum=0.0, co2_gap_penalty=0.0),
    "co2_cpu_state": dict(co2_state_device="cpu"),
}


def run(name: str, args) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from co2_hf import CO2, CO2Config

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=args.seq, **SHAPES[args.model])
    model = GPT2LMHeadModel(config).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    settings = RUNS[name]
    co2 = (
        None if settings is None else CO2(model, CO2Config(co2_local_steps=args.tau, **settings), optimizer=optimizer)
    )
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    times = []
    for _ in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=args.device)
        _sync(args.device)
        start = time.perf_counter()
        with torch.autocast(args.device, dtype=dtype, enabled=args.device == "cuda"):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if co2 is not None:
            co2.step()
        _sync(args.device)
        times.append(time.perf_counter() - start)
    steady = times[args.tau :]  # round 0 (and its warm-up) excluded
    boundaries = steady[args.tau - 1 :: args.tau]
    return {
        "run": name,
        "median_step_s": statistics.median(steady),
        "mean_step_s": statistics.fmean(steady),
        "boundary_step_s": statistics.median(boundaries) if boundaries else None,
        "outer_state_bytes": co2.outer_state_nbytes() if co2 is not None else 0,
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=sorted(SHAPES), default="small")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tau", type=int, default=12)
    parser.add_argument("--steps", type=int, default=12 * 6, help="per run; round 0 is excluded")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args(argv)
    if args.steps < 2 * args.tau:
        parser.error("--steps must cover at least two rounds (round 0 is excluded)")
    lines = []
    for repeat in range(args.repeats):
        for name in args.runs:
            line = {**run(name, args), "repeat": repeat, "device": args.device, "model": args.model}
            print(json.dumps(line), flush=True)
            lines.append(line)
    plain = [x["median_step_s"] for x in lines if x["run"] == "plain"]
    for name in args.runs:
        medians = [x["median_step_s"] for x in lines if x["run"] == name]
        ratio = statistics.median(medians) / statistics.median(plain) if plain else float("nan")
        print(f"# {name}: median step {statistics.median(medians):.4f} s, {ratio:.3f} x plain", flush=True)
    return lines


if __name__ == "__main__":
    main()
