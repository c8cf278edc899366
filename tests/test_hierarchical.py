"""co2_worker_size = 2 with 4 gloo processes: 2 workers of 2 processes each (fast link inside a
worker, CO2 between workers), against a reference of 2 workers whose batch is the union of their
processes' batches (SGD on the mean loss, where that is exact)."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_processes
from workers import (
    SPEC_DEFAULTS,
    assert_same_anchors,
    hierarchical_resume,
    hierarchical_stop,
    outer_state_of_a_wide_model,
    reference_hierarchical,
    train_hierarchical,
)

pytestmark = pytest.mark.slow  # every test reads runs of four gloo processes

K, STEPS = 2, 3 * 4 + 2
SCENARIOS = {
    "co2": dict(co2_local_steps=3, co2_outer_momentum=0.5, co2_clip_threshold=0.05),
    "window_eager": dict(co2_local_steps=3, co2_overlap_steps=1, co2_start_rule="eager", co2_nesterov=True),
    "slowmo": dict(co2_local_steps=3, co2_overlap=False, co2_outer_momentum=0.5),
    # each process fragments its own half of the flat state
    "fragments3_eager": dict(co2_local_steps=3, co2_fragments=3, co2_start_rule="eager", co2_outer_momentum=0.5),
    "fragments2_lookahead_clip": dict(
        co2_local_steps=4, co2_fragments=2, co2_start_rule="lookahead", co2_clip_threshold=0.05
    ),
}
SCENARIOS = {name: {**SPEC_DEFAULTS, **knobs} for name, knobs in SCENARIOS.items()}  # fragments: named


def _suite(rank: int, world: int) -> dict:
    out = {
        name: train_hierarchical(rank, world, dict(co2_worker_size=K, **kw), STEPS) for name, kw in SCENARIOS.items()
    }
    out["wide"] = outer_state_of_a_wide_model(rank, world)
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_processes(_suite, 4, timeout_s=150)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_two_workers_of_two_processes_equal_the_union_batch_reference(four_ranks, name):
    reference = reference_hierarchical(2, K, SCENARIOS[name], STEPS)
    for rank in range(4):
        assert_same_anchors(four_ranks[rank][name]["anchors"], reference, f"rank {rank}")


@pytest.mark.timeout(200)
def test_each_process_sends_one_kth_of_the_outer_gradient(four_ranks):
    for rank in range(4):
        run = four_ranks[rank]["co2"]
        assert run["shard_numel"] * K == run["padded_numel"]
        per_round = (run["shard_numel"] + run["header_slots"]) * 4  # fp32 on the wire
        assert run["launched_bytes"] == [per_round] * len(run["launched_bytes"]) and len(run["launched_bytes"]) == 5


@pytest.mark.timeout(200)
def test_outer_state_is_one_kth_of_twelve_bytes_per_parameter(four_ranks):
    wide = four_ranks[0]["wide"]
    assert wide["nbytes"] <= 1.05 * 12 * wide["params"] / K
    assert wide["nbytes"] >= 12 * wide["params"] / K


@pytest.mark.timeout(200)
def test_stop_and_resume_with_two_processes_per_worker_is_bit_identical(tmp_path):
    cfg = dict(co2_worker_size=K, co2_local_steps=4, co2_outer_momentum=0.5, co2_start_rule="eager")
    path = os.path.join(tmp_path, "state")
    full = run_processes(hierarchical_stop, 4, cfg, path, timeout_s=120)
    resumed = run_processes(hierarchical_resume, 4, cfg, path, timeout_s=120)
    for rank in range(4):
        for key, value in full[rank].items():
            assert torch.equal(resumed[rank][key], value), (rank, key)


@pytest.mark.timeout(240)
def test_trainer_with_two_processes_per_worker_resumes_bit_for_bit(tmp_path):
    """CO2Trainer, 4 processes as 2 workers of 2: stopped mid-round with a checkpoint, resumed."""
    from trainer_workers import STOP_AT, stopped_then_resumed_in_process
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "run")
    runs = run_processes(stopped_then_resumed_in_process, 4, out, {"co2_worker_size": K}, timeout_s=200)
    for rank in range(4):
        assert runs[rank]["stopped_at"] == STOP_AT
        for key, value in runs[rank]["full"].items():
            assert torch.equal(runs[rank]["final"][key], value), (rank, key)
            assert torch.equal(runs[rank]["final"][key], runs[0]["final"][key]), (rank, key)  # one anchor
    checkpoint = tmp_path / "run" / f"checkpoint-{STOP_AT}"
    assert sorted(p.name for p in checkpoint.glob("co2_rank*.pt")) == [f"co2_rank{r}.pt" for r in range(4)]
    AutoModelForCausalLM.from_pretrained(checkpoint)  # the gathered anchor, a normal model folder
