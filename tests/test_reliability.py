"""Faults: bad input, a non-finite worker, dead or frozen peers, saves killed halfway, and a short
soak of kill-and-resume cycles that must end bit for bit where an uninterrupted run ends."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from reliability_workers import FAULT_TIMEOUT_S, FAULTS, NAN_STEP, TAU, corrupt, nan_suite, peer_faults
from tables import SLACK_S  # scheduling noise on a loaded 2-core machine

from co2_hf import CO2, CO2Config
from co2_hf.checkpoints import publish, rank_files
from co2_hf.checkpoints.manifest import MANIFEST_FILE
from co2_hf.testing import HF_PRELOAD, FakeCommunicator, run_with_faults
from scripts import soak

# a safety net for the tests that may set up the module's shared runs (about 15-20 s each on 2 free
# cores; more than twice that when the machine is busy)
SHARED_RUNS_TIMEOUT_S = 120

# ---------------------------------------------------------------- 1. bad input, refused up front

# flag, command-line value, words of the refusal that say what is allowed (flag and value appear too)
BAD_FLAGS = [
    ("co2_enabled", "maybe", "expected one of yes/no"),
    ("co2_local_steps", "0", "integer >= 1"),
    ("co2_local_steps", "2.5", "invalid int value"),
    ("co2_outer_lr", "0", "a finite number > 0"),
    ("co2_outer_lr", "nan", "a finite number > 0"),
    ("co2_outer_momentum", "1.0", "[0, 1)"),
    ("co2_nesterov", "2", "expected one of yes/no"),
    ("co2_overlap", "maybe", "expected one of yes/no"),
    ("co2_overlap_steps", "0", "an integer >= 1 and < co2_local_steps"),
    ("co2_fragments", "5", "allowed values are [1, 2, 3, 4, 6, 12]"),
    ("co2_fragments", "x", "invalid"),
    ("co2_start_rule", "latest", "choose from"),
    ("co2_eager_weight", "-0.1", "a number in [0, 1]"),
    ("co2_gap_penalty", "-1", ">= 0"),
    ("co2_gap_penalty", "inf", ">= 0"),
    ("co2_gap_penalty_mode", "linear", "choose from"),
    ("co2_clip_threshold", "0", "in [1e-08, 1e+08]"),
    ("co2_comm_dtype", "float16", "choose from"),
    ("co2_quant_block", "7", "an even integer in [2, 4096]"),
    ("co2_quant_rounding", "up", "choose from"),
    ("co2_sparse_density", "0", "a number in (0, 1]"),
    ("co2_sparse_density", "1.5", "a number in (0, 1]"),
    ("co2_sparse_bits", "3", "2 or 4"),
    ("co2_sparse_keep_unsent", "maybe", "expected one of yes/no"),
    ("co2_sparse_feedback_decay", "0", "a number in (0, 1]"),
    ("co2_sync_warmup_steps", "-1", "integer >= 0"),
    ("co2_global_second_moment_every", "20000", "integer >= 0 and <= 10000 (0: off; unset: the default)"),
    ("co2_global_second_moment_every", "1.5", "invalid int value"),
    ("co2_worker_size", "0", "integer >= 1"),
    ("co2_state_device", "cuda", "choose from"),
    ("co2_max_skipped_rounds", "-2", "integer >= 0"),
    ("co2_timeout_s", "0", "a finite number of seconds >= 1"),
    ("co2_timeout_s", "0.0001", "a finite number of seconds >= 1"),
    ("co2_timeout_s", "inf", "a finite number of seconds >= 1"),
    ("co2_local_steps", "1000000000", "an integer in [1, 10000]"),
    ("co2_elastic", "maybe", "expected one of yes/no"),
    ("co2_fault_tolerance", "bogus", "choose from"),
]


@pytest.fixture
def no_process_group(monkeypatch):
    """A 2-process launch environment in which creating a process group fails the test: every
    refusal must come before it. Accelerate's state is a singleton, reset around the test."""
    from accelerate.state import AcceleratorState

    def created(*args, **kwargs):
        raise AssertionError("a process group was created before the refusal")

    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    # OMP_NUM_THREADS set: Accelerate would otherwise change this process's torch thread count
    env.update(MASTER_PORT="29561", OMP_NUM_THREADS=str(torch.get_num_threads()))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.distributed, "init_process_group", created)
    AcceleratorState._reset_state(True)
    yield monkeypatch
    AcceleratorState._reset_state(True)


