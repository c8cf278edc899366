"""Kill a replica mid-round every few rounds, on torchft: how much training survives (issue 25).

    python scripts/ft_kill.py --runs 3 --methods co2 diloco --out outputs/ft_kill

A Lighthouse and 3 replica groups of one process each run on loopback. Each replica trains the
micro GPT of scripts/sim_sweep.py (the GPT recipe's Shakespeare corpus, 2 plays held out) with
AdamW, tau 12, its batches following its replica id and its step. ``co2`` is CO2 through
`co2_hf.torchft.job.TorchFT` (CO2Config's defaults but tau, ``--fragments`` and ``--comm_dtype``); ``diloco`` is
torchft's own `DiLoCo` (outer SGD lr 0.7, Nesterov 0.9, the DiLoCo paper's), on the same
Lighthouse settings and the same recovery transport. For each method and run, a no-fault run and
a fault run are made one after the other with the same seed. In the fault run the supervisor
SIGKILLs one replica ``--kills`` times (replicas 1, 2, 0, 1, ...), the first once the job has
committed ``--kill_every`` rounds and each next ``--kill_every`` rounds after the last
replacement's first commit, always half a round after the victim's last boundary (an all-reduce
in flight), and restarts it at once (a supervisor loop, as ``torchrun --max-restarts`` does).

``--spares``: the supervisor keeps a warm spare per replica in fault runs (a process that has done its
imports and built its model, waiting to be told to join), starts it in place of a killed replica and
starts the next spare behind it, instead of a new process: what a job with standby nodes does.

A step takes at least ``--step_s`` seconds (compute, then a sleep): on a shared 2-core machine this
stands in for a GPU's step, so that rounds last what they would and restarts are not free.

Reported per run (one JSON line, then a table of medians):

- ``survivors_kept``: every process that exited was one the supervisor killed (the others' pids
  never change);
- ``goodput``: inner steps that entered a committed round, summed over the replicas' processes,
  divided by 3 x the steps per second of the no-fault run x the fault run's wall time (both timed
  from the first boundary every replica reached to the last commit);
- ``progress``: the job's committed rounds per second against the no-fault run's (what the
  global model gained; a replacement inherits its peer's count);
- ``first_commit_s`` per replacement: from its model being built to its first committed round,
  and from its process start, beside the no-fault run's round time;
- ``same_anchor``: every replica's global model (CO2's anchor, DiLoCo's synced weights) has one
  SHA-256 at every step two or more of them recorded; ``checkpoint_files``: none is ever written,
  so none can be read;
- ``final_loss``: the held-out loss of replica 0's global model at the end, beside the no-fault's.

Needs the ``ft`` extra (torchft). Proxy variables are removed for the replicas (torchft's clients
talk to 127.0.0.1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VICTIMS = (1, 2, 0)


# ---------------------------------------------------------------------------------------- replica
def _digest(tensors) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class Recorder:
    """One JSON line per event in the replica's file (a replacement appends to its predecessor's)."""

    def __init__(self, path: str) -> None:
        self.path, self.pid = path, os.getpid()

    def __call__(self, event: str, **fields) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(dict(event=event, pid=self.pid, time=time.time(), **fields)) + "\n")


def replica(a: argparse.Namespace) -> None:
    import torch

    sys.path[:0] = [str(ROOT), str(ROOT / "recipes")]
    from scripts.sim_sweep import make_task

    torch.set_num_threads(1)
    rank = int(os.environ["REPLICA_GROUP_ID"])
    task = make_task("micro", a.steps, a.seed)
    model = task.build_model(rank)
    optimizer = task.build_optimizer(model)
    scheduler = task.build_scheduler(optimizer)
    if a.spare:  # warm: imports done and model built, not yet in the job; the supervisor says when
        import torchft.local_sgd  # noqa: F401 - what joining needs, imported while waiting

        import co2_hf.torchft  # noqa: F401

        sys.stdin.readline()
    record = Recorder(a.out)
    record("built")
    run = _run_co2 if a.method == "co2" else _run_diloco
    final = run(a, rank, task, model, optimizer, scheduler, record)
    if rank == 0:
        record("final", loss=task.evaluate(model, final))


def _paced(step_s: float, work):
    """Run one step's work, then sleep what is left of ``step_s``; returns what the work returned."""
    start = time.perf_counter()
    result = work()
    time.sleep(max(0.0, step_s - (time.perf_counter() - start)))
    return result


