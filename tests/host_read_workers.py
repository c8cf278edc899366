"""Per-rank runs for tests/test_host_reads.py: the engine's host reads at every setting, and the
operations one boundary dispatches for models of few and many tensors."""

from __future__ import annotations

import torch
from torch import nn
from workers import TinyNet, loss_on, make_optimizer

from co2_hf import CO2, CO2Config
from co2_hf.testing import DispatchTrace

TAU, STEPS, LOG_EVERY = 4, 14, 7  # three rounds and a half; pop_metrics after every 7th step

# Every setting whose boundary decides something: streaming and one fragment, each start rule, the
# penalties, clipping, Nesterov, a window, no overlap, the warm-up, the wires. Coded wires and worker
# groups need several processes (GLOO_SETTINGS); the rest run on one.
LOCAL_SETTINGS = {
    "streaming": {},
    "one_fragment": dict(co2_fragments=1),
    "paper_gap_aware": dict(co2_fragments=1, co2_start_rule="anchor", co2_gap_penalty=1.0, co2_outer_momentum=0.2),
    "constant_nesterov_clip": dict(
        co2_fragments=1,
        co2_gap_penalty=2.0,
        co2_gap_penalty_mode="constant",
        co2_nesterov=True,
        co2_clip_threshold=1e-3,
    ),
    "streaming_clip_nesterov": dict(co2_clip_threshold=1e-3, co2_nesterov=True),
    "eager_weight": dict(co2_fragments=1, co2_start_rule="eager", co2_eager_weight=0.5),
    "synchronous": dict(co2_overlap=False, co2_outer_momentum=0.5),
    "window": dict(co2_fragments=1, co2_overlap_steps=2, co2_start_rule="eager"),
    "bfloat16_wire": dict(co2_comm_dtype="bfloat16"),
    "warmup": dict(co2_sync_warmup_steps=3),
    "second_moment": dict(co2_global_second_moment_every=1),
}
GLOO_SETTINGS = {
    "float32": {},
    "int8": dict(co2_comm_dtype="int8"),
    "int4_stochastic_one_fragment": dict(co2_comm_dtype="int4", co2_quant_rounding="stochastic", co2_fragments=1),
    "sparse": dict(co2_comm_dtype="sparse", co2_sparse_density=0.25, co2_quant_block=8),
    "sparse_keep_unsent": dict(
        co2_comm_dtype="sparse", co2_sparse_density=0.25, co2_quant_block=8, co2_sparse_keep_unsent=True
    ),
}
WORKER_GROUP_SETTINGS = {
    "streaming": dict(co2_worker_size=2),
    "paper_gap_aware_clip": dict(
        co2_worker_size=2, co2_fragments=1, co2_start_rule="anchor", co2_gap_penalty=1.0, co2_clip_threshold=1e-3
    ),
}


def host_reads_of(config: CO2Config, *, rank: int = 0, poison_at: int | None = None) -> list[tuple[int, str, str]]:
    """Train TinyNet for `STEPS` steps; every host read inside ``co2.step()`` (and ``average_gradients``)
    of a step after which ``pop_metrics`` is not called, as ``(step, read, where)``. ``poison_at``:
    this worker's weights turn NaN before that step (a non-finite outer gradient, then a skipped
    round if it is the only worker)."""
    model = TinyNet(seed=rank)
    optimizer = make_optimizer(model)
    co2 = CO2(model, config, optimizer=optimizer)
    found = []
    for step in range(STEPS):
        if step == poison_at:
            with torch.no_grad():
                model.hidden.weight[0, 0] = float("nan")
        optimizer.zero_grad()
        loss_on(model, rank, step).backward()
        trace = DispatchTrace()
        trace(co2.average_gradients)
        optimizer.step()
        trace(co2.step)
        found += [(step, read, where) for read, where in trace.reads]
        if step % LOG_EVERY == LOG_EVERY - 1:
            co2.pop_metrics()  # a logging step: it may read (once)
    co2.finalize()
    return found


def gloo_host_reads(rank: int, world: int, settings: dict[str, dict]) -> dict[str, list]:
    return {
        name: host_reads_of(CO2Config(co2_local_steps=TAU, **knobs), rank=rank) for name, knobs in settings.items()
    }


class ManyTensors(nn.Module):
    """``count`` parameter tensors of ``numel / count`` values each: the same size, any tensor count."""

    def __init__(self, count: int, numel: int = 48_000) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.parts = nn.ParameterList(nn.Parameter(torch.randn(numel // count)) for _ in range(count))


def ops_per_step(count: int, knobs: dict) -> list[int]:
    """Operations ``co2.step()`` dispatches at each of 3 rounds' steps after the first round, for a
    model of ``count`` tensors (its live values moved a little before each step)."""
    model = ManyTensors(count)
    co2 = CO2(model, CO2Config(co2_local_steps=TAU, **knobs))
    params = list(model.parameters())
    counts = []
    for step in range(4 * TAU):
        with torch.no_grad():
            torch._foreach_add_(params, 1e-3 * (1 if step % 2 else -1))
        trace = DispatchTrace()
        trace(co2.step)
        if step >= TAU:
            counts.append(len(trace.ops))
    return counts
