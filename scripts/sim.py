"""Simulate G CO2 workers in one process, driving the real engine (for sweeps and tests).

A research harness, so it lives in ``scripts/`` and not in the installed package: it trains a toy
task with simulated workers to compare CO2's settings (scripts/sim_sweep.py, docs/choosing_settings.md),
which no user of the library needs to train a model. It uses the library's public API only
(``CO2``, ``CO2Config``, and `SimulatedNetwork` of ``co2_hf.testing``, a communicator fake built on
the ``Communicator`` interface of ``co2_hf.core``); tests/test_sim.py checks that it matches a real
two-process run.

Every worker has its own model, optimizer and `CO2` engine; a `SimulatedNetwork` stands in for the
process group, so the code path measured is the shipped one. Workers compute one after another;
only the ``CO2.step()`` calls of a step run in a thread per worker, because a blocking all-reduce
(synchronous mode, warm-up) must wait for the other workers' contributions. Sums are taken in
worker order, so a simulation is deterministic.

    from scripts.sim import Task, train_simulated
    result = train_simulated(workers=4, config=CO2Config(...), task=task, steps=600, eval_every=50)

``config=None`` trains the data-parallel baseline: one model whose gradient is the mean of the
workers' micro-batch gradients, exactly what DDP computes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from co2_hf import CO2Config
from co2_hf.core import CO2
from co2_hf.testing import SimulatedNetwork

__all__ = ["SimResult", "SimulatedNetwork", "Task", "train_simulated"]  # SimulatedNetwork: tests import it from here


@dataclass
class Task:
    """What to train: builders for the model, optimizer and schedule; batches; losses."""

    build_model: Callable[[int], nn.Module]  # seed -> model
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batch: Callable[[int, int], Any]  # (worker, step) -> inputs
    loss: Callable[[nn.Module, Any], Tensor]
    evaluate: Callable[[nn.Module, dict[str, Tensor] | None], float]  # (model, params or None) -> metric
    build_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None


@dataclass
class SimResult:
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, metric of the global model)
    final: float = float("nan")
    seconds: float = 0.0
    engines: list[CO2] = field(default_factory=list)


def train_simulated(
    *,
    workers: int,
    config: CO2Config | None,
    task: Task,
    steps: int,
    seed: int = 0,
    eval_every: int = 0,
    average_inner_state: tuple[str, ...] = (),
) -> SimResult:
    """Train ``steps`` inner steps with ``workers`` simulated workers (see the module docstring).

    ``average_inner_state`` (a screening probe, not an engine setting): names of the inner optimizer's
    state tensors (AdamW: ``exp_avg``, ``exp_avg_sq``) replaced by their mean over the workers after
    every ``co2_local_steps`` steps, at once and for free: an upper bound of what averaging them
    through the wire could give. ``"global_exp_avg_sq"`` replaces AdamW's second moment by an estimate
    of the second moment of the workers' *averaged* gradient (`_global_second_moment_`), the
    denominator data parallel's AdamW divides by."""
    start, result = time.perf_counter(), SimResult()
    if config is None:
        _train_data_parallel(workers, task, steps, seed, eval_every, result)
    else:
        _train_co2(workers, config, task, steps, seed, eval_every, result, average_inner_state)
    result.seconds = time.perf_counter() - start
    return result


def _train_data_parallel(workers, task, steps, seed, eval_every, result) -> None:
    model = task.build_model(seed)
    optimizer = task.build_optimizer(model)
    scheduler = task.build_scheduler(optimizer) if task.build_scheduler else None
    for step in range(steps):
        optimizer.zero_grad()
        for worker in range(workers):  # mean loss over workers = mean of their gradients
            (task.loss(model, task.batch(worker, step)) / workers).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if eval_every and (step + 1) % eval_every == 0:
            result.history.append((step + 1, task.evaluate(model, None)))
    result.final = task.evaluate(model, None)


def _same_param_states(optimizers):
    """(the first worker's param group, every worker's state of one parameter), parameter by parameter
    in the workers' common order; a state is empty before the parameter's first step."""
    for group in zip(*(o.param_groups for o in optimizers)):
        for params in zip(*(g["params"] for g in group)):
            yield group[0], [o.state[p] for o, p in zip(optimizers, params)]


