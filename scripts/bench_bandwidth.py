"""Throughput and hidden communication on bandwidth-limited links: data parallel, local SGD, DiLoCo, CO2.

    sudo .venv/bin/python scripts/bench_bandwidth.py --out bench_bandwidth.jsonl --plot docs/bench_bandwidth.png
    python scripts/bench_bandwidth.py --dry-run      # the plan, its estimate and every ip/tc command; no root
    python scripts/bench_bandwidth.py --loopback --rates unshaped --model tiny   # no namespaces, no root

The links are real: one network namespace per node, joined by a veth pair (two nodes) or through
a bridge in a switch namespace (more nodes), each node's link shaped with ``tc tbf`` in both
directions (the node side's egress is its upload; the egress of the peer or switch side is its
download). Ranks run inside the namespaces with gloo bound to the node's interface
(GLOO_SOCKET_IFNAME); ``--ranks-per-node`` puts several ranks in one namespace, where they talk
over loopback, so only the inter-node link is shaped. Only the rate can be shaped (no netem here).

Methods, one GPT-2 style model (``bench_overlap.py``'s config, 10.3M parameters; ``large`` is
29.4M): ``ddp`` (torch DDP, AdamW, a gradient all-reduce every step), ``local_sgd`` and ``diloco``
(the CO2 engine with a blocking outer step), ``co2`` (overlapped) and ``no_comm`` (each rank trains
alone: the compute-bound limit). Every run sits between two ``no_comm`` runs and is compared with
their mean, so load that comes and goes on a shared machine moves a run and its limit together; each
block (one rate, one topology, one model) first times a blocking all-reduce of the model's size (the
``probe`` line: its achieved rate checks the shaping). At the slowest rate the extras follow: twice
the ranks at tau 48, and the large model (DiLoCo communicates exactly as local SGD: left out there).

Steady state: a run's first and last round are excluded (a round is tau steps; one step for ddp and
no_comm). Every number is the slowest rank's: a method that synchronises runs at its pace, so the
limit of a data-parallel job is the slowest rank too (the cores of a shared machine differ by a few
percent from run to run). ``--repeats N`` runs every method N times in one block (each between two
no_comm runs); ``--table`` then gives the median of each cell. Fields of each JSON line:
``step_time_s`` (median step), ``time_per_step_s`` (median round / tau: includes the boundary step
and any exposed wait), ``tokens_per_s`` (all ranks at that pace),
``allreduce_alone_s`` (the block's probe), ``exposed_comm_per_round_s`` (CO2 engine: the wait at a
boundary, max over ranks, median over rounds; ddp: its step time minus the limit's),
``exposed_frac_of_round`` and ``comm_over_compute`` (exposed time and all-reduce alone over one
round of the limit's compute), ``hidden_frac`` (CO2 engine: 1 - sum(wait) / sum(launch to done);
ddp: 1 - exposed / all-reduce alone), ``rel_to_limit`` (tokens/s over the neighbouring no_comm
runs'; for a no_comm run, over the block's mean) and ``load_1m`` (the load average at the run's end:
above the rank count, other work shared the cores).
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_overlap import MODEL, SEQ
from scaling_model import gpt2_params, ring_allreduce_s, step_time_s

PREFIX = "co2b"  # every namespace and link this script makes starts with it
SUBNET = "10.47.0"
CO2_SETTINGS = {  # the README's table of methods
    "local_sgd": dict(co2_overlap=False, co2_outer_lr=1.0, co2_outer_momentum=0.0),
    "diloco": dict(co2_overlap=False, co2_nesterov=True, co2_outer_lr=0.7, co2_outer_momentum=0.9),
    "co2": dict(co2_overlap=True),
    # CO2 with one worker per node (co2_worker_size = --ranks-per-node): data parallel inside the
    # node, and each rank all-reduces 1/k of the outer gradient across nodes
    "co2_node": dict(co2_overlap=True),
}
METHODS = ("no_comm", "ddp", "local_sgd", "diloco", "co2", "co2_node")
MODELS = {
    "small": MODEL,
    "large": {**MODEL, "n_embd": 512, "n_layer": 8, "n_head": 8},
    "tiny": {**MODEL, "vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 2},
}
# Compute per step at the default micro-batch, 2 ranks on 2 cores (measured here): the estimate.
# The default batch makes one round at tau 12 several times the 100 Mbit/s all-reduce of the
# small model (the regime the target names); a step is then ~0.76 s.
DEFAULT_BATCH = 16
STEP_S = {"small": 0.76, "large": 2.07, "tiny": 0.03}
STARTUP_S = 20.0  # ranks importing torch and transformers
UNSHAPED_BPS = 5e9


@dataclass
class Run:
    method: str
    tau: int  # steps per round: tau for the CO2 engine, 1 for ddp and no_comm
    rounds: int


@dataclass
class Block:
    """One launch of the ranks: one topology, one link rate, one model, several runs."""

    ranks: int
    ranks_per_node: int
    rate: str
    model: str
    runs: list[Run]
    batch: int = DEFAULT_BATCH  # sequences of SEQ tokens per rank and step

    @property
    def step_s(self) -> float:
        """Estimated compute per step (ranks beyond the cores share them)."""
        share = max(1.0, self.ranks / (os.cpu_count() or 1))
        return STEP_S[self.model] * self.batch / DEFAULT_BATCH * share

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node


def rate_bps(rate: str) -> float | None:
    """``'100mbit'`` -> 1e8; ``'unshaped'`` -> None."""
    if rate == "unshaped":
        return None
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: use e.g. 100mbit, 1gbit or unshaped")


# ---------------------------------------------------------------- the network


def node_ns(i: int) -> str:
    return f"{PREFIX}-n{i}"


def node_dev(i: int) -> str:
    return f"{PREFIX}-e{i}"


def switch_dev(i: int) -> str:
    return f"{PREFIX}-p{i}"


SWITCH_NS, BRIDGE = f"{PREFIX}-sw", f"{PREFIX}-br"


def network_commands(nodes: int, mtu: int = 1500) -> tuple[list[list[str]], list[list[str]]]:
    """Set-up and tear-down commands for ``nodes`` namespaces; veths are created inside them, so a
    failed set-up never leaves a link in the root namespace. ``mtu``: of every veth end (1500, plain
    Ethernet; 9000, datacenter jumbo frames: fewer packets for the kernel to handle per byte)."""
    names = [node_ns(i) for i in range(nodes)] + ([SWITCH_NS] if nodes > 2 else [])
    up = [f"ip netns add {ns}" for ns in names] + [f"ip -n {ns} link set lo up" for ns in names]
    down = [f"ip -n {node_ns(i)} link del {node_dev(i)}" for i in range(nodes)]
    if nodes == 2:  # one cable
        up.append(f"ip link add {node_dev(0)} netns {node_ns(0)} type veth peer name {node_dev(1)} netns {node_ns(1)}")
    else:  # a cable from every node to a bridge in the switch namespace
        sw = f"ip -n {SWITCH_NS} link"
        up += [f"{sw} add {BRIDGE} type bridge", f"{sw} set {BRIDGE} up"]
        for i in range(nodes):
            up.append(
                f"ip link add {node_dev(i)} netns {node_ns(i)} type veth peer name {switch_dev(i)} netns {SWITCH_NS}"
            )
            up.append(f"{sw} set {switch_dev(i)} mtu {mtu}")
            up += [f"{sw} set {switch_dev(i)} master {BRIDGE}", f"{sw} set {switch_dev(i)} up"]
        down += [f"{sw} del {switch_dev(i)}" for i in range(nodes)] + [f"{sw} del {BRIDGE}"]
    for i in range(nodes):
        up.append(f"ip -n {node_ns(i)} link set {node_dev(i)} mtu {mtu}")
        up.append(f"ip -n {node_ns(i)} addr add {SUBNET}.{i + 1}/24 dev {node_dev(i)}")
        up.append(f"ip -n {node_ns(i)} link set {node_dev(i)} up")
    down += [f"ip netns del {ns}" for ns in names]
    return [c.split() for c in up], [c.split() for c in down]


def rate_commands(nodes: int, rate: str) -> list[list[str]]:
    """Shape both directions of every node's link: each end's egress, peer or switch side included."""
    ends = [(node_ns(i), node_dev(i)) for i in range(nodes)]
    ends += [(SWITCH_NS, switch_dev(i)) for i in range(nodes) if nodes > 2]
    bps = rate_bps(rate)
    if bps is None:
        return [f"tc -n {ns} qdisc del dev {dev} root".split() for ns, dev in ends]
    # burst: at least one GSO super-packet (64 KiB) and 2 ms at the rate; latency bounds the queue
    burst = max(128 * 1024, int(bps / 8 * 0.002))
    return [
        f"tc -n {ns} qdisc replace dev {dev} root tbf rate {rate} burst {burst} latency 100ms".split()
        for ns, dev in ends
    ]


def _execute(cmd: list[str], *, check: bool) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


class Network:
    """One topology's namespaces: built on enter, removed once on exit, error, signal or atexit."""

    def __init__(self, nodes: int, mtu: int = 1500) -> None:
        self.nodes = nodes
        self.up, self.down = network_commands(nodes, mtu)
        self.closed = False

    def __enter__(self) -> Network:
        atexit.register(self.close)
        try:
            for cmd in self.up:
                _execute(cmd, check=True)
        except BaseException:
            self.close()
            raise
        return self

    def set_rate(self, rate: str) -> None:
        for cmd in rate_commands(self.nodes, rate):
            _execute(cmd, check=rate != "unshaped")  # deleting an absent qdisc is fine

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for cmd in self.down:  # a veth goes with its peer: later deletes may find nothing
                _execute(cmd, check=False)

    def __exit__(self, *exc) -> None:
        self.close()


