"""ViT image classification with CO2, in the shape of transformers' run_image_classification.py.

    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/finetune_vit.py
    accelerate launch --config_file recipes/accelerate_configs/multi_node.yaml recipes/finetune_vit.py \\
        --model_name_or_path google/vit-base-patch16-224-in21k --dataset_name imagenet-1k ...

With no data flag it trains, offline, a small ViT built from a config on scikit-learn's bundled
handwritten digits (1,797 8x8 images, 10 classes), upscaled to 16x16, with a stratified held-out
fifth. Images are transformed with PIL/numpy and the model's image processor (no torchvision).
Accuracy is computed with an `evaluate` metric that ships in recipes/metrics/ (no Hub access).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from common import CO2_RECIPE_DEFAULTS, TRAINING_DEFAULTS, WallClock, train_and_report
from transformers import HfArgumentParser, ViTConfig, ViTForImageClassification

from co2_hf import CO2Trainer, CO2TrainingArguments

METRIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics", "accuracy")
# hidden, layers, heads, MLP, image, patch: a CPU-sized ViT, and the ViT-B/16 shape
MODEL_SIZES = {"tiny": (64, 4, 4, 128, 16, 4), "base": (768, 12, 12, 3072, 224, 16)}


@dataclass
class ModelArguments:
    dry_run: bool = field(default=False, metadata={"help": "parse the flags, build the model config, print it, exit"})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "pretrained ViT, e.g. google/vit-base-patch16-224-in21k"}
    )
    model_size: Literal["tiny", "base"] = field(default="tiny", metadata={"help": "ViT shape built from a config"})


@dataclass
class DataArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "image dataset on the Hub (cifar10, imagenet-1k, ...)"}
    )
    train_dir: str | None = field(default=None, metadata={"help": "an imagefolder: one sub-folder per class"})
    validation_split_percentage: int = field(default=20, metadata={"help": "held out when no validation split"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "cap on validation images"})


def digits_splits(image_size: int, seed: int = 0):
    """scikit-learn's digits, upscaled to ``image_size`` (3 channels, in [-1, 1]); stratified 80/20."""
    from datasets import Dataset
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = []
    for image in digits.images:  # values 0..16
        big = Image.fromarray((image * 255 / 16).astype(np.uint8)).resize((image_size, image_size), Image.BILINEAR)
        pixels.append(np.repeat(np.asarray(big, dtype=np.float32)[None] / 127.5 - 1.0, 3, axis=0))
    train_idx, val_idx = train_test_split(
        np.arange(len(pixels)), test_size=0.2, random_state=seed, stratify=digits.target
    )
    labels = [str(i) for i in range(10)]

    def subset(idx):
        return Dataset.from_dict(
            {"pixel_values": [pixels[i] for i in idx], "labels": [int(digits.target[i]) for i in idx]}
        ).with_format("torch")

    return subset(train_idx), subset(val_idx), labels


def image_splits(data: DataArguments, processor):
    """A Hub dataset or an imagefolder, transformed on the fly by the model's image processor."""
    from datasets import load_dataset

    if data.dataset_name:
        raw = load_dataset(data.dataset_name)
    else:
        raw = load_dataset("imagefolder", data_dir=data.train_dir)
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=data.validation_split_percentage / 100, seed=0)
        raw = {"train": split["train"], "validation": split["test"]}
    train, validation = raw["train"], raw["validation"]
    image_key = "img" if "img" in train.column_names else "image"
    label_key = "label" if "label" in train.column_names else "labels"
    labels = train.features[label_key].names

    def transform(batch):
        out = processor([img.convert("RGB") for img in batch[image_key]], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "labels": batch[label_key]}

    train.set_transform(transform)
    validation.set_transform(transform)
    return train, validation, labels


def model_config(model_args: ModelArguments, **labels) -> ViTConfig:
    """The ViT shape of ``--model_size`` (``labels``: num_labels, id2label, label2id)."""
    hidden, layers, heads, mlp, image, patch = MODEL_SIZES[model_args.model_size]
    return ViTConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=mlp,
        image_size=image,
        patch_size=patch,
        **labels,
    )