def _run_co2(a, rank, task, model, optimizer, scheduler, record):
    from co2_hf import CO2Config
    from co2_hf.torchft.job import TorchFT

    config = CO2Config(co2_local_steps=a.tau, co2_fragments=a.fragments, co2_comm_dtype=a.comm_dtype)
    ft = TorchFT(config, timeout_s=a.timeout_s, quorum_timeout_s=120, start_timeout_s=120)
    commit = ft.comm.commit

    def counted_commit(pending) -> bool:
        committed = commit(pending)
        record("commit", ok=committed, rounds=ft.committed_rounds)
        return committed

    ft.comm.commit = counted_commit
    co2 = ft.start(model, optimizer, state={"scheduler": (scheduler.load_state_dict, scheduler.state_dict)})
    record("joined", step=co2.inner_steps)

    def one_step() -> bool:
        loss = task.loss(model, task.batch(rank, co2.inner_steps))
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return co2.step()

    while co2.inner_steps < a.steps:
        if _paced(a.step_s, one_step):
            anchor = co2.anchor_state()
            record("boundary", step=co2.inner_steps, anchor=_digest(anchor[n] for n in sorted(anchor)))
    co2.finalize()
    anchor = co2.anchor_state()
    ft.shutdown()
    return anchor


def _run_diloco(a, rank, task, model, optimizer, scheduler, record):
    import torch
    from torchft.local_sgd import DiLoCo

    from co2_hf.torchft.job import build_manager, job_interface
    from co2_hf.torchft.transport import RecoveryTransport, job_secret

    host, timeout = job_interface(os.environ["TORCHFT_LIGHTHOUSE"]), timedelta(seconds=a.timeout_s)
    # CO2's transport and listeners (torchft's own transport unpickles objects and serves anyone);
    # no async quorum: DiLoCo requires it
    transport = RecoveryTransport(host, timeout, secret=job_secret())
    manager, _, store = build_manager(  # store: referenced until the run ends
        host, transport, replica_id=f"diloco_{rank}", timeout=timeout, quorum_timeout=timedelta(seconds=120)
    )
    position = {"local": 0}  # the step within the round: with torchft's step, the data position
    for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
        manager.register_state_dict_fn(name, obj.load_state_dict, obj.state_dict)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with DiLoCo(manager, [model], optimizer, outer, sync_every=a.tau, pin_memory=False) as diloco:
        perform_sync = diloco._fragments[0].perform_sync

        def counted_sync() -> bool:
            committed = perform_sync()
            record("commit", ok=committed, rounds=manager.current_step())
            return committed

        diloco._fragments[0].perform_sync = counted_sync  # torchft's hook calls it after the round
        record("joined", step=manager.current_step() * a.tau)

        def one_step() -> None:
            step = manager.current_step() * a.tau + position["local"]
            loss = task.loss(model, task.batch(rank, step))
            loss.backward()
            optimizer.step()  # DiLoCo's post-hook: the quorum and the sync at the round's end
            scheduler.step()
            optimizer.zero_grad()
            position["local"] = diloco._local_step

        while manager.current_step() * a.tau < a.steps:
            _paced(a.step_s, one_step)
            if position["local"] == 0:
                record("boundary", step=manager.current_step() * a.tau, anchor=_digest(model.parameters()))
    manager.shutdown(wait=False)
    return None  # the model holds the synced weights after the last round


# ------------------------------------------------------------------------------------- supervisor
def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


