"""Per-rank run for tests/test_gpu_readiness.py: a peer that freezes inside a worker of 2 processes."""

from __future__ import annotations

import os
import signal
import time

import torch
from reliability_workers import TAU, Regression, regression_loss

from co2_hf import CO2, CO2Config

FROZEN_TIMEOUT_S = 3.0


def frozen_peer_inside_a_worker(rank: int, world: int, where: str) -> dict:
    """Both processes form one worker (``co2_worker_size=2``, groups made by CO2); rank 1 freezes
    (SIGSTOP) before the per-step gradient average (``where="gradient"``) or before the boundary's
    small collectives (``where="boundary"``); rank 0 must stop with CO2's error within the timeout."""
    model = Regression(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = CO2Config(co2_local_steps=TAU, co2_worker_size=2, co2_timeout_s=FROZEN_TIMEOUT_S)
    co2 = CO2(model, config, optimizer=optimizer)
    freeze_at = 2 * TAU - 1  # the step whose co2.step() runs the second boundary
    for step in range(20 * TAU):
        victim_now = rank == 1 and step == freeze_at
        optimizer.zero_grad()
        regression_loss(model, rank, step).backward()
        if victim_now and where == "gradient":
            _freeze()
        start = time.perf_counter()
        try:
            co2.average_gradients()
            optimizer.step()
            if victim_now and where == "boundary":
                _freeze()
            co2.step()
        except RuntimeError as error:
            return {"error": str(error), "blocked_s": time.perf_counter() - start, "step": step}
    raise AssertionError("the survivor trained to the end without noticing its frozen peer")


def _freeze() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)  # frozen here until the launcher kills it
