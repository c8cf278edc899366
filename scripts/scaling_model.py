"""An analytic model of step time for data parallel, local SGD / DiLoCo and CO2 on slow links.

    python scripts/scaling_model.py                                   # the paper's setting
    python scripts/scaling_model.py --measured results/bench_bandwidth.jsonl  # first, the model vs a benchmark
    python -m scripts.scaling_model --params 124e6 --bandwidth-gbps 1 --step-time-s 0.3 [--workers N]
                                          # the smallest co2_local_steps (tau) that hides the all-reduce, per wire

Inputs: compute time per step ``c``, parameter count ``P``, bytes per element on the wire, link
bandwidth ``B`` (bits/s per node, full duplex), worker count ``G`` and ``tau``. A ring all-reduce
sends ``2 (G-1)/G`` times the payload from every node; latency is left out (the benchmark's links
are rate-shaped only), so::

    comm          = 2 (G-1)/G * P * bytes * 8 / B
    data parallel = c + comm                              (an all-reduce per step, none hidden)
    local SGD     = c + comm / tau                        (a blocking all-reduce per round; DiLoCo too)
    CO2           = c + max(0, comm - tau * c) / tau      (the all-reduce runs during the next round)
    CO2, window k = c + max(0, comm - k * c) / tau        (co2_overlap_steps: it must land in k steps)
    CO2, F fragments = c + F * max(0, comm / F - (tau / F) * c) / tau = CO2's
                                                          (1/F of the bytes, tau/F steps to land each)

So fragments need the bandwidth of full overlap, ``B >= 2 (G-1)/G * P * bytes * 8 / (tau * c)``,
where a window of k steps needs tau / k times that. On a real WAN each of a round's F all-reduces
also pays the ring's per-message latency, ``2 (G-1)`` hops: ``fragment_fits`` checks
``2 (G-1) * latency + comm / F <= (tau / F) * c``.

Throughput is ``G * tokens_per_step / step``. Left out as well: DDP's bucketed all-reduce
overlapping backward (real data parallel is faster than the model says), the CPU that
communication takes from compute, stragglers, and the per-message latency of real WANs.
"""

from __future__ import annotations

import argparse
import json
import statistics

# The paper's Table 3: 80 Gbps TCP/IP, 128 A100s, words/s, and scalability ratios 16 -> 128 GPUs.
PAPER = {"adamw_words_s": 22_810, "co2_words_s": 304_736, "adamw_scaling": 0.82, "co2_scaling": 1.06}
A100_BF16_FLOPS = 312e12
GPUS_PER_NODE = 8  # the slow links are between nodes; NVLink inside a node is taken as free
GPT2_SMALL = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12)


def gpt2_params(cfg: dict) -> int:
    """Parameters of a GPT-2 with a tied head: embeddings, then 12 d^2 + 13 d per layer, final norm."""
    d = cfg["n_embd"]
    return (cfg["vocab_size"] + cfg["n_positions"]) * d + cfg["n_layer"] * (12 * d * d + 13 * d) + 2 * d