def remove_stale_namespaces() -> None:
    """Namespaces left by a run killed with SIGKILL (the only exit that skips the tear-down)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listing.splitlines() if line.startswith(f"{PREFIX}-")):
        print(f"# removing stale namespace {name}", flush=True)
        _execute(["ip", "netns", "del", name], check=False)


def check_privileges() -> None:
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"bench_bandwidth.py needs {' and '.join(missing)} (iproute2) to build shaped links")
    if os.geteuid() != 0:
        sys.exit(
            "bench_bandwidth.py builds network namespaces and tc shapers, which needs root: run it with "
            "sudo, or use --dry-run to print the commands, or --loopback to run unshaped without root"
        )


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: workers killed, links removed


# ---------------------------------------------------------------- the plan


def rounds_for(tau: int, args) -> int:
    """At least 4 rounds (two steady ones once the ends are excluded), ``--min-steps`` when it fits."""
    return min(args.max_rounds, max(4, math.ceil(args.min_steps / tau)))


def make_block(args, *, ranks: int, model: str, rate: str, taus: list[int], methods: list[str]) -> Block:
    """Every run sits between two no_comm runs, its limit is their mean: load that comes and goes on a
    shared machine then moves a run and its limit together."""
    runs = [Run("ddp", 1, args.ddp_steps)] if "ddp" in methods else []
    for tau in taus:
        runs += [Run(m, tau, rounds_for(tau, args)) for m in methods if m in CO2_SETTINGS]
    runs = runs * args.repeats
    if "no_comm" in methods:
        limit = Run("no_comm", 1, args.limit_steps)
        runs = [limit] + [r for run in runs for r in (run, limit)]
    return Block(ranks, args.ranks_per_node, rate, model, runs, batch=args.batch)


def build_plan(args) -> list[Block]:
    base = dict(ranks=args.ranks, model=args.model, methods=args.methods)
    blocks = [make_block(args, **base, rate=rate, taus=args.taus) for rate in args.rates]
    if args.extras:  # at the slowest link only; DiLoCo communicates exactly as local SGD, left out for time
        slow = min(args.rates, key=lambda r: rate_bps(r) or math.inf)
        methods = [m for m in args.methods if m != "diloco"]
        blocks.append(make_block(args, ranks=args.ranks, model="large", rate=slow, taus=[12], methods=methods))
        blocks.append(make_block(args, ranks=2 * args.ranks, model=args.model, rate=slow, taus=[48], methods=methods))
    return blocks


def _method_and_link(run: Run, block: Block) -> tuple[str, float]:
    bps = rate_bps(block.rate)
    return {"ddp": "data_parallel", "diloco": "local_sgd", "co2_node": "co2"}.get(
        run.method, run.method
    ), 0.95 * bps if bps else UNSHAPED_BPS


def estimate_run_s(run: Run, block: Block) -> float:
    """scaling_model's step time with this machine's compute per step (ranks beyond the cores share them)."""
    method, bps = _method_and_link(run, block)
    step = step_time_s(method, block.step_s, gpt2_params(MODELS[block.model]), bps, block.nodes, tau=run.tau)
    return run.tau * run.rounds * step


def startup_estimate_s(block: Block) -> float:
    """Ranks importing torch and transformers, the probe's three all-reduces, four warm-up steps."""
    _, bps = _method_and_link(Run("ddp", 1, 1), block)
    probe = ring_allreduce_s(4 * gpt2_params(MODELS[block.model]), block.nodes, bps)
    return STARTUP_S * max(1.0, block.ranks / (os.cpu_count() or 1)) + 3 * probe + 4 * block.step_s


