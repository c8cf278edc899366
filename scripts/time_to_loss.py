"""The race: which library reaches a validation loss first, two ranks on a shaped link, real text.

    python scripts/time_to_loss.py --out results/time_to_loss.jsonl --plot docs/time_to_loss.png   # root
    python scripts/time_to_loss.py --loopback --rate unshaped --budget-s 20 --repeats 1 --methods ddp co2
    python scripts/time_to_loss.py --table results/time_to_loss.jsonl   # the comparison, from JSON lines

Every method trains the same model from the same initial weights on the same data: the GPT-2 shape
``tiny`` of scripts/sim_sweep.py (1.3M parameters, 4 layers) on the Shakespeare plays of the GPT
recipe's offline default, with its BPE (two plays held out); each rank draws its own micro-batches
of 8 blocks of 128 tokens in the same order for every method (data parallel: a global batch of 16);
AdamW (lr 1e-3, weight decay 0.1), a linear warm-up of 30 steps, then a constant rate, because the
number of steps a method fits in the budget is what the race measures (a cosine schedule would need
it beforehand). Each method runs through its own library (``scripts/bandwidth``: ``peers.py`` and
``worker.make_loop``) for ``--budget-s`` seconds of training on every rank, the two ranks in their own
network namespaces joined by a veth pair that ``tc`` shapes to ``--rate`` (``scripts/bandwidth/netns.py``).

The clock counts a rank's training steps only (forward, backward, the method's step and what it
waits for) and the stop check (a one-value all-reduce on a group of its own every 12 steps, so both
ranks stop at the same step). Rank 0 copies the global model (``Loop.global_state``: the anchor for
CO2, each fragment's global copy for torchft, the model after a round's average for the local-SGD
peers, the model for data parallel) at the first step where one exists after each of ``--snapshots``
evenly spaced times (copies off the clock), and after the run evaluates every copy on 64 held-out
blocks. The target is the best peer's final loss (at the budget) (median over repeats); each method's time to it is
the first crossing of its curve (linear between snapshots), median over repeats.

Methods (``METHODS``): ``ddp``; ``accelerate_local_sgd``, ``torch_post_local_sgd``, ``torchft_diloco``
and ``torchft_streaming`` (4 fragments, each launched tau/4 - 1 steps before it is waited for), all at
tau 12 (DiLoCo's outer SGD: lr 0.7, Nesterov 0.9); CO2's defaults (``co2``, tau 12), the defaults at
tau 4 (``co2_tau4``: at 100 Mbit/s a quarter of the model per step still hides behind a step) and
with the global second moment every 4 rounds (``co2_gm4``), and with the int8 wire (``co2_int8``,
for links where fp32 does not hide). ``--repeats`` passes interleave the methods
(A B C A B C), one launch of the ranks per pass.

One JSON line per run: ``method``, ``tau``, ``settings``, ``repeat``, ``rate``, ``budget_s``,
``steps``, ``curve`` ([seconds, step, validation loss] per snapshot), ``final_loss`` (the curve's at
the budget: a run stops at the first check past it, up to 12 steps later), ``allreduce_alone_s`` (a
blocking all-reduce of the model's fp32 size, timed at the pass's start: it checks the shaping),
``library``, ``load_1m``, ``date``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: import the package `scripts` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED, LR, WEIGHT_DECAY, WARMUP_STEPS, CHECK_EVERY = 0, 1e-3, 0.1, 30, 12
TORCHFT_FRAGMENTS = 4
# name -> (tau, CO2Config fields or None for a peer run through its own library)
METHODS: dict[str, tuple[int, dict | None]] = {
    "ddp": (1, None),
    "accelerate_local_sgd": (12, None),
    "torch_post_local_sgd": (12, None),
    "torchft_diloco": (12, None),
    "torchft_streaming": (12, None),
    # CO2's defaults before the second-moment exchange became one (co2_gm4 is CO2Config() now)
    "co2": (12, {"co2_global_second_moment_every": 0}),
    "co2_tau4": (4, {"co2_global_second_moment_every": 0}),
    "co2_gm4": (12, {"co2_global_second_moment_every": 4}),
    # a quarter of the bytes: hidden where fp32 is not (the exchange is not built for coded wires)
    "co2_int8": (12, {"co2_comm_dtype": "int8", "co2_global_second_moment_every": 0}),
}
PEERS = [m for m, (_, settings) in METHODS.items() if settings is None]


# ---------------------------------------------------------------- inside a rank


def build_model():
    import torch
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    from scripts.sim_sweep import gpt2_config

    logging.set_verbosity_error()
    torch.manual_seed(SEED)  # the same initial weights on every rank and for every method
    return GPT2LMHeadModel(gpt2_config("tiny"))


def make_race_loop(method: str, model, optimizer, rank: int):
    import co2_hf
    from scripts.bandwidth.plan import Run
    from scripts.bandwidth.worker import CO2Loop, make_loop

    tau, settings = METHODS[method]
    if settings is not None:
        return CO2Loop(model, optimizer, {"co2_local_steps": tau, **settings}, co2_hf)
    options = {"torchft_fragments": TORCHFT_FRAGMENTS}
    return make_loop(Run(method, tau, 0), model, optimizer, rank=rank, device="cpu", ranks_per_node=1, **options)


def race(method: str, spec: dict, rank: int, control, train_blocks) -> dict:
    """Train ``method`` until every rank's clock passes the budget; rank 0's snapshots of the global model."""
    import torch
    import torch.distributed as dist

    from scripts.bandwidth.peers import PostLocalSGDLoop
    from scripts.sim_sweep import draw_batch

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    loop = make_race_loop(method, model, optimizer, rank)
    budget, every = spec["budget_s"], spec["budget_s"] / spec["snapshots"]
    clock, step, next_snapshot, stop, snapshots = 0.0, 0, 0.0, False, []
    # torch's averager averages one step after its warm-up ends, and every period from there
    offset = PostLocalSGDLoop.WARMUP_STEPS + 1 if method == "torch_post_local_sgd" else 0
    while not stop:
        tokens = draw_batch(train_blocks, SEED, rank, step)
        start = time.perf_counter()
        loop.optimizer.zero_grad()
        loop.backward(loop.module(input_ids=tokens, labels=tokens).loss)
        loop.step()
        schedule.step()
        step += 1
        if (step - offset) % CHECK_EVERY == 0:  # a round boundary for every method (12: a multiple of each tau)
            over = torch.tensor([float(clock + time.perf_counter() - start >= budget)])
            dist.all_reduce(over, op=dist.ReduceOp.MAX, group=control)
            stop = bool(over.item())
        clock += time.perf_counter() - start
        if rank == 0 and (clock >= next_snapshot or stop):
            state = loop.global_state(model)
            if state is not None:  # copied off the clock
                snapshots.append((clock, step, {k: v.detach().clone() for k, v in state.items()}))
                next_snapshot += every
    loop.close()
    return {"steps": step, "snapshots": snapshots, "library": loop.version(), "load_1m": os.getloadavg()[0]}


def evaluate(snapshots, val) -> list[list[float]]:
    import torch

    model = build_model().eval()
    curve = []
    with torch.no_grad():
        for seconds, step, state in snapshots:
            model.load_state_dict(state)
            curve.append([round(seconds, 3), step, round(float(model(input_ids=val, labels=val).loss), 5)])
    return curve


def rank_main(spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    from scripts.bench_overlap import allreduce_alone
    from scripts.sim_sweep import corpus_blocks

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    torch.set_num_threads(1)  # one core per rank
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    control = dist.new_group(backend="gloo")  # the stop check: never queued behind a method's traffic
    train_blocks, val = corpus_blocks()
    probe = allreduce_alone(sum(p.numel() for p in build_model().parameters()), 3)
    for i, method in enumerate(spec["methods"]):
        dist.barrier()  # every run starts together
        result = race(method, spec, rank, control, train_blocks)
        if rank == 0:
            result["curve"] = evaluate(result.pop("snapshots"), val)
            result["allreduce_alone_s"] = probe
            tmp = out / f"run{i}.tmp"
            tmp.write_text(json.dumps(result))
            tmp.replace(out / f"run{i}.json")
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the launcher


def run_pass(methods: list[str], args, repeat: int) -> list[dict]:
    """One launch of the two ranks that races every method in turn; its JSON lines."""
    from scripts.bandwidth.launch import BlockFailed, await_files, free_port, kill_ranks, rank_command
    from scripts.bandwidth.plan import Block

    block = Block(ranks=2, ranks_per_node=1, rate=args.rate, model="tiny", runs=[])
    lines = []
    with tempfile.TemporaryDirectory(prefix="co2b-race-") as tmp:
        spec = {"methods": methods, "budget_s": args.budget_s, "snapshots": args.snapshots, "out_dir": tmp}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        procs, port = [], str(free_port() if args.loopback else 29400 + repeat)
        for rank in range(2):
            cmd, env = rank_command(block, rank, spec_path, loopback=args.loopback, script=Path(__file__).resolve())
            with open(Path(tmp) / f"rank{rank}.log", "w") as log:  # the child keeps its own descriptor
                env = {**os.environ, **env, "MASTER_PORT": port}
                child = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(child)
        try:
            for i, method in enumerate(methods):
                deadline = time.monotonic() + args.budget_s + 240  # start-up, evaluation, a slow close
                (result,) = await_files([Path(tmp) / f"run{i}.json"], procs, deadline, method)
                tau, settings = METHODS[method]
                line = dict(method=method, tau=tau, settings=settings, repeat=repeat, rate=args.rate)
                final = round(loss_at(result["curve"], args.budget_s), 5)
                line.update(budget_s=args.budget_s, **result, final_loss=final)
                line["date"] = datetime.date.today().isoformat()
                print(f"# {method} (pass {repeat}): {result['steps']} steps, final {line['final_loss']}", flush=True)
                lines.append(line)
        except BlockFailed as error:
            tail = (Path(tmp) / "rank0.log").read_text()[-3000:]
            print(f"# pass {repeat} failed: {error}\n# rank 0 log:\n{tail}", flush=True)
        finally:
            kill_ranks(procs)
    return lines


def loss_at(curve: list[list[float]], seconds: float) -> float:
    """The curve's loss at ``seconds`` (linear between snapshots; the last one past its end)."""
    for (t0, _, l0), (t1, _, l1) in zip(curve, curve[1:]):
        if t1 >= seconds:
            return l1 if t1 == t0 else l0 + (l1 - l0) * (max(seconds, t0) - t0) / (t1 - t0)
    return curve[-1][2]


