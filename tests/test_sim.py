"""The simulation harness drives the real engine: it must match a real 2-process gloo run."""

from __future__ import annotations

import pytest
import torch
from distributed import run_processes
from workers import TinyNet, loss_on, make_optimizer, train_engine

from co2_hf import CO2Config
from co2_hf.sim import Task, train_simulated

SETTINGS = {
    "co2": dict(co2_local_steps=3, co2_outer_momentum=0.5, co2_clip_threshold=0.5),
    "slowmo": dict(co2_local_steps=3, co2_overlap=False, co2_outer_momentum=0.5),
}
STEPS = 14


def _task() -> Task:
    return Task(
        build_model=lambda seed: TinyNet(seed=seed),
        build_optimizer=make_optimizer,
        batch=lambda worker, step: (worker, step),
        loss=lambda model, ws: loss_on(model, *ws),
        evaluate=_checksum,
    )


def _checksum(model, params) -> float:
    """A metric that identifies the weights: the sum of the hidden layer's."""
    weight = params["hidden.weight"] if params is not None else model.hidden.weight
    return float(weight.double().sum())


def _real(rank: int, world: int) -> dict:
    return {name: train_engine(rank, world, kw, STEPS) for name, kw in SETTINGS.items()}


@pytest.fixture(scope="module")
def real_runs():
    return run_processes(_real, 2, timeout_s=100)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_simulated_workers_match_a_real_two_process_run(real_runs, name):
    sim = train_simulated(workers=2, config=CO2Config(**SETTINGS[name]), task=_task(), steps=STEPS)
    real_anchor = real_runs[0][name]["anchors"][-1]
    sim_anchor = sim.engines[0].anchor_state()
    for key, value in real_anchor.items():
        torch.testing.assert_close(sim_anchor[key].double(), value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.timeout(60)
def test_data_parallel_baseline_is_the_mean_gradient():
    """config=None: one model stepped with the mean of the workers' gradients."""
    sim = train_simulated(workers=2, config=None, task=_task(), steps=3, eval_every=1)
    assert [step for step, _ in sim.history] == [1, 2, 3] and sim.engines == []
    model = TinyNet(seed=0)
    optimizer = make_optimizer(model)
    for step in range(3):
        optimizer.zero_grad()
        for worker in range(2):
            (loss_on(model, worker, step) / 2).backward()
        optimizer.step()
    assert sim.final == _checksum(model, None)
    assert sim.final != _checksum(TinyNet(seed=0), None)
