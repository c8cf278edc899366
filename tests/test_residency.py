"""Host-memory outer state worked on by the device, a fragment at a time (``co2_hf/core/residency.py``):
staged on the CPU (the same steps a GPU runs, between two CPU tensors) it trains bit for bit as state
that stays put, checkpoints and resumes the same, and keeps at most three fragments on the device."""

from __future__ import annotations

import pytest
import torch
from simulated import Workers

from co2_hf import CO2Config

pytestmark = pytest.mark.timeout(60)

SETTINGS = {
    "lookahead": dict(co2_local_steps=6, co2_outer_momentum=0.5, co2_clip_threshold=0.05),
    "eager_nesterov": dict(co2_local_steps=6, co2_start_rule="eager", co2_nesterov=True),
    "anchor_three_fragments": dict(co2_local_steps=6, co2_fragments=3, co2_start_rule="anchor"),
    "synchronous": dict(co2_local_steps=6, co2_overlap=False, co2_outer_momentum=0.5),
    "sparse_keep_unsent": dict(
        co2_local_steps=6,
        co2_comm_dtype="sparse",
        co2_sparse_density=1 / 16,
        co2_quant_block=32,
        co2_sparse_keep_unsent=True,
    ),
    "int8_one_fragment": dict(co2_local_steps=3, co2_fragments=1, co2_comm_dtype="int8"),
}


def _run(config: CO2Config, *, stage: bool, steps: int = 20, poison: tuple[int, int] | None = None):
    run = Workers(config, stage_state=stage)
    run.train(0, steps, poison=poison)
    metrics = [engine.pop_metrics() for engine in run.engines]
    anchors = [{k: v.clone() for k, v in engine.anchor_state().items()} for engine in run.engines]
    return run, metrics, anchors, run.finish()


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_staged_state_trains_bit_for_bit_as_state_that_stays(name):
    config = CO2Config(**SETTINGS[name])
    _, plain_metrics, plain_anchors, plain_final = _run(config, stage=False)
    run, staged_metrics, staged_anchors, staged_final = _run(config, stage=True)
    assert run.engines[0]._stage and not run.engines[0].fragments[0].residency.resident  # finish put it back
    for got, want in zip(staged_anchors + staged_final, plain_anchors + plain_final):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for got, want in zip(staged_metrics, plain_metrics):
        assert got.keys() == want.keys()
        assert all(got[k] == pytest.approx(want[k]) for k in want if "comm" not in k and "hidden" not in k)


def test_a_non_finite_worker_restarts_the_same_with_staged_state(caplog):
    config = CO2Config(**SETTINGS["lookahead"])
    *_, plain = _run(config, stage=False, poison=(1, 10))
    *_, staged = _run(config, stage=True, poison=(1, 10))
    assert "worker 1 has a non-finite outer gradient" in caplog.text
    for got, want in zip(staged, plain):
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_of_staged_state_resumes_bit_for_bit():
    config = CO2Config(**SETTINGS["lookahead"])
    straight = Workers(config, stage_state=True)
    straight.train(0, 20)
    expected = straight.finish()
    first = Workers(config, stage_state=True)
    first.train(0, 9)  # mid-round: a fragment in flight, three resident
    saved = first.save()
    resumed = Workers(config, saved=saved, stage_state=True)
    resumed.train(9, 20)
    for got, want in zip(resumed.finish(), expected):
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_fragment_arrives_a_step_before_its_boundary_and_at_most_three_are_on_the_device():
    config = CO2Config(co2_local_steps=6)  # six fragments, one boundary and one apply per step
    run = Workers(config, workers=2, stage_state=True)
    engine = run.engines[0]
    for step in range(18):
        run.train(step, step + 1)
        resident = [f for f, part in enumerate(engine.fragments) if part.residency.resident]
        upcoming = [f for event, f in engine.plan.due(engine.round_step % 6 + 1) if event.name == "BOUNDARY"]
        assert set(upcoming) <= set(resident)  # prefetched for the next step's boundary
        assert len(resident) <= 3  # the one whose apply is next, the one at its boundary, the next one