def time_to(curve: list[list[float]], target: float) -> float | None:
    """Seconds until the curve first reaches ``target`` (linear between snapshots); None if never."""
    for (t0, _, l0), (t1, _, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def table(lines: list[dict]) -> str:
    """Markdown: per method its steps, final loss and time to the target, medians over repeats."""
    by: dict[str, list[dict]] = {}
    for line in lines:
        by.setdefault(line["method"], []).append(line)
    finals = {m: statistics.median(r["final_loss"] for r in rs) for m, rs in by.items()}
    peers = [m for m in by if m in PEERS]
    if not peers:
        return "no peer ran: no target"
    target = min(finals[m] for m in peers)
    times = {m: [time_to(r["curve"], target) for r in rs] for m, rs in by.items()}
    reached = {m: statistics.median(t) if all(x is not None for x in t) else None for m, t in times.items()}
    fastest = min((reached[m] for m in peers if reached[m] is not None), default=None)
    rows = [
        f"target {target:.4f} (the best peer's final loss, median of repeats); rate {lines[0]['rate']}, "
        f"budget {lines[0]['budget_s']:.0f} s, all-reduce of the model alone "
        f"{statistics.median(r['allreduce_alone_s'] for r in lines):.3f} s",
        "",
        "| method | tau | steps | final loss | time to target (s), per repeat | median | / fastest peer |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, rs in by.items():
        cells = ", ".join("-" if t is None else f"{t:.1f}" for t in times[m])
        med = "not reached" if reached[m] is None else f"{reached[m]:.1f}"
        ratio = "" if reached[m] is None or not fastest else f"{reached[m] / fastest:.2f}"
        steps = statistics.median(r["steps"] for r in rs)
        rows.append(f"| {m} | {rs[0]['tau']} | {steps:.0f} | {finals[m]:.4f} | {cells} | {med} | {ratio} |")
    return "\n".join(rows)


def plot(lines: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    colours = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(line["method"] for line in lines))}
    for line in lines:
        t, _, loss = zip(*line["curve"])
        label = line["method"] if line["repeat"] == min(r["repeat"] for r in lines) else None
        ax.plot(t, loss, color=colours[line["method"]], lw=1, ls="--" if line["method"] in PEERS else "-", label=label)
    ax.set(xlabel="training seconds (each rank's clock)", ylabel="validation loss (global model)")
    ax.set_ylim(top=min(max(line["curve"][0][2] for line in lines), 7.0))
    ax.set_title(f"time to loss, 2 ranks at {lines[0]['rate']} (peers dashed)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--rate", default="100mbit", help="tc rate of each node's link, or 'unshaped'")
    parser.add_argument("--budget-s", type=float, default=90.0, help="training seconds per run (each rank's clock)")
    parser.add_argument("--snapshots", type=int, default=16, help="evenly spaced copies of the global model per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loopback", action="store_true", help="no namespaces, no shaping, no root")
    parser.add_argument("--out", help="append each run's JSON line to this file")
    parser.add_argument("--plot", help="write the loss-against-time figure here (with --out or --table)")
    parser.add_argument("--table", help="print the comparison of the JSON lines in this file and stop")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return rank_main(args.worker)
    if args.table:
        lines = [json.loads(x) for x in Path(args.table).read_text().splitlines() if x.strip()]
        print(table(lines))
        if args.plot:
            plot(lines, args.plot)
        return
    if args.budget_s <= 0 or args.snapshots < 1 or args.repeats < 1:
        parser.error("--budget-s must be > 0, --snapshots and --repeats >= 1")
    if args.loopback and args.rate != "unshaped":
        parser.error("--loopback cannot shape the link: add --rate unshaped")
    from scripts.bandwidth.netns import Network, check_privileges, remove_stale_namespaces
    from scripts.bandwidth.peers import skip_missing
    from scripts.sim_sweep import corpus_blocks

    methods = skip_missing(args.methods)
    corpus_blocks()  # the tokenised corpus, cached once before the ranks read it
    if not args.loopback:
        check_privileges()
        remove_stale_namespaces()
    lines = []
    with contextlib.nullcontext() if args.loopback else Network(2) as net:
        if net is not None:
            net.set_rate(args.rate)
        for repeat in range(args.repeats):
            for line in run_pass(methods, args, repeat):
                lines.append(line)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(line) + "\n")
    print(table(lines))
    if args.plot and lines:
        plot(lines, args.plot)


if __name__ == "__main__":
    main()
