"""From the ranks' raw timings to the JSON lines and the tables of docs/performance.md.

Steady state: a run's first and last round are excluded (a round is tau steps; one step for ddp).
Every number is the slowest rank's: a method that synchronises runs at its pace, so the limit of a
data-parallel job is the slowest rank too. Each run is compared with the no-communication time at
its place, interpolated between the ``no_comm`` runs before and after its pass (``plan.make_block``).
The comparison across repeats is ``compare.py``.
"""

from __future__ import annotations

import statistics
import time

from ..bench_overlap import SEQ
from ..scaling_model import gpt2_params
from .netns import rate_bps
from .plan import CO2_SETTINGS, MODELS, PEERS, ROUND_METHODS, Block, Run, wire_bytes_per_value


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
    """The JSON line of one run; ``limit`` is the no-communication time per step at its place."""
    step = statistics.median(statistics.median(r["times"][run.tau : run.tau * (run.rounds - 1)]) for r in per_rank)
    slowest = _slowest_per_step(run, per_rank)
    line = {
        **_ids(block),
        "method": run.method,
        "tau": run.tau if run.method in ROUND_METHODS else None,
        "wire": run.wire if run.method in CO2_SETTINGS else None,
        "code": run.code or None,  # --against: the other checkout's commit
        "repeat": run.repeat,
        "rounds": run.rounds,
        "step_time_s": round(step, 4),
        "time_per_step_s": round(slowest, 4),
        "tokens_per_s": round(block.ranks * block.batch * SEQ / slowest, 1),
        "allreduce_alone_s": round(alone, 4),
        "load_1m": round(per_rank[0]["load_1m"], 2),
        "date": time.strftime("%Y-%m-%d"),
        "invocation": block.invocation,  # pairs the runs of one repeat of one invocation (compare.py)
        "library": per_rank[0].get("library"),  # the peer's package and version
        **_peer_settings(block, run),
    }
    line.update(_link_bytes(block, run, per_rank))
    exposed, hidden = 0.0, None
    if run.method in CO2_SETTINGS:
        waits = [max(w) for w in zip(*(r["waits"][1:-1] for r in per_rank))]  # max over ranks per round
        comms = [max(c) for c in zip(*(r["comms"][1:-1] for r in per_rank))]
        exposed = statistics.median(waits)
        hidden = max(0.0, 1 - sum(waits) / sum(comms)) if sum(comms) > 0 else None
        line["comm_s"] = round(statistics.median(comms), 4)
        line.update(_engine_work(per_rank))
    elif run.method == "ddp" and limit is not None:
        exposed = max(0.0, slowest - limit)
        hidden = min(1.0, max(0.0, 1 - exposed / alone))
    elif run.method in PEERS and limit is not None:  # their own code keeps no timings: over the limit
        exposed = max(0.0, slowest - limit) * run.tau
    if limit is not None:
        round_compute = run.tau * limit
        line["exposed_comm_per_round_s"] = round(exposed, 4)
        line["exposed_frac_of_round"] = round(exposed / round_compute, 4)
        line["comm_over_compute"] = round(alone / round_compute, 4) if run.method != "no_comm" else None
        line["rel_to_limit"] = round(limit / slowest, 4)
        line["limit_tokens_per_s"] = round(block.ranks * block.batch * SEQ / limit, 1)
    line["hidden_frac"] = round(hidden, 4) if hidden is not None else None
    return line


def _engine_work(per_rank: list[dict]) -> dict:
    """The engine's own work per round on the host: its time in ``step()`` less the waits there
    (max over ranks per round, median over the steady rounds; on a GPU, only its launches)."""
    if not all(r.get("engine") for r in per_rank):
        return {}  # an older JSON, or a run without rounds
    work = [[max(0.0, e - w) for e, w in zip(r["engine"][1:-1], r["waits"][1:-1])] for r in per_rank]
    return {"engine_per_round_s": round(statistics.median(max(x) for x in zip(*work)), 4)}


