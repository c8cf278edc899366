"""The CO2 part of a model card: tags, hyperparameters, world size and the paper's citation; and
the corrections the Trainer's draft card needs (`complete_card`)."""

from __future__ import annotations

import json
import os
import re

from ..config import CO2Config
from ..core.schedule import Plan

ARXIV_ID = "2401.16265"
TAGS = ["co2", f"arxiv:{ARXIV_ID}", "distributed-training"]
CITATION = """@inproceedings{sun2024co2,
  title     = {CO2: Efficient Distributed Training with Full Communication-Computation Overlap},
  author    = {Sun, Weigao and Qin, Zhen and Sun, Weixuan and Li, Shidi and Li, Dong and Shen, Xuyang
               and Qiao, Yu and Zhong, Yiran},
  booktitle = {International Conference on Learning Representations},
  year      = {2024},
  url       = {https://arxiv.org/abs/2401.16265}
}"""


# the sentence transformers' card writes for a model built from a config (its _name_or_path is "")
_EMPTY_BASE = re.compile(r"This model is a fine-tuned version of \[\]\(https://huggingface\.co/\) on ")


def _load(card_path: str):
    from huggingface_hub import ModelCard

    if os.path.exists(card_path):
        return ModelCard.load(card_path)
    return ModelCard("---\nlibrary_name: transformers\n---\n")


def complete_card(
    card_path: str, *, base_model: str | None = None, pipeline_tag: str | None = None, device_type: str | None = None
) -> None:
    """Fix what ``Trainer.create_model_card`` leaves wrong or out, in the card at ``card_path``:

    - a model trained from scratch is "fine-tuned version of [](https://huggingface.co/)" there:
      it says "trained from scratch" instead;
    - a base model that is a local folder is named in the text, but is not a Hub id, so it leaves
      the ``base_model`` metadata (the Hub rejects it);
    - ``pipeline_tag`` (the task the Hub's widget and ``pipeline()`` use): given, or found from
      ``config.json``'s architecture beside the card;
    - the Trainer calls every multi-process run "multi-GPU": a run on ``device_type`` "cpu" (gloo)
      is named for its device.
    """
    card = _load(card_path)
    card.text = _EMPTY_BASE.sub("This model was trained from scratch on ", card.text)
    if device_type and device_type != "cuda":
        card.text = card.text.replace(
            "- distributed_type: multi-GPU\n", f"- distributed_type: multi-{device_type.upper()}\n"
        )
    if base_model and os.path.isdir(base_model):
        card.text = card.text.replace(f"[{base_model}](https://huggingface.co/{base_model})", f"`{base_model}`")
        card.data.base_model = None
    tag = pipeline_tag or _task_of(os.path.join(os.path.dirname(card_path) or ".", "config.json"))
    if tag and not card.data.get("pipeline_tag"):
        card.data.pipeline_tag = tag
    card.save(card_path)


def write_card(
    card_path: str,
    *,
    base_model: str | None = None,
    dataset: str | None = None,
    license: str | None = None,
    pipeline_tag: str | None = None,
    library_name: str = "transformers",
) -> None:
    """A short card for a model saved outside the Trainer (``CO2Accelerate.save_pretrained``):
    what it was trained from and on; `add_co2_section` adds the CO2 part. ``library_name``:
    "pytorch" for a plain ``nn.Module``, which transformers cannot load."""
    from huggingface_hub import ModelCard, ModelCardData

    hub_base = base_model if base_model and not os.path.isdir(base_model) else None
    data = ModelCardData(library_name=library_name, license=license, base_model=hub_base, pipeline_tag=pipeline_tag)
    origin = f"a fine-tuned version of `{base_model}`" if base_model else "trained from scratch"
    name = os.path.basename(os.path.dirname(os.path.abspath(card_path)))
    text = f"---\n{data.to_yaml()}\n---\n\n# {name}\n\nThis model is {origin} on {dataset or 'an unknown dataset'}.\n"
    ModelCard(text).save(card_path)
    complete_card(card_path)  # the pipeline tag, when none was given, from config.json


def _task_of(config_path: str) -> str | None:
    """The pipeline task of the model class named in ``config.json`` (transformers' own table)."""
    if not os.path.exists(config_path):
        return None
    from transformers.modelcard import TASK_MAPPING

    with open(config_path) as f:
        architectures = json.load(f).get("architectures") or []
    for task, mapping in TASK_MAPPING.items():
        names = {n for v in mapping.values() for n in ((v,) if isinstance(v, str) else v)}
        if any(a in names for a in architectures):
            return task
    return None


def add_co2_section(
    card_path: str, config: CO2Config, *, plan: Plan, world_size: int, device_type: str | None = None
) -> None:
    """Add CO2's metadata (YAML) and a section (Markdown) to the model card at ``card_path``: the
    settings as they ran (``co2_fragments`` the plan's F) and the resolved ``plan``; ``device_type``
    (the run's ``torch.device`` type) corrects the Trainer's hyperparameter list (`complete_card`)."""
    complete_card(card_path, device_type=device_type)
    card = _load(card_path)
    tags = list(card.data.tags or [])
    card.data.tags = tags + [t for t in TAGS if t not in tags]
    settings = plan.settings(config)
    workers = world_size // config.co2_worker_size
    card.data.co2 = {**settings, "world_size": world_size, "num_workers": workers, "co2_plan": plan.describe()}
    if "## Trained with CO2" not in card.text:
        rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in settings.items())
        rows += "\n" + "\n".join(f"| resolved: `{k}` | `{v}` |" for k, v in plan.describe().items())
        card.text = card.text.rstrip() + (
            "\n\n## Trained with CO2\n\n"
            f"This model was trained with co2_hf on {world_size} processes "
            f"({world_size // config.co2_worker_size} workers): CO2 data-parallel training, whose outer "
            "all-reduce overlaps the next round's computation ([Sun et al., ICLR 2024, "
            f"arXiv:{ARXIV_ID}](https://arxiv.org/abs/{ARXIV_ID})). The weights are the final anchor, "
            "the model all workers share.\n\n"
            f"| setting | value |\n|---|---|\n{rows}\n\n### Citation\n\n```bibtex\n{CITATION}\n```\n"
        )
    card.save(card_path)