def estimate_block_s(block: Block) -> float:
    return startup_estimate_s(block) + sum(estimate_run_s(r, block) + 3.0 for r in block.runs)


# ---------------------------------------------------------------- inside a rank


def build_model(cfg: dict, seed: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**cfg))


def train(run: Run, cfg: dict, rank: int, device: str, batch: int, ranks_per_node: int = 1) -> dict:
    """One method for tau x rounds steps; per-step times, for the CO2 engine the waits per boundary,
    and the bytes this rank's node sent over its link (its veth's tx counter; None on loopback)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from co2_hf import CO2, CO2Config

    model = build_model(cfg, seed=rank).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    co2 = None
    if run.method == "ddp":
        model = DistributedDataParallel(model)
    elif run.method in CO2_SETTINGS:
        k = ranks_per_node if run.method == "co2_node" else 1
        settings = CO2Config(co2_local_steps=run.tau, co2_worker_size=k, **CO2_SETTINGS[run.method])
        co2 = CO2(model, settings, optimizer=optimizer)
    gen = torch.Generator().manual_seed(rank)
    tx_start = _link_tx_bytes()
    times, waits, comms = [], [], []
    for _ in range(run.tau * run.rounds):
        tokens = torch.randint(0, cfg["vocab_size"], (batch, SEQ), generator=gen).to(device)
        start = time.perf_counter()
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        if co2 is not None:
            co2.average_gradients()  # inside a worker of several ranks (co2_node); else nothing
        optimizer.step()
        boundary = co2 is not None and co2.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if boundary:
            waits.append(co2.last_wait_s)
            comms.append(co2.last_comm_s)
    if co2 is not None:
        co2.finalize()  # the last round's all-reduce completes: every round's bytes are counted
    tx = _link_tx_bytes()
    # the load average shows whether anything else ran on the machine during the run
    return {
        "times": times,
        "waits": waits,
        "comms": comms,
        "load_1m": os.getloadavg()[0],
        "link_tx_bytes": tx - tx_start if tx is not None else None,
    }


def _link_tx_bytes() -> int | None:
    """Bytes sent so far through this node's link (the namespace's veth); None on loopback."""
    device = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    if device == "lo":
        return None
    return int(Path(f"/sys/class/net/{device}/statistics/tx_bytes").read_text())


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)  # the parent never reads half a file


def worker(spec_path: str) -> None:
    """A rank: time the all-reduce alone (the probe), then every run of the block in order."""
    import datetime

    import torch
    import torch.distributed as dist
    from bench_overlap import allreduce_alone

    spec = json.loads(Path(spec_path).read_text())
    out, cfg = Path(spec["out_dir"]), MODELS[spec["model"]]
    torch.set_num_threads(1)  # the ranks share the cores; gloo's threads compete with compute anyway
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    _write_json(out / f"probe.rank{rank}.json", {"allreduce_alone_s": allreduce_alone(gpt2_params(cfg), 3)})
    batch = spec["batch"]
    train(Run("no_comm", 1, 4), cfg, rank, spec["device"], batch)  # untimed: first calls are slow everywhere
    for i, run in enumerate(spec["runs"]):
        dist.barrier()  # every run starts together
        result = train(Run(**run), cfg, rank, spec["device"], batch, spec["ranks_per_node"])
        _write_json(out / f"run{i}.rank{rank}.json", result)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- running a block


class BlockFailed(RuntimeError):
    pass


def rank_command(block: Block, rank: int, spec_path: Path, *, loopback: bool) -> tuple[list[str], dict]:
    node = rank // block.ranks_per_node
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(spec_path)]
    env = {"RANK": str(rank), "WORLD_SIZE": str(block.ranks)}
    if loopback:
        env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    else:
        cmd = ["ip", "netns", "exec", node_ns(node), *cmd]
        env.update(MASTER_ADDR=f"{SUBNET}.1", GLOO_SOCKET_IFNAME=node_dev(node))
    return cmd, env


def _await(paths: list[Path], procs: list[subprocess.Popen], deadline: float, what: str) -> list[dict]:
    while not all(p.exists() for p in paths):
        failed = [p.returncode for p in procs if p.poll() is not None]
        if failed:
            raise BlockFailed(f"{what}: a rank exited (codes {failed}) before finishing")
        if time.monotonic() > deadline:
            raise BlockFailed(f"{what}: timed out")
        time.sleep(0.2)
    return [json.loads(p.read_text()) for p in paths]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # each rank leads its own session: only our processes
        p.wait()


def run_block(block: Block, workdir: Path, *, port: int, loopback: bool, device: str) -> tuple[list, list]:
    """Launch the ranks; return the probe per rank and, per run, its results per rank or an error."""
    spec = {"model": block.model, "batch": block.batch, "device": device, "out_dir": str(workdir), "timeout_s": 900}
    spec["ranks_per_node"] = block.ranks_per_node
    spec["runs"] = [asdict(r) for r in block.runs]
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs, results, probe = [], [None] * len(block.runs), None
    try:
        for rank in range(block.ranks):
            cmd, env = rank_command(block, rank, spec_path, loopback=loopback)
            with open(workdir / f"rank{rank}.log", "w") as log:  # the child keeps its own descriptor
                env = {**os.environ, **env, "MASTER_PORT": str(port)}
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                )
        ranks = range(block.ranks)
        deadline = time.monotonic() + 3 * startup_estimate_s(block) + 120
        probe = _await([workdir / f"probe.rank{r}.json" for r in ranks], procs, deadline, "probe")
        for i, run in enumerate(block.runs):
            deadline = time.monotonic() + 2 * estimate_run_s(run, block) + 120  # every run is bounded
            started = time.monotonic()
            results[i] = _await([workdir / f"run{i}.rank{r}.json" for r in ranks], procs, deadline, run.method)
            print(
                f"# {block.rate} x{block.ranks} {block.model}: {run.method} tau {run.tau} took "
                f"{time.monotonic() - started:.0f} s",
                flush=True,
            )
        for p in procs:
            p.wait(timeout=60)
    except (BlockFailed, subprocess.TimeoutExpired) as error:
        tail = (workdir / "rank0.log").read_text()[-2000:]
        print(f"# block {block.rate} x{block.ranks} {block.model} failed: {error}\n# rank 0 log:\n{tail}", flush=True)
        results = [r if r is not None else f"{error} (see the rank logs)" for r in results]
    finally:
        _kill(procs)
    return probe, results


# ---------------------------------------------------------------- summaries


def _steady_per_step(run: Run, times: list[float]) -> float:
    """Median over the steady rounds of a round's wall time, per step."""
    rounds = [sum(times[k * run.tau : (k + 1) * run.tau]) for k in range(1, run.rounds - 1)]
    return statistics.median(rounds) / run.tau


