"""Throughput and hidden communication on bandwidth-limited links: data parallel, local SGD, DiLoCo, CO2.

    sudo .venv/bin/python scripts/bench_bandwidth.py --out results/bench_bandwidth.jsonl \
        --plot docs/bench_bandwidth.png
    python scripts/bench_bandwidth.py --dry-run      # the plan, its estimate and every ip/tc command; no root
    python scripts/bench_bandwidth.py --loopback --rates unshaped --model tiny   # no namespaces, no root

The links are real: one network namespace per node, joined by a veth pair (two nodes) or through
a bridge in a switch namespace (more nodes), each node's link shaped with ``tc tbf`` in both
directions (the node side's egress is its upload; the egress of the peer or switch side is its
download). Ranks run inside the namespaces with gloo bound to the node's interface
(GLOO_SOCKET_IFNAME); ``--ranks-per-node`` puts several ranks in one namespace, where they talk
over loopback, so only the inter-node link is shaped. Only the rate can be shaped (no netem here).

Devices: ``--device cpu`` (the default) runs every rank on the CPU with a gloo default group.
``--device cuda`` gives every rank its own GPU: a namespace is a node with ``--ranks-per-node`` GPUs
(its slice of CUDA_VISIBLE_DEVICES), each rank calls ``torch.cuda.set_device(LOCAL_RANK)``, the
default group is NCCL and CO2's state lives on the GPU. All nodes are on this one machine, so a
block of N ranks needs N GPUs (refused before any rank starts otherwise). NCCL would see one host
and join the ranks by P2P or shared memory, past the shaped link: each node gets its own
NCCL_HOSTID and NCCL talks TCP (NCCL_NET=Socket) over the node's veth, which tc shapes; ranks of
one node still use P2P. Step times are taken after a device synchronisation; CO2's wait and
launch-to-done times are the engine's own (``last_wait_s``, ``last_comm_s``: CUDA events on NCCL).

Methods, one GPT-2 style model (``bench_overlap.py``'s config, 10.3M parameters; ``large`` is
29.4M): ``ddp`` (torch DDP, AdamW, a gradient all-reduce every step), ``local_sgd`` and ``diloco``
(the CO2 engine with a blocking outer step), ``co2`` (overlapped) and ``co2_stream`` (the defaults:
streaming, F = tau), and ``no_comm`` (each rank trains alone: the compute-bound limit). The peers a
user would pick instead, each through its own library (``peers.py``; skipped with a message where
the library is missing): ``torchft_diloco`` and ``torchft_streaming`` (torchft's DiLoCo, one
Lighthouse, one replica group per rank), ``accelerate_local_sgd`` (accelerate's LocalSGD) and
``torch_post_local_sgd`` (torch's PostLocalSGDOptimizer). ``--against TREE`` runs every CO2-engine
run also on another checkout's engine, next to this one's.

Repeats: ``--repeats N`` makes N passes over the methods, interleaved (A B C A B C ...), each pass
led by a ``no_comm`` run in rounds of the block's longest tau and the last followed by one more;
every run is compared with the no-communication time interpolated, by its place, between the
no_comm runs before and after its pass: a machine whose speed drifts, or load that comes and goes,
moves a run and its limit together wherever it sits in the pass, and the passes give each figure
a median and a range (``compare.py``; ``--table``, and ``--doc``
writes that comparison, dated, into docs/performance.md). Each block (one rate, one topology, one
model) first times a blocking all-reduce of the model's size (the ``probe`` line: its achieved
rate checks the shaping). At the slowest rate the extras follow: twice the ranks at tau 48, and the
large model (DiLoCo communicates exactly as local SGD: left out there).

Steady state: a run's first and last round are excluded (a round is tau steps; one step for ddp).
Every number is the slowest rank's: a method that synchronises runs at its pace, so the limit of a
data-parallel job is the slowest rank too (the cores of a shared machine differ by a few percent
from run to run). Fields of each JSON line:
``step_time_s`` (median step), ``time_per_step_s`` (median round / tau: includes the boundary step
and any exposed wait), ``tokens_per_s`` (all ranks at that pace),
``allreduce_alone_s`` (the block's probe), ``exposed_comm_per_round_s`` (CO2 engine: the wait at a
boundary, max over ranks, median over rounds; ddp: its step time minus the limit's; a peer, whose
library keeps no timings: its round minus the limit's), ``exposed_frac_of_round`` and
``comm_over_compute`` (exposed time and all-reduce alone over one round of the limit's compute),
``hidden_frac`` (CO2 engine: 1 - sum(wait) / sum(launch to done); ddp: 1 - exposed / all-reduce
alone), ``rel_to_limit`` (tokens/s over the interpolated no-communication rate at the run's place; for a
no_comm run, over the block's mean), ``repeat``, ``invocation`` (when the command started: with ``repeat``, one pass),
``code`` (``--against``: the other engine's commit), ``library`` (a peer's package and version),
``fragments`` and ``delay`` (torchft_streaming's), ``date``, and ``load_1m`` (the load average at the
run's end: above the rank count, other work shared the cores).

The code, one module per job: ``netns`` (namespaces, veths, tc), ``plan`` (methods, blocks,
estimates, where each rank runs), ``worker`` (inside a rank), ``launch`` (running a plan's blocks),
``peers`` (the other libraries' training steps), ``analysis`` (JSON lines, the table of every
figure), ``compare`` (across repeats: medians, ranges, CO2 against each), ``plot`` and ``cli``;
``scripts/bench_bandwidth.py`` is the command.
"""
