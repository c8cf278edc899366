"""The simulation harness (scripts/sim.py) drives the real engine: it must match a real 2-process gloo run."""

from __future__ import annotations

import pytest
import torch
from distributed import run_processes
from workers import SPEC_DEFAULTS, TinyNet, loss_on, make_optimizer, sim_task, train_engine

from co2_hf import CO2Config
from scripts.sim import Task, train_simulated

pytestmark = pytest.mark.research  # the simulated-worker harness of scripts/ (the real two-process run is also slow)

SETTINGS = {
    "co2": dict(SPEC_DEFAULTS, co2_local_steps=3, co2_outer_momentum=0.5, co2_clip_threshold=0.5),
    "streaming": dict(co2_local_steps=3, co2_clip_threshold=0.5),  # the defaults: fragments
    "slowmo": dict(co2_local_steps=3, co2_overlap=False, co2_outer_momentum=0.5),
}
STEPS = 14


def _task() -> Task:
    return sim_task(evaluate=_checksum)


def _checksum(model, params) -> float:
    """A metric that identifies the weights: the sum of the hidden layer's."""
    weight = params["hidden.weight"] if params is not None else model.hidden.weight
    return float(weight.double().sum())


def _real(rank: int, world: int) -> dict:
    return {name: train_engine(rank, world, kw, STEPS) for name, kw in SETTINGS.items()}


@pytest.fixture(scope="module")
def real_runs():
    return run_processes(_real, 2, timeout_s=100)


@pytest.mark.slow
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


def _final_anchor(workers: int, steps: int, **knobs) -> dict:
    config = CO2Config(co2_local_steps=3, co2_gap_penalty=0.0, co2_fragments=1, **knobs)
    return train_simulated(workers=workers, config=config, task=_task(), steps=steps).engines[0].anchor_state()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nesterov", [False, True], ids=["heavy_ball", "nesterov"])
def test_lookahead_with_one_worker_predicts_exactly_and_equals_synchronous_slowmo(nesterov):
    """With one worker the in-flight average is the worker's own outer gradient, so the lookahead
    start is exactly where the anchor will be: overlapped CO2 then trains synchronous SlowMo's
    trajectory, one round of staleness and all (docs/algorithm.md, section 7). Parameters only:
    buffers (BatchNorm statistics) travel as values and still arrive one round late."""
    knobs = dict(co2_outer_momentum=0.5, co2_outer_lr=0.8, co2_nesterov=nesterov)
    lookahead = _final_anchor(1, STEPS, co2_start_rule="lookahead", **knobs)
    synchronous = _final_anchor(1, STEPS, co2_overlap=False, **knobs)
    eager = _final_anchor(1, STEPS, co2_start_rule="eager", **knobs)
    params = [name for name, _ in TinyNet(seed=0).named_parameters()]
    for key in params:
        torch.testing.assert_close(lookahead[key], synchronous[key], rtol=1e-5, atol=1e-6, msg=key)
    assert any(not torch.allclose(eager[k], synchronous[k], rtol=1e-4, atol=1e-5) for k in params)


@pytest.mark.timeout(60)
def test_lookahead_without_momentum_at_outer_lr_one_is_the_eager_start():
    knobs = dict(co2_outer_momentum=0.0, co2_outer_lr=1.0)
    lookahead = _final_anchor(2, STEPS, co2_start_rule="lookahead", **knobs)
    eager = _final_anchor(2, STEPS, co2_start_rule="eager", **knobs)
    for key, value in eager.items():
        assert torch.equal(lookahead[key], value), key


def test_the_inner_state_probe_replaces_only_the_named_moments_by_their_mean_over_workers():
    """average_inner_state's step (a screening probe of sim_sweep): exp_avg becomes the workers'
    mean on every worker; exp_avg_sq, not named, stays each worker's own."""
    from scripts.sim import _average_state_

    models = [TinyNet(seed=i) for i in range(3)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for worker, (model, optimizer) in enumerate(zip(models, optimizers)):
        loss_on(model, worker, 0).backward()
        optimizer.step()
    param_lists = [[p for p in m.parameters() if p in o.state] for m, o in zip(models, optimizers)]
    assert param_lists[0]
    before = {
        name: [[o.state[p][name].clone() for p in ps] for o, ps in zip(optimizers, param_lists)]
        for name in ("exp_avg", "exp_avg_sq")
    }
    _average_state_(optimizers, ("exp_avg",))
    for j in range(len(param_lists[0])):
        mean = torch.stack([before["exp_avg"][w][j] for w in range(3)]).mean(0)
        for w in range(3):
            assert torch.equal(optimizers[w].state[param_lists[w][j]]["exp_avg"], mean)
            assert torch.equal(optimizers[w].state[param_lists[w][j]]["exp_avg_sq"], before["exp_avg_sq"][w][j])
    assert not torch.equal(before["exp_avg"][0][0], before["exp_avg"][1][0])  # there was something to average


def _stepped_adamw(workers: int, steps: int):
    """AdamW on TinyNet per worker, each stepped ``steps`` times on its own batches."""
    models = [TinyNet(seed=i) for i in range(workers)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(steps):
        for worker, (model, optimizer) in enumerate(zip(models, optimizers)):
            optimizer.zero_grad()
            loss_on(model, worker, step).backward()
            optimizer.step()
    return models, optimizers


def test_the_global_second_moment_probe_is_the_averaged_gradients_estimate_and_is_not_applied_twice():
    """global_exp_avg_sq (a screening probe of sim_sweep): every worker's exp_avg_sq becomes
    m^2 + (u - m^2) / W in bias-corrected units (m, u: the workers' mean moments), at most u; taken again
    with no step between, it is unchanged: the estimate is never mistaken for a worker's own moment."""
    from scripts.sim import _global_second_moment_

    workers, steps = 3, 4
    models, optimizers = _stepped_adamw(workers, steps)
    beta1, beta2 = optimizers[0].param_groups[0]["betas"]
    c1, c2 = 1 - beta1**steps, 1 - beta2**steps
    params = [next(iter(m.parameters())) for m in models]
    m = torch.stack([o.state[p]["exp_avg"] for o, p in zip(optimizers, params)]).mean(0) / c1
    u = torch.stack([o.state[p]["exp_avg_sq"] for o, p in zip(optimizers, params)]).mean(0) / c2
    expected = torch.minimum(m * m + (u - m * m).clamp(min=0) / workers, u) * c2
    _global_second_moment_(optimizers, steps_apart=steps)
    for o, p in zip(optimizers, params):
        torch.testing.assert_close(o.state[p]["exp_avg_sq"], expected)
    assert (expected < u * c2).any()  # the workers' noise was there to divide
    _global_second_moment_(optimizers, steps_apart=0)
    for o, p in zip(optimizers, params):
        torch.testing.assert_close(o.state[p]["exp_avg_sq"], expected)
