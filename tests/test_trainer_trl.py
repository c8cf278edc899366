"""CO2 beside TRL: SFTTrainer composed with CO2Trainer, SFTConfig with CO2TrainingArguments.

Skipped when TRL is not installed (``pip install co2_hf[trl]``)."""

from __future__ import annotations

import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install 'co2_hf[trl]'")

from distributed import run_processes  # noqa: E402
from sft_workers import sft_args, sft_classes, sft_dataset, sft_run, tiny_tokenizer  # noqa: E402
from trainer_workers import tiny_gpt2  # noqa: E402


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft"))
    return out, run_processes(sft_run, 2, out, timeout_s=200)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sft_with_co2_issues_no_collective_during_local_steps(sft):
    _, ranks = sft
    for result in ranks:
        assert result["world"] == 2 and result["wrapped"] == "GPT2LMHeadModel"
        assert result["windows"] and all(n == 0 for n in result["windows"]), result["windows"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sft_metric_gathers_are_local_and_said_so_once(sft):
    _, ranks = sft
    logs = [e for e in ranks[0]["log_history"] if "loss" in e]
    assert all("mean_token_accuracy" in e and "entropy" in e for e in logs), logs
    assert "co2/comm_wait_s" in logs[-1]
    said = [m for m in ranks[0]["warnings"] if "gathered inside the training step" in m]
    assert len(said) == 1, ranks[0]["warnings"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sft_outputs_are_the_anchor(sft):
    from transformers import AutoModelForCausalLM

    out, ranks = sft
    for name, value in ranks[0]["final"].items():  # finalize: the live models are the shared anchor
        assert torch.equal(value, ranks[1]["final"][name]), name
    saved = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final")).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in ranks[0]["final"].items() if k in saved)
    middle = os.path.join(out, "checkpoint-6")  # mid-round: the model files hold the anchor, not rank 0's
    model = AutoModelForCausalLM.from_pretrained(middle)
    state = torch.load(os.path.join(middle, "co2_rank0.pt"), weights_only=True)
    wte = model.transformer.wte.weight.detach().reshape(-1)
    assert torch.equal(wte, state["co2"]["anchor"][: wte.numel()])
    assert not torch.equal(state["model"]["transformer.wte.weight"].reshape(-1), wte)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("co2_first", [True, False], ids=["CO2-first", "SFT-first"])
def test_sft_config_and_co2_arguments_mix_in_either_order(tmp_path, co2_first):
    config_class, _ = sft_classes(co2_first)
    args = sft_args(config_class, str(tmp_path), pad_to_multiple_of="auto", co2_timeout_s=41.5)
    assert args.pad_to_multiple_of is None  # SFTConfig's __post_init__ ran
    assert args.ddp_timeout == 42 and args.average_tokens_across_devices is False  # and CO2's
    with pytest.raises(ValueError, match="co2_local_steps=0"):
        sft_args(config_class, str(tmp_path), co2_local_steps=0)


@pytest.mark.timeout(120)
def test_sft_trainer_first_still_trains_with_co2(tmp_path, monkeypatch):
    """(SFTTrainer, CO2Trainer): CO2's overrides run beneath SFT's and still apply."""
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    config_class, trainer_class = sft_classes(co2_first=False)
    args = sft_args(config_class, str(tmp_path), max_steps=8)
    trainer = trainer_class(
        model=tiny_gpt2(), args=args, train_dataset=sft_dataset(64), processing_class=tiny_tokenizer()
    )
    trainer.train()
    live, anchor = trainer.model.state_dict(), trainer.co2.anchor_state()
    assert all(torch.equal(live[k], v) for k, v in anchor.items())  # finalized: the live model is the anchor
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert "co2/outer_grad_norm" in logs[-1] and "mean_token_accuracy" in logs[-1]