def _slowest_per_step(run: Run, per_rank: list[dict]) -> float:
    """The slowest rank's steady time per step. Any method that synchronises runs at its pace (the
    others wait for it), so the no-communication limit of a data-parallel job is the slowest rank
    too; the cores of a shared machine differ in speed by a few percent from run to run."""
    return max(_steady_per_step(run, r["times"]) for r in per_rank)


def probe_line(block: Block, probe: list[dict]) -> dict:
    seconds = max(p["allreduce_alone_s"] for p in probe)
    params = gpt2_params(MODELS[block.model])
    sent_bits = 2 * (block.nodes - 1) / block.nodes * 4 * params * 8  # ring: what each node sends
    bps = rate_bps(block.rate)
    return {
        **_ids(block),
        "method": "probe",
        "allreduce_alone_s": round(seconds, 4),
        "achieved_mbit": round(sent_bits / seconds / 1e6, 1),
        "nominal_mbit": bps / 1e6 if bps else None,
    }


def _ids(block: Block) -> dict:
    return {
        "rate": block.rate,
        "ranks": block.ranks,
        "nodes": block.nodes,
        "ranks_per_node": block.ranks_per_node,
        "model": block.model,
        "params": gpt2_params(MODELS[block.model]),
        "batch": block.batch,
    }


