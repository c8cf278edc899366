"""``co2_elastic`` and ``co2_fault_tolerance``: settings of `CO2Config`, read alike by the Trainer, Accelerate
and the engine; left out of what a checkpoint records and compares (how a run is hosted may change on resume)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from workers import SPEC_DEFAULTS, TinyNet, make_optimizer, train_local

from co2_hf import CO2, CO2Config
from co2_hf.config import HOSTING
from co2_hf.testing import QuorumCommunicator

pytestmark = pytest.mark.timeout(60)


def _engine(**settings):
    model = TinyNet(seed=0)
    optimizer = make_optimizer(model)
    return model, optimizer, CO2(model, CO2Config(**{**SPEC_DEFAULTS, "co2_local_steps": 3, **settings}), optimizer)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(co2_fault_tolerance="torchft", co2_enabled=False), "co2_fault_tolerance='torchft' needs co2_enabled"),
        (dict(co2_fault_tolerance="torchft", co2_elastic=True), "co2_elastic=True with co2_fault_tolerance='torchft'"),
    ],
)
def test_the_config_refuses_what_the_hosting_settings_cannot_be_combined_with(settings, message):
    """(Each value alone: tests/test_config.py's refusal table.)"""
    with pytest.raises(ValueError, match=message):
        CO2Config(**settings)


def test_the_hosting_settings_are_declared_once_in_the_config_and_recorded_nowhere():
    from co2_hf import CO2TrainingArguments

    assert {f.name for f in dataclasses.fields(CO2Config)} >= set(HOSTING)
    assert not set(HOSTING) & set(CO2TrainingArguments.__dict__.get("__annotations__", {}))  # inherited
    config = CO2Config(co2_elastic=True)
    assert not set(HOSTING) & set(config.co2_dict())  # checkpoints, co2_config.json and cards as before
    assert CO2Config.from_object(config).co2_elastic is True


def test_the_command_line_flags_parse_as_before(tmp_path):
    from transformers import HfArgumentParser

    from co2_hf import CO2TrainingArguments

    argv = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--co2_elastic", "true"]
    parse = HfArgumentParser(CO2TrainingArguments).parse_args_into_dataclasses
    (args,) = parse(argv + ["--co2_fault_tolerance", "none"])
    assert (args.co2_elastic, args.co2_fault_tolerance) == (True, "none")
    (config,) = HfArgumentParser(CO2Config).parse_args_into_dataclasses(["--co2_elastic", "true"])  # Accelerate's
    assert config.co2_elastic is True
    with pytest.raises(SystemExit):  # argparse names the flag and the allowed choices
        parse(argv + ["--co2_fault_tolerance", "x"])


def test_a_state_saved_before_the_hosting_settings_existed_loads_into_an_elastic_run():
    """A state's config holds exactly the settings it held before these two were CO2Config fields:
    one saved then (or now, with co2_elastic=False) resumes under co2_elastic=True, bit for bit."""
    model, optimizer, co2 = _engine()
    train_local(model, co2, optimizer, 4)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "co2": co2.state_dict()})
    assert set(saved["co2"]["config"]) == {f.name for f in dataclasses.fields(CO2Config)} - set(HOSTING)
    train_local(model, co2, optimizer, 5, start=4)

    model, optimizer, elastic = _engine(co2_elastic=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    elastic.load_state_dict(saved["co2"])
    train_local(model, elastic, optimizer, 5, start=4)
    for name, value in co2.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_state_that_records_a_hosting_setting_loads_under_another():
    _, _, co2 = _engine()
    state = co2.state_dict()
    state["config"] = {**state["config"], "co2_fault_tolerance": "torchft", "co2_elastic": True}
    _, _, other = _engine()
    other.load_state_dict(state)  # how the saving run was hosted is not what the state must match


def test_the_engine_refuses_torchft_without_its_communicator_naming_where_it_runs():
    config = CO2Config(co2_fault_tolerance="torchft")
    with pytest.raises(ValueError, match=r"co2_fault_tolerance='torchft' is not supported by CO2 .*allowed is 'none'"):
        CO2(TinyNet(seed=0), config)
    with pytest.raises(ValueError, match=r"co2_hf\.torchft\.TorchFT\(config\)\.build"):
        CO2(TinyNet(seed=0), config)
    CO2(TinyNet(seed=0), config, communicator=QuorumCommunicator())  # torchft's kind of transport


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(co2_elastic=True), "co2_elastic=True is not supported by CO2Accelerate: allowed is False"),
        (dict(co2_fault_tolerance="torchft"), "co2_fault_tolerance='torchft' is not supported by CO2Accelerate"),
    ],
)
def test_accelerate_refuses_what_it_does_not_run_before_touching_the_accelerator(settings, message):
    from co2_hf import CO2Accelerate

    with pytest.raises(ValueError, match=message):
        CO2Accelerate(None, None, None, config=CO2Config(**settings))