def ring_allreduce_s(nbytes: float, workers: int, bandwidth_bps: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``workers`` nodes linked at ``bandwidth_bps``."""
    if workers < 2:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes * 8 / bandwidth_bps


def step_time_s(
    method: str,
    compute_s: float,
    params: float,
    bandwidth_bps: float,
    workers: int,
    *,
    tau: int = 1,
    wire_bytes=4,
    window: int = 1,
) -> float:
    """Mean seconds per inner step of ``method``: data_parallel, local_sgd, co2 (full overlap or
    fragments), co2_window (``window`` = k) or no_comm."""
    comm = ring_allreduce_s(params * wire_bytes, workers, bandwidth_bps)
    if method == "data_parallel":
        return compute_s + comm
    if method == "local_sgd":
        return compute_s + comm / tau
    if method == "co2":  # full overlap, and fragments (each 1/F of the bytes with tau/F steps to land)
        return compute_s + max(0.0, comm - tau * compute_s) / tau
    if method == "co2_window":
        return compute_s + max(0.0, comm - window * compute_s) / tau
    if method == "no_comm":
        return compute_s
    raise ValueError(f"unknown method {method!r}")


def fragment_fits(
    compute_s: float,
    params: float,
    bandwidth_bps: float,
    workers: int,
    *,
    tau: int,
    fragments: int,
    latency_s: float = 0.0,
    bytes_per_element: float = 4.0,
) -> bool:
    """Whether one fragment's all-reduce, latency included, lands within its tau / F steps."""
    nbytes = params * bytes_per_element / fragments
    comm = ring_allreduce_s(nbytes, workers, bandwidth_bps) + 2 * (workers - 1) * latency_s
    return comm <= tau // fragments * compute_s


def scalability(method: str, compute_s: float, params: float, bw: float, small: int, large: int, **kw) -> float:
    """Throughput at ``large`` workers over ``large / small`` times that at ``small``: 1 is linear."""
    return step_time_s(method, compute_s, params, bw, small, **kw) / step_time_s(
        method, compute_s, params, bw, large, **kw
    )


def compute_time_s(params: float, tokens: float, mfu: float) -> float:
    """One forward and backward (6 FLOPs per parameter per token) on an A100 at ``mfu``."""
    return 6 * params * tokens / (A100_BF16_FLOPS * mfu)


def paper_rows(models: dict, *, mfu: float, tau: int) -> list[dict]:
    """Predictions for the paper's clusters: 16 to 128 A100s, 8 per node, bf16 on the wire."""
    rows = []
    for name, (params, tokens) in models.items():
        c = compute_time_s(params, tokens, mfu)
        for link, bw in (("80 Gbps TCP", 80e9), ("800 Gbps RDMA", 800e9)):
            for gpus in (16, 32, 64, 128):
                nodes = gpus // GPUS_PER_NODE
                dp = step_time_s("data_parallel", c, params, bw, nodes, wire_bytes=2)
                co2 = step_time_s("co2", c, params, bw, nodes, tau=tau, wire_bytes=2)
                comm = ring_allreduce_s(2 * params, nodes, bw)
                rows.append(
                    dict(model=name, link=link, gpus=gpus, compute_s=round(c, 3), comm_s=round(comm, 3))
                    | dict(dp_words_s=round(gpus * tokens / dp), co2_words_s=round(gpus * tokens / co2))
                    | dict(co2_over_dp=round(dp / co2, 2))
                )
    return rows


def print_paper_comparison(mfu: float, tau: int, tokens_7b: int) -> None:
    models = {"GPT-2 small": (gpt2_params(GPT2_SMALL), 8 * 1024), "7B": (7e9, tokens_7b)}
    print(f"# the paper's setting: bf16 on the wire, MFU {mfu}, tau {tau}, tokens per GPU per step assumed:")
    print("# " + ", ".join(f"{name} {tokens}" for name, (_, tokens) in models.items()))
    for row in paper_rows(models, mfu=mfu, tau=tau):
        print(json.dumps(row))
    for name, (params, tokens) in models.items():
        args = (compute_time_s(params, tokens, mfu), params, 80e9, 16 // GPUS_PER_NODE, 128 // GPUS_PER_NODE)
        dp = scalability("data_parallel", *args, wire_bytes=2)
        co2 = scalability("co2", *args, tau=tau, wire_bytes=2)
        print(f"# model, {name}, 80 Gbps TCP, scalability 16 -> 128 GPUs: data parallel {dp:.2f}, CO2 {co2:.2f}")
    ratio = PAPER["co2_words_s"] / PAPER["adamw_words_s"]
    print(
        f"# paper Table 3, 80 Gbps TCP, 128 GPUs: AdamW {PAPER['adamw_words_s']:,} words/s, CO2 tau=48 "
        f"{PAPER['co2_words_s']:,} ({ratio:.1f}x); scalability {PAPER['adamw_scaling']} vs {PAPER['co2_scaling']}"
    )
    per_gpu = PAPER["co2_words_s"] / 128
    mfu_at = {name: 6 * params * per_gpu / A100_BF16_FLOPS for name, (params, _) in models.items()}
    comm = ring_allreduce_s(2 * 7e9, 128 // GPUS_PER_NODE, 80e9)
    print(
        f"# the paper's CO2 rate, {per_gpu:,.0f} words/s per GPU, is an MFU of "
        + ", ".join(f"{mfu:.1%} at {name}" for name, mfu in mfu_at.items())
        + f"; its {ratio:.1f}x needs data parallel's all-reduce to take {ratio - 1:.1f}x a step's compute, "
        f"i.e. at 7B and 80 Gbps ({comm:.2f} s per all-reduce) {comm / (ratio - 1) * per_gpu:,.0f} tokens "
        "per GPU per step"
    )


def check_measured(path: str) -> None:
    """The model vs a benchmark, row by row: compute from the block's no_comm runs, bandwidth the
    nominal link rate (for unshaped links, the rate the block's probe achieved)."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    block = lambda r: (r["rate"], r["ranks"], r["model"])  # noqa: E731
    probes = {block(r): r for r in rows if r["method"] == "probe"}
    print("# model vs measured: rel = tokens/s over the no_comm limit")
    for r in rows:
        limits = [x["time_per_step_s"] for x in rows if x["method"] == "no_comm" and block(x) == block(r)]
        if r["method"] in ("probe", "no_comm") or "error" in r or not limits:
            continue
        probe, c = probes[block(r)], statistics.fmean(limits)
        bw = (probe["nominal_mbit"] or probe["achieved_mbit"]) * 1e6
        method = {"ddp": "data_parallel", "diloco": "local_sgd", "co2_node": "co2", "co2_stream": "co2"}.get(
            r["method"], r["method"]
        )
        predicted = step_time_s(method, c, r["params"], bw, r["nodes"], tau=r["tau"] or 1)
        comm = ring_allreduce_s(4 * r["params"], r["nodes"], bw)
        print(
            json.dumps(
                dict(method=r["method"], rate=r["rate"], ranks=r["ranks"], tau=r["tau"], model=r["model"])
                | dict(allreduce_model_s=round(comm, 3), allreduce_measured_s=r["allreduce_alone_s"])
                | dict(rel_model=round(c / predicted, 3), rel_measured=r["rel_to_limit"])
            )
        )


# bytes per element of each co2_comm_dtype wire (int8's and int4's per-block scales left out)
WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
WIRE_FLAG = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8", "int4": "int4"}  # --co2_comm_dtype's values


def smallest_tau(compute_s: float, params: float, bandwidth_bps: float, workers: int, wire: str, limit: int = 100_000):
    """The smallest tau whose all-reduce, cut into tau fragments (the defaults' streaming form), hides
    behind the compute (`fragment_fits`); None beyond ``limit``."""
    for tau in range(1, limit + 1):
        if fragment_fits(
            compute_s, params, bandwidth_bps, workers, tau=tau, fragments=tau, bytes_per_element=WIRE_BYTES[wire]
        ):
            return tau
    return None


def print_smallest_tau(params: float, bandwidth_gbps: float, step_time_s: float, workers: int) -> None:
    print(
        f"{params:.3g} parameters, {workers} workers, {bandwidth_gbps:g} Gbit/s per node, {step_time_s:g} s per step:"
    )
    print("| wire | --co2_comm_dtype | smallest --co2_local_steps (tau) that hides the all-reduce |")
    print("|---|---|---|")
    for wire in WIRE_BYTES:
        tau = smallest_tau(step_time_s, params, bandwidth_gbps * 1e9, workers, wire)
        print(f"| {wire} | {WIRE_FLAG[wire]} | {tau if tau is not None else 'over 100000'} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", help="a bench_bandwidth.py JSON-lines file to check the model against")
    parser.add_argument("--mfu", type=float, default=0.35, help="assumed A100 model-FLOPs utilisation")
    parser.add_argument("--tau", type=int, default=48, help="CO2's tau in the paper's setting")
    parser.add_argument("--tokens-7b", type=int, default=2048, help="assumed tokens per GPU per step, 7B model")
    parser.add_argument("--params", type=float, help="the model's parameter count: print the smallest tau per wire")
    parser.add_argument("--bandwidth-gbps", type=float, default=1.0, help="link between workers, Gbit/s per node")
    parser.add_argument("--step-time-s", type=float, default=0.3, help="seconds of one optimizer step's compute")
    parser.add_argument("--workers", type=int, default=2, help="CO2 workers (nodes with --co2_worker_size)")
    args = parser.parse_args(argv)
    if args.params is not None:
        for flag, value in (("--params", args.params), ("--bandwidth-gbps", args.bandwidth_gbps)):
            if not value > 0:
                parser.error(f"{flag}={value:g}: allowed values are numbers > 0")
        if not args.step_time_s > 0:
            parser.error(f"--step-time-s={args.step_time_s:g}: allowed values are numbers > 0")
        if args.workers < 1:
            parser.error(f"--workers={args.workers}: allowed values are integers >= 1")
        return print_smallest_tau(args.params, args.bandwidth_gbps, args.step_time_s, args.workers)
    if args.measured:
        check_measured(args.measured)
    print_paper_comparison(args.mfu, args.tau, args.tokens_7b)


if __name__ == "__main__":
    main()
