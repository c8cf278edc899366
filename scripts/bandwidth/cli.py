"""The command line of scripts/bench_bandwidth.py: flags, their checks, and the order of the steps."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..bench_overlap import SEQ
from . import __doc__ as DESCRIPTION
from .analysis import markdown_table
from .compare import comparison_table, write_doc
from .launch import print_dry_run, run_plan
from .netns import check_privileges, rate_bps, remove_stale_namespaces
from .peers import skip_missing, split_modules
from .plan import (
    DEFAULT_BATCH,
    DEVICES,
    METHODS,
    MODELS,
    PEERS,
    WIRES,
    build_plan,
    check_gpus,
    estimate_block_s,
    visible_gpus,
)
from .plot import plot
from .worker import build_model, worker


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    csv = lambda kind: lambda text: [kind(x) for x in text.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(
        prog="bench_bandwidth.py", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", type=csv(str), default=["unshaped", "1gbit", "300mbit", "100mbit"])
    parser.add_argument("--taus", type=csv(int), default=[4, 12], help="taus of the CO2-engine methods")
    parser.add_argument(
        "--methods",
        type=csv(str),
        default=[m for m in METHODS if m != "co2_node" and m not in PEERS],
        help=f"among {', '.join(METHODS)} (co2_node: needs --ranks-per-node > 1; the peers, from "
        "torchft_diloco on, each needs its library)",
    )
    parser.add_argument(
        "--wires",
        type=csv(str),
        default=["float32"],
        help=f"co2_comm_dtype of every CO2-engine run, among {', '.join(WIRES)}: one run per wire type",
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
    parser.add_argument(
        "--repeats", type=int, default=1, help="passes over the methods per block, interleaved (--table: median)"
    )
    parser.add_argument(
        "--against",
        metavar="TREE",
        help="another checkout of this project (git worktree add /tmp/co2_OLD OLD): every CO2-engine run also "
        "runs on its engine, next to this one's",
    )
    parser.add_argument(
        "--torchft-fragments", type=int, default=4, help="torchft_streaming: fragments, dividing every tau"
    )
    parser.add_argument(
        "--torchft-delay",
        type=int,
        help="torchft_streaming: fragment_sync_delay, steps from a fragment's launch to its wait "
        "(unset: tau / fragments - 1, the most torchft allows)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu: gloo, one core per rank. cuda: one GPU per rank (GPU LOCAL_RANK of its node), default "
        "group NCCL, CO2's state on the GPU; every node is on this machine, so a block of N ranks needs N GPUs",
    )
    parser.add_argument("--budget-min", type=float, default=90.0, help="refuse a plan estimated above this")
    parser.add_argument("--loopback", action="store_true", help="no namespaces (unshaped only, no root)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--plot", help="write the PNG plot here")
    parser.add_argument("--table", help="print the Markdown table of a JSONL written by --out, and exit")
    parser.add_argument(
        "--doc",
        help="with --table: also write its comparison table, dated, between the bench_bandwidth markers of "
        "this Markdown file (docs/performance.md)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if set(args.wires) - set(WIRES):
        parser.error(f"--wires must be among {', '.join(WIRES)}; got {','.join(args.wires)}")
    unknown = set(args.methods) - set(METHODS)
    if unknown or args.ranks % args.ranks_per_node or args.ranks < 2:
        parser.error(f"methods must be among {METHODS}; --ranks >= 2, a multiple of --ranks-per-node")
    if "co2_node" in args.methods and (args.ranks_per_node < 2 or args.extras):
        parser.error("--methods co2_node makes each node one worker: it needs --ranks-per-node >= 2 and --no-extras")
    if args.loopback and (args.rates != ["unshaped"] or args.extras):
        parser.error("--loopback cannot shape: use --rates unshaped --no-extras")
    for rate in args.rates:
        rate_bps(rate)
    _check_torchft(parser, args)
    args.against = _against(parser, args.against) if args.against else None
    args.invocation = time.strftime("%Y-%m-%dT%H:%M:%S")  # with a repeat's index, names one pass
    return args


def _check_torchft(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """torchft's DiLoCo syncs one fragment every tau / F steps, and waits before the next one."""
    if "torchft_streaming" not in args.methods:
        return
    fragments, delay = args.torchft_fragments, args.torchft_delay
    if fragments < 1 or any(tau % fragments for tau in args.taus):
        parser.error(f"--torchft-fragments={fragments} must be >= 1 and divide every --taus ({args.taus})")
    window = min(args.taus) // fragments
    if delay is not None and not 0 <= delay < window:
        parser.error(f"--torchft-delay={delay}: allowed are 0 .. tau / --torchft-fragments - 1 = {window - 1}")
    for model in {args.model, *(["large"] if args.extras else [])}:
        with torch.device("meta"):  # its modules only: nothing allocated, nothing initialised
            try:
                split_modules(build_model(MODELS[model], seed=0), fragments)
            except ValueError as error:
                parser.error(f"{error} ({model} model)")


def _against(parser: argparse.ArgumentParser, tree: str) -> tuple[str, str]:
    """(its commit, its path) for ``--against``: a checkout of this project."""
    path = Path(tree).resolve()
    if not (path / "co2_hf" / "__init__.py").is_file():
        parser.error(f"--against {tree}: not a checkout of this project (no co2_hf/__init__.py there)")
    head = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return (head.stdout.strip() or path.name), str(path)


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: workers killed, links removed


def _gpus(blocks, *, dry_run: bool) -> list[str]:
    """The GPUs to hand out with --device cuda, refused before any rank starts when too few; a dry
    run only notes the shortfall, since it is often read on another machine than the one it plans."""
    available, needed = torch.cuda.device_count(), max(block.ranks for block in blocks)
    if dry_run and available < needed:
        print(f"# --device cuda: the plan needs {needed} GPUs, torch sees {available} here", flush=True)
    elif not dry_run:
        check_gpus(blocks, available)
    return visible_gpus(max(available, needed))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.table:
        lines = [json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()]
        if args.doc:
            write_doc(args.doc, lines, args.table)
        return print(f"{markdown_table(lines)}\n\n{comparison_table(lines)}")
    args.methods = skip_missing(args.methods)
    blocks = build_plan(args)
    total = sum(estimate_block_s(b) for b in blocks)
    print(
        f"# plan: {len(blocks)} blocks, {sum(len(b.runs) for b in blocks)} runs, estimated "
        f"{total / 60:.0f} min (budget {args.budget_min:g} min)",
        flush=True,
    )
    if total > 60 * args.budget_min:
        sys.exit("the estimate exceeds --budget-min: lower --min-steps, --ddp-steps or the matrix")
    gpus = _gpus(blocks, dry_run=args.dry_run) if args.device == "cuda" else []
    if args.dry_run:
        return print_dry_run(blocks, args.mtu, args.device, gpus)
    if not args.loopback:
        check_privileges()
        remove_stale_namespaces()
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        lines = run_plan(blocks, args, gpus)
    finally:  # main() may run inside another program (the tests)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.plot and lines:
        plot(lines, args.plot, ranks=args.ranks, model=args.model)
