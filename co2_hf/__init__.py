"""co2_hf: CO2 distributed training (arXiv 2401.16265) for PyTorch, Accelerate and Trainer.

``import co2_hf`` loads torch only. The Hugging Face integrations are attached lazily (module
``__getattr__``), so a pure-torch user never imports transformers or accelerate.
"""

from .config import CO2Config
from .core import CO2

__version__ = "0.1.0"

# name -> module that defines it; imported on first access
_LAZY = {
    "CO2Trainer": "co2_hf.integrations.trainer",
    "CO2TrainingArguments": "co2_hf.integrations.trainer",
    "CO2Accelerate": "co2_hf.integrations.accelerate",
}

__all__ = ["CO2", "CO2Config", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'co2_hf' has no attribute {name!r}")
