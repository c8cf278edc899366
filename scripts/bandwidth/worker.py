"""Inside a rank: time the all-reduce alone (the probe), then train every run of the block in turn.

A rank is a process that ``bench_bandwidth.py --worker SPEC`` starts (inside its node's namespace);
it reads the block from the JSON spec, its place from the environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT: see ``plan.rank_env``) and writes one JSON file per run, which the launcher waits
for. With ``--device cuda`` it binds GPU LOCAL_RANK before the default group (NCCL) starts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..bench_overlap import SEQ
from ..scaling_model import gpt2_params
from .peers import AccelerateLoop, Loop, PostLocalSGDLoop, TorchFTLoop
from .plan import CO2_SETTINGS, MODELS, Run, backend_and_device, co2_settings


def build_model(cfg: dict, seed: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**cfg))


def train(run: Run, cfg: dict, rank: int, device: str, batch: int, ranks_per_node: int = 1, **options) -> dict:
    """One method for tau x rounds steps; per-step times, for the CO2 engine the waits per boundary,
    and the bytes this rank's node sent over its link (its veth's tx counter; None on loopback).
    ``device``: ``cpu`` or this rank's ``cuda:<local rank>``; ``options``: `make_loop`'s."""
    import torch

    model = build_model(cfg, seed=rank).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loop = make_loop(run, model, optimizer, rank=rank, device=device, ranks_per_node=ranks_per_node, **options)
    gen = torch.Generator().manual_seed(rank)
    tx_start = _link_tx_bytes()
    times = []
    for _ in range(run.tau * run.rounds):
        tokens = torch.randint(0, cfg["vocab_size"], (batch, SEQ), generator=gen).to(device)
        start = time.perf_counter()
        loop.optimizer.zero_grad()
        loop.backward(loop.module(input_ids=tokens, labels=tokens).loss)
        loop.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()  # a step's wall time is its kernels' time, not their launch
        times.append(time.perf_counter() - start)
        loop.record()
    loop.close()  # CO2: the last round's all-reduce completes, so every round's bytes are counted
    tx = _link_tx_bytes()
    # the load average shows whether anything else ran on the machine during the run
    return {
        "times": times,
        "waits": loop.waits,
        "comms": loop.comms,
        "engine": loop.engine,
        "load_1m": os.getloadavg()[0],
        "link_tx_bytes": tx - tx_start if tx is not None else None,
        "library": loop.version(),
    }


class CO2Loop(Loop):
    """The CO2 engine of this checkout or of another one (``package``: its ``co2_hf``)."""

    def __init__(self, model, optimizer, settings: dict, package) -> None:
        super().__init__(model, optimizer)
        self.co2 = package.CO2(model, package.CO2Config(**settings), optimizer=optimizer)
        self._round_ended = False
        self._in_step = 0.0  # host seconds in co2.step() since the round started

    def step(self) -> None:
        self.co2.average_gradients()  # inside a worker of several ranks (co2_node); else nothing
        self.optimizer.step()
        start = time.perf_counter()
        # a round ended (with fragments: the last fragment's boundary): its waits, summed over fragments
        self._round_ended = self.co2.step() and self.co2.round_step == 0
        self._in_step += time.perf_counter() - start

    def record(self) -> None:
        if self._round_ended:  # read after the step's time was taken (on a GPU the read may wait)
            self.waits.append(self.co2.last_wait_s)
            self.comms.append(self.co2.last_comm_s)
            self.engine.append(self._in_step)
            self._in_step = 0.0

    def global_state(self, model) -> dict:
        """The anchor (CO2's global model), valid until the next boundary."""
        return self.co2.anchor_state()

    def close(self) -> None:
        self.co2.finalize()


def make_loop(run: Run, model, optimizer, *, rank: int, device: str, ranks_per_node: int, **options) -> Loop:
    """The training step of ``run.method`` around ``model``. ``options``: ``trees`` (--against: commit
    -> checkout), ``torchft_fragments`` and ``torchft_delay`` (torchft_streaming)."""
    import torch

    tau = run.tau
    if run.method == "ddp":
        ids = [torch.device(device).index] if device.startswith("cuda") else None
        return Loop(torch.nn.parallel.DistributedDataParallel(model, device_ids=ids), optimizer)
    if run.method in CO2_SETTINGS:
        k = ranks_per_node if run.method == "co2_node" else 1
        settings = dict(co2_worker_size=k, co2_comm_dtype=run.wire, **co2_settings(run.method, tau))
        return CO2Loop(model, optimizer, settings, co2_package(run.code, options.get("trees", {})))
    if run.method == "torchft_diloco":
        return TorchFTLoop(model, optimizer, tau=tau, fragments=1, delay=0, rank=rank)
    if run.method == "torchft_streaming":
        fragments, delay = options["torchft_fragments"], options.get("torchft_delay")
        return TorchFTLoop(model, optimizer, tau=tau, fragments=fragments, delay=delay, rank=rank)
    if run.method == "accelerate_local_sgd":
        return AccelerateLoop(model, optimizer, tau=tau, device=device)
    if run.method == "torch_post_local_sgd":
        return PostLocalSGDLoop(model, optimizer, tau=tau, device=device, ranks_per_node=ranks_per_node)
    return Loop(model, optimizer)  # no_comm


def co2_package(code: str, trees: dict[str, str]):
    """``co2_hf`` of this checkout (``code`` empty) or of the ``--against`` checkout at commit ``code``
    (imported once, as ``co2_hf_other``: ``scripts/time_boundary.py``)."""
    if not code:
        import co2_hf

        return co2_hf
    import sys

    from ..time_boundary import load_other

    return sys.modules.get("co2_hf_other") or load_other(trees[code])


def _link_tx_bytes() -> int | None:
    """Bytes sent so far through this node's link (the namespace's veth); None on loopback."""
    device = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    if device == "lo":
        return None
    return int(Path(f"/sys/class/net/{device}/statistics/tx_bytes").read_text())


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)  # the parent never reads half a file


def worker(spec_path: str) -> None:
    """A rank: time the all-reduce alone (the probe), then every run of the block in order."""
    import datetime

    import torch
    import torch.distributed as dist

    from ..bench_overlap import allreduce_alone

    spec = json.loads(Path(spec_path).read_text())
    out, cfg = Path(spec["out_dir"]), MODELS[spec["model"]]
    torch.set_num_threads(1)  # the ranks share the cores; gloo's threads compete with compute anyway
    rank = int(os.environ["RANK"])
    backend, device = backend_and_device(spec["device"], int(os.environ["LOCAL_RANK"]))
    bound = {}
    if backend == "nccl":  # bind the GPU first: NCCL then never guesses (or duplicates) a device
        torch.cuda.set_device(device)
        bound = dict(device_id=torch.device(device))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=spec["timeout_s"]), **bound)
    probe = allreduce_alone(gpt2_params(cfg), 3, device=device)
    _write_json(out / f"probe.rank{rank}.json", {"allreduce_alone_s": probe})
    batch, options = spec["batch"], spec.get("options", {})
    train(Run("no_comm", 1, 4), cfg, rank, device, batch)  # untimed: first calls are slow everywhere
    for i, run in enumerate(spec["runs"]):
        dist.barrier()  # every run starts together
        result = train(Run(**run), cfg, rank, device, batch, spec["ranks_per_node"], **options)
        _write_json(out / f"run{i}.rank{rank}.json", result)
    dist.barrier()
    dist.destroy_process_group()