def _peer_settings(block: Block, run: Run) -> dict:
    """torchft_streaming's fragments and fragment_sync_delay, as they ran."""
    if run.method != "torchft_streaming":
        return {}
    fragments, delay = block.options["torchft_fragments"], block.options.get("torchft_delay")
    return {"fragments": fragments, "delay": run.tau // fragments - 1 if delay is None else delay}


def _link_bytes(block: Block, run: Run, per_rank: list[dict]) -> dict:
    """Bytes a node sent over its link per round, and the prediction (none on loopback)."""
    tx = [r.get("link_tx_bytes") for r in per_rank]
    if not tx or any(t is None for t in tx):
        return {}
    per_node = [tx[n * block.ranks_per_node] for n in range(block.nodes)]  # a node's ranks read one counter
    return {
        "link_tx_bytes_per_round": round(statistics.fmean(per_node) / run.rounds),
        "link_tx_predicted_bytes_per_round": round(predicted_link_bytes(run.method, block, run)),
    }


def predicted_link_bytes(method: str, block: Block, run: Run | None = None) -> float:
    """Bytes a node sends over its link per round (per step for ddp), for fp32 ring all-reduces of
    the model's size S: a ring of R members makes every hop carry 2 (R-1)/R x S, and a ring over
    all ranks in node order leaves each node through one hop. With one worker per node
    (co2_node), k rings of one rank per node each carry S/k, and all k leave the node. Streaming
    (co2_stream, F = tau fragments) sends S per round too, but the counter also holds the end of the
    run: ``finalize()`` runs the boundary of the F - 1 fragments that took steps since theirs, one
    more (F - 1)/F of S over the run's rounds. Another wire type scales S by its bytes per value
    (`wire_bytes_per_value`); the quantized all-reduce sends ``2 (R-1)/R`` of its codes and scales as
    well (an all-to-all, then an all-gather: core/codecs/quant.py). The peers: S per round for their syncs;
    what they send once per run is not in it (torchft's first quorum, where replica 0 sends its state
    to the others; accelerate's average on exit; post-local SGD's warm-up step)."""
    if method == "no_comm":
        return 0.0
    wire = run.wire if run is not None and method in CO2_SETTINGS else "float32"
    size = wire_bytes_per_value(wire) * gpt2_params(MODELS[block.model])
    members = block.nodes if method == "co2_node" else block.ranks
    per_round = 2 * (members - 1) / members * size
    if method == "co2_stream" and run is not None:
        per_round *= 1 + (run.tau - 1) / (run.tau * run.rounds)
    return per_round


def _limit_for(i: int, block: Block, per_step: list[float | None]) -> float | None:
    """The no-communication time per step at run ``i``'s place: interpolated, by position, between
    the nearest no_comm runs before and after it (one of them where there is no other; for a
    no_comm run, the mean of them all)."""
    limits = [j for j, r in enumerate(block.runs) if r.method == "no_comm" and per_step[j] is not None]
    if not limits or block.runs[i].method == "no_comm":
        return statistics.fmean(per_step[j] for j in limits) if limits else None
    before, after = [j for j in limits if j < i][-1:], [j for j in limits if j > i][:1]
    if not (before and after):
        return per_step[(before or after)[0]]
    a, b = before[0], after[0]
    return per_step[a] + (per_step[b] - per_step[a]) * (i - a) / (b - a)


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


def markdown_table(lines: list[dict]) -> str:
    """The table of every figure: one row per cell (link, ranks, model, method, tau; ``--against``
    runs as ``method@commit``), probes and no_comm runs left out, in file order; with repeats, the
    median of each column and the number of runs (`compare.comparison_table`: ranges, CO2 against each)."""
    head = (
        "| link | ranks | model | method | wire | tau | step (s) | tokens/s | vs limit | fp32 all-reduce alone (s) "
        "| exposed per round (s) | hidden | bytes vs fp32 | load | runs |"
    )
    cells: dict[tuple, list[dict]] = {}
    for x in lines:
        if x["method"] not in ("probe", "no_comm") and "error" not in x:
            method = f"{x['method']}@{x['code']}" if x.get("code") else x["method"]  # --against
            key = (x["rate"], x["ranks"], x["model"], method, x.get("wire") or "-", x.get("tau"))
            cells.setdefault(key, []).append(x)
    rows = [head, "|---" * 15 + "|"]
    fp32_bytes = {k[:4] + k[5:]: _median_bytes(v) for k, v in cells.items() if k[4] == "float32"}
    for (rate, ranks, model, method, wire, tau), runs in cells.items():
        med = {key: statistics.median(r[key] for r in runs) for key in _TABLE_KEYS}
        hidden = [r["hidden_frac"] for r in runs if r.get("hidden_frac") is not None]
        hidden_text = f"{statistics.median(hidden):.2f}" if hidden else "-"
        fp32 = fp32_bytes.get((rate, ranks, model, method, tau))
        sent = _median_bytes(runs)
        ratio = f"{sent / fp32:.3f}" if fp32 and sent is not None else "-"
        rows.append(
            f"| {rate} | {ranks} | {model} | {method} | {wire} | {tau or '-'} | {med['time_per_step_s']:.3f} "
            f"| {med['tokens_per_s']:.0f} | **{med['rel_to_limit']:.2f}** | {med['allreduce_alone_s']:.3f} "
            f"| {med['exposed_comm_per_round_s']:.3f} | {hidden_text} | {ratio} | {med['load_1m']:.1f} | {len(runs)} |"
        )
    return "\n".join(rows)


def _median_bytes(runs: list[dict]) -> float | None:
    sent = [r["link_tx_bytes_per_round"] for r in runs if r.get("link_tx_bytes_per_round") is not None]
    return statistics.median(sent) if sent else None


_TABLE_KEYS = (
    "time_per_step_s",
    "tokens_per_s",
    "rel_to_limit",
    "allreduce_alone_s",
    "exposed_comm_per_round_s",
    "load_1m",
)
