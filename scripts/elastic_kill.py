"""Lose a node under torchrun's elastic agent, keep training: 3 "nodes" become 2 and finish.

Three network namespaces on a bridge are three nodes, one training process each; gloo talks over
the namespaces' interfaces. Each node runs

    torchrun --nnodes 2:3 --nproc-per-node 1 --max-restarts 2 --rdzv-backend c10d \\
        --rdzv-endpoint 10.48.0.1:29400 --local-addr 10.48.0.<i+1> scripts/elastic_kill.py --worker ...

a CO2Trainer run (tiny GPT-2 from a config, no downloads) that saves every ``--save-steps`` steps
into one shared folder (a shared disk) and resumes from the last complete checkpoint with
``--co2_elastic true``. Once a checkpoint exists and the run is mid-round (an outer all-reduce in
flight), every process of node 2 (agent and worker) is SIGKILLed. The check, per run:

- each survivor's worker stops by itself with an error, within ``co2_timeout_s`` of the kill;
- the two agents re-rendezvous and restart their workers on a world of 2, which resume from the
  last complete checkpoint (only the steps since that save are lost) and train to ``--steps``;
- the final model loads with ``from_pretrained``; its held-out loss is printed beside that of a
  2-node run resumed from the same checkpoint without any kill (``--reference``; torch's gloo
  all-reduce and the data order make it the same run when the ranks map to the same nodes).

Only namespaces and links named ``co2e-*`` are created and removed (also those a killed earlier run
left). Needs root (``ip netns``). Prints one JSON line per run, then a summary:

    sudo python scripts/elastic_kill.py --runs 5 --out elastic_out
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

PREFIX, SUBNET, NODES = "co2e", "10.48.0", 3  # co2e-*: apart from the bandwidth benchmark's co2b-*
SWITCH_NS, BRIDGE = f"{PREFIX}-sw", f"{PREFIX}-br"
RDZV_PORT, TAU = 29400, 4


# ---------------------------------------------------------------------- the network


def _ns(i: int) -> str:
    return f"{PREFIX}-n{i}"


def _dev(i: int) -> str:
    return f"{PREFIX}-e{i}"


def network_commands() -> tuple[list[list[str]], list[list[str]]]:
    """Set-up and tear-down: a bridge in a switch namespace, a veth from each node's namespace to it
    (as ``scripts/bandwidth/netns.py`` builds them, unshaped)."""
    names = [_ns(i) for i in range(NODES)] + [SWITCH_NS]
    sw = f"ip -n {SWITCH_NS} link"
    up = [f"ip netns add {ns}" for ns in names] + [f"ip -n {ns} link set lo up" for ns in names]
    up += [f"{sw} add {BRIDGE} type bridge", f"{sw} set {BRIDGE} up"]
    for i in range(NODES):
        port = f"{PREFIX}-p{i}"
        up.append(f"ip link add {_dev(i)} netns {_ns(i)} type veth peer name {port} netns {SWITCH_NS}")
        up += [f"{sw} set {port} master {BRIDGE}", f"{sw} set {port} up"]
        up.append(f"ip -n {_ns(i)} addr add {SUBNET}.{i + 1}/24 dev {_dev(i)}")
        up.append(f"ip -n {_ns(i)} link set {_dev(i)} up")
    down = [f"ip netns del {ns}" for ns in names]  # a namespace takes its veth ends with it
    return [c.split() for c in up], [c.split() for c in down]


def remove_stale_namespaces() -> None:
    """``co2e-*`` namespaces left by a run killed with SIGKILL (the one exit that skips the tear-down)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listing.splitlines() if line.startswith(f"{PREFIX}-")):
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


class Network:
    def __enter__(self) -> Network:
        self.up, self.down = network_commands()
        try:
            for cmd in self.up:
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for cmd in self.down:
            subprocess.run(cmd, capture_output=True)


# ---------------------------------------------------------------------- one node's training process