def _average_state_(optimizers, names) -> None:
    """Every worker's ``names`` state tensors replaced by their mean over the workers (in worker order)."""
    for _, states in _same_param_states(optimizers):
        for name in names:
            if all(name in s for s in states):
                mean = torch.stack([s[name] for s in states]).mean(0)
                for s in states:
                    s[name].copy_(mean)


def _global_second_moment_(optimizers, steps_apart: int) -> None:
    """Every worker's AdamW ``exp_avg_sq`` replaced by an estimate of the second moment of the gradient
    averaged over the W workers, from the means of their moments (bias-corrected): with m and u the
    workers' mean first and own second moments, the mean gradient's square is about m^2 and one worker's
    noise variance about u - m^2, so the averaged gradient's second moment is m^2 + (u - m^2) / W,
    never above u. Each worker's own second moment holds the noise of its own batch; data parallel's
    holds 1/W of it, so its steps are larger where the gradient is noisy (the probe asks whether that
    is the gap).

    u is each worker's own moment, kept beside AdamW's (``probe_own_sq``): what AdamW added since the
    last replacement (``probe_set_sq``, decayed by beta2 per step for ``steps_apart`` steps) joins
    it, so that an estimate is never taken as a worker's own and divided by W again."""
    n = len(optimizers)
    for group, states in _same_param_states(optimizers):
        if not all("exp_avg_sq" in s for s in states):
            continue
        beta1, beta2 = group["betas"]
        decay = beta2**steps_apart
        for s in states:
            if "probe_own_sq" in s:
                s["probe_own_sq"].mul_(decay).add_(s["exp_avg_sq"] - decay * s["probe_set_sq"])
            else:
                s["probe_own_sq"] = s["exp_avg_sq"].clone()
        step = float(states[0]["step"])
        c1, c2 = 1 - beta1**step, 1 - beta2**step
        m = torch.stack([s["exp_avg"] for s in states]).mean(0) / c1
        u = torch.stack([s["probe_own_sq"] for s in states]).mean(0).clamp(min=0) / c2
        noise = (u - m * m).clamp_(min=0)
        estimate = torch.minimum(m * m + noise / n, u) * c2
        for s in states:
            s["exp_avg_sq"].copy_(estimate)
            s["probe_set_sq"] = estimate  # one read-only tensor shared by the workers


def _probe_(optimizers, names, steps_apart: int) -> None:
    """The inner-state probe of `train_simulated` (``average_inner_state``) after a round's steps."""
    plain = tuple(name for name in names if name != "global_exp_avg_sq")
    if plain:
        _average_state_(optimizers, plain)
    if "global_exp_avg_sq" in names:
        _global_second_moment_(optimizers, steps_apart)


def _train_co2(workers, config, task, steps, seed, eval_every, result, average_inner_state) -> None:
    network = SimulatedNetwork(workers)
    models = [task.build_model(seed + i) for i in range(workers)]  # like ranks; CO2 broadcasts worker 0's
    optimizers = [task.build_optimizer(m) for m in models]
    schedulers = [task.build_scheduler(o) if task.build_scheduler else None for o in optimizers]
    with ThreadPoolExecutor(workers) as pool:
        engines = list(
            pool.map(
                lambda i: CO2(models[i], config, optimizer=optimizers[i], communicator=network.communicator(i)),
                range(workers),
            )
        )
        for step in range(steps):
            for i in range(workers):
                optimizers[i].zero_grad()
                task.loss(models[i], task.batch(i, step)).backward()
            if engines[0].in_warmup:  # data parallel until the anchor is taken
                list(pool.map(lambda e: e.average_gradients(), engines))
            for optimizer, scheduler in zip(optimizers, schedulers):
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
            list(pool.map(lambda e: e.step(), engines))
            # (in the warm-up every worker already steps on the averaged gradient)
            if average_inner_state and not engines[0].in_warmup and (step + 1) % config.co2_local_steps == 0:
                _probe_(optimizers, average_inner_state, config.co2_local_steps)
            if eval_every and (step + 1) % eval_every == 0:
                # in the warm-up the live model is the global one (and its state_dict holds tied
                # weights twice, which functional_call refuses)
                params = None if engines[0].in_warmup else engines[0].anchor_state()
                result.history.append((step + 1, task.evaluate(models[0], params)))
        list(pool.map(lambda e: e.finalize(), engines))
    result.final = task.evaluate(models[0], None)
    result.engines = engines
