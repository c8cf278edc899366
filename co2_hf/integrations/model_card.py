"""The CO2 part of a model card: tags, hyperparameters, world size and the paper's citation."""

from __future__ import annotations

import os

from ..config import CO2Config

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


def add_co2_section(card_path: str, config: CO2Config, *, world_size: int) -> None:
    """Add CO2's metadata (YAML) and a section (Markdown) to the model card at ``card_path``."""
    from huggingface_hub import ModelCard

    if os.path.exists(card_path):
        card = ModelCard.load(card_path)
    else:
        card = ModelCard("---\nlibrary_name: transformers\n---\n")
    tags = list(card.data.tags or [])
    card.data.tags = tags + [t for t in TAGS if t not in tags]
    settings = config.co2_dict()
    card.data.co2 = {**settings, "world_size": world_size, "num_workers": world_size // config.co2_worker_size}
    if "## Trained with CO2" not in card.text:
        rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in settings.items())
        card.text = card.text.rstrip() + (
            "\n\n## Trained with CO2\n\n"
            f"This model was trained with [co2_hf](https://arxiv.org/abs/{ARXIV_ID}) on {world_size} "
            f"processes ({world_size // config.co2_worker_size} workers): CO2 data-parallel training, "
            "whose outer all-reduce overlaps the next round's computation (Sun et al., ICLR 2024, "
            f"arXiv:{ARXIV_ID}). The weights are the final anchor, the model all workers share.\n\n"
            f"| setting | value |\n|---|---|\n{rows}\n\n### Citation\n\n```bibtex\n{CITATION}\n```\n"
        )
    card.save(card_path)