def worker(out: str, steps: int, save_steps: int, timeout_s: float, step_sleep: float) -> None:
    """What torchrun starts on every node: train, resuming from the last complete checkpoint."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint

    from co2_hf import CO2Trainer, CO2TrainingArguments

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    args = CO2TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=TAU,
        save_strategy="steps",
        save_steps=save_steps,  # every checkpoint kept: --reference resumes from the one the survivors did
        report_to="none",
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        co2_local_steps=TAU,
        co2_timeout_s=timeout_s,
        co2_elastic=True,
    )

    class Progress(TrainerCallback):
        """Rank 0 tells the launcher where training is (after the step); every step is slowed down a
        little so that a kill lands inside the round the launcher aimed at."""

        def on_step_end(self, args, state, control, **kwargs):
            if rank == 0:
                record = {"step": state.global_step, "world": world, "restart": restart, "at": time.time()}
                _write_json(os.path.join(out, "progress.json"), record)
            time.sleep(step_sleep)

    trainer = CO2Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=_dataset(256, 0))
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(Progress())
    last = get_last_checkpoint(out) if os.path.isdir(out) else None
    try:
        trainer.train(resume_from_checkpoint=last)
    except Exception as error:  # a peer is gone: say when this rank noticed, then fail for the agent
        _write_json(
            os.path.join(out, f"stopped.rank{rank}.restart{restart}.json"),
            {"at": time.time(), "error": f"{type(error).__name__}: {error}"[:400], "world": world},
        )
        raise
    trainer.save_model(os.path.join(out, "final"))
    if rank == 0:
        state = {"world": world, "restart": restart, "step": trainer.state.global_step, "resumed_from": last}
        _write_json(os.path.join(out, "done.json"), {**state, "at": time.time()})


class _Sequences(list):
    """Counting sequences (learnable), as the tests use; a plain list of dicts is a map-style dataset."""


def _dataset(n: int, seed: int) -> _Sequences:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, 64, (n, 1), generator=g) + torch.arange(16)) % 64
    return _Sequences({"input_ids": row, "labels": row} for row in ids)


def held_out_loss(folder: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.stack([x["input_ids"] for x in _dataset(64, 1)])
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def _write_json(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------- the launcher


def start_node(i: int, nodes: str, out: str, a: argparse.Namespace) -> subprocess.Popen:
    """torchrun on node ``i``, in its namespace and its own session (killed as one group)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": _dev(i),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        # torchrun's agents share one TCP store with their workers across restarts (torch 2.13's
        # default), and the restarted workers' gloo group then read the dead group's addresses from it
        # ("Connection refused" in connectFullMesh, every restart). Off: a fresh store per rendezvous.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    rdzv = f"is_host={int(i == 0)},join_timeout=120,last_call_timeout=5"
    cmd = ["ip", "netns", "exec", _ns(i), torchrun, f"--nnodes={nodes}", "--nproc-per-node=1", "--monitor-interval=1"]
    cmd += [f"--max-restarts={a.max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={SUBNET}.1:{RDZV_PORT}"]
    cmd += [f"--rdzv-id=elastic-{os.path.basename(out)}", f"--rdzv-conf={rdzv}", f"--local-addr={SUBNET}.{i + 1}"]
    cmd += [os.path.abspath(__file__), "--worker", "--out", out, "--steps", str(a.steps)]
    cmd += ["--save-steps", str(a.save_steps), "--timeout-s", str(a.timeout_s), "--step-sleep", str(a.step_sleep)]
    log = open(os.path.join(out, f"node{i}.log"), "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_node(i: int, proc: subprocess.Popen) -> list[int]:
    """SIGKILL every process in node ``i``'s namespace: its agent, and the worker that torchrun
    started in a session of its own (a process-group kill would miss it)."""
    listing = subprocess.run(["ip", "netns", "pids", _ns(i)], capture_output=True, text=True).stdout
    pids = [int(p) for p in listing.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _kill(proc)
    return pids


def _wait(procs: list[subprocess.Popen], deadline: float) -> list[int | None]:
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    return [p.poll() for p in procs]


def _checkpoints(out: str) -> list[int]:
    return sorted(int(p.rsplit("-", 1)[1]) for p in glob.glob(os.path.join(out, "checkpoint-*")))


def one_run(index: int, a: argparse.Namespace) -> dict:
    out = os.path.abspath(os.path.join(a.out, f"run{index}"))
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    result: dict = {"run": index}
    started = time.time()
    procs = [start_node(i, f"2:{NODES}", out, a) for i in range(NODES)]
    try:
        killed = _kill_mid_round(procs, out, a, deadline=started + a.run_timeout_s / 2)
        result.update(killed, killed_after_s=round(killed["killed_at"] - started, 1))
        codes = _wait(procs[:2], deadline=started + a.run_timeout_s)
        result["survivor_exit_codes"] = codes
    finally:
        for i, p in enumerate(procs):
            kill_node(i, p)  # whatever is left of this run
    result.update(_outcome(out, result, a))
    result["seconds"] = round(time.time() - started, 1)
    if a.reference and result.get("ok"):
        result["reference_loss"] = reference_run(out, result["resumed_from"], a)
    return result


def _kill_mid_round(procs: list[subprocess.Popen], out: str, a: argparse.Namespace, deadline: float) -> dict:
    """SIGKILL node 2 (agent and worker) once a checkpoint is published and the run is mid-round."""
    while time.time() < deadline:
        progress = _read_json(os.path.join(out, "progress.json"))
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a node exited before the kill; see {out}/node*.log")
        if progress and progress["step"] >= a.kill_after and progress["step"] % TAU == TAU // 2 and _checkpoints(out):
            killed = kill_node(2, procs[2])
            return {
                "killed_at": time.time(),
                "killed_after_step": progress["step"],
                "killed_pids": len(killed),
                "saved": _checkpoints(out),
            }
        time.sleep(0.05)
    raise RuntimeError(f"training did not reach step {a.kill_after} in time; see {out}/node*.log")


def _outcome(out: str, result: dict, a: argparse.Namespace) -> dict:
    done = _read_json(os.path.join(out, "done.json")) or {}
    stops = [_read_json(p) for p in sorted(glob.glob(os.path.join(out, "stopped.rank*.restart0.json")))]
    stop_s = [round(s["at"] - result["killed_at"], 2) for s in stops if s]
    lost = result["killed_after_step"] - max(result["saved"])
    ok = (
        result["survivor_exit_codes"] == [0, 0]
        and done.get("world") == 2
        and done.get("step") == a.steps
        and len(stop_s) == 2
        and all(s <= a.timeout_s for s in stop_s)
        and done.get("resumed_from", "").endswith(f"checkpoint-{max(result['saved'])}")
    )
    loss = held_out_loss(os.path.join(out, "final")) if done else None
    return {
        "ok": ok,
        "survivors_stopped_after_s": stop_s,
        "stop_errors": [s["error"][:160] for s in stops if s],
        "resumed_from": done.get("resumed_from"),
        "final_world": done.get("world"),
        "final_step": done.get("step"),
        "restarts": done.get("restart"),
        "steps_lost": lost,
        "recovery_s": round(done["at"] - result["killed_at"], 1) if done else None,
        "final_loss": loss,
    }


def reference_run(out: str, checkpoint: str, a: argparse.Namespace) -> float | None:
    """Two nodes resumed from a copy of the same checkpoint, with no kill: the loss to compare with."""
    ref = out + "_reference"
    shutil.rmtree(ref, ignore_errors=True)
    os.makedirs(ref)
    shutil.copytree(checkpoint, os.path.join(ref, os.path.basename(checkpoint)))
    procs = [start_node(i, "2:2", ref, a) for i in range(2)]
    try:
        codes = _wait(procs, deadline=time.time() + a.run_timeout_s)
    finally:
        for i, p in enumerate(procs):
            kill_node(i, p)
    final = os.path.join(ref, "final")
    return held_out_loss(final) if codes == [0, 0] and os.path.isdir(final) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="elastic_out")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--save-steps", type=int, default=8)
    parser.add_argument("--kill-after", type=int, default=18, help="kill at the first mid-round step from here")
    parser.add_argument("--timeout-s", type=float, default=20.0, help="co2_timeout_s")
    parser.add_argument("--step-sleep", type=float, default=0.2)
    parser.add_argument("--max-restarts", type=int, default=2)
    parser.add_argument("--run-timeout-s", type=float, default=420.0, help="bound on one run")
    parser.add_argument("--reference", action="store_true", help="also run 2 nodes from the checkpoint, no kill")
    a = parser.parse_args()
    if a.worker:
        return worker(a.out, a.steps, a.save_steps, a.timeout_s, a.step_sleep)
    if os.geteuid() != 0 or shutil.which("ip") is None:
        sys.exit("elastic_kill.py builds network namespaces (ip netns): run it as root, with iproute2 installed")
    remove_stale_namespaces()
    results = []
    with Network():
        for index in range(a.runs):
            try:
                result = one_run(index, a)
            except Exception as error:  # noqa: BLE001 -- one run's failure is reported, the next runs still run
                result = {"run": index, "ok": False, "error": f"{type(error).__name__}: {error}"}
            print(json.dumps(result), flush=True)
            results.append(result)
    passed = sum(bool(r.get("ok")) for r in results)
    print(json.dumps({"runs": len(results), "passed": passed}), flush=True)
    sys.exit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    main()
