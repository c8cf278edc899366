"""What a benchmark runs: methods, models, blocks of runs, their time estimates, and where each rank runs.

A block is one launch of the ranks (one topology, one link rate, one model) that runs several
methods in turn, each between two ``no_comm`` runs. The estimates come from ``scaling_model`` with
this machine's measured compute per step; they bound every wait of the orchestration and the
``--budget-min`` check. The placement says which process-group backend and device each rank uses
and the environment that tells it so: with ``--device cuda`` one GPU per rank and NCCL.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from ..bench_overlap import MODEL
from ..scaling_model import gpt2_params, ring_allreduce_s, step_time_s
from .netns import SUBNET, node_dev, node_ns, rate_bps

CO2_SETTINGS = {  # the methods as docs/accelerate.md tables them ("The methods it covers")
    "local_sgd": dict(co2_overlap=False, co2_outer_lr=1.0, co2_outer_momentum=0.0),
    "diloco": dict(co2_overlap=False, co2_nesterov=True, co2_outer_lr=0.7, co2_outer_momentum=0.9),
    # full overlap: the whole model's all-reduce hides behind the next round
    "co2": dict(co2_overlap=True, co2_fragments=1),
    # streaming: co2_fragments = tau, one fragment (1/tau of the bytes) launched after every step and
    # applied one step later (docs/algorithm.md, section 7b)
    "co2_stream": dict(co2_overlap=True, co2_fragments="tau"),
    # CO2 with one worker per node (co2_worker_size = --ranks-per-node): data parallel inside the
    # node, and each rank all-reduces 1/k of the outer gradient across nodes
    "co2_node": dict(co2_overlap=True, co2_fragments=1),
}
# The libraries a user would pick instead of CO2, each run through its own documented API
# (``peers.py``), and the package each needs: without it, its runs are skipped with a message.
PEERS = {
    "torchft_diloco": "torchft",  # torchft's DiLoCo, one fragment, blocking (fragment_sync_delay 0)
    "torchft_streaming": "torchft",  # torchft's streaming DiLoCo: fragments, each overlapped
    "accelerate_local_sgd": "accelerate",  # accelerate.local_sgd.LocalSGD
    "torch_post_local_sgd": "torch",  # torch's PostLocalSGDOptimizer with the post-local-SGD DDP hook
}
METHODS = ("no_comm", "ddp", "local_sgd", "diloco", "co2", "co2_stream", "co2_node", *PEERS)
ROUND_METHODS = (*CO2_SETTINGS, *PEERS)  # the methods that communicate once per round of tau steps
WIRES = ("float32", "bfloat16", "int8", "int4", "sparse")  # co2_comm_dtype of the CO2-engine runs (--wires)
QUANT_BLOCK = 128  # co2_quant_block: CO2Config's default


def co2_settings(method: str, tau: int) -> dict:
    """The CO2Config fields of a CO2-engine method at ``tau`` ("tau" stands for the round's length).
    The inner second moment's exchange is off: every measurement in docs/performance.md ran before it
    was the default, and the throughput compared here is the outer gradient's."""
    fields = {k: tau if v == "tau" else v for k, v in CO2_SETTINGS[method].items()}
    return {"co2_local_steps": tau, "co2_global_second_moment_every": 0, **fields}


MODELS = {
    "small": MODEL,
    "large": {**MODEL, "n_embd": 512, "n_layer": 8, "n_head": 8},
    "tiny": {**MODEL, "vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 2},
}
DEVICES = ("cpu", "cuda")
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
    tau: int  # steps per round: tau for the round methods and no_comm, 1 for ddp
    rounds: int
    wire: str = "float32"  # co2_comm_dtype of a CO2-engine run
    repeat: int = 0  # which pass over the block's methods: compared with that pass's no_comm run
    code: str = ""  # a CO2-engine run on another checkout's engine (--against): its commit; "" this one


def wire_bytes_per_value(wire: str) -> float:
    """Bytes on the wire per outer-gradient value: the dtype's, or a code plus its share of the block's
    fp32 scale (core/codecs/quant.py; the exact fp32 header of each all-reduce is left out); sparse: the
    payload of CO2Config()'s sparse settings (core/codecs/sparse.py), which an all-gather between 2 ranks
    sends once, as a ring all-reduce sends 2 (R-1)/R = 1 of a dense vector (more ranks: not comparable)."""
    if wire == "sparse":
        from co2_hf import CO2Config
        from co2_hf.config import bytes_per_value

        config = CO2Config(co2_comm_dtype="sparse")
        return bytes_per_value(block=config.co2_quant_block, keep=config.sparse_keep, bits=config.co2_sparse_bits)
    return {"float32": 4.0, "bfloat16": 2.0, "int8": 1 + 4 / QUANT_BLOCK, "int4": 0.5 + 4 / QUANT_BLOCK}[wire]


@dataclass
class Block:
    """One launch of the ranks: one topology, one link rate, one model, several runs."""

    ranks: int
    ranks_per_node: int
    rate: str
    model: str
    runs: list[Run]
    batch: int = DEFAULT_BATCH  # sequences of SEQ tokens per rank and step
    # what the ranks need besides the runs: ``trees`` (--against: its commit -> the checkout's path),
    # ``torchft_fragments`` and ``torchft_delay`` (torchft_streaming)
    options: dict = field(default_factory=dict)
    invocation: str = ""  # when the command started: with a run's repeat, which runs were one pass

    @property
    def step_s(self) -> float:
        """Estimated compute per step (ranks beyond the cores share them)."""
        share = max(1.0, self.ranks / (os.cpu_count() or 1))
        return STEP_S[self.model] * self.batch / DEFAULT_BATCH * share

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node


# ---------------------------------------------------------------- the plan


def rounds_for(tau: int, args) -> int:
    """At least 4 rounds (two steady ones once the ends are excluded), ``--min-steps`` when it fits."""
    return min(args.max_rounds, max(4, math.ceil(args.min_steps / tau)))


def make_block(args, *, ranks: int, model: str, rate: str, taus: list[int], methods: list[str]) -> Block:
    """The methods interleaved, one pass per repeat (A B C A B C ...), each pass led by a no_comm
    run (in rounds of the block's longest tau: the same statistic) and the last one followed by
    another. Every run is compared with the no-communication time interpolated, by its place,
    between the no_comm runs before and after its pass: a machine whose speed drifts, or load that
    comes and goes, then moves a run and its limit together wherever it sits in the pass, and the
    repeats give each figure a median and a range."""
    one_pass = [Run("ddp", 1, args.ddp_steps)] if "ddp" in methods else []
    for tau in taus:
        for method in (m for m in methods if m in ROUND_METHODS):
            one_pass += _round_runs(method, tau, args)
    limit = [Run("no_comm", max(taus), rounds_for(max(taus), args))] if "no_comm" in methods else []
    runs = []
    for repeat in range(args.repeats):
        runs += [dataclasses.replace(run, repeat=repeat) for run in limit + one_pass]
    runs += [dataclasses.replace(run, repeat=args.repeats) for run in limit]  # closes the last pass
    options = dict(
        trees=dict([args.against]) if args.against else {},  # (its commit, its path)
        torchft_fragments=args.torchft_fragments,
        torchft_delay=args.torchft_delay,
    )
    return Block(
        ranks, args.ranks_per_node, rate, model, runs, batch=args.batch, options=options, invocation=args.invocation
    )


def _round_runs(method: str, tau: int, args) -> list[Run]:
    """A peer's run, or a CO2-engine method's: one per wire type, each on this checkout's engine
    and then, with ``--against``, on the other's (next to each other in time)."""
    rounds = rounds_for(tau, args)
    if method in PEERS:
        return [Run(method, tau, rounds)]
    codes = ["", args.against[0]] if args.against else [""]
    return [Run(method, tau, rounds, wire, code=code) for wire in args.wires for code in codes]


def build_plan(args) -> list[Block]:
    base = dict(ranks=args.ranks, model=args.model, methods=args.methods)
    blocks = [make_block(args, **base, rate=rate, taus=args.taus) for rate in args.rates]
    if args.extras:  # at the slowest link only; DiLoCo communicates exactly as local SGD, left out for time
        slow = min(args.rates, key=lambda r: rate_bps(r) or math.inf)
        methods = [m for m in args.methods if m != "diloco"]
        blocks.append(make_block(args, ranks=args.ranks, model="large", rate=slow, taus=[12], methods=methods))
        blocks.append(make_block(args, ranks=2 * args.ranks, model=args.model, rate=slow, taus=[48], methods=methods))
    return blocks


# ---------------------------------------------------------------- estimates


SCALING_METHOD = {  # scaling_model's name of each method: how its communication meets compute
    "ddp": "data_parallel",
    "diloco": "local_sgd",
    "co2_node": "co2",
    "co2_stream": "co2",
    "torchft_diloco": "local_sgd",
    "torchft_streaming": "co2",
    "accelerate_local_sgd": "local_sgd",
    "torch_post_local_sgd": "local_sgd",
}


def _method_and_link(run: Run, block: Block) -> tuple[str, float]:
    """scaling_model's method, and the rate at which its fp32 bytes would cross (a narrower wire
    type sends fewer bytes: as if the link were that much faster)."""
    bps = rate_bps(block.rate)
    method = SCALING_METHOD.get(run.method, run.method)
    return method, (0.95 * bps if bps else UNSHAPED_BPS) * 4 / wire_bytes_per_value(run.wire)


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


# ---------------------------------------------------------------- where each rank runs


def backend_and_device(device: str, local_rank: int) -> tuple[str, str]:
    """The default group's backend and the rank's device: gloo on the CPU, or NCCL on GPU ``local_rank``
    of the rank's node (CO2's state follows the model there, ``co2_state_device`` being ``same``)."""
    if device == "cuda":
        return "nccl", f"cuda:{local_rank}"
    return "gloo", "cpu"


def visible_gpus(count: int) -> list[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES names them (``count`` if unset)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [g for g in listed.split(",") if g] if listed is not None else [str(i) for i in range(count)]


def check_gpus(blocks: list[Block], available: int) -> None:
    """``--device cuda`` runs one rank per GPU, and every simulated node is on this machine: the
    largest block needs as many GPUs as it has ranks. Refused before any rank starts."""
    needed = max(block.ranks for block in blocks)
    if needed > available:
        raise SystemExit(
            f"--device cuda runs one rank per GPU and all nodes on this machine: the plan has a block of "
            f"{needed} ranks (--ranks, and twice that in the slowest-rate extras unless --no-extras) but "
            f"torch sees {available} GPU(s). Lower --ranks, add --no-extras, or use --device cpu."
        )


def rank_env(block: Block, rank: int, device: str, *, loopback: bool, gpus: list[str]) -> dict[str, str]:
    """The environment that places one rank: its rank, its node's address and interface, and with
    ``--device cuda`` its node's GPUs and how NCCL must reach the other nodes.

    Each namespace is one node with ``ranks_per_node`` GPUs (CUDA_VISIBLE_DEVICES: its slice of
    ``gpus``, so LOCAL_RANK indexes it as on a real node). NCCL tells hosts apart by a host hash
    that is the same in every namespace of one machine, so it would join all ranks by P2P or shared
    memory and never touch the shaped link; NCCL_HOSTID gives each node its own, and NCCL_NET=Socket
    (with InfiniBand off) makes the inter-node traffic the TCP of the node's veth, which tc shapes.
    Ranks of one node still use P2P between their GPUs, as inside a real node. On loopback all ranks
    are one host: LOCAL_RANK is the rank and NCCL picks its fastest path.
    """
    node, k = rank // block.ranks_per_node, block.ranks_per_node
    local_rank = rank if loopback else rank % k
    env = {"RANK": str(rank), "WORLD_SIZE": str(block.ranks), "LOCAL_RANK": str(local_rank)}
    env["OMP_NUM_THREADS"] = "1"  # one core per rank: accelerate would set 2 threads where it is unset
    if loopback:
        env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
        return env
    env.update(MASTER_ADDR=f"{SUBNET}.1", GLOO_SOCKET_IFNAME=node_dev(node))
    if device == "cuda":
        env.update(
            CUDA_VISIBLE_DEVICES=",".join(gpus[node * k : (node + 1) * k]),
            NCCL_SOCKET_IFNAME=node_dev(node),
            NCCL_HOSTID=node_ns(node),
            NCCL_NET="Socket",
            NCCL_IB_DISABLE="1",
        )
    return env
