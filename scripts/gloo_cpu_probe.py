"""How much CPU an asynchronous gloo all-reduce takes while it crosses a shaped link.

    sudo .venv/bin/python scripts/gloo_cpu_probe.py --rates 100mbit,1gbit

Two ranks in bench_bandwidth.py's namespaces all-reduce the benchmark model's 10.3M fp32 elements
with ``async_op=True`` while their main thread sleeps; each prints the wall time of the transfer and
the CPU time its process used meanwhile. CPU time close to the wall time would mean gloo's transport
spins while it waits, which would steal a core from compute in CO2's overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: import the package `scripts` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ELEMENTS = 10_293_504  # bench_bandwidth.py's small model


def rank_main(rate: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:29777",
        rank=int(os.environ["RANK"]),
        world_size=2,
    )
    x = torch.ones(ELEMENTS)
    dist.all_reduce(torch.ones(1000))  # connections are set up
    runs = []
    for _ in range(3):
        dist.barrier()
        cpu, wall = time.process_time(), time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        while not work.is_completed():
            time.sleep(0.05)
        work.wait()
        runs.append({"wall_s": round(time.perf_counter() - wall, 3), "cpu_s": round(time.process_time() - cpu, 3)})
    print(json.dumps({"rank": dist.get_rank(), "rate": rate, "runs": runs}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100mbit,1gbit")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        return rank_main(args.rank_of)
    from scripts.bandwidth import netns

    netns.check_privileges()
    netns.remove_stale_namespaces()
    with netns.Network(2) as network:
        for rate in args.rates.split(","):
            network.set_rate(rate)
            procs = []
            for rank in range(2):
                env = {**os.environ, "RANK": str(rank), "MASTER_ADDR": f"{netns.SUBNET}.1"}
                env["GLOO_SOCKET_IFNAME"] = netns.node_dev(rank)
                cmd = ["ip", "netns", "exec", netns.node_ns(rank), sys.executable, os.path.abspath(__file__)]
                procs.append(subprocess.Popen([*cmd, "--rank-of", rate], env=env))
            for proc in procs:
                proc.wait(timeout=180)


if __name__ == "__main__":
    main()