def _parse(argv: list[str]):
    from transformers import HfArgumentParser

    from co2_hf import CO2TrainingArguments

    return HfArgumentParser(CO2TrainingArguments).parse_args_into_dataclasses(argv)


def _refusal(argv: list[str], capsys) -> str:
    """The refusal's message, whether argparse (type, choice) or CO2's validation gave it."""
    with pytest.raises((SystemExit, ValueError)) as info:
        _parse(argv)
    return capsys.readouterr().err if info.type is SystemExit else str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flag", "value", "allowed"), BAD_FLAGS, ids=[f"{f}={v}" for f, v, _ in BAD_FLAGS])
def test_every_bad_flag_value_is_refused_by_the_parser(tmp_path, capsys, no_process_group, flag, value, allowed):
    message = _refusal(["--output_dir", str(tmp_path), f"--{flag}", value], capsys)
    assert flag in message and value in message and allowed in message, message


@pytest.mark.timeout(10)
def test_the_parser_table_covers_every_knob():
    assert {flag for flag, _, _ in BAD_FLAGS} == {f.name for f in dataclasses.fields(CO2Config)}


# argv beyond --output_dir, environment, words of the refusal
BAD_COMBINATIONS = [
    (["--deepspeed", "ds.json"], {}, "CO2 does not support DeepSpeed"),
    (
        ["--co2_global_second_moment_every", "2", "--co2_comm_dtype", "int8"],
        {},
        "co2_global_second_moment_every=2 with co2_comm_dtype='int8': allowed is co2_comm_dtype='float32' or",
    ),
    ([], {"ACCELERATE_USE_DEEPSPEED": "true"}, "CO2 does not support DeepSpeed"),
    (["--fsdp", "full_shard"], {}, "FSDP with co2_worker_size=1 would shard the model across CO2 workers"),
    ([], {"ACCELERATE_USE_FSDP": "true"}, "FSDP with co2_worker_size=1 would shard the model across CO2 workers"),
    (
        ["--fsdp", "full_shard", "--fsdp_config", '{"version": 1}', "--co2_worker_size", "2"],
        {"WORLD_SIZE": "4"},
        "FSDP version 1 is not supported with CO2: use FSDP2 inside each worker",
    ),
    (
        ["--fsdp", "full_shard offload", "--co2_worker_size", "2"],
        {"WORLD_SIZE": "4"},
        "fsdp options ['offload'] are not supported inside a CO2 worker",
    ),
    (["--include_num_input_tokens_seen", "true"], {}, "include_num_input_tokens_seen=True"),
    (["--accelerator_config", "{missing}"], {}, "is neither inline JSON"),
    (["--co2_worker_size", "3"], {"WORLD_SIZE": "4"}, "co2_worker_size=3 must divide the world size 4"),
    (["--co2_comm_dtype", "bfloat16"], {"WORLD_SIZE": "512"}, "supports at most 256 workers"),
]


