"""Across repeats: each cell's ratio to the no-communication limit (median and range), CO2 against
every other cell in the same repeat, and the dated Markdown table ``--doc`` writes.

A cell is one method at one (link, ranks, model, tau, wire type, engine checkout). Runs are paired
by (invocation, repeat): the runs of one pass over the methods, which ran minutes apart between
the same two no-communication runs. The reference of a row is CO2's defaults (``co2_stream``
on float32, this checkout) at the same tau; for a row on another checkout's engine (``--against``),
the same cell on this one, so that its ratio reads "this checkout / that one".
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from .plan import PEERS

DEFAULTS = ("co2_stream", "float32", None)  # method, wire, code: CO2Config's defaults but tau
NAMES = {
    "no_comm": "no communication",
    "ddp": "DDP",
    "local_sgd": "CO2 engine as local SGD",
    "diloco": "CO2 engine as DiLoCo",
    "co2": "CO2, full overlap (F = 1)",
    "co2_stream": "CO2, the defaults (streaming, F = tau)",
    "co2_node": "CO2, one worker per node",
    "torchft_diloco": "DiLoCo",
    "torchft_streaming": "streaming DiLoCo",
    "accelerate_local_sgd": "LocalSGD",
    "torch_post_local_sgd": "PostLocalSGDOptimizer",
}
BEGIN, END = "<!-- bench_bandwidth --doc: begin -->", "<!-- bench_bandwidth --doc: end -->"


def _key(line: dict) -> tuple:
    where = (line["rate"], line["ranks"], line["model"], line.get("tau"))
    return (*where, line["method"], line.get("wire"), line.get("code"))


def cells(lines: list[dict]) -> dict[tuple, list[dict]]:
    """The runs of each cell (probes, no_comm runs and failed runs left out), in file order."""
    found: dict[tuple, list[dict]] = {}
    for line in lines:
        if line["method"] not in ("probe", "no_comm") and "error" not in line and "rel_to_limit" in line:
            found.setdefault(_key(line), []).append(line)
    return found


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest)."""
    return statistics.median(values), min(values), max(values)


def reference_key(key: tuple) -> tuple:
    """The cell a row is compared with: the same settings on this checkout (a row of ``--against``),
    else the defaults at its tau."""
    rate, ranks, model, tau, method, wire, code = key
    if code is not None:
        return (*key[:-1], None)
    return (rate, ranks, model, tau, *DEFAULTS)


def ratios_to(reference: list[dict], runs: list[dict]) -> list[float]:
    """The reference's tokens/s over the row's, one per repeat both ran in (same invocation)."""
    theirs = {(r.get("invocation"), r.get("repeat")): r["tokens_per_s"] for r in reference}
    pairs = [(r.get("invocation"), r.get("repeat")) for r in runs]
    return [theirs[p] / r["tokens_per_s"] for p, r in zip(pairs, runs) if p in theirs]


def _fmt(values: list[float], digits: int = 2) -> str:
    if not values:
        return "-"
    mid, lo, hi = spread(values)
    return f"{mid:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})" if len(values) > 1 else f"{mid:.{digits}f}"


def label(line: dict) -> str:
    """What a row is: the library and version of a peer, the engine's checkout of an --against row."""
    name = NAMES.get(line["method"], line["method"])
    if line["method"] == "torchft_streaming" and "fragments" in line:
        name += f" (F = {line['fragments']}, delay {line['delay']})"
    if line["method"] in PEERS and line.get("library"):
        name = f"{line['library']} {name}"
    return name + (f", at {line['code']}" if line.get("code") else "")


def lost_per_round(line: dict) -> tuple[float | None, float | None, float]:
    """What a run lost against its limit per round, in seconds: (waits, the engine's own work, the
    rest). The rest is its steps' compute running slower than the limit's (the link's and the
    other rank's work sharing the cores, the ranks in lockstep) and noise; a peer's library keeps no
    timings, so all of its loss is the rest."""
    tau = line.get("tau") or 1
    lost = tau * line["time_per_step_s"] * (1 - line["rel_to_limit"])
    if "engine_per_round_s" not in line:
        return None, None, lost
    waits, engine = line["exposed_comm_per_round_s"], line["engine_per_round_s"]
    return waits, engine, lost - waits - engine


def _lost(runs: list[dict]) -> str:
    parts = list(zip(*(lost_per_round(r) for r in runs)))
    return " / ".join("-" if None in part else f"{statistics.median(part):.2f}" for part in parts)


def comparison_table(lines: list[dict]) -> str:
    """One row per cell: its ratio to the no-communication limit and the reference's tokens/s over
    its own, per repeat (median and range), what it lost per round, the bytes, the load."""
    found = cells(lines)
    rows = [
        "| link | tau | wire | method | vs no-comm limit, median (range) | CO2 / this, same repeat "
        "| lost per round (s): waits / engine / rest | MB a node sent per round | load 1 min | runs |",
        "|---" * 10 + "|",
    ]
    for key, runs in found.items():
        reference = reference_key(key)
        ratio = "reference" if reference == key else _fmt(ratios_to(found.get(reference, []), runs))
        sent = [r["link_tx_bytes_per_round"] / 1e6 for r in runs if r.get("link_tx_bytes_per_round") is not None]
        _, low, high = spread([r["load_1m"] for r in runs])
        rows.append(
            f"| {key[0]} | {key[3] or '-'} | {key[5] or '-'} | {label(runs[0])} "
            f"| **{_fmt([r['rel_to_limit'] for r in runs])}** | {ratio} | {_lost(runs)} "
            f"| {f'{statistics.median(sent):.1f}' if sent else '-'} | {low:.1f}-{high:.1f} | {len(runs)} |"
        )
    return "\n".join(rows)


def write_doc(path: str, lines: list[dict], source: str) -> None:
    """Replace what lies between the markers of ``path`` with the dated table of ``lines``, read
    from ``source`` (a JSONL written by ``--out``)."""
    text = Path(path).read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"--doc {path}: the file has no {BEGIN} ... {END} markers to write between")
    dates = sorted({line["date"] for line in lines if line.get("date")})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else "an unrecorded date"
    section = (
        f"{BEGIN}\nMeasured {when}; the table is written by "
        f"`python scripts/bench_bandwidth.py --table {source} --doc {path}` from the JSON lines.\n\n"
        f"{comparison_table(lines)}\n{END}"
    )
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    Path(path).write_text(pattern.sub(lambda _: section, text, count=1))