def run_line(block: Block, run: Run, per_rank: list[dict], alone: float, limit: float | None) -> dict:
    """The JSON line of one run; ``limit`` is the block's no_comm time per step."""
    step = statistics.median(statistics.median(r["times"][run.tau : run.tau * (run.rounds - 1)]) for r in per_rank)
    slowest = _slowest_per_step(run, per_rank)
    line = {
        **_ids(block),
        "method": run.method,
        "tau": run.tau if run.method in CO2_SETTINGS else None,
        "rounds": run.rounds,
        "step_time_s": round(step, 4),
        "time_per_step_s": round(slowest, 4),
        "tokens_per_s": round(block.ranks * block.batch * SEQ / slowest, 1),
        "allreduce_alone_s": round(alone, 4),
        "load_1m": round(per_rank[0]["load_1m"], 2),
    }
    tx = [r.get("link_tx_bytes") for r in per_rank]
    if tx and all(t is not None for t in tx):  # every rank of a node reads the node's one counter
        per_node = [tx[n * block.ranks_per_node] for n in range(block.nodes)]
        line["link_tx_bytes_per_round"] = round(statistics.fmean(per_node) / run.rounds)
        line["link_tx_predicted_bytes_per_round"] = round(predicted_link_bytes(run.method, block))
    exposed, hidden = 0.0, None
    if run.method in CO2_SETTINGS:
        waits = [max(w) for w in zip(*(r["waits"][1:-1] for r in per_rank))]  # max over ranks per round
        comms = [max(c) for c in zip(*(r["comms"][1:-1] for r in per_rank))]
        exposed = statistics.median(waits)
        hidden = max(0.0, 1 - sum(waits) / sum(comms)) if sum(comms) > 0 else None
        line["comm_s"] = round(statistics.median(comms), 4)
    elif run.method == "ddp" and limit is not None:
        exposed = max(0.0, slowest - limit)
        hidden = min(1.0, max(0.0, 1 - exposed / alone))
    if limit is not None:
        round_compute = run.tau * limit
        line["exposed_comm_per_round_s"] = round(exposed, 4)
        line["exposed_frac_of_round"] = round(exposed / round_compute, 4)
        line["comm_over_compute"] = round(alone / round_compute, 4) if run.method != "no_comm" else None
        line["rel_to_limit"] = round(limit / slowest, 4)
        line["limit_tokens_per_s"] = round(block.ranks * block.batch * SEQ / limit, 1)
    line["hidden_frac"] = round(hidden, 4) if hidden is not None else None
    return line