class Job:
    """A Lighthouse and one process per replica, restarted when it dies (the supervisor)."""

    def __init__(self, a: argparse.Namespace, folder: Path, spares: bool = False) -> None:
        from torchft._torchft import LighthouseServer

        self.a, self.folder, self.use_spares = a, folder, spares
        self.lighthouse = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=1,
            join_timeout_ms=a.join_timeout_ms,
            quorum_tick_ms=10,
            heartbeat_timeout_ms=a.heartbeat_timeout_ms,
        )
        self.env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
        self.env.update(
            TORCHFT_LIGHTHOUSE=self.lighthouse.address(), NUM_REPLICA_GROUPS=str(a.replicas), OMP_NUM_THREADS="1"
        )
        self.env.pop("CO2_FT_SECRET_FILE", None)  # a new secret for each job (co2_hf/torchft/transport.py)
        self.env["CO2_FT_SECRET"] = secrets.token_hex(32)
        self.procs: dict[int, subprocess.Popen] = {}
        self.started: dict[int, float] = {}  # pid -> its start, as the supervisor saw it
        self.spares: dict[int, subprocess.Popen] = {}  # with --spares: a warm process per replica
        self.unexpected: list[dict] = []

    def path(self, rank: int) -> Path:
        return self.folder / f"replica{rank}.jsonl"

    def start(self, rank: int) -> None:
        """Start replica ``rank``: its warm spare if it has one (then a new spare behind it)."""
        spare = self.spares.pop(rank, None)
        if spare is None:
            proc = self._spawn(rank)
        else:
            proc = spare
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        self.procs[rank], self.started[proc.pid] = proc, time.time()
        if self.use_spares:
            self.spares[rank] = self._spawn(rank, spare=True)

    def _spawn(self, rank: int, spare: bool = False) -> subprocess.Popen:
        a = self.a
        argv = [sys.executable, __file__, "--replica", "--method", a.method, "--out", str(self.path(rank))]
        argv += ["--steps", str(a.steps), "--tau", str(a.tau), "--step_s", str(a.step_s), "--seed", str(a.seed)]
        argv += ["--timeout_s", str(a.timeout_s)] + (["--fragments", str(a.fragments)] if a.fragments else [])
        argv += ["--comm_dtype", a.comm_dtype]
        log = open(self.folder / f"replica{rank}.log", "a")
        env = {**self.env, "REPLICA_GROUP_ID": str(rank)}
        stdin = subprocess.PIPE if spare else subprocess.DEVNULL
        return subprocess.Popen(argv + ["--spare"] * spare, env=env, stdin=stdin, stdout=log, stderr=log)

    def kill(self, rank: int) -> None:
        proc = self.procs[rank]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self.start(rank)

    def poll(self) -> bool:
        """Restart what died by itself (recorded as unexpected); True once every replica is done."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code not in (None, 0):
                self.unexpected.append(dict(replica=rank, pid=proc.pid, code=code))
                if len(self.unexpected) > 3 * self.a.replicas:
                    raise RuntimeError(f"replicas keep failing: see {self.folder}/replica*.log")
                self.start(rank)
        return all(p.poll() == 0 for p in self.procs.values())

    def records(self) -> dict[int, list[dict]]:
        return {rank: _records(self.path(rank)) for rank in self.procs}

    def stop(self) -> None:
        for proc in [*self.procs.values(), *self.spares.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.lighthouse.shutdown()


def commits_per_round(a: argparse.Namespace) -> int:
    """torchft commits once per fragment's round: F times a round with CO2's fragments."""
    return 1 if a.method == "diloco" else (a.fragments or a.tau)  # unset: F = tau (CO2Config)


def _rounds(records: dict[int, list[dict]]) -> int:
    return max((r["rounds"] for rs in records.values() for r in rs if r["event"] == "commit"), default=0)


def run_job(a: argparse.Namespace, folder: Path, kills: int, spares: bool = False) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("replica*"):
        old.unlink()  # this script's own files from an earlier run
    job = Job(a, folder, spares)
    for rank in range(a.replicas):
        job.start(rank)
    deadline, plan = time.time() + a.run_timeout_s, []
    try:
        while not job.poll():
            if time.time() > deadline:
                raise RuntimeError(f"run past {a.run_timeout_s} s: see {folder}/replica*.log")
            if len(plan) < kills:
                _maybe_kill(job, plan)
            time.sleep(0.02)
    finally:
        job.stop()
    return summarize(job, plan)


def _maybe_kill(job: Job, plan: list[dict]) -> None:
    """Kill the next victim half a round after its last boundary, once the job is far enough on."""
    records = job.records()
    if plan and not _committed(records[plan[-1]["replica"]], plan[-1]["new_pid"]):
        return  # the last replacement has not committed yet
    a, since = job.a, plan[-1]["rounds"] if plan else 0
    if _rounds(records) < since + a.kill_every * commits_per_round(a):
        return
    victim = VICTIMS[len(plan) % len(VICTIMS)]
    pid = job.procs[victim].pid
    starts = [r for r in records[victim] if r["event"] == "boundary" and r["pid"] == pid and r["step"] % a.tau == 0]
    if len(starts) < 2:
        return
    half_round = 0.5 * (starts[-1]["time"] - starts[-2]["time"])
    if time.time() < starts[-1]["time"] + half_round:
        return
    job.kill(victim)
    plan.append(dict(replica=victim, new_pid=job.procs[victim].pid, rounds=_rounds(records)))


def _committed(records: list[dict], pid: int) -> bool:
    return any(r["event"] == "commit" and r["ok"] and r["pid"] == pid for r in records)


def summarize(job: Job, plan: list[dict]) -> dict:
    a, records = job.a, job.records()
    every = [r for rs in records.values() for r in rs]
    boundary_times = {}  # first time each replica reached a boundary, then the last commit
    for rank, rs in records.items():
        boundary_times[rank] = min(r["time"] for r in rs if r["event"] == "boundary")
    commits = [r for r in every if r["event"] == "commit"]
    t0, t1 = max(boundary_times.values()), max(r["time"] for r in commits if r["ok"])
    per_round = commits_per_round(a)
    window = [r for r in commits if r["time"] >= t0]
    rounds = (_rounds(records) - min(r["rounds"] for r in window) + 1) / per_round  # the job's, in the window
    steps = a.tau / per_round * sum(r["ok"] for r in window)  # a process's commit: tau/F of its steps
    by_step: dict[int, set[str]] = {}
    for r in every:
        if r["event"] == "boundary":
            by_step.setdefault(r["step"], set()).add(r["anchor"])
    replacements = []
    for kill in plan:
        pid = kill["new_pid"]
        own = [r for r in records[kill["replica"]] if r["pid"] == pid]
        built = next(r["time"] for r in own if r["event"] == "built")
        first = next((r["time"] for r in own if r["event"] == "commit" and r["ok"]), None)
        replacements.append(
            dict(
                replica=kill["replica"],
                start_to_built_s=round(built - job.started[pid], 2),
                first_commit_s=None if first is None else round(first - built, 2),
                first_commit_from_start_s=None if first is None else round(first - job.started[pid], 2),
            )
        )
    final = [r["loss"] for r in records[0] if r["event"] == "final"]
    return dict(
        method=a.method,
        kills=len(plan),
        survivors_kept=not job.unexpected,
        unexpected_exits=job.unexpected,
        seconds=round(t1 - t0, 2),
        committed_steps=steps,
        rounds=rounds,
        round_s=round((t1 - t0) / rounds, 3),
        dropped=sum(not r["ok"] for r in commits),
        same_anchor=all(len(digests) == 1 for digests in by_step.values()),
        steps_compared=sum(len(d) >= 1 for d in by_step.values()),
        replacements=replacements,
        checkpoint_files=sorted(str(p) for p in job.folder.rglob("*") if p.suffix in (".pt", ".safetensors", ".bin")),
        final_loss=final[-1] if final else None,
    )


def compare(nofault: dict, fault: dict) -> dict:
    rate = nofault["committed_steps"] / nofault["seconds"]
    progress = (fault["rounds"] / fault["seconds"]) / (nofault["rounds"] / nofault["seconds"])
    losses = fault["final_loss"], nofault["final_loss"]
    return dict(
        goodput=round(fault["committed_steps"] / (rate * fault["seconds"]), 3),
        progress=round(progress, 3),
        loss_ratio=round(losses[0] / losses[1], 4) if all(losses) else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)  # one replica's process
    parser.add_argument("--method", default="co2", choices=["co2", "diloco"], help=argparse.SUPPRESS)
    parser.add_argument("--spare", action="store_true", help=argparse.SUPPRESS)  # a replica's warm spare
    parser.add_argument("--methods", nargs="+", default=["co2", "diloco"], choices=["co2", "diloco"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--tau", type=int, default=12)
    parser.add_argument("--fragments", type=int, default=None, help="CO2's co2_fragments (unset: its default)")
    parser.add_argument("--comm_dtype", default="float32", help="CO2's co2_comm_dtype (DiLoCo sends float32)")
    parser.add_argument("--steps", type=int, default=240, help="inner steps a replica trains")
    parser.add_argument("--step_s", type=float, default=0.25, help="the least time a step takes")
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument(
        "--spares",
        action="store_true",
        help="in fault runs, keep a warm spare per replica (imports done, model built) that the supervisor "
        "starts in place of a killed one, instead of a new process",
    )
    parser.add_argument("--kill_every", type=int, default=3, help="rounds between kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout_s", type=float, default=10.0, help="a collective's, commit's, recovery's")
    parser.add_argument("--join_timeout_ms", type=int, default=10_000)
    parser.add_argument(
        "--heartbeat_timeout_ms", type=int, default=1_000, help="how long a dead replica holds up the next quorum"
    )
    parser.add_argument("--run_timeout_s", type=float, default=600)
    parser.add_argument("--out", default="outputs/ft_kill")
    a = parser.parse_args()
    if a.replica:
        replica(a)
        return
    if a.replicas < 2 or a.kills < 0 or a.kill_every < 1:
        parser.error("--replicas >= 2, --kills >= 0 and --kill_every >= 1 are allowed")
    results, out = [], Path(a.out)
    for run in range(a.runs):
        for method in a.methods:
            a.method, a.seed = method, run
            nofault = run_job(a, out / f"{method}_run{run}_nofault", kills=0)
            fault = run_job(a, out / f"{method}_run{run}_fault", kills=a.kills, spares=a.spares)
            line = dict(run=run, method=method, nofault=nofault, fault=fault, **compare(nofault, fault))
            print(json.dumps(line), flush=True)
            results.append(line)
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    print(table(results))


def table(results: list[dict]) -> str:
    """Medians over the runs (min-max for goodput), one row per method."""
    rows = [
        "| method | goodput | progress | first commit after build (s) | round (s) | loss fault / no-fault "
        "| same anchors | survivors kept |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method in dict.fromkeys(r["method"] for r in results):
        mine = [r for r in results if r["method"] == method]
        goodput = [r["goodput"] for r in mine]
        firsts = [x["first_commit_s"] for r in mine for x in r["fault"]["replacements"] if x["first_commit_s"]]
        losses = [r["loss_ratio"] for r in mine if r["loss_ratio"]]
        cells = [
            method,
            f"{_median(goodput)} ({min(goodput)}-{max(goodput)})",
            _median([r["progress"] for r in mine]),
            f"{_median(firsts)} (max {max(firsts, default=None)})",
            _median([r["nofault"]["round_s"] for r in mine]),
            _median(losses),
            all(r["fault"]["same_anchor"] and r["nofault"]["same_anchor"] for r in mine),
            all(r["fault"]["survivors_kept"] for r in mine),
        ]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(rows)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


if __name__ == "__main__":
    main()
