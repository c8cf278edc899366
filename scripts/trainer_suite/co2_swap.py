"""transformers' own Trainer tests with ``Trainer``/``TrainingArguments`` replaced by co2_hf's classes.

``CO2_MODE`` (environment variable, set by run.sh):

- ``plain``: nothing replaced (the baseline on this machine);
- ``identity``: CO2 as the identity on one worker (``co2_local_steps=1``, ``co2_outer_lr=1``,
  ``co2_outer_momentum=0``, ``co2_fragments=1``): every test should pass as with the plain Trainer;
- ``defaults``: the library's defaults with ``co2_local_steps=4``: resume, rotation, best model and
  evaluation must hold too; only tests that compare a trajectory with plain training may differ.

``CO2_EXTRA``: a JSON object of further ``co2_*`` defaults, for diagnosis (``'{"co2_max_skipped_rounds": 0}'``).

Loaded as a pytest plugin (``-p co2_swap``, run.sh), so the replacement runs before pytest imports
the test modules, so their
``from transformers import Trainer, TrainingArguments`` (and the subclasses they define) get
subclasses of CO2Trainer / CO2TrainingArguments that keep the names and only change the defaults.
"""

import dataclasses
import json
import os
import sys

MODES = {
    "plain": None,
    "identity": {"co2_local_steps": 1, "co2_outer_lr": 1.0, "co2_outer_momentum": 0.0, "co2_fragments": 1},
    "defaults": {"co2_local_steps": 4},
}
MODE = os.environ.get("CO2_MODE", "plain")
if MODE not in MODES:
    raise RuntimeError(f"CO2_MODE={MODE!r}: allowed values are {sorted(MODES)}")
OVERRIDES = MODES[MODE]
if OVERRIDES is not None and os.environ.get("CO2_EXTRA"):
    OVERRIDES = {**OVERRIDES, **json.loads(os.environ["CO2_EXTRA"])}

if OVERRIDES is not None:
    import transformers.trainer  # noqa: F401 - importing it registers sys.modules["transformers"] anew

    from co2_hf import CO2Trainer, CO2TrainingArguments

    types = {f.name: f.type for f in dataclasses.fields(CO2TrainingArguments)}
    fields = [(k, types[k], dataclasses.field(default=v, kw_only=True)) for k, v in OVERRIDES.items()]
    TrainingArguments = dataclasses.make_dataclass("TrainingArguments", fields, bases=(CO2TrainingArguments,))
    # pickle finds a class by module and name: this module's global (the tests pickle their arguments;
    # make_dataclass takes module= only from Python 3.12)
    TrainingArguments.__module__ = __name__
    Trainer = type("Trainer", (CO2Trainer,), {})
    for module in {id(m): m for m in (sys.modules["transformers"], transformers)}.values():
        module.TrainingArguments, module.Trainer = TrainingArguments, Trainer


def _placeholder_for_removed_names():
    """Some stored test files import names this transformers no longer exports (``GlueDataset``,
    used by @slow tests only): a placeholder lets the module import; existing names are untouched."""
    import transformers.trainer  # noqa: F401

    module = sys.modules["transformers"]
    for name in ("GlueDataset", "GlueDataTrainingArguments"):
        try:
            getattr(module, name)
        except AttributeError:
            setattr(module, name, type(name, (), {}))


_placeholder_for_removed_names()


def pytest_report_header(config):
    replaced = "transformers.Trainer unchanged" if OVERRIDES is None else f"CO2Trainer, {OVERRIDES}"
    return f"CO2_MODE={MODE}: {replaced}"
