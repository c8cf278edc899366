"""Per-rank SFTTrainer + CO2 runs for tests/test_trainer_trl.py (imports TRL: import it only where
TRL is installed)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from trainer_workers import SequenceProbe, _env, dataset, make_args, tiny_gpt2
from trl import SFTConfig, SFTTrainer

from co2_hf import CO2Trainer, CO2TrainingArguments


def tiny_tokenizer():
    """A word-level tokenizer over the 64 ids of `tiny_gpt2` (no download): "t0" ... "t62", "<eos>"."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(63)} | {"<eos>": 63}
    backend = Tokenizer(WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>")


# as README shows them; module-level, so that the Trainer can pickle the arguments (training_args.bin)
@dataclass
class CO2SFTConfig(CO2TrainingArguments, SFTConfig):
    pass


class CO2SFTTrainer(CO2Trainer, SFTTrainer):
    pass


@dataclass
class SFTCO2Config(SFTConfig, CO2TrainingArguments):  # the other base-class order
    pass


class SFTCO2Trainer(SFTTrainer, CO2Trainer):
    pass


def sft_classes(co2_first: bool):
    """An SFT config and trainer with CO2, composed in the given base-class order."""
    return (CO2SFTConfig, CO2SFTTrainer) if co2_first else (SFTCO2Config, SFTCO2Trainer)


def sft_args(config_class, output_dir: str, **overrides):
    # TRL's defaults differ: bf16 where fp16 is off, gradient checkpointing on
    return make_args(output_dir, config_class, bf16=False, gradient_checkpointing=False, **overrides)


def sft_dataset(n: int = 128):
    from datasets import Dataset

    base = dataset(n)
    return Dataset.from_dict({"input_ids": base["input_ids"]})  # already tokenized: SFT adds labels


def sft_run(rank: int, world: int, out: str) -> dict:
    """SFTTrainer + CO2 on ``world`` gloo processes: collectives per logging window, a mid-round
    checkpoint at step 6 (its model files and its rank file), the final model on every rank."""
    import logging

    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    _env(rank, world)
    config_class, _ = sft_classes(co2_first=True)
    probe = SequenceProbe()

    class Probed(CO2SFTTrainer):
        def _save_checkpoint(self, model, trial):  # a save is not a local step: its collectives don't count
            before = probe._seq()
            super()._save_checkpoint(model, trial)
            if probe._start is not None:
                probe._start += probe._seq() - before

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("co2_hf").addHandler(handler)
    args = sft_args(config_class, out, save_strategy="steps", save_steps=6)
    trainer = Probed(
        model=tiny_gpt2(),
        args=args,
        train_dataset=sft_dataset(),
        processing_class=tiny_tokenizer(),
        callbacks=[probe],
    )
    probe.trainer = trainer
    trainer.train()
    trainer.save_model(out + "/final")
    return {
        "windows": probe.windows,
        "world": torch.distributed.get_world_size(),
        "wrapped": type(trainer.model_wrapped).__name__,
        "log_history": trainer.state.log_history,
        "final": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "warnings": records,
    }
