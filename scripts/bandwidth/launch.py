"""Running a plan: one network per topology, one launch of the ranks per block, every wait bounded.

Ranks are separate processes (``bench_bandwidth.py --worker SPEC``), each leading its own session so
that a failure kills exactly them; the launcher waits for their result files with deadlines taken
from the plan's estimates, turns a failed block into error lines instead of stopping the benchmark,
and prints each JSON line as soon as its block ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .analysis import block_lines
from .netns import PREFIX, Network, network_commands, node_ns, rate_commands
from .plan import Block, estimate_block_s, estimate_run_s, rank_env, startup_estimate_s

SCRIPT = Path(__file__).resolve().parents[1] / "bench_bandwidth.py"  # what each rank runs, with --worker


class BlockFailed(RuntimeError):
    pass


def rank_command(
    block: Block,
    rank: int,
    spec_path: Path,
    *,
    loopback: bool,
    device: str = "cpu",
    gpus: Sequence[str] = (),
    script: Path = SCRIPT,
) -> tuple[list[str], dict]:
    """The command line and the environment (``plan.rank_env``) of one rank running ``script --worker``."""
    cmd = [sys.executable, str(script), "--worker", str(spec_path)]
    env = rank_env(block, rank, device, loopback=loopback, gpus=list(gpus))
    if not loopback:
        cmd = ["ip", "netns", "exec", node_ns(rank // block.ranks_per_node), *cmd]
    return cmd, env


def await_files(paths: list[Path], procs: list[subprocess.Popen], deadline: float, what: str) -> list[dict]:
    while not all(p.exists() for p in paths):
        failed = [p.returncode for p in procs if p.poll() is not None]
        if failed:
            raise BlockFailed(f"{what}: a rank exited (codes {failed}) before finishing")
        if time.monotonic() > deadline:
            raise BlockFailed(f"{what}: timed out")
        time.sleep(0.2)
    return [json.loads(p.read_text()) for p in paths]


def kill_ranks(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # each rank leads its own session: only our processes
        p.wait()


def run_block(
    block: Block, workdir: Path, *, port: int, loopback: bool, device: str, gpus: Sequence[str] = ()
) -> tuple[list, list]:
    """Launch the ranks; return the probe per rank and, per run, its results per rank or an error."""
    spec = {"model": block.model, "batch": block.batch, "device": device, "out_dir": str(workdir), "timeout_s": 900}
    spec.update(ranks_per_node=block.ranks_per_node, options=block.options)
    spec["runs"] = [asdict(r) for r in block.runs]
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    procs, results, probe = [], [None] * len(block.runs), None
    try:
        for rank in range(block.ranks):
            cmd, env = rank_command(block, rank, spec_path, loopback=loopback, device=device, gpus=gpus)
            with open(workdir / f"rank{rank}.log", "w") as log:  # the child keeps its own descriptor
                env = {**os.environ, **env, "MASTER_PORT": str(port)}
                procs.append(
                    subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                )
        ranks = range(block.ranks)
        deadline = time.monotonic() + 3 * startup_estimate_s(block) + 120
        probe = await_files([workdir / f"probe.rank{r}.json" for r in ranks], procs, deadline, "probe")
        for i, run in enumerate(block.runs):
            deadline = time.monotonic() + 2 * estimate_run_s(run, block) + 120  # every run is bounded
            started = time.monotonic()
            results[i] = await_files([workdir / f"run{i}.rank{r}.json" for r in ranks], procs, deadline, run.method)
            print(
                f"# {block.rate} x{block.ranks} {block.model}: {run.method} tau {run.tau} {run.wire} took "
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
        kill_ranks(procs)
    return probe, results


def _topologies(blocks: list[Block]) -> list[tuple[int, list[Block]]]:
    """Consecutive blocks on the same number of nodes share one network."""
    groups: list[tuple[int, list[Block]]] = []
    for block in blocks:
        if groups and groups[-1][0] == block.nodes:
            groups[-1][1].append(block)
        else:
            groups.append((block.nodes, [block]))
    return groups


def print_dry_run(blocks: list[Block], mtu: int, device: str = "cpu", gpus: Sequence[str] = ()) -> None:
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
                cmd, env = rank_command(block, rank, Path("SPEC"), loopback=False, device=device, gpus=gpus)
                show([f"{k}={v}" for k, v in env.items()] + cmd)
        for cmd in down:
            show(cmd)


def run_plan(blocks: list[Block], args, gpus: Sequence[str] = ()) -> list[dict]:
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
                    port = free_port() if args.loopback else 29500 + index
                    probe, results = run_block(
                        block, Path(tmp), port=port, loopback=args.loopback, device=args.device, gpus=gpus
                    )
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
    return contextlib.nullcontext() if loopback else Network(nodes, mtu)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _emit(line: dict, out: str | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")
