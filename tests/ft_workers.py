"""One torchft replica group running CO2 on a tiny regression task, for tests/test_ft.py.

    python tests/ft_workers.py --out FILE --steps 40 --tau 4 [--fragments 1] [--sleep 0.05] [--die MODE:K]
        [--comm_dtype float32]

torchft's environment (TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS) says which replica
group this is. One JSON line per boundary is appended to ``--out`` (a replacement appends to its
predecessor's file): the process id, the inner step, torchft's committed step, the quorum's size,
the rounds dropped so far, a digest of the anchor and its largest magnitude. ``--die MODE:K`` kills
the first process of the replica (its file does not exist yet) with SIGKILL at its K-th quorum: ``before`` it,
``during`` an all-reduce (after the quorum, where the others launch theirs and this one never
sends), ``after`` its commit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import time

import torch

from co2_hf import CO2Config
from co2_hf.torchft.job import TorchFT


def anchor_digest(co2) -> str:
    state = co2.anchor_state()
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(state[name].detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def die_at(ft: TorchFT, mode: str, boundary: int) -> None:
    """Wrap the communicator's verbs so that this process kills itself at its ``boundary``-th one."""
    comm, seen = ft.comm, {"quorum": 0}

    def kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    start_quorum, launch, launch_coded, commit = comm.start_quorum, comm.launch, comm.launch_coded, comm.commit

    def quorum_then_maybe_die() -> None:
        seen["quorum"] += 1
        if mode == "before" and seen["quorum"] == boundary:
            kill()
        start_quorum()

    def launch_or_die(tensor):
        if mode == "during" and seen["quorum"] == boundary:
            kill()
        return launch(tensor)

    def launch_coded_or_die(tensor, reduce_):
        if mode == "during" and seen["quorum"] == boundary:
            kill()
        return launch_coded(tensor, reduce_)

    def commit_then_maybe_die(pending) -> bool:
        committed = commit(pending)
        if mode == "after" and seen["quorum"] == boundary:  # the commit of the launch after quorum K
            kill()
        return committed

    comm.start_quorum, comm.launch, comm.commit = quorum_then_maybe_die, launch_or_die, commit_then_maybe_die
    comm.launch_coded = launch_coded_or_die


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tau", type=int, default=4)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--timeout_s", type=float, default=5.0)
    parser.add_argument("--start_timeout_s", type=float, default=60.0)
    parser.add_argument("--die", default=None)
    parser.add_argument("--comm_dtype", default="float32")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.environ.get("CO2_FT_DEBUG"):  # torchft's quorum, heal and commit lines, for a failing test
        logging.getLogger("torchft").setLevel(logging.INFO)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    torch.manual_seed(replica)  # each replica its own init: the first quorum must make them agree
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = CO2Config(
        co2_local_steps=args.tau,
        co2_fragments=args.fragments,
        co2_comm_dtype=args.comm_dtype,
        # where the wire reads it: a float32 or bfloat16 wire refuses a block (it sends no codes)
        **({"co2_quant_block": 16} if args.comm_dtype in ("int8", "int4", "sparse") else {}),
    )
    ft = TorchFT(config, timeout_s=args.timeout_s, quorum_timeout_s=60, start_timeout_s=args.start_timeout_s)
    if args.die and not os.path.exists(args.out):  # a replacement (its predecessor wrote) lives
        mode, boundary = args.die.split(":")
        die_at(ft, mode, int(boundary))
    co2 = ft.start(model, optimizer)
    while co2.inner_steps < args.steps:
        g = torch.Generator().manual_seed(co2.inner_steps * 10 + replica)  # the data follows the step
        x = torch.randn(16, 8, generator=g)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if co2.step():
            record = dict(
                pid=os.getpid(),
                step=co2.inner_steps,
                committed=ft.committed_rounds,
                participants=ft.manager.num_participants(),
                dropped=ft.comm.dropped_rounds,
                anchor=anchor_digest(co2),
                anchor_max=max(t.abs().max().item() for t in co2.anchor_state().values()),
                time=time.time(),
            )
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
        time.sleep(args.sleep)
    co2.finalize()
    ft.shutdown()


if __name__ == "__main__":
    main()
