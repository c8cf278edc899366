"""The multi-process engine against the naive reference, after every round and after finalize."""

from __future__ import annotations

import pytest
import torch
from distributed import run_processes
from workers import SPEC_DEFAULTS, train_engine, train_reference

pytestmark = pytest.mark.slow  # every test reads runs of two and three gloo processes

TAU = 3


def steps(kwargs: dict) -> int:
    """Warm-up, four whole rounds and a partial one, which finalize completes."""
    return kwargs.get("co2_sync_warmup_steps", 0) + 4 * kwargs["co2_local_steps"] + 2


def with_tau(kwargs: dict) -> dict:
    """A scenario's settings over the SPEC's defaults (the fragment scenarios name theirs)."""
    return {**SPEC_DEFAULTS, "co2_local_steps": TAU, **kwargs}


SCENARIOS = {
    "co2_gap_aware": dict(co2_outer_momentum=0.5, co2_gap_penalty=1.0),
    "co2_constant_clip_nesterov": dict(
        co2_outer_momentum=0.5,
        co2_gap_penalty=2.0,
        co2_gap_penalty_mode="constant",
        co2_clip_threshold=0.05,
        co2_nesterov=True,
    ),
    "co2_no_penalty_outer_lr": dict(co2_gap_penalty=0.0, co2_outer_lr=0.5),
    "co2_eager": dict(co2_start_rule="eager", co2_gap_penalty=0.0, co2_outer_momentum=0.2),
    "co2_eager_weight": dict(co2_start_rule="eager", co2_eager_weight=0.3, co2_outer_momentum=0.2, co2_outer_lr=0.8),
    "co2_eager_weight_nesterov_window": dict(
        co2_start_rule="eager", co2_eager_weight=0.5, co2_nesterov=True, co2_overlap_steps=1
    ),
    "co2_lookahead": dict(co2_start_rule="lookahead", co2_outer_momentum=0.5, co2_outer_lr=0.8, co2_gap_penalty=1.0),
    "co2_lookahead_nesterov_window_clip": dict(
        co2_start_rule="lookahead", co2_nesterov=True, co2_overlap_steps=1, co2_clip_threshold=0.05
    ),
    "co2_warmup_clip": dict(co2_sync_warmup_steps=4, co2_clip_threshold=0.05),
    "co2_window_anchor": dict(co2_overlap_steps=1, co2_outer_momentum=0.5, co2_clip_threshold=0.05),
    "co2_window_eager": dict(co2_overlap_steps=2, co2_start_rule="eager", co2_nesterov=True),
    "slowmo": dict(co2_overlap=False, co2_outer_momentum=0.5),
    "diloco": dict(co2_overlap=False, co2_nesterov=True, co2_outer_lr=0.7, co2_outer_momentum=0.9),
    # streaming fragments (tau 6 so that F = 2 and 3 both divide it)
    "fragments2_eager": dict(co2_local_steps=6, co2_fragments=2, co2_start_rule="eager", co2_outer_momentum=0.5),
    "fragments3_lookahead_nesterov_clip": dict(
        co2_local_steps=6,
        co2_fragments=3,
        co2_start_rule="lookahead",
        co2_nesterov=True,
        co2_outer_momentum=0.5,
        co2_clip_threshold=0.05,
    ),
    "fragments3_anchor_warmup": dict(
        co2_local_steps=6, co2_fragments=3, co2_outer_momentum=0.5, co2_sync_warmup_steps=4
    ),
    "fragments2_eager_weight_lr": dict(
        co2_local_steps=6, co2_fragments=2, co2_start_rule="eager", co2_eager_weight=0.5, co2_outer_lr=0.8
    ),
    "fragments3_synchronous": dict(co2_local_steps=6, co2_fragments=3, co2_overlap=False, co2_outer_momentum=0.5),
}


def _all_scenarios(rank: int, world: int) -> dict:
    return {name: train_engine(rank, world, with_tau(kw), steps(with_tau(kw))) for name, kw in SCENARIOS.items()}


@pytest.fixture(scope="module", params=[2, 3], ids=["2proc", "3proc"])
def engine_runs(request):
    """One spawn per world size runs every scenario (spawning per case would cost seconds each)."""
    world = request.param
    return world, run_processes(_all_scenarios, world, timeout_s=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_engine_matches_reference(engine_runs, scenario):
    world, ranks = engine_runs
    kwargs = with_tau(SCENARIOS[scenario])
    reference = train_reference(world, kwargs, steps(kwargs))["anchors"]
    engine = ranks[0][scenario]["anchors"]
    assert len(engine) == len(reference) >= 5
    for boundary, (got, want) in enumerate(zip(engine, reference)):
        for name, value in want.items():
            torch.testing.assert_close(
                got[name],
                value,
                rtol=1e-5,
                atol=1e-5,
                msg=f"{scenario}, boundary {boundary}, {name}",
            )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_rank_holds_the_same_anchor(engine_runs, scenario):
    _, ranks = engine_runs
    for rank, result in enumerate(ranks[1:], start=1):
        for boundary, (mine, first) in enumerate(zip(result[scenario]["anchors"], ranks[0][scenario]["anchors"])):
            for name in first:
                assert torch.equal(mine[name], first[name]), (scenario, rank, boundary, name)
        # after finalize every worker's live parameters are the anchor
        final = ranks[0][scenario]["anchors"][-1]
        for name, value in final.items():
            assert torch.equal(result[scenario]["live"][name], value), (scenario, rank, name)