# settings that used to reach the process group and run without effect, or past any sense: argv beyond
# --output_dir, words of the refusal (the flag, its value and what is allowed)
SILENT_SETTINGS = [
    (
        ["--co2_quant_rounding", "stochastic"],
        "co2_quant_rounding='stochastic' has no effect with co2_comm_dtype='float32'",
    ),
    (
        ["--co2_comm_dtype", "bfloat16", "--co2_quant_rounding", "stochastic"],
        "co2_quant_rounding='stochastic' has no effect with co2_comm_dtype='bfloat16': only co2_comm_dtype 'int8'",
    ),
    (["--co2_quant_block", "64"], "co2_quant_block=64 has no effect with co2_comm_dtype='float32'"),
    (
        ["--co2_comm_dtype", "bfloat16", "--co2_quant_block", "64"],
        "co2_quant_block=64 has no effect with co2_comm_dtype='bfloat16'",
    ),
    (
        ["--co2_comm_dtype", "sparse", "--co2_sparse_density", "1e-9"],
        "co2_sparse_density=1e-09 is not allowed: it must be a number in (0, 1], at least 1/256",
    ),
    (
        ["--co2_comm_dtype", "int8", "--co2_quant_block", "2147483648"],
        "co2_quant_block=2147483648 is not allowed: it must be an integer >= 2 and <= 4096",
    ),
    (
        ["--co2_gap_penalty", "1e308"],
        "co2_gap_penalty=1e+308 is not allowed: it must be a finite number >= 0 and <= 10000",
    ),
    (
        ["--co2_sync_warmup_steps", "99999999999"],
        "co2_sync_warmup_steps=99999999999 is not allowed: it must be an integer >= 0 and <= 1000000000",
    ),
    (
        ["--co2_max_skipped_rounds", "99999999999999"],
        "co2_max_skipped_rounds=99999999999999 is not allowed: it must be an integer >= 0 and <= 1000 (0: never stop)",
    ),
    (["--co2_outer_lr", "1e20"], "co2_outer_lr=1e+20 is not allowed: it must be a finite number > 0 and <= 10"),
    (
        ["--co2_clip_threshold", "1e20"],
        "co2_clip_threshold=1e+20 is not allowed: it must be a finite number in [1e-08, 1e+08]",
    ),
    (
        ["--co2_clip_threshold", "1e-300"],
        "co2_clip_threshold=1e-300 is not allowed: it must be a finite number in [1e-08",
    ),
    (
        ["--co2_timeout_s", "5", "--ddp_timeout", "1"],
        "ddp_timeout=1 is not allowed with co2_timeout_s=5: the default group's collectives would time out first",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "message"), SILENT_SETTINGS, ids=[" ".join(a) for a, _ in SILENT_SETTINGS])
def test_a_setting_without_effect_or_sense_is_refused_before_any_process_group(
    tmp_path, no_process_group, argv, message
):
    with pytest.raises(ValueError, match=re.escape(message)):
        _parse(["--output_dir", str(tmp_path), *argv])


SHORT_RUNS = [
    (
        ["--co2_local_steps", "10000", "--max_steps", "5"],
        "co2_local_steps=10000 with max_steps=5 and co2_sync_warmup_steps=0: no round completes before the end "
        "(the first would end after step 10000)",
    ),
    (
        ["--co2_local_steps", "4", "--co2_sync_warmup_steps", "3", "--max_steps", "6"],
        "co2_local_steps=4 with max_steps=6 and co2_sync_warmup_steps=3: no round completes",
    ),
    (
        ["--co2_sync_warmup_steps", "5", "--max_steps", "3"],
        "co2_sync_warmup_steps=5 >= max_steps=3: the whole run is plain data parallel",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "message"), SHORT_RUNS, ids=[" ".join(a) for a, _ in SHORT_RUNS])
def test_a_run_too_short_for_a_round_is_accepted_with_one_warning(tmp_path, caplog, argv, message):
    """The plain Trainer's short runs (max_steps=3 at the default tau) stay valid: the run is data
    parallel, or one partial round that finalize() averages; CO2 says so once, naming the flags."""
    with caplog.at_level(logging.WARNING, logger="co2_hf.integrations.arguments"):
        (args,) = _parse(["--output_dir", str(tmp_path), *argv])
    said = [r.getMessage() for r in caplog.records if message in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert args.max_steps == int(argv[-1])


@pytest.mark.timeout(60)
def test_a_run_long_enough_for_a_round_and_a_matching_timeout_say_nothing(tmp_path, caplog):
    """The edges: a round completes on the last step, the warm-up ends before it, and ddp_timeout
    equals co2_timeout_s; with epochs the length is not known yet, so nothing is said."""
    argv = ["--co2_local_steps", "4", "--co2_sync_warmup_steps", "2", "--max_steps", "6"]
    with caplog.at_level(logging.WARNING, logger="co2_hf.integrations.arguments"):
        (args,) = _parse(["--output_dir", str(tmp_path), *argv, "--co2_timeout_s", "5", "--ddp_timeout", "5"])
        (epochs,) = _parse(["--output_dir", str(tmp_path), "--co2_local_steps", "10000"])
    assert (args.co2_local_steps, args.max_steps, args.ddp_timeout) == (4, 6, 5)
    assert epochs.max_steps == -1
    assert "no round completes" not in caplog.text and "plain data parallel" not in caplog.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "env", "message"), BAD_COMBINATIONS, ids=[m[:28] for _, _, m in BAD_COMBINATIONS])