def predicted_link_bytes(method: str, block: Block) -> float:
    """Bytes a node sends over its link per round (per step for ddp), for fp32 ring all-reduces of
    the model's size S: a ring of R members makes every hop carry 2 (R-1)/R x S, and a ring over
    all ranks in node order leaves each node through one hop. With one worker per node
    (co2_node), k rings of one rank per node each carry S/k, and all k leave the node."""
    if method == "no_comm":
        return 0.0
    size = 4 * gpt2_params(MODELS[block.model])
    members = block.nodes if method == "co2_node" else block.ranks
    return 2 * (members - 1) / members * size


def _limit_for(i: int, block: Block, per_step: list[float | None]) -> float | None:
    """Mean time per step of the no_comm runs next to run ``i`` (of all of them, for a no_comm run)."""
    limits = [j for j, run in enumerate(block.runs) if run.method == "no_comm" and per_step[j] is not None]
    if block.runs[i].method != "no_comm":
        before, after = [j for j in limits if j < i], [j for j in limits if j > i]
        limits = before[-1:] + after[:1]
    return statistics.fmean(per_step[j] for j in limits) if limits else None


def block_lines(block: Block, probe: list[dict] | None, results: list) -> list[dict]:
    if probe is None:
        return [
            {**_ids(block), "method": run.method, "tau": run.tau, "error": str(res)}
            for run, res in zip(block.runs, results)
        ]
    head = probe_line(block, probe)
    per_step = [None if isinstance(res, str) else _slowest_per_step(run, res) for run, res in zip(block.runs, results)]
    lines = [head]
    for i, (run, res) in enumerate(zip(block.runs, results)):
        if isinstance(res, str):
            lines.append({**_ids(block), "method": run.method, "tau": run.tau, "error": res})
        else:
            lines.append(run_line(block, run, res, head["allreduce_alone_s"], _limit_for(i, block, per_step)))
    return lines


LABELS = {
    "ddp": "data parallel (DDP)",
    "local_sgd": "local SGD",
    "diloco": "DiLoCo-style",
    "co2": "CO2",
    "co2_node": "CO2, one worker per node",
}


