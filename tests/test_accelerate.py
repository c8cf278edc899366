"""CO2Accelerate: no collective during local steps, and save_state/load_state resume bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from accelerate_workers import SAVE_AT, resumed, uninterrupted_and_stopped
from distributed import run_processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("accelerate") / "state")
    first = run_processes(uninterrupted_and_stopped, 2, out, timeout_s=150)
    return out, first, run_processes(resumed, 2, out, timeout_s=150)


@pytest.mark.timeout(320)
def test_no_collective_on_the_default_group_during_local_steps(runs):
    _, first, _ = runs
    for rank in (0, 1):
        full = first[rank]["full"]
        assert full["wrapped"] == "DistributedDataParallel"  # as accelerator.prepare made it
        assert full["local_collectives"] == [0] * 12


@pytest.mark.timeout(320)
def test_each_rank_saved_its_own_optimizer_state(runs):
    out, _, _ = runs
    states = [torch.load(os.path.join(out, f"co2_rank{r}.pt"), weights_only=False) for r in (0, 1)]
    moments = [s["optimizer"]["state"][0]["exp_avg"] for s in states]
    assert not torch.equal(moments[0], moments[1])  # the ranks' Adam moments differ
    assert torch.equal(states[0]["co2"]["anchor"], states[1]["co2"]["anchor"])


@pytest.mark.timeout(320)
def test_save_state_is_published_with_a_manifest_of_every_rank(runs):
    from co2_hf.integrations import checkpoint

    out, _, _ = runs
    manifest = checkpoint.check_complete(out, 1, 2, step=SAVE_AT)
    assert sorted(manifest["ranks"]) == ["0", "1"] and "model.safetensors" in manifest["files"]
    assert not os.path.exists(os.path.join(os.path.dirname(out), checkpoint.STAGING_DIR))


@pytest.mark.timeout(320)
def test_load_state_resumes_bit_for_bit(runs):
    _, first, final = runs
    for rank in (0, 1):
        for name, value in first[rank]["full"]["final"].items():
            assert torch.equal(final[rank]["final"][name], value), (rank, name)


@pytest.mark.timeout(320)
def test_saved_model_file_is_the_anchor(runs):
    from safetensors.torch import load_file

    out, _, _ = runs
    weights = load_file(os.path.join(out, "model.safetensors"))
    anchor = torch.load(os.path.join(out, "co2_rank0.pt"), weights_only=False)["co2"]["anchor"]
    key = next(k for k in weights if k.endswith("wte.weight"))
    assert torch.equal(weights[key].reshape(-1), anchor[: weights[key].numel()])
    assert SAVE_AT == 6


@pytest.mark.timeout(60)
def test_independent_replicas_are_refused(monkeypatch):
    """Accelerator() without cpu=True on a GPU-less machine: each launched process trains alone."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from co2_hf import CO2Config
    from co2_hf.integrations.accelerate import _check_launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    alone = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO)
    with pytest.raises(RuntimeError, match=r"Accelerator\(cpu=True\)"):
        _check_launch(alone, CO2Config())
    deepspeed = SimpleNamespace(num_processes=2, distributed_type=DistributedType.DEEPSPEED)
    with pytest.raises(ValueError, match="does not support Accelerate's DEEPSPEED"):
        _check_launch(deepspeed, CO2Config())
    fsdp = SimpleNamespace(num_processes=2, distributed_type=DistributedType.FSDP)
    with pytest.raises(ValueError, match=r"FSDP: it shards across every process.*worker_mesh\(k\)"):
        _check_launch(fsdp, CO2Config())


@pytest.mark.timeout(60)
def test_training_arguments_use_the_cpu_when_launched_without_an_accelerator(monkeypatch):
    from types import SimpleNamespace

    from co2_hf.integrations.arguments import _use_cpu_without_accelerator

    monkeypatch.setenv("WORLD_SIZE", "2")
    args = SimpleNamespace(use_cpu=False)
    _use_cpu_without_accelerator(args)
    assert args.use_cpu is (not torch.accelerator.is_available())
