"""FSDP2 inside a CO2 worker: 4 gloo processes as 2 workers of 2, the model sharded by
``fully_shard`` over each worker's processes, against the reference of 2 workers whose batch is
the union of their processes' batches (SGD on the mean loss, where that is exact)."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_processes
from fsdp_workers import evaluation_on_the_anchor, fsdp_over_every_process, fsdp_stop_and_resume, train_fsdp
from workers import SPEC_DEFAULTS, assert_same_anchors, reference_hierarchical

pytestmark = pytest.mark.slow  # every test reads runs of four gloo processes

K, STEPS = 2, 3 * 4 + 2
SCENARIOS = {
    "co2": dict(co2_local_steps=3, co2_outer_momentum=0.5, co2_clip_threshold=0.05),
    "window_eager": dict(co2_local_steps=3, co2_overlap_steps=1, co2_start_rule="eager", co2_nesterov=True),
    "slowmo_warmup": dict(co2_local_steps=3, co2_overlap=False, co2_outer_momentum=0.5, co2_sync_warmup_steps=2),
    # each process fragments its own local shards
    "fragments3_eager": dict(co2_local_steps=3, co2_fragments=3, co2_start_rule="eager", co2_outer_momentum=0.5),
}
SCENARIOS = {name: {**SPEC_DEFAULTS, **knobs} for name, knobs in SCENARIOS.items()}  # fragments: named


def _suite(rank: int, world: int, path: str) -> dict:
    out = {name: train_fsdp(rank, world, dict(co2_worker_size=K, **kw), STEPS) for name, kw in SCENARIOS.items()}
    resume_cfg = dict(co2_worker_size=K, co2_local_steps=4, co2_outer_momentum=0.5, co2_start_rule="eager")
    out["resume"] = fsdp_stop_and_resume(rank, world, resume_cfg, path)
    out["refusal"] = fsdp_over_every_process(rank, world)
    out["evaluation"] = evaluation_on_the_anchor(rank, world)
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One spawn of 4 processes runs every case (each spawn costs seconds)."""
    path = os.path.join(tmp_path_factory.mktemp("fsdp"), "state")
    return run_processes(_suite, 4, path, timeout_s=150)


