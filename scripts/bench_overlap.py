"""Is CO2's outer all-reduce really hidden behind computation? Two processes, one GPT-2 style model.

    python scripts/bench_overlap.py [--tau 12] [--rounds 7] [--out results/bench_overlap.jsonl]

Prints one JSON line per configuration, measured in one invocation so the figures compare:

- ``co2_overlap`` / ``sync``: CO2 with overlap on / off over real gloo on loopback, the whole model
  in one all-reduce per round (``co2_fragments=1``: the paper's form);
- ``co2_stream``: the default, streaming fragments (``co2_fragments`` unset: F = tau, one fragment's
  all-reduce of 1/F of the bytes after every inner step, applied one step later);
- ``*_slow``: the same with each outer all-reduce made to complete no earlier than 0.8 x (one
  round of compute) x (its share of the model) after its launch, i.e. a link slow enough that one
  round's bytes take 80% of a round (loopback is too fast to show anything otherwise). The delay
  is injected at construction (``DelayedCommunicator`` around the engine's own communicator), so
  that every fragment's all-reduce goes through it.

Fields: steady-state median step time (first and last round excluded; the mean step time too,
since one boundary step in tau carries any exposed wait and the median hides it), the all-reduce alone
(blocking, the whole model's buffer), the exposed wait per round (max over ranks; with fragments the
sum of the round's F waits), launch-to-completion time of a round's outer all-reduces (summed over
fragments), and the hidden fraction ``1 - wait / comm`` over the steady rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from co2_hf import CO2, CO2Config
from co2_hf.core.groups import make_communicator
from co2_hf.core.wire import header_numel
from co2_hf.testing import DelayedCommunicator, run_processes

MODEL = dict(vocab_size=8192, n_positions=128, n_embd=384, n_layer=4, n_head=6)  # ~10M parameters
MODEL.update(bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
BATCH, SEQ = 4, 64


def build_model(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**MODEL))


def allreduce_alone(numel: int, repeats: int = 5, device: str = "cpu") -> float:
    """Median seconds of a blocking fp32 all-reduce of the outer buffer's size, on its own group
    (of the default backend: on ``cuda`` NCCL, whose all-reduce returns once queued, so the clock
    stops after the device finished it)."""
    group = dist.new_group()
    buf = torch.ones(numel, device=device)
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if buf.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_config(rank: int, tau: int, rounds: int, *, overlap: bool, fragments: int | None, delay_s: float) -> dict:
    """One configuration; ``delay_s``: the simulated link's time for the whole model's bytes (each
    fragment's all-reduce is delayed by its share of it)."""
    model = build_model(seed=rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    cfg = CO2Config(co2_local_steps=tau, co2_overlap=overlap, co2_fragments=fragments)
    F = cfg.fragments
    inner = make_communicator(state_device=torch.device("cpu"), timeout_s=cfg.co2_timeout_s)
    comm = DelayedCommunicator(inner, delay_s / F) if delay_s > 0 else inner
    co2 = CO2(model, cfg, optimizer=optimizer, communicator=comm)
    gen = torch.Generator().manual_seed(rank)
    step_times, waits, comms = [], [], []
    for _ in range(tau * rounds):
        tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=gen)
        start = time.perf_counter()
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        co2.step()
        step_times.append(time.perf_counter() - start)
        if co2.round_step == 0:  # a round ended: its waits and all-reduces, summed over fragments
            waits.append(co2.last_wait_s)
            comms.append(co2.last_comm_s)
    co2.finalize()
    # steady state: drop the first and last round (and round 0's boundary, which never waits)
    steady_steps = step_times[tau : tau * (rounds - 1)]
    steady_waits, steady_comms = waits[1:-1], comms[1:-1]
    return {
        "fragments": F,
        "step_time_s": statistics.median(steady_steps),
        "mean_step_time_s": statistics.fmean(steady_steps),
        "waits": steady_waits,
        "comms": steady_comms,
        "outer_numel": co2.layout.shard_numel + header_numel(co2.num_workers),
    }


CONFIGS = {  # name: (co2_overlap, co2_fragments)
    "co2_overlap": (True, 1),
    "co2_stream": (True, None),
    "sync": (False, None),
}


def bench(rank: int, world: int, tau: int, rounds: int) -> list[dict]:
    torch.set_num_threads(1)
    results = []
    runs = {"co2_overlap": run_config(rank, tau, rounds, overlap=True, fragments=1, delay_s=0.0)}
    alone = allreduce_alone(runs["co2_overlap"]["outer_numel"])
    # one delay for every rank: 0.8 x a round of compute, as rank 0 measured it
    delay = torch.tensor([0.8 * tau * runs["co2_overlap"]["step_time_s"]])
    dist.broadcast(delay, src=0)
    for name, (overlap, fragments) in CONFIGS.items():
        if name not in runs:
            runs[name] = run_config(rank, tau, rounds, overlap=overlap, fragments=fragments, delay_s=0.0)
    for name, (overlap, fragments) in CONFIGS.items():
        runs[f"{name}_slow"] = run_config(
            rank, tau, rounds, overlap=overlap, fragments=fragments, delay_s=float(delay)
        )
    for name, run in runs.items():
        results.append(dict(config=name, allreduce_alone_s=alone, delay_s=float(delay) * ("slow" in name), **run))
    return results


def summarise(per_rank: list[list[dict]], tau: int) -> list[dict]:
    lines = []
    for configs in zip(*per_rank):
        first = configs[0]
        wait = [max(w) for w in zip(*(c["waits"] for c in configs))]  # max over ranks per round
        comm = [max(c) for c in zip(*(c["comms"] for c in configs))]
        step = statistics.median(c["step_time_s"] for c in configs)
        lines.append(
            {
                "config": first["config"],
                "tau": tau,
                "fragments": first["fragments"],
                "step_time_s": round(step, 4),
                "mean_step_time_s": round(statistics.median(c["mean_step_time_s"] for c in configs), 4),
                "round_compute_s": round(step * tau, 4),
                "allreduce_alone_s": round(first["allreduce_alone_s"], 4),
                "simulated_link_delay_s": round(first["delay_s"], 4),  # for the whole model's bytes
                "comm_s": round(statistics.median(comm), 4),
                "exposed_wait_per_round_s": round(statistics.median(wait), 4),
                "exposed_frac_of_round": round(statistics.median(wait) / (step * tau), 4),
                "hidden_frac": round(max(0.0, 1 - sum(wait) / sum(comm)), 4) if sum(comm) > 0 else None,
            }
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tau", type=int, default=12, help="inner steps per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per configuration (>= 4)")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = parser.parse_args()
    if args.rounds < 4:
        parser.error("--rounds must be >= 4: the first and last rounds are excluded")
    per_rank = run_processes(bench, 2, args.tau, args.rounds, timeout_s=1800)
    for line in summarise(per_rank, args.tau):
        text = json.dumps(line)
        print(text)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()
