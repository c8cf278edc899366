"""Try CO2 on torchft on one machine: a Lighthouse and N replica groups of one command, each
restarted when it dies (the supervisor), until every one has exited on its own.

    co2-ft-launch --replicas 3 [--max_restarts 10] -- python tests/ft_workers.py --out r.jsonl

(installed with the package; ``python -m co2_hf.torchft.launch`` is the same command).

Each replica gets torchft's variables (TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS),
the job's secret and a new id for the job (CO2_FT_JOB_ID, unless set: a restart keeps it);
``{replica}`` in the command becomes its id. The Lighthouse listens on
127.0.0.1, so every replica's listeners do too: nothing outside this machine reaches the job. The
secret is yours if CO2_FT_SECRET or CO2_FT_SECRET_FILE is set; else a new one, in a file only you
can read, in a private folder removed at the end (CO2_FT_SECRET_FILE names it to the replicas).
Proxy variables are removed (torchft's clients talk to 127.0.0.1). ``--join_timeout_ms`` must cover
a round's compute (docs/algorithm.md section 19). Kill
a replica (``kill -9 PID``; the pids are printed) to watch its replacement rejoin. Exit status: 0 if
every replica's last process exited 0. On SIGTERM or SIGINT it ends its replicas (SIGTERM, then
SIGKILL after 10 s), stops the Lighthouse, removes the secret it made, and exits 143 or 130. If
it is killed outright (SIGKILL), the Lighthouse goes with it and the replicas exit at their next
quorum; only its secret's folder is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from .transport import JOB_ENV, SECRET_ENV, SECRET_FILE_ENV

HOST = "127.0.0.1"
GRACE_S = 10.0  # how long a replica has to exit after SIGTERM before it is killed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="co2-ft-launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--max_restarts", type=int, default=10, help="per replica")
    parser.add_argument("--join_timeout_ms", type=int, default=10_000)
    parser.add_argument(
        "--heartbeat_timeout_ms", type=int, default=1_000, help="how long a dead replica holds up the next quorum"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the replica's command after --")
    if args.replicas < 1:
        parser.error(f"--replicas={args.replicas}: allowed is 1 or more")
    signal.signal(signal.SIGTERM, _exit_on_signal)  # SIGINT raises KeyboardInterrupt already
    try:
        with job_secret() as secret:
            return run(args, command, secret)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def _exit_on_signal(signum: int, _frame: object) -> None:
    """SIGTERM: leave through the ``finally`` blocks (replicas ended, Lighthouse stopped, secret removed)."""
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def job_secret() -> Iterator[dict[str, str]]:
    """The secret's variable for the replicas: the user's, or a new secret's file (mode 0600, in a
    folder of mode 0700 that only this launcher writes), removed when the job ends."""
    given = {name: os.environ[name] for name in (SECRET_ENV, SECRET_FILE_ENV) if os.environ.get(name)}
    if given:
        yield given
        return
    folder = tempfile.mkdtemp(prefix="co2_ft_")  # mode 0700
    try:
        path = os.path.join(folder, "secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        print(f"ft_launch: the job's secret is in {path} ({SECRET_FILE_ENV})", flush=True)
        yield {SECRET_FILE_ENV: path}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(args: argparse.Namespace, command: list[str], secret: dict[str, str]) -> int:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind=f"{HOST}:0",
        min_replicas=1,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=10,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    port = lighthouse.address().rsplit(":", 1)[1]  # address() names the host, which may not be loopback
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update(secret, TORCHFT_LIGHTHOUSE=f"http://{HOST}:{port}", NUM_REPLICA_GROUPS=str(args.replicas))
    env.setdefault(JOB_ENV, secrets.token_hex(8))  # binds the signatures to this job (transport.job_key)

    def start(replica: int) -> subprocess.Popen:
        argv = [part.replace("{replica}", str(replica)) for part in command]
        proc = subprocess.Popen(argv, env={**env, "REPLICA_GROUP_ID": str(replica)})
        print(f"ft_launch: replica {replica} is pid {proc.pid}", flush=True)
        return proc

    procs = {replica: start(replica) for replica in range(args.replicas)}
    restarts = dict.fromkeys(procs, 0)
    try:
        while True:
            for replica, proc in procs.items():
                code = proc.poll()
                if code not in (None, 0) and restarts[replica] < args.max_restarts:
                    restarts[replica] += 1
                    print(f"ft_launch: replica {replica} exited with {code}; restart {restarts[replica]}", flush=True)
                    procs[replica] = start(replica)
            if all(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.1)
    finally:
        stop(list(procs.values()))
        lighthouse.shutdown()
    return 0 if all(p.returncode == 0 for p in procs.values()) else 1


def stop(procs: list[subprocess.Popen]) -> None:
    """End every replica still running: SIGTERM, then SIGKILL for those not gone within `GRACE_S`."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + GRACE_S
    for proc in running:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