def plot(lines: list[dict], path: str, *, ranks: int, model: str) -> None:
    """Throughput relative to the no-communication limit against link rate, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in lines if r["ranks"] == ranks and r["model"] == model and "rel_to_limit" in r]
    shaped = sorted({rate_bps(r["rate"]) / 1e6 for r in rows if r["rate"] != "unshaped"})
    unshaped_x = 10 * max(shaped, default=1000)  # drawn to the right of the fastest shaped link
    x_of = lambda rate: rate_bps(rate) / 1e6 if rate != "unshaped" else unshaped_x  # noqa: E731
    taus = sorted({r["tau"] for r in rows if r["tau"]})
    fig, axes = plt.subplots(1, len(taus), sharey=True, figsize=(5.5 * len(taus), 4.2), squeeze=False)
    for ax, tau in zip(axes[0], taus):
        for method, label in LABELS.items():
            pts = sorted(
                (x_of(r["rate"]), r["rel_to_limit"]) for r in rows if r["method"] == method and r["tau"] in (tau, None)
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.axhline(1.0, color="gray", linestyle="--", label="no communication (limit)")
        ax.set_xscale("log")
        ticks = [*shaped, unshaped_x]
        ax.set_xticks(ticks, [f"{x:g} Mbit/s" for x in shaped] + ["unshaped"])
        ax.minorticks_off()
        ax.set_title(f"{ranks} ranks, {model} model, tau {tau} (DDP: every step)")
        ax.set_xlabel("link rate (tc tbf, both directions)")
        ax.set_ylim(0, 1.1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tokens/s relative to the no-communication limit")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    csv = lambda kind: lambda text: [kind(x) for x in text.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=csv(str), default=["unshaped", "1gbit", "300mbit", "100mbit"])
    parser.add_argument("--taus", type=csv(int), default=[4, 12], help="taus of the CO2-engine methods")
    parser.add_argument(
        "--methods",
        type=csv(str),
        default=[m for m in METHODS if m != "co2_node"],
        help=f"among {', '.join(METHODS)} (co2_node: needs --ranks-per-node > 1)",
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks sharing one namespace (unshaped)")
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument(
        "--no-extras",
        dest="extras",
        action="store_false",
        help="skip the slowest-rate extras: 2x ranks at tau 48, and the large model",
    )
    parser.add_argument(
        "--batch", type=int, default=DEFAULT_BATCH, help=f"sequences of {SEQ} tokens per rank and step"
    )
    parser.add_argument("--mtu", type=int, default=1500, help="MTU of the veth links (1500; 9000: jumbo frames)")
    parser.add_argument("--min-steps", type=int, default=60, help="steps per CO2-engine run, at least 4 rounds")
    parser.add_argument("--max-rounds", type=int, default=8, help="rounds per CO2-engine run, at most")
    parser.add_argument("--ddp-steps", type=int, default=8)
    parser.add_argument("--limit-steps", type=int, default=12, help="steps of each no_comm run")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every method per block (--table: median)")
    parser.add_argument("--device", default="cpu", help="cuda: the GPU step-overhead check (never required)")
    parser.add_argument("--budget-min", type=float, default=60.0, help="refuse a plan estimated above this")
    parser.add_argument("--loopback", action="store_true", help="no namespaces (unshaped only, no root)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--plot", help="write the PNG plot here")
    parser.add_argument("--table", help="print the Markdown table of a JSONL written by --out, and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.methods) - set(METHODS)
    if unknown or args.ranks % args.ranks_per_node or args.ranks < 2:
        parser.error(f"methods must be among {METHODS}; --ranks >= 2, a multiple of --ranks-per-node")
    if "co2_node" in args.methods and (args.ranks_per_node < 2 or args.extras):
        parser.error("--methods co2_node makes each node one worker: it needs --ranks-per-node >= 2 and --no-extras")
    if args.loopback and (args.rates != ["unshaped"] or args.extras):
        parser.error("--loopback cannot shape: use --rates unshaped --no-extras")
    for rate in args.rates:
        rate_bps(rate)
    return args


def print_dry_run(blocks: list[Block], mtu: int) -> None:
    show = lambda cmd: print("+ " + " ".join(cmd))  # noqa: E731
    for nodes, group in _topologies(blocks):
        up, down = network_commands(nodes, mtu)
        print(f"# topology: {nodes} namespaces")
        for cmd in up:
            show(cmd)
        for block in group:
            print(
                f"# block: {block.rate}, {block.ranks} ranks, {block.model} model, "
                f"{len(block.runs)} runs, ~{estimate_block_s(block) / 60:.1f} min"
            )
            for cmd in rate_commands(nodes, block.rate):
                show(cmd)
            for rank in range(block.ranks):
                cmd, env = rank_command(block, rank, Path("SPEC"), loopback=False)
                show([f"{k}={v}" for k, v in env.items()] + cmd)
        for cmd in down:
            show(cmd)


def _topologies(blocks: list[Block]) -> list[tuple[int, list[Block]]]:
    """Consecutive blocks on the same number of nodes share one network."""
    groups: list[tuple[int, list[Block]]] = []
    for block in blocks:
        if groups and groups[-1][0] == block.nodes:
            groups[-1][1].append(block)
        else:
            groups.append((block.nodes, [block]))
    return groups


def run_plan(blocks: list[Block], args) -> list[dict]:
    lines, start, index, estimated_done = [], time.monotonic(), 0, 0.0
    for nodes, group in _topologies(blocks):
        with _network(nodes, args.loopback, args.mtu) as net:
            for block in group:
                index += 1
                elapsed = time.monotonic() - start
                slowdown = max(1.0, elapsed / estimated_done) if estimated_done else 1.0  # a busy machine
                if elapsed + slowdown * estimate_block_s(block) > 60 * args.budget_min:
                    print(f"# skipping block {block.rate} x{block.ranks} {block.model}: over --budget-min", flush=True)
                    continue
                estimated_done += estimate_block_s(block)
                if net is not None:
                    net.set_rate(block.rate)
                with tempfile.TemporaryDirectory(prefix=f"{PREFIX}-") as tmp:
                    port = _free_port() if args.loopback else 29500 + index
                    probe, results = run_block(block, Path(tmp), port=port, loopback=args.loopback, device=args.device)
                block_out = block_lines(block, probe, results)
                for line in block_out:
                    _emit(line, args.out)
                _warn_if_contended(block, block_out)
                lines += block_out
    print(f"# total wall time {(time.monotonic() - start) / 60:.1f} min", flush=True)
    return lines


def _warn_if_contended(block: Block, lines: list[dict]) -> None:
    """The ranks alone keep the load average near their count; more means other work shared the cores."""
    load = max((line.get("load_1m", 0.0) for line in lines), default=0.0)
    if load > block.ranks + 1:
        print(
            f"# warning: load average up to {load:.1f} during this block of {block.ranks} ranks: other "
            "processes competed for the cores, so its ratios are not reliable",
            flush=True,
        )


def _network(nodes: int, loopback: bool, mtu: int):
    import contextlib

    return contextlib.nullcontext() if loopback else Network(nodes, mtu)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _emit(line: dict, out: str | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")


def markdown_table(lines: list[dict]) -> str:
    """The README's table: one row per cell (link, ranks, model, method, tau), probes and no_comm
    runs left out, in file order; with repeats, the median of each column and the number of runs."""
    head = (
        "| link | ranks | model | method | tau | step (s) | tokens/s | vs limit | all-reduce alone (s) "
        "| exposed per round (s) | hidden | load | runs |"
    )
    cells: dict[tuple, list[dict]] = {}
    for x in lines:
        if x["method"] not in ("probe", "no_comm") and "error" not in x:
            cells.setdefault((x["rate"], x["ranks"], x["model"], x["method"], x.get("tau")), []).append(x)
    rows = [head, "|---" * 13 + "|"]
    for (rate, ranks, model, method, tau), runs in cells.items():
        med = {key: statistics.median(r[key] for r in runs) for key in _TABLE_KEYS}
        hidden = [r["hidden_frac"] for r in runs if r.get("hidden_frac") is not None]
        hidden_text = f"{statistics.median(hidden):.2f}" if hidden else "-"
        rows.append(
            f"| {rate} | {ranks} | {model} | {method} | {tau or '-'} | {med['time_per_step_s']:.3f} "
            f"| {med['tokens_per_s']:.0f} | **{med['rel_to_limit']:.2f}** | {med['allreduce_alone_s']:.3f} "
            f"| {med['exposed_comm_per_round_s']:.3f} | {hidden_text} | {med['load_1m']:.1f} | {len(runs)} |"
        )
    return "\n".join(rows)


_TABLE_KEYS = (
    "time_per_step_s",
    "tokens_per_s",
    "rel_to_limit",
    "allreduce_alone_s",
    "exposed_comm_per_round_s",
    "load_1m",
)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.table:
        lines = [json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()]
        return print(markdown_table(lines))
    blocks = build_plan(args)
    total = sum(estimate_block_s(b) for b in blocks)
    print(
        f"# plan: {len(blocks)} blocks, {sum(len(b.runs) for b in blocks)} runs, estimated "
        f"{total / 60:.0f} min (budget {args.budget_min:g} min)",
        flush=True,
    )
    if total > 60 * args.budget_min:
        sys.exit("the estimate exceeds --budget-min: lower --min-steps, --ddp-steps or the matrix")
    if args.dry_run:
        return print_dry_run(blocks, args.mtu)
    if not args.loopback:
        check_privileges()
        remove_stale_namespaces()
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        lines = run_plan(blocks, args)
    finally:  # main() may run inside another program (the tests)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.plot and lines:
        plot(lines, args.plot, ranks=args.ranks, model=args.model)


if __name__ == "__main__":
    main()
