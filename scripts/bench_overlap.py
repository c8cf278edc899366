"""Is CO2's outer all-reduce really hidden behind computation? Two processes, one GPT-2 style model.

    python scripts/bench_overlap.py [--tau 12] [--rounds 7] [--out bench_overlap.jsonl]

Prints one JSON line per configuration, measured in one invocation so the figures compare:

- ``co2_overlap`` / ``sync``: CO2 with overlap on / off over real gloo on loopback;
- ``co2_overlap_slow`` / ``sync_slow``: the same with each outer all-reduce made to complete no
  earlier than 0.8 x (one round of compute) after its launch, i.e. a link slow enough that one
  round's all-reduce takes 80% of a round (loopback is too fast to show anything otherwise).

Fields: steady-state median step time (first and last round excluded; the mean step time too,
since one boundary step in tau carries any exposed wait and the median hides it), the all-reduce alone
(blocking, same buffer), the exposed wait per round (max over ranks), launch-to-completion time of
the outer all-reduce, and the hidden fraction ``1 - wait / comm`` over the steady rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from co2_hf import CO2, CO2Config
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


def run_config(rank: int, tau: int, rounds: int, *, overlap: bool, delay_s: float) -> dict:
    model = build_model(seed=rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    cfg = CO2Config(co2_local_steps=tau, co2_overlap=overlap)
    co2 = CO2(model, cfg, optimizer=optimizer)
    if delay_s > 0:
        co2.comm = DelayedCommunicator(co2.comm, delay_s)
    gen = torch.Generator().manual_seed(rank)
    step_times, waits, comms = [], [], []
    for _ in range(tau * rounds):
        tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=gen)
        start = time.perf_counter()
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        boundary = co2.step()
        step_times.append(time.perf_counter() - start)
        if boundary:
            waits.append(co2.last_wait_s)
            comms.append(co2.last_comm_s)
    co2.finalize()
    # steady state: drop the first and last round (and round 0's boundary, which never waits)
    steady_steps = step_times[tau : tau * (rounds - 1)]
    steady_waits, steady_comms = waits[1:-1], comms[1:-1]
    return {
        "step_time_s": statistics.median(steady_steps),
        "mean_step_time_s": statistics.fmean(steady_steps),
        "waits": steady_waits,
        "comms": steady_comms,
        "outer_numel": co2.wire.fp32.numel(),
    }


def bench(rank: int, world: int, tau: int, rounds: int) -> list[dict]:
    torch.set_num_threads(1)
    results = []
    base = run_config(rank, tau, rounds, overlap=True, delay_s=0.0)
    alone = allreduce_alone(base["outer_numel"])
    # one delay for every rank: 0.8 x a round of compute, as rank 0 measured it
    delay = torch.tensor([0.8 * tau * base["step_time_s"]])
    dist.broadcast(delay, src=0)
    runs = {"co2_overlap": base}
    runs["sync"] = run_config(rank, tau, rounds, overlap=False, delay_s=0.0)
    runs["co2_overlap_slow"] = run_config(rank, tau, rounds, overlap=True, delay_s=float(delay))
    runs["sync_slow"] = run_config(rank, tau, rounds, overlap=False, delay_s=float(delay))
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
                "step_time_s": round(step, 4),
                "mean_step_time_s": round(statistics.median(c["mean_step_time_s"] for c in configs), 4),
                "round_compute_s": round(step * tau, 4),
                "allreduce_alone_s": round(first["allreduce_alone_s"], 4),
                "simulated_link_delay_s": round(first["delay_s"], 4),
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