def test_unsupported_combinations_are_refused_before_any_process_group(tmp_path, no_process_group, argv, env, message):
    argv = [str(tmp_path / "missing.json") if a == "{missing}" else a for a in argv]
    for key, value in env.items():
        no_process_group.setenv(key, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        _parse(["--output_dir", str(tmp_path), *argv])


@pytest.mark.timeout(60)
def test_a_valid_launch_reaches_the_process_group(tmp_path, no_process_group):
    """The probe above works: a valid 2-process launch gets as far as creating the group."""
    with pytest.raises(AssertionError, match="process group was created"):
        _parse(["--output_dir", str(tmp_path), "--co2_local_steps", "4"])


@pytest.mark.timeout(60)
def test_ddp_timeout_follows_co2_timeout_unless_set(tmp_path):
    (args,) = _parse(["--output_dir", str(tmp_path), "--co2_timeout_s", "41.5"])
    assert args.ddp_timeout == 42
    (args,) = _parse(["--output_dir", str(tmp_path), "--co2_timeout_s", "41.5", "--ddp_timeout", "70"])
    assert args.ddp_timeout == 70
    (args,) = _parse(["--output_dir", str(tmp_path), "--co2_enabled", "false"])
    assert args.ddp_timeout == 1800  # the Trainer's own default


# ---------------------------------------------------------------- 2. a non-finite worker


@pytest.fixture(scope="module")
def nan_runs():
    outcomes = run_with_faults(nan_suite, 2, timeout_s=90, preload=HF_PRELOAD)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None and outcome["ok"], (rank, outcome and outcome.get("error"))
    return [o["result"] for o in outcomes]


@pytest.mark.slow
@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
def test_a_nan_worker_sends_nothing_and_D_is_the_other_workers_outer_gradient(nan_runs):
    first, second = (r["one"] for r in nan_runs)
    q, n = NAN_STEP // TAU, first["payload"]  # round 2 ended with rank 1 poisoned for two steps
    assert torch.count_nonzero(second["sent"][q][:n]) == 0 and second["sent"][q][n] == 0  # zeros, weight 0
    assert first["sent"][q][n] == 1
    for result in (first, second):
        assert result["summed"][q - 1][n] == 2  # a normal round: both weights
        assert result["summed"][q][n] == 1  # D = the mean over the one finite worker...
        assert torch.equal(result["summed"][q][:n], first["sent"][q][:n])  # ...which is its d, exactly
        assert result["skipped_rounds"] == 0
    assert any("non-finite outer gradient at round 2" in m for m in second["warnings"]), second["warnings"]


@pytest.mark.slow
@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
def test_after_a_nan_worker_anchors_stay_finite_and_equal_and_the_loss_keeps_falling(nan_runs):
    first, second = (r["one"] for r in nan_runs)
    assert len(first["anchors"]) == len(second["anchors"]) == 9
    for a, b in zip(first["anchors"], second["anchors"]):
        for name, value in a.items():
            assert torch.isfinite(value).all() and torch.equal(value, b[name]), name
    q = NAN_STEP // TAU
    restarted = second["after_quarantine"]
    assert restarted["optimizer_state"] == 0  # its poisoned Adam moments were dropped
    for name, value in first["anchors"][q].items():  # and it restarted from the new anchor
        assert torch.equal(restarted["live"][name], value), name
    losses = torch.tensor([first["losses"], second["losses"]]).mean(0)
    assert torch.isfinite(losses[(q + 1) * TAU :]).all()
    just_after = losses[(q + 1) * TAU : (q + 2) * TAU].mean()
    three_rounds_later = losses[(q + 4) * TAU : (q + 5) * TAU].mean()
    assert three_rounds_later < 0.8 * just_after, (float(just_after), float(three_rounds_later))


@pytest.mark.slow
@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
def test_when_no_worker_is_finite_the_update_is_skipped_then_training_stops(nan_runs):
    first, second = (r["none"] for r in nan_runs)
    for result in (first, second):
        assert [skipped for _, skipped in result["anchors"]] == [0, 0, 1]
        kept, after_skip = result["anchors"][1][0], result["anchors"][2][0]
        assert all(torch.equal(kept[k], after_skip[k]) for k in kept)  # the skipped round left it alone
        assert "co2_max_skipped_rounds=2" in result["error"]
    assert all(torch.equal(v, second["anchors"][2][0][k]) for k, v in first["anchors"][2][0].items())


@pytest.mark.timeout(30)
def test_a_timeout_shorter_than_two_rounds_warns_once(caplog):
    model = torch.nn.Linear(4, 4)
    comm = FakeCommunicator(delay_s=0.55)  # each outer all-reduce takes 0.55 s: two take more than the timeout
    co2 = CO2(model, CO2Config(co2_local_steps=1, co2_timeout_s=1.0), communicator=comm)
    with caplog.at_level(logging.WARNING, logger="co2_hf.core.co2"):
        for _ in range(6):
            co2.step()
    warnings = [r.getMessage() for r in caplog.records if "co2_timeout_s=1s is shorter" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    quiet = CO2(model, CO2Config(co2_local_steps=1, co2_timeout_s=60), communicator=FakeCommunicator(delay_s=0.1))
    caplog.clear()
    for _ in range(6):
        quiet.step()
    assert "is shorter" not in caplog.text


# ---------------------------------------------------------------- 3. dead or frozen peers


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    markers = str(tmp_path_factory.mktemp("faults"))
    survivors = list(range(0, 2 * len(FAULTS), 2))
    world = 2 * len(FAULTS)
    outcomes = run_with_faults(peer_faults, world, markers, wait_for=survivors, timeout_s=90, preload=HF_PRELOAD)
    return {FAULTS[r // 2]: outcomes[r] for r in survivors}


@pytest.mark.slow
@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
@pytest.mark.parametrize(("signame", "when", "wire"), FAULTS, ids=[f"{s}-{w}-{c}" for s, w, c in FAULTS])
def test_a_dead_or_frozen_peer_stops_the_other_rank_with_co2s_error(fault_runs, signame, when, wire):
    outcome = fault_runs[(signame, when, wire)]
    assert outcome is not None and outcome["ok"], outcome
    result = outcome["result"]
    assert result["fault"]["in_flight"] is (when == "in_flight")  # the all-reduce the peer died in
    failed_round = 1 if when == "in_flight" else 2
    assert f"CO2's outer all-reduce of round {failed_round} failed" in result["error"], result["error"]
    assert f"co2_timeout_s={FAULT_TIMEOUT_S}s" in result["error"]
    assert result["blocked_s"] <= FAULT_TIMEOUT_S + SLACK_S, result
    if signame == "SIGKILL":  # the transport sees the peer's connection close at once
        assert result["blocked_s"] < 1.0, result
    else:  # a frozen peer keeps its connection open: only the timeout can tell
        assert result["blocked_s"] >= FAULT_TIMEOUT_S - SLACK_S, result


# ---------------------------------------------------------------- 4 and 5. killed saves, kill-and-resume

SOAK_FAULTS = [  # a save killed after every file was written, before its manifest; then a frozen peer
    {"rank": 0, "signal": "SIGKILL", "where": "publish", "step": 20},
    {"rank": 1, "signal": "SIGSTOP", "where": "step", "step": 27},
]
SOAK_TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def soaked(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("soak"))
    return out, soak.soak(out, steps=40, faults=SOAK_FAULTS, save_steps=10, timeout_s=SOAK_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.research
@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
def test_a_save_killed_halfway_is_never_visible_and_resume_takes_the_last_complete(soaked):
    _, result = soaked
    killed_in_save, frozen = result["cycles"]
    assert killed_in_save["visible_checkpoints"] == ["checkpoint-10"]  # not the half-written 20
    assert killed_in_save["staged_leftovers"] == ["checkpoint-20"]
    assert frozen["resumed_from"] == 10
    assert killed_in_save["survivor_stopped_after_s"] < SOAK_TIMEOUT_S + SLACK_S


@pytest.mark.slow
@pytest.mark.research
@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
def test_a_frozen_peer_stops_the_trainer_within_the_timeout(soaked):
    _, result = soaked
    frozen = result["cycles"][1]
    assert frozen["survivor_stopped_after_s"] < SOAK_TIMEOUT_S + SLACK_S, frozen  # ddp_timeout followed


@pytest.mark.slow
@pytest.mark.research
@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
def test_short_soak_ends_bit_identical_to_an_uninterrupted_run(soaked):
    out, result = soaked
    assert result["final_resumed"] and result["ranks_agree"]
    assert result["tensors_differing"] == [] and result["max_abs_diff"] == 0.0
    assert not os.path.exists(os.path.join(out, "faulted", publish.STAGING_DIR))  # cleared by later saves


@pytest.mark.slow
@pytest.mark.research
@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
def test_incomplete_or_mismatched_checkpoints_are_refused(soaked, tmp_path):
    out, _ = soaked
    complete = os.path.join(out, "faulted", "checkpoint-40")
    rank_files.check_complete(complete, 1, 2, step=40)
    cases = {
        "no manifest": (lambda d: os.remove(os.path.join(d, MANIFEST_FILE)), "has no co2_manifest.json"),
        "truncated": (lambda d: _truncate(os.path.join(d, "co2_rank1.pt")), "co2_rank1.pt has 10 bytes"),
        "missing file": (lambda d: os.remove(os.path.join(d, "optimizer.pt")), "optimizer.pt is missing"),
        "other rank": (lambda d: _drop_rank(d, "1"), "holds the CO2 state of ranks [0] only"),
    }
    for name, (damage, message) in cases.items():
        folder = str(tmp_path / name.replace(" ", "_"))
        shutil.copytree(complete, folder)
        damage(folder)
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            rank_files.read_rank_state(folder, 1, 2)
    with pytest.raises(ValueError, match="saved by 2 processes and this run has 3"):
        rank_files.check_complete(complete, 0, 3)
    with pytest.raises(ValueError, match="mixes steps"):
        rank_files.check_complete(complete, 0, 2, step=30)


# each damaged file, and the rank that reads it on resume (the other ranks' files are their own ranks' to verify)
CORRUPTED = {
    "co2_rank1.pt": 1,
    "co2_rank0.pt": 0,
    "model.safetensors": 1,
    "optimizer.pt": 1,
    "scheduler.pt": 1,
    "trainer_state.json": 1,
    "rng_state_1.pth": 1,
}


@pytest.mark.slow
@pytest.mark.research
@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
def test_a_same_size_corruption_of_any_checkpoint_file_is_refused_naming_it(soaked, tmp_path):
    out, _ = soaked
    complete = os.path.join(out, "faulted", "checkpoint-40")
    manifest = rank_files.check_complete(complete, 1, 2, step=40)
    assert manifest["format"] == 2 and set(CORRUPTED) <= set(manifest["files"])
    for name, reader in CORRUPTED.items():
        folder = str(tmp_path / name)
        shutil.copytree(complete, folder)
        corrupt(os.path.join(folder, name))
        expected = manifest["files"][name]["sha256"]
        found = rf"{re.escape(name)} has sha256 [0-9a-f]{{64}} but its co2_manifest.json says {expected}"
        with pytest.raises(ValueError, match=rf"{re.escape(folder)} is corrupted: {found}"):
            rank_files.read_rank_state(folder, reader, 2)
        if name == "co2_rank0.pt":  # rank 1 does not read it; in a run `agree` makes rank 1 refuse too
            rank_files.check_complete(folder, 1, 2)
    folder = str(tmp_path / "manifest")
    shutil.copytree(complete, folder)
    corrupt(os.path.join(folder, MANIFEST_FILE))
    with pytest.raises(ValueError, match="is corrupted: its co2_manifest.json is not valid JSON"):
        rank_files.read_rank_state(folder, 1, 2)


@pytest.mark.slow
@pytest.mark.research
@pytest.mark.timeout(SHARED_RUNS_TIMEOUT_S)
def test_a_manifest_without_checksums_is_refused(soaked, tmp_path):
    """Format 1 (sizes only, saved before checksums) cannot say whether its files are the ones saved:
    refused, saying what to do, never read with hashing turned off."""
    out, _ = soaked
    folder = str(tmp_path / "format1")
    shutil.copytree(os.path.join(out, "faulted", "checkpoint-40"), folder)
    path = os.path.join(folder, MANIFEST_FILE)
    with open(path) as f:
        manifest = json.load(f)
    manifest.update(format=1, files={name: entry["bytes"] for name, entry in manifest["files"].items()})
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match="format 1 lists sizes without checksums.*from_pretrained"):
        rank_files.read_rank_state(folder, 0, 2)


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(10)


def _drop_rank(folder: str, rank: str) -> None:
    path = os.path.join(folder, MANIFEST_FILE)
    with open(path) as f:
        manifest = json.load(f)
    del manifest["ranks"][rank]
    with open(path, "w") as f:
        json.dump(manifest, f)


@pytest.mark.timeout(60)
def test_trainer_refuses_a_copied_staging_folder_and_keeps_best_and_rotation_right(tmp_path):
    """One process: the best checkpoint is recorded under its final name (not the staging one),
    rotation keeps it, and a folder without a manifest is refused before training."""
    from trainer_workers import dataset, make_args, tiny_gpt2
    from transformers.trainer_utils import get_last_checkpoint

    from co2_hf import CO2Trainer

    args = dict(save_strategy="steps", save_steps=4, eval_strategy="steps", eval_steps=4, save_total_limit=2)
    best = dict(load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)  # best: step 4
    trainer = CO2Trainer(
        model=tiny_gpt2(),
        args=make_args(str(tmp_path), **args, **best),
        train_dataset=dataset(),
        eval_dataset=dataset(16, seed=1),
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-4"]
    with open(tmp_path / "checkpoint-12" / "trainer_state.json") as f:
        assert json.load(f)["best_model_checkpoint"] == str(tmp_path / "checkpoint-4")
    assert not (tmp_path / publish.STAGING_DIR).exists()
    copied = tmp_path / "checkpoint-13"
    shutil.copytree(tmp_path / "checkpoint-12", copied)
    os.remove(copied / MANIFEST_FILE)
    assert get_last_checkpoint(str(tmp_path)) == str(copied)
    again = CO2Trainer(model=tiny_gpt2(), args=make_args(str(tmp_path), max_steps=16), train_dataset=dataset())
    with pytest.raises(ValueError, match="checkpoint-13 is incomplete: it has no co2_manifest.json"):
        again.train(resume_from_checkpoint=True)


@pytest.mark.timeout(60)
def test_hub_push_from_a_checkpoint_uploads_the_published_folder(tmp_path, monkeypatch):
    import transformers.trainer as trainer_module
    from trainer_workers import dataset, make_args, tiny_gpt2

    from co2_hf import CO2Trainer

    uploads = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            return type("Url", (), {"repo_id": repo_id})()

        def upload_folder(self, *, folder_path, path_in_repo=None, **kwargs):
            uploads.append((path_in_repo, folder_path, sorted(os.listdir(folder_path))))
            return type("Done", (), {"done": lambda self: True, "is_done": lambda self: True})()

    monkeypatch.setattr(trainer_module, "hf_api", lambda: FakeApi())
    hub = dict(push_to_hub=True, hub_model_id="a/b", hub_strategy="checkpoint", hub_always_push=True)
    with pytest.warns(UserWarning, match="every rank's local parameters"):
        args = make_args(str(tmp_path), save_strategy="steps", save_steps=6, **hub)
    CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset()).train()
    pushed = [(folder, files) for path, folder, files in uploads if path == "last-checkpoint"]
    assert [folder for folder, _ in pushed] == [str(tmp_path / "checkpoint-6"), str(tmp_path / "checkpoint-12")]
    assert all(MANIFEST_FILE in files and "co2_rank0.pt" in files for _, files in pushed)


@pytest.mark.timeout(90)
def test_trainer_refuses_to_resume_from_a_corrupted_file_naming_it(tmp_path):
    """``resume_from_checkpoint`` with 8 bytes overwritten in the rank file, the model or the
    optimizer: refused before training, naming the file."""
    from trainer_workers import dataset, make_args, tiny_gpt2

    from co2_hf import CO2Trainer

    saved = make_args(str(tmp_path / "run"), max_steps=4, save_strategy="steps", save_steps=4)
    CO2Trainer(model=tiny_gpt2(), args=saved, train_dataset=dataset()).train()
    for name in ("co2_rank0.pt", "model.safetensors", "optimizer.pt"):
        folder = tmp_path / name
        shutil.copytree(tmp_path / "run" / "checkpoint-4", folder)
        corrupt(str(folder / name))
        args = make_args(str(tmp_path / "again"), max_steps=8)
        again = CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
        with pytest.raises(ValueError, match=rf"is corrupted: {re.escape(name)} has sha256"):
            again.train(resume_from_checkpoint=str(folder))
        assert again.state.global_step == 0 and again.co2 is None  # before CO2 or training started
    # a payload in the rank file, the manifest rewritten to match: refused before it runs
    from tampering import Payload, deflated, rehash, rewrite_manifest

    hostile, marker = tmp_path / "hostile", str(tmp_path / "code_ran")
    shutil.copytree(tmp_path / "run" / "checkpoint-4", hostile)
    torch.save({"co2": Payload(marker), "model": {}, "optimizer": None, "scaler": None}, hostile / "co2_rank0.pt")
    rewrite_manifest(str(hostile), rehash(str(hostile)))
    args = make_args(str(tmp_path / "again"), max_steps=8)
    again = CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
    with pytest.raises(ValueError, match="co2_rank0.pt holds something other than tensors"):
        again.train(resume_from_checkpoint=str(hostile))
    assert not os.path.exists(marker) and again.state.global_step == 0
    # the Trainer's own optimizer.pt deflate-compressed (the form of a zip bomb), its manifest rewritten:
    # refused before the Trainer reads it (torch.load would have inflated it)
    bomb = tmp_path / "bomb"
    shutil.copytree(tmp_path / "run" / "checkpoint-4", bomb)
    deflated(str(bomb / "optimizer.pt"))
    rewrite_manifest(str(bomb), rehash(str(bomb)))
    with pytest.raises(ValueError, match=r"bomb: optimizer.pt holds a compressed entry \("):
        again.train(resume_from_checkpoint=str(bomb))
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at .*no_such_folder: no such folder"):
        again.train(resume_from_checkpoint=str(tmp_path / "no_such_folder"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_full_disk_during_a_save_says_so_naming_the_folder_and_keeps_the_previous_checkpoint(tmp_path):
    """A real full disk: output_dir on a 1.7 MB tmpfs (in a user and mount namespace of its own), where
    checkpoint-2 (1.15 MB) fits and checkpoint-4 does not. The save used to fail with torch's
    ``[enforce fail at inline_container.cc:672] unexpected pos``."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f"""
from trainer_workers import dataset, make_args, tiny_gpt2
from co2_hf import CO2Trainer
from co2_hf.checkpoints import publish, rank_files
from co2_hf.checkpoints.manifest import MANIFEST_FILE
args = make_args({str(disk)!r}, max_steps=4, save_strategy="steps", save_steps=2)
try:
    CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset(64)).train()
except OSError as error:
    print("REFUSED:", error)
rank_files.check_shared({str(disk / "checkpoint-2")!r})
print("PREVIOUS:", sorted(p for p in __import__("os").listdir({str(disk)!r}) if p.startswith("checkpoint")))
"""
    mount = 'mount -t tmpfs -o size=1700k none "$0" && exec "$1" -c "$2"'
    command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, str(disk), sys.executable, script]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=100, cwd=os.path.dirname(__file__))
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if "mount" in done.stderr and "REFUSED" not in done.stdout:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {done.stderr[-300:]}")
    refused = [line for line in done.stdout.splitlines() if line.startswith("REFUSED:")]
    assert refused, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"CO2 could not save {disk / 'checkpoint-4'}: the disk that holds it is full" in refused[0]
    assert "Nothing was published: the previous checkpoints are untouched" in refused[0]
    assert "PREVIOUS: ['checkpoint-2']" in done.stdout, done.stdout[-2000:]
