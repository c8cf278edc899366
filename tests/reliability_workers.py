"""Per-rank runs for tests/test_reliability.py: a non-finite worker, and peers that die or freeze."""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import Tensor, nn
from workers import SPEC_DEFAULTS

from co2_hf import CO2, CO2Config
from co2_hf.core.comm import ProcessGroupCommunicator
from co2_hf.testing import RecordingCommunicator

TAU = 4


class Regression(nn.Module):
    """A small MLP with BatchNorm learning a fixed linear teacher: the loss falls for many rounds."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def regression_loss(model: nn.Module, rank: int, step: int) -> Tensor:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(32, 8, generator=g)
    teacher = torch.linspace(-1.0, 1.0, 8).view(8, 1)
    return nn.functional.mse_loss(model(x), x @ teacher)


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _engine(rank: int, **cfg) -> tuple[nn.Module, torch.optim.Optimizer, CO2, RecordingCommunicator]:
    model = Regression(seed=rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    comm = RecordingCommunicator(ProcessGroupCommunicator(group))
    config = CO2Config(**{**SPEC_DEFAULTS, "co2_local_steps": TAU, **cfg})
    co2 = CO2(model, config, optimizer=optimizer, communicator=comm)
    return model, optimizer, co2, comm


def _poison(model: nn.Module) -> None:
    with torch.no_grad():
        model.net[0].weight[0, 0] = float("nan")


def _anchor(co2: CO2) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in co2.anchor_state().items() if "num_batches" not in k}


NAN_STEP, NAN_STEPS = 10, 36  # NaN before step 10: steps 10 and 11 run poisoned, boundary after 11


def one_worker_turns_nan(rank: int, world: int) -> dict:
    """Rank 1 turns NaN two inner steps before the boundary of round 2; rank 0 stays finite."""
    handler = _Messages()
    logging.getLogger("co2_hf.core.co2").addHandler(handler)
    model, optimizer, co2, comm = _engine(rank)
    losses, anchors, after_quarantine = [], [], {}
    for step in range(NAN_STEPS):
        if rank == 1 and step == NAN_STEP:
            _poison(model)
        optimizer.zero_grad()
        loss = regression_loss(model, rank, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if co2.step():
            anchors.append(_anchor(co2))
            if co2.round == NAN_STEP // TAU + 1:  # the boundary that ended the poisoned round
                live = {k: v.detach().clone() for k, v in model.state_dict().items()}
                after_quarantine = {"optimizer_state": len(optimizer.state), "live": live}
    return {
        "losses": losses,
        "anchors": anchors,
        "after_quarantine": after_quarantine,
        "sent": comm.sent,
        "summed": comm.summed,
        "payload": co2.layout.shard_numel,
        "skipped_rounds": co2.skipped_rounds,
        "warnings": handler.messages,
    }


def no_worker_is_finite(rank: int, world: int) -> dict:
    """Both ranks turn NaN in rounds 1 and 2: the first skip keeps the anchor, the second stops."""
    model, optimizer, co2, _ = _engine(rank, co2_max_skipped_rounds=2)
    anchors, error = [], None
    try:
        for step in range(5 * TAU):
            if step in (TAU + 1, 2 * TAU + 1):
                _poison(model)
            optimizer.zero_grad()
            regression_loss(model, rank, step).backward()
            optimizer.step()
            if co2.step():
                anchors.append((_anchor(co2), co2.skipped_rounds))
    except RuntimeError as e:
        error = str(e)
    return {"anchors": anchors, "error": error}


def nan_suite(rank: int, world: int) -> dict:
    return {"one": one_worker_turns_nan(rank, world), "none": no_worker_is_finite(rank, world)}


# ---------------------------------------------------------------- peers that die or freeze

# (signal, when, wire): the quantized wire's all-reduce runs in a thread of its own (core/waits.py),
# so a peer lost with one in flight is checked there too
FAULTS = [(signame, when, "float32") for signame in ("SIGKILL", "SIGSTOP") for when in ("mid_round", "in_flight")]
FAULTS += [(signame, "in_flight", "int8") for signame in ("SIGKILL", "SIGSTOP")]
FAULT_TIMEOUT_S = 4.0


def peer_faults(rank: int, world: int, marker_dir: str) -> dict | None:
    """Ranks 2k and 2k+1 train as a pair with a CO2 group of their own; rank 2k+1 meets the fault
    ``FAULTS[k]`` (it signals itself), and rank 2k must stop with CO2's error within the timeout."""
    timeout = datetime.timedelta(seconds=FAULT_TIMEOUT_S)  # what CO2 gives the group it creates
    groups = [dist.new_group([2 * k, 2 * k + 1], timeout=timeout) for k in range(world // 2)]
    pair, victim = rank // 2, rank % 2 == 1
    signame, when, wire = FAULTS[pair]
    model = Regression(seed=rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = CO2Config(
        **{**SPEC_DEFAULTS, "co2_local_steps": TAU, "co2_timeout_s": FAULT_TIMEOUT_S, "co2_comm_dtype": wire}
    )
    co2 = CO2(model, config, optimizer=optimizer, process_group=groups[pair])
    marker = os.path.join(marker_dir, f"pair{pair}.json")
    for step in range(20 * TAU):
        if not victim and when == "in_flight" and step == 2 * TAU - 1:
            time.sleep(0.5)  # the victim launches round 1's all-reduce first, then dies with it in flight
        optimizer.zero_grad()
        regression_loss(model, rank, step).backward()
        optimizer.step()
        start = time.perf_counter()
        try:
            co2.step()
        except RuntimeError as error:
            with open(marker) as f:
                fault = json.load(f)
            return {
                "error": str(error),
                "blocked_s": time.perf_counter() - start,
                "since_fault_s": time.time() - fault["at"],
                "fault": fault,
                "step": step,
            }
        if victim and step == (2 * TAU - 1 if when == "in_flight" else 2 * TAU + 1):
            _fault(co2, signame, marker, when)
    raise AssertionError("the survivor trained to the end without noticing its dead peer")


def _fault(co2: CO2, signame: str, marker: str, when: str) -> None:
    work = co2._pending.work
    if when == "mid_round":  # the last all-reduce completed: the peer dies between two boundaries
        deadline = time.monotonic() + 10
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
    in_flight = not work.is_completed()
    sent_round = co2.fragments[0].progress.sent_round
    fault = {"at": time.time(), "signal": signame, "in_flight": in_flight, "all_reduce_round": sent_round}
    with open(marker + ".tmp", "w") as f:
        json.dump(fault, f)
    os.replace(marker + ".tmp", marker)
    os.kill(os.getpid(), getattr(signal, signame))
    time.sleep(60)  # SIGSTOP: frozen here until the launcher kills it


def corrupt(path: str) -> None:
    """Flip the 8 bytes in the middle of a file, its size unchanged: a bad copy, bit rot."""
    middle = os.path.getsize(path) // 2
    with open(path, "r+b") as f:
        f.seek(middle)
        flipped = bytes(b ^ 0xFF for b in f.read(8))
        f.seek(middle)
        f.write(flipped)
