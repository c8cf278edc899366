"""Every invalid CO2Config value is refused with a message naming the field, value and range."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from co2_hf import CO2Config

pytestmark = pytest.mark.timeout(30)

# field, bad value, words the message must contain (besides the field name and the value)
INVALID = [
    ("co2_enabled", "yes", "True or False"),
    ("co2_local_steps", 0, "integer >= 1"),
    ("co2_local_steps", 2.5, "integer >= 1"),
    ("co2_local_steps", True, "integer >= 1"),
    ("co2_local_steps", 10**9, "an integer in [1, 10000] (a longer round would average the workers only a few"),
    ("co2_outer_lr", 0.0, "> 0"),
    ("co2_outer_lr", float("nan"), "> 0"),
    ("co2_outer_lr", True, "a finite number > 0"),
    ("co2_outer_lr", 1e20, "<= 10 (published runs use 0.7 to 1)"),
    ("co2_sparse_bits", 4.5, "2 or 4"),
    ("co2_sparse_bits", True, "2 or 4"),
    ("co2_outer_momentum", 1.0, "[0, 1)"),
    ("co2_outer_momentum", -0.1, "[0, 1)"),
    ("co2_nesterov", 1, "True or False"),
    ("co2_overlap", None, "True or False"),
    ("co2_overlap_steps", 0, "integer >= 1 and < co2_local_steps"),
    ("co2_overlap_steps", 12, "must be < co2_local_steps"),
    ("co2_fragments", 0, "integer >= 1"),
    ("co2_fragments", 5, "must divide co2_local_steps=12"),
    ("co2_start_rule", "latest", "'anchor', 'eager', 'lookahead'"),
    ("co2_eager_weight", 1.5, "a number in [0, 1]"),
    ("co2_gap_penalty", -1.0, ">= 0"),
    ("co2_gap_penalty", float("inf"), ">= 0"),
    ("co2_gap_penalty_mode", "linear", "'gap_aware', 'constant'"),
    ("co2_clip_threshold", 0.0, "in [1e-08, 1e+08]"),
    ("co2_clip_threshold", -3.0, "in [1e-08, 1e+08]"),
    ("co2_comm_dtype", "float16", "'float32', 'bfloat16', 'int8', 'int4'"),
    ("co2_quant_block", 1, "integer >= 2"),
    ("co2_quant_block", 33, "an even integer in [2, 4096]"),
    ("co2_quant_rounding", "up", "'nearest', 'stochastic'"),
    ("co2_sparse_density", 0.0, "a number in (0, 1]"),
    ("co2_sparse_density", 1.5, "a number in (0, 1]"),
    ("co2_sparse_bits", 8, "2 or 4"),
    ("co2_sparse_keep_unsent", "yes", "True or False"),
    ("co2_sparse_feedback_decay", 0.0, "a number in (0, 1]"),
    ("co2_sparse_feedback_decay", 1.05, "a number in (0, 1]"),
    ("co2_sync_warmup_steps", -1, "integer >= 0"),
    ("co2_global_second_moment_every", -1, "integer >= 0 and <= 10000 (0: off; unset: the default)"),
    ("co2_global_second_moment_every", 1.5, "integer >= 0"),
    ("co2_worker_size", 0, "integer >= 1"),
    ("co2_state_device", "cuda", "'same', 'cpu'"),
    ("co2_max_skipped_rounds", -2, "integer >= 0"),
    ("co2_elastic", "yes", "True or False"),
    ("co2_fault_tolerance", "bogus", "allowed are 'none', 'torchft'"),
    ("co2_timeout_s", 0, "seconds >= 1"),
    (
        "co2_timeout_s",
        0.0001,
        "seconds >= 1 and <= 31536000 (one year); gloo and NCCL count timeouts in whole milliseconds",
    ),
]


@pytest.mark.parametrize(("name", "value", "allowed"), INVALID, ids=[f"{n}={v!r}" for n, v, _ in INVALID])
def test_invalid_value_is_refused_with_its_name_value_and_range(name, value, allowed):
    with pytest.raises(ValueError) as info:
        CO2Config(**{name: value})
    message = str(info.value)
    assert name in message and repr(value) in message and allowed in message


def test_every_knob_is_covered_by_the_refusal_table():
    covered = {name for name, _, _ in INVALID}
    assert covered == {f.name for f in dataclasses.fields(CO2Config)}


def test_defaults_and_help():
    cfg = CO2Config()  # streaming: one fragment per inner step, the lookahead start, beta 0.2
    assert (cfg.co2_local_steps, cfg.co2_outer_lr, cfg.co2_outer_momentum) == (12, 1.0, 0.2)
    assert (cfg.fragments, cfg.window_steps, cfg.co2_start_rule) == (12, 1, "lookahead")
    assert cfg.co2_overlap and cfg.co2_gap_penalty == 0.0 and cfg.co2_clip_threshold is None
    assert all(f.metadata.get("help") for f in dataclasses.fields(CO2Config))


def test_check_world_needs_worker_size_to_divide_the_world():
    assert CO2Config(co2_worker_size=2).check_world(8) == 4
    with pytest.raises(ValueError, match=r"co2_worker_size=3 must divide the world size 8.*\[1, 2, 4, 8\]"):
        CO2Config(co2_worker_size=3).check_world(8)


def test_eager_weight_belongs_to_the_eager_start_only():
    CO2Config(co2_start_rule="eager", co2_eager_weight=0.5)
    for rule in ("lookahead", "anchor"):
        with pytest.raises(ValueError, match=rf"co2_eager_weight=0.5 is not allowed with co2_start_rule='{rule}'"):
            CO2Config(co2_start_rule=rule, co2_eager_weight=0.5)


# settings another one makes useless: (the settings, words of the refusal, naming both flags)
IGNORED = [
    (dict(co2_sparse_keep_unsent=True), "co2_sparse_keep_unsent=True has no effect with co2_comm_dtype='float32'"),
    (
        dict(co2_sparse_feedback_decay=0.95),
        "co2_sparse_feedback_decay=0.95 has no effect with co2_comm_dtype='float32'",
    ),
    (
        dict(co2_sparse_density=0.5, co2_comm_dtype="int4"),
        "co2_sparse_density=0.5 has no effect with co2_comm_dtype='int4'",
    ),
    (
        dict(co2_sparse_bits=4, co2_comm_dtype="bfloat16"),
        "co2_sparse_bits=4 has no effect with co2_comm_dtype='bfloat16'",
    ),
]


@pytest.mark.parametrize(("settings", "refusal"), IGNORED, ids=[r[:28] for _, r in IGNORED])
def test_a_setting_another_one_makes_useless_is_refused_naming_both(settings, refusal):
    with pytest.raises(ValueError, match=re.escape(refusal)):
        CO2Config(**settings)
    sparse = {k: v for k, v in settings.items() if k.startswith("co2_sparse")}
    if sparse:  # where it has an effect it is accepted
        CO2Config(**sparse, co2_comm_dtype="sparse")


def test_a_setting_the_plan_leaves_without_effect_is_warned_once_naming_what_stops_it(caplog):
    """A gap penalty where no average is stale, the eager start without overlap: trains (a recipe's
    defaults combined with a baseline's --co2_overlap false hold them), with one WARNING each."""
    from co2_hf.core.schedule import Plan

    with caplog.at_level(logging.WARNING, logger="co2_hf.core.co2"):
        for _ in range(3):
            Plan.resolve(CO2Config(co2_gap_penalty=0.7))  # default fragments: one per inner step
        Plan.resolve(CO2Config(co2_gap_penalty=0.7, co2_overlap=False))
        assert Plan.resolve(CO2Config(co2_gap_penalty=0.7, co2_fragments=1)).penalty == "gap_aware"
        for _ in range(2):
            assert Plan.resolve(CO2Config(co2_start_rule="eager", co2_overlap=False)).start_rule == "anchor"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert "co2_gap_penalty=0.7 has no effect" in said[0] and "co2_fragments=12 (unset" in said[0]
    assert "co2_overlap=False applies every average at once" in said[1]
    assert "co2_start_rule='eager' has no effect with co2_overlap=False" in said[2]


def test_the_plan_is_sized_by_its_fragments_not_its_steps():
    import tracemalloc

    from co2_hf.core.schedule import Event, Plan

    config = CO2Config(co2_local_steps=10_000, co2_fragments=1)
    tracemalloc.start()
    plan = Plan.resolve(config)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 32_000, peak  # a table of every step of the round took ~1 MB here, and grew with tau
    assert plan.due(1) == () and plan.due(10_000) == ((Event.BOUNDARY, 0),)


def test_overlap_window_needs_overlap():
    with pytest.raises(ValueError, match="co2_overlap_steps=2 needs co2_overlap=True"):
        CO2Config(co2_overlap_steps=2, co2_overlap=False)
    assert CO2Config(co2_overlap_steps=11).co2_overlap_steps == 11


def test_bfloat16_wire_is_limited_to_256_workers():
    assert CO2Config(co2_comm_dtype="bfloat16").check_world(256) == 256
    with pytest.raises(ValueError, match="co2_comm_dtype='bfloat16' supports at most 256 workers"):
        CO2Config(co2_comm_dtype="bfloat16").check_world(512)


def test_co2_dict_round_trips():
    cfg = CO2Config(co2_local_steps=7, co2_clip_threshold=2.0)
    assert CO2Config(**cfg.co2_dict()) == cfg


def test_fragments_set_the_window_and_refuse_a_second_one():
    assert CO2Config(co2_fragments=4).window_steps == 3  # tau 12 / F 4
    assert CO2Config(co2_overlap_steps=2).window_steps == 2  # a window: one fragment, unless asked
    assert CO2Config(co2_overlap_steps=2).fragments == 1 and CO2Config(co2_overlap=False).fragments == 1
    assert CO2Config(co2_local_steps=2).fragments == 2  # unset: F = tau
    assert CO2Config(co2_fragments=1).window_steps is None
    with pytest.raises(ValueError, match="co2_overlap_steps=2 cannot be combined with co2_fragments=3.*None"):
        CO2Config(co2_fragments=3, co2_overlap_steps=2)
    with pytest.raises(ValueError, match=r"allowed values are \[1, 2, 3, 4, 6, 12\]"):
        CO2Config(co2_fragments=5)


def test_numbers_are_stored_as_their_declared_type():
    """4.0 for an int field used to stay a float (and pass ``in (2, 4)``), numpy.float64 stayed numpy:
    each becomes the declared int or float, so the config saves and compares as JSON does."""
    import numpy as np

    config = CO2Config(
        co2_comm_dtype="sparse",
        co2_sparse_bits=4.0,
        co2_quant_block=np.float64(64.0),
        co2_outer_lr=np.float64(0.5),
        co2_outer_momentum=0,
        co2_clip_threshold=np.int64(2),
    )
    values = (config.co2_sparse_bits, config.co2_quant_block, config.co2_outer_lr, config.co2_outer_momentum)
    assert [type(v) for v in values] == [int, int, float, float] and values == (4, 64, 0.5, 0.0)
    assert type(config.co2_clip_threshold) is float and config.co2_clip_threshold == 2.0
    with pytest.raises(ValueError, match=re.escape("co2_local_steps=4.5 is not allowed: it must be an integer")):
        CO2Config(co2_local_steps=4.5)


def test_co2_settings_with_co2_disabled_are_warned_once_naming_them(caplog):
    """Plain data parallel reads no co2_* setting; a recipe's own defaults stand beside --co2_enabled
    false, so it is a warning, said once, not a refusal."""
    with caplog.at_level(logging.WARNING, logger="co2_hf.config"):
        for _ in range(3):
            CO2Config(co2_enabled=False, co2_comm_dtype="int8", co2_fragments=2)
        CO2Config(co2_enabled=False)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "CO2: co2_fragments=2, co2_comm_dtype='int8' have no effect with co2_enabled=False: the plain data-parallel "
        "run reads no co2_* setting. Drop them, or set co2_enabled=True."
    ], said