def build_model(model_args: ModelArguments, labels: list[str], *, seed: int):
    """The model (a new classification head on a pretrained one), initial weights drawn from
    ``seed``: the Trainer seeds only after the model exists."""
    from transformers import set_seed

    set_seed(seed)
    id2label = dict(enumerate(labels))
    label_kwargs = dict(num_labels=len(labels), id2label=id2label, label2id={v: k for k, v in id2label.items()})
    if model_args.model_name_or_path:
        return ViTForImageClassification.from_pretrained(
            model_args.model_name_or_path, ignore_mismatched_sizes=True, **label_kwargs
        )
    return ViTForImageClassification(model_config(model_args, **label_kwargs))


def accuracy_metric():
    import evaluate

    metric = evaluate.load(METRIC_DIR)

    def compute(eval_pred):
        logits, references = eval_pred
        return metric.compute(predictions=np.argmax(logits, axis=-1), references=references)

    return compute


def dry_run(model_args: ModelArguments, data_args: DataArguments, training_args) -> None:
    """Everything up to the data: the flags parse and the model's shape is what was asked for."""
    if model_args.model_name_or_path:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    else:
        config = model_config(model_args)
    print(
        f"dry run: ViT hidden={config.hidden_size} layers={config.num_hidden_layers} image={config.image_size} "
        f"patch={config.patch_size}; data={data_args.dataset_name or data_args.train_dir or 'digits'}; "
        f"co2_local_steps={training_args.co2_local_steps} co2_enabled={training_args.co2_enabled}"
    )


def parse(argv: list[str] | None = None):
    parser = HfArgumentParser((ModelArguments, DataArguments, CO2TrainingArguments))
    parser.set_defaults(
        output_dir="outputs/finetune_vit",
        max_steps=250,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=64,
        learning_rate=3e-3,
        weight_decay=0.05,
        remove_unused_columns=False,
        **{**TRAINING_DEFAULTS, "eval_steps": 25},
        # tuned on this task (recipes/README.md): the one-round delay costs accuracy in proportion
        # to the round's length (5 seeds: tau 12 0.71, tau 4 0.80, tau 2 0.88; data parallel 0.89)
        **{**CO2_RECIPE_DEFAULTS, "co2_local_steps": 2, "co2_outer_momentum": 0.2},
    )
    return parser.parse_args_into_dataclasses(args=argv)


def main(argv: list[str] | None = None) -> None:
    model_args, data_args, training_args = parse(argv)
    if model_args.dry_run:
        return dry_run(model_args, data_args, training_args)
    start = time.time()
    processor = None
    if data_args.dataset_name is None and data_args.train_dir is None:
        image_size = MODEL_SIZES[model_args.model_size][4]
        train, validation, labels = digits_splits(image_size)
    else:
        from transformers import AutoImageProcessor, ViTImageProcessor

        size = MODEL_SIZES[model_args.model_size][4]
        processor = (
            AutoImageProcessor.from_pretrained(model_args.model_name_or_path)
            if model_args.model_name_or_path
            else ViTImageProcessor(size={"height": size, "width": size})
        )
        train, validation, labels = image_splits(data_args, processor)
    if data_args.max_eval_samples is not None:
        validation = validation.select(range(min(len(validation), data_args.max_eval_samples)))
    model = build_model(model_args, labels, seed=training_args.seed)
    trainer = CO2Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=validation,
        compute_metrics=accuracy_metric(),
        callbacks=[WallClock(training_args.output_dir)],
        processing_class=processor,
    )
    samples_per_step = (
        training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size
    )
    title = f"ViT {model_args.model_size} on {data_args.dataset_name or 'digits'}"
    train_and_report(
        trainer, start=start, per_step={"samples_per_step": samples_per_step}, title=title, metric="eval_accuracy"
    )


if __name__ == "__main__":
    main()