def _reference(name: str) -> list[dict]:
    kwargs = dict(SCENARIOS[name])
    warmup = kwargs.pop("co2_sync_warmup_steps", 0)  # the reference's warm-up: every process's batch
    return reference_hierarchical(2, K, kwargs, STEPS, warmup=warmup, fsdp=True)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fsdp2_inside_two_workers_equals_the_union_batch_reference(four_ranks, name):
    reference = _reference(name)
    for rank in range(4):
        assert_same_anchors(four_ranks[rank][name]["anchors"], reference, f"rank {rank}")
        for key, value in reference[-1].items():  # after finalize the live model is the anchor
            torch.testing.assert_close(four_ranks[rank][name]["live"][key], value, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(200)
def test_under_fsdp2_each_process_sends_and_holds_its_own_shard_only(four_ranks):
    for rank in range(4):
        run = four_ranks[rank]["co2"]
        assert run["launched_elements"] == [run["params"] // K] * 5  # half of the outer gradient, 5 rounds
        # anchor + momentum (4 bytes each) and the buffer (4 bytes + 35 header slots) of its half only
        assert run["nbytes"] == 12 * run["params"] // K + 4 * 35


@pytest.mark.timeout(200)
def test_fsdp2_stop_mid_round_and_resume_is_bit_identical(four_ranks):
    for rank in range(4):
        run = four_ranks[rank]["resume"]
        for key, value in run["full"].items():
            assert torch.equal(run["resumed"][key], value), (rank, key)


@pytest.mark.timeout(200)
def test_under_fsdp2_evaluation_sees_the_anchor_and_training_the_live_model_after_it(four_ranks):
    for rank in range(4):
        run = four_ranks[rank]["evaluation"]
        torch.testing.assert_close(run["on_anchor"], run["expected"], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(run["on_anchor"], run["live_before"], atol=1e-3)  # the test can tell
        assert torch.equal(run["live_after"], run["live_before"])


@pytest.mark.timeout(200)
def test_fsdp2_across_workers_is_refused(four_ranks):
    for rank in range(4):
        message = four_ranks[rank]["refusal"]
        assert "sharded by FSDP2 over ranks [0, 1, 2, 3]" in message and "worker_mesh" in message, message


def _hf_suite(rank: int, world: int, out: str) -> dict:
    from fsdp_workers import accelerate_fsdp_run, trainer_fsdp_suite

    return {
        "trainer": trainer_fsdp_suite(rank, world, f"{out}/trainer"),
        "accelerate": accelerate_fsdp_run(rank, world, f"{out}/plain", save_at=None, load=False),
        "accelerate_reloaded": accelerate_fsdp_run(rank, world, f"{out}/reload", save_at=6, load=True),
    }


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_hf")
    return out, run_processes(_hf_suite, 4, str(out), timeout_s=200)


@pytest.mark.timeout(240)
def test_trainer_with_fsdp2_inside_workers_equals_replicated_workers_and_resumes_bit_for_bit(hf_runs):
    """CO2Trainer, 4 processes as 2 workers of 2, ``--fsdp full_shard``: the same training as
    workers of 2 full replicas; evaluation on the anchor; a loadable model; an exact resume."""
    tmp_path, suites = hf_runs
    runs = [suite["trainer"] for suite in suites]
    for rank in range(4):
        run = runs[rank]
        assert run["fsdp_type"].startswith("FSDP")
        for key, value in run["replicated"].items():
            torch.testing.assert_close(run["fsdp"][key], value, rtol=1e-5, atol=1e-6, msg=f"{rank} {key}")
            assert torch.equal(run["resumed"][key], run["fsdp"][key]), (rank, key)
            assert torch.equal(run["fsdp"][key], runs[0]["fsdp"][key]), (rank, key)  # one anchor
        # evaluations at steps 3, 6, 9 and 12, then the one after training
        assert len(run["evals"]) == 5 and run["eval_trained"] == pytest.approx(run["eval_loaded"], rel=1e-5)
    assert runs[0]["losses"][-1] < runs[0]["losses"][0]
    checkpoint = tmp_path / "trainer" / "resume" / "checkpoint-6"
    assert sorted(p.name for p in checkpoint.glob("co2_rank*.pt")) == [f"co2_rank{r}.pt" for r in range(4)]


@pytest.mark.timeout(240)
def test_trainer_with_fsdp2_resumes_a_four_process_checkpoint_on_two_with_co2_elastic(hf_runs):
    """The 4-process checkpoint (2 workers of 2, FSDP2) resumed on 1 worker of 2 (FSDP2 re-sharded)."""
    from fsdp_workers import trainer_fsdp_elastic
    from transformers import AutoModelForCausalLM

    tmp_path, _ = hf_runs
    saved, out = tmp_path / "trainer" / "resume", tmp_path / "elastic"
    runs = run_processes(trainer_fsdp_elastic, 2, str(saved), str(out), timeout_s=200)
    state = torch.load(saved / "checkpoint-6" / "co2_rank0.pt", weights_only=True)["co2"]
    (fragment,) = state["fragments"]
    for run in runs:
        assert run["fsdp_type"].startswith("FSDP") and run["step"] == 12 and run["live_is_anchor"]
        assert run["begin"] == {"clock": state["counters"], "fragment": {**fragment["counters"], "have_d": False}}
        for key, value in runs[0]["final"].items():
            assert torch.isfinite(value).all() and torch.equal(run["final"][key], value), key
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(loaded.transformer.wte.weight.detach(), runs[0]["final"]["transformer.wte.weight"])


@pytest.mark.timeout(240)
def test_accelerate_loop_with_fsdp2_saves_and_loads_mid_round_without_changing_the_run(hf_runs):
    from safetensors.torch import load_file

    tmp_path, suites = hf_runs
    for rank in range(4):
        for key, value in suites[rank]["accelerate"].items():
            assert torch.equal(suites[rank]["accelerate_reloaded"][key], value), (rank, key)
    saved = load_file(tmp_path / "reload" / "ckpt" / "model.safetensors")  # the whole anchor, not a shard
    assert saved["transformer.wte.weight"].shape == (64, 32) and saved["transformer.h.0.mlp.c_fc.weight"].shape == (
        32,
        128,
    )
