"""CO2Trainer with mixed precision, bf16 weights, torch.compile and AMP-skipped steps (one process)."""

from __future__ import annotations

import pytest
import torch
from trainer_workers import dataset, make_args, tiny_gpt2
from transformers import TrainerCallback

from co2_hf import CO2Trainer

pytestmark = pytest.mark.timeout(120)


def test_bf16_mixed_precision_keeps_an_fp32_anchor(tmp_path):
    trainer = CO2Trainer(model=tiny_gpt2(), args=make_args(str(tmp_path), bf16=True), train_dataset=dataset())
    trainer.train()
    assert trainer.co2._anchor.dtype == torch.float32
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)


def test_bf16_weights_keep_an_fp32_anchor_and_save_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_gpt2().to(torch.bfloat16)
    trainer = CO2Trainer(model=model, args=make_args(str(tmp_path)), train_dataset=dataset())
    trainer.train()
    assert trainer.co2._anchor.dtype == torch.float32
    trainer.save_model(str(tmp_path / "out"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype="auto")
    assert loaded.transformer.wte.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight)


@pytest.mark.slow  # torch.compile traces the model: about 7 s on 2 cores
def test_torch_compile_sees_the_in_place_reset(tmp_path):
    args = make_args(str(tmp_path), torch_compile=True, torch_compile_backend="eager")
    trainer = CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
    trainer.train()
    tokens = torch.arange(16).view(1, 16)
    compiled, plain = trainer.model_wrapped, trainer.model
    assert compiled is not plain
    plain.eval()  # no dropout
    with torch.no_grad():  # after finalize the live weights are the anchor, in the same tensors
        torch.testing.assert_close(compiled(input_ids=tokens).logits, plain(input_ids=tokens).logits)
    assert torch.equal(plain.transformer.wte.weight.reshape(-1), trainer.co2._anchor[: 64 * 32])


class _SkipSomeSteps(TrainerCallback):
    """Pretend the grad scaler found an overflow at steps 2 and 5 (runs before CO2's callback)."""

    def __init__(self, trainer_ref):
        self.trainer_ref = trainer_ref

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer_ref[0].optimizer._is_overflow = state.global_step in (1, 4)


def test_amp_skipped_steps_still_count_as_inner_steps(tmp_path):
    ref = []
    trainer = CO2Trainer(
        model=tiny_gpt2(), args=make_args(str(tmp_path)), train_dataset=dataset(), callbacks=[_SkipSomeSteps(ref)]
    )
    ref.append(trainer)
    trainer.train()
    assert trainer.co2.amp_skipped_steps == 2
    assert trainer.co2.inner_steps == 12  # every optimizer-step call, skipped or not
    logged = [e for e in trainer.state.log_history if "co2/amp_skipped_steps" in e]
    assert logged[-1]["co2/amp_skipped_steps"] == 2.0


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    args = make_args(str(tmp_path), gradient_accumulation_steps=3)
    trainer = CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
    trainer.train()
    assert trainer.co2.inner_steps == 12 and trainer.state.global_step == 12
