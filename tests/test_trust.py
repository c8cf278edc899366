"""What a checkpoint from elsewhere, a shared folder or an unusual input can do to a run: nothing it
should not. The manifest validated before use, no unpickling of what a checkpoint holds, saves that
never delete or mix a user's files, durable publishing, and the settings that used to surprise users
(positional ``output_dir``, the default fragments on a tiny model, numpy integers, huge timeouts,
inline JSON, metrics at any logging interval). One process each; the multi-process sides are in
test_accelerate.py and test_trainer.py."""

from __future__ import annotations

import inspect
import io
import json
import logging
import os
import time

import pytest
import torch
from tampering import Payload, deflated, overlapping, pickle_bomb, rehash, rewrite_manifest
from workers import TinyNet, loss_on, make_optimizer

from co2_hf import CO2Config, CO2TrainingArguments
from co2_hf.checkpoints import agreement, bounded, config_file, publish, rank_files
from co2_hf.checkpoints.manifest import MANIFEST_FILE, read_manifest
from co2_hf.core import CO2
from co2_hf.testing import FakeCommunicator

pytestmark = pytest.mark.timeout(60)


RUN = "a" * 16  # the run the tests' saves belong to


def published(folder: str, files: dict[str, bytes], *, rank_state: dict | None = None, run: str = RUN) -> str:
    """A folder published through the real save path (one process): ``files`` and a rank file."""
    staging = publish.begin_save(folder, rank=0, leader=0, run=run)
    for name, data in files.items():
        with open(os.path.join(staging, name), "wb") as f:
            f.write(data)
    state = rank_state or {"co2": {}, "model": {}, "optimizer": None, "scaler": None}
    torch.save(state, rank_files.rank_file(staging, 0))
    publish.publish(staging, folder, rank=0, leader=0, world_size=1, step=4, own="co2_rank0.pt", run=run)
    return folder


# ---------------------------------------------------------------------- item 1: nothing is unpickled


def test_a_hostile_rank_file_with_a_matching_manifest_is_refused_before_it_runs(tmp_path):
    folder = published(str(tmp_path / "ckpt"), {"model.safetensors": b"weights"})
    marker = str(tmp_path / "code_ran")
    hostile = {"co2": Payload(marker), "model": {}, "optimizer": None, "scaler": None}
    torch.save(hostile, rank_files.rank_file(folder, 0))
    rewrite_manifest(folder, rehash(folder))
    rank_files.check_shared(folder)  # the manifest matches: checking for damage cannot tell
    refusal = r"co2_rank0.pt holds something other than tensors.*nothing in it was run"
    for check in (rank_files.check_complete, rank_files.read_rank_state):
        with pytest.raises(ValueError, match=refusal):
            check(folder, 0, 1)
    os.remove(os.path.join(folder, MANIFEST_FILE))  # a plain accelerator.save_state folder
    with pytest.raises(ValueError, match="co2_rank0.pt holds something other than tensors"):
        rank_files.read_rank_state(folder, 0, 1, require_manifest=False)
    assert not os.path.exists(marker)


def test_co2_files_never_load_with_weights_only_false():
    root = os.path.join(os.path.dirname(__file__), "..", "co2_hf")
    for base, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(base, name)) as f:
                    assert "weights_only=False" not in f.read(), name


# ---------------------------------------------------------------------- item 4: the manifest validated


MALFORMED = {
    "a list": (lambda m: [], "a JSON list, not an object"),
    "empty": (lambda m: {}, "no format, step, world_size, ranks, files"),
    "no files": (lambda m: {**m, "files": {}}, "files must be a non-empty object"),
    "format 1": (lambda m: {**m, "format": 1}, "format 1 lists sizes without checksums"),
    "format 3": (lambda m: {**m, "format": 3}, "format 3"),
    "no checksum": (lambda m: {**m, "files": {k: {"bytes": v["bytes"]} for k, v in m["files"].items()}}, "sha256"),
    "absolute": (lambda m: {**m, "files": {**m["files"], "/etc/hostname": m["files"]["a.bin"]}}, "not a relative"),
    "parent": (lambda m: {**m, "files": {**m["files"], "../a.bin": m["files"]["a.bin"]}}, "not a relative"),
    "inner parent": (lambda m: {**m, "files": {**m["files"], "x/../a.bin": m["files"]["a.bin"]}}, "not a relative"),
    "step": (lambda m: {**m, "step": "4"}, "step must be an integer"),
    "rank outside": (lambda m: {**m, "ranks": {"7": m["ranks"]["0"]}}, "rank '7' is not a rank of a world of 1"),
    "rank file unlisted": (
        lambda m: {**m, "ranks": {"0": {"file": "co2_rank0.pt", "bytes": 1}}},
        "is not among the files, with the same bytes",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_manifest_is_a_value_error_naming_the_problem(tmp_path, case):
    folder = published(str(tmp_path / "ckpt"), {"a.bin": b"abc"})
    change, message = MALFORMED[case]
    rewrite_manifest(folder, change)
    with pytest.raises(ValueError, match=f"co2_manifest.json.*{message}"):
        rank_files.read_rank_state(folder, 0, 1)


def test_listed_names_must_be_regular_files_of_the_folder(tmp_path):
    """A symbolic link (to /dev/zero: resume would hash forever), a file outside, a file added after
    the save: each refused naming it, before anything is hashed or loaded. (A name torch.load reads, such
    as a.bin, must also be a torch.save zip: test_only_torch_save_zips_that_cannot_expand_are_loaded.)"""
    for target, message in (("/dev/zero", "a.dat is a link to /dev/zero"), ("outside", "a.dat is a link to")):
        folder = published(str(tmp_path / f"ckpt_{target.strip('/').replace('/', '_')}"), {"a.dat": b"abc"})
        outside = str(tmp_path / "outside")
        with open(outside, "wb") as f:
            f.write(b"abc")
        os.remove(os.path.join(folder, "a.dat"))
        os.symlink(target if target.startswith("/") else outside, os.path.join(folder, "a.dat"))
        with pytest.raises(ValueError, match=message):
            rank_files.read_rank_state(folder, 0, 1)
    folder = published(str(tmp_path / "added"), {"a.dat": b"abc"})
    with open(os.path.join(folder, "optimizer.pt"), "wb") as f:
        f.write(b"planted")
    with pytest.raises(ValueError, match=r"has files its co2_manifest.json does not list \(optimizer.pt\)"):
        rank_files.read_rank_state(folder, 0, 1)
    os.makedirs(os.path.join(folder, ".cache"))  # a Hub download's own folder: never loaded, not refused
    os.remove(os.path.join(folder, "optimizer.pt"))
    with open(os.path.join(folder, ".cache", "x"), "w") as f:
        f.write("x")
    rank_files.read_rank_state(folder, 0, 1)


@pytest.mark.parametrize("kind", ["folder", "file", "nested"])
def test_a_link_the_manifest_does_not_list_is_refused_by_name(tmp_path, kind):
    """``extra -> /etc`` (a folder: os.walk does not enter it) used to be accepted; a linked file or
    a link inside a listed folder is refused by name too, before anything is hashed or loaded."""
    folder = published(str(tmp_path / "ckpt"), {"a.dat": b"abc"})
    name = {"folder": "extra", "file": "extra.json", "nested": "sub/extra"}[kind]
    os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
    os.symlink("/etc" if kind != "file" else "/etc/hostname", os.path.join(folder, name))
    with pytest.raises(ValueError, match=rf"checkpoint {folder}: {name} is a link to /etc.* does not list"):
        rank_files.check_shared(folder)
    with pytest.raises(ValueError, match=rf"CO2 will not save into {folder}: it holds files CO2 did not write"):
        publish.begin_save(folder, rank=0, leader=0, run=RUN)  # nor replaced: the link is not CO2's


def test_agree_turns_any_exception_into_the_same_value_error():
    def unreadable():
        raise PermissionError(13, "Permission denied", "/ckpt/co2_rank0.pt")

    with pytest.raises(ValueError, match=r"PermissionError: \[Errno 13\] Permission denied: '/ckpt/co2_rank0.pt'"):
        agreement.agree(unreadable)


def test_the_world_file_is_validated_after_the_manifest(tmp_path):
    folder = published(str(tmp_path / "ckpt"), {config_file.CONFIG_FILE: b'{"world_size": 2, "co2_worker_size": 0}'})
    with pytest.raises(ValueError, match="co2_config.json does not record a world"):
        config_file.saved_world(folder)
    broken = str(tmp_path / "broken")
    os.makedirs(broken)
    with open(os.path.join(broken, "trainer_state.json"), "w") as f:
        f.write("{")
    torch.save({}, rank_files.rank_file(broken, 0))
    with pytest.raises(ValueError, match="has no co2_manifest.json"):  # not a JSON error of another file
        rank_files.check_shared(broken)


# ---------------------------------------------------------------------- bounded JSON (issue 49, item 5)


def _saved_step(folder: str) -> int | None:
    from co2_hf.integrations.trainer_checkpoints import _saved_step

    return _saved_step(folder, read_manifest(folder)["step"])


# each JSON file CO2 reads from a checkpoint: how it is read (after the manifest, where it is not
# the manifest itself), and a content over its cap (the manifest's 16 MiB, the config's 64 KiB, the
# Trainer state's 1 MiB + 4 KiB per step: a 36 MB one took 1.43 GB per rank)
JSON_FILES = {
    MANIFEST_FILE: (rank_files.check_shared, b'{"pad": "' + b"x" * (16 << 20) + b'"}'),
    config_file.CONFIG_FILE: (config_file.saved_world, b'{"pad": "' + b"x" * (64 << 10) + b'"}'),
    "trainer_state.json": (_saved_step, b'{"global_step": 4, "log_history": [' + b"{}, " * (1 << 19) + b"{}]}"),
}
DEEP = b"[" * 30_000 + b"]" * 30_000  # 30 times the parser's recursion limit: a bare RecursionError, before


@pytest.mark.parametrize("content", ["oversize", "deep"])
@pytest.mark.parametrize("name", list(JSON_FILES))
def test_every_json_file_of_a_checkpoint_is_read_bounded_naming_file_and_checkpoint(tmp_path, name, content):
    folder = published(str(tmp_path / "ckpt"), {config_file.CONFIG_FILE: b"{}", "trainer_state.json": b"{}"})
    read, oversize = JSON_FILES[name]
    with open(os.path.join(folder, name), "wb") as f:
        f.write(oversize if content == "oversize" else DEEP)
    if name != MANIFEST_FILE:
        rewrite_manifest(folder, rehash(folder))  # the manifest made to match: it cannot tell
    with pytest.raises(ValueError) as info:
        read(folder)
    message = str(info.value)
    assert f"checkpoint {folder}: its {name} " in message, message
    expected = "more than it can need" if content == "oversize" else "nests deeper than 32 levels"
    assert expected in message, message


def test_a_trainer_state_with_a_key_trainerstate_lacks_is_refused_by_name_before_the_trainer_builds_it(tmp_path):
    """It used to end in a raw ``TypeError: TrainerState.__init__() got an unexpected keyword argument
    'junk'`` from the Trainer, after CO2's checks had passed."""
    first = _trainer_run(tmp_path, 4, every=4)
    first.train()
    folder = str(tmp_path / "checkpoint-4")
    path = os.path.join(folder, "trainer_state.json")
    with open(path) as f:
        state = json.load(f)
    with open(path, "w") as f:
        json.dump({**state, "junk": 1}, f)
    rewrite_manifest(folder, rehash(folder))
    with pytest.raises(ValueError) as info:
        _trainer_run(tmp_path, 4, every=4).train(resume_from_checkpoint=folder)
    message = str(info.value)
    assert f"checkpoint {folder}: its trainer_state.json holds 'junk', not fields of" in message, message


# ---------------------------------------------------------------------- bounded loads


@pytest.fixture
def no_torch_load(monkeypatch):
    """``torch.load`` fails the test: a refusal must come before anything is inflated or unpickled."""

    def reached(*args, **kwargs):
        raise AssertionError("torch.load was reached")

    monkeypatch.setattr(torch, "load", reached)


def test_a_zip_bomb_in_a_shared_file_is_refused_before_anything_is_inflated(tmp_path, no_torch_load):
    folder = published(str(tmp_path / "ckpt"), {"optimizer.pt": _torch_bytes({"state": {}, "param_groups": []})})
    optimizer = os.path.join(folder, "optimizer.pt")
    deflated(optimizer, inflate_to=256 << 20)  # 256 MiB of zeros after its pickle, deflated to 0.25 MB
    rewrite_manifest(folder, rehash(folder))
    assert os.path.getsize(optimizer) < 1 << 20
    start = time.perf_counter()
    expands = r"optimizer.pt holds a compressed entry \(archive/data.pkl: \d+ bytes that would expand to 2684"
    with pytest.raises(ValueError, match=expands):
        rank_files.check_shared(folder)
    assert time.perf_counter() - start < 1.0


def test_a_pickle_larger_than_its_entries_need_is_refused_before_it_is_read(tmp_path, no_torch_load):
    folder = published(str(tmp_path / "ckpt"), {"model.safetensors": b"w"})
    pickle_bomb(rank_files.rank_file(folder, 0), 3 << 20)  # stored: its size is what the manifest says
    rewrite_manifest(folder, rehash(folder))
    start = time.perf_counter()
    larger = r"co2_rank0.pt's pickle \(bomb/data.pkl\) is 3145728 bytes, more than the 1051648 the structure of 3"
    with pytest.raises(ValueError, match=larger):
        rank_files.check_complete(folder, 0, 1)
    assert time.perf_counter() - start < 1.0


def test_only_torch_save_zips_that_cannot_expand_are_loaded(tmp_path):
    real = tmp_path / "real.pt"
    real.write_bytes(_torch_bytes({"w": torch.ones(1000), "step": 4}))
    bounded.check_torch_file(str(real), where="here")  # what torch.save writes passes
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="here: legacy.pt is not a zip of torch.save"):
        bounded.check_torch_file(str(legacy), where="here")
    overlapping(str(real), copies=3)  # one tensor's bytes listed as three entries
    with pytest.raises(ValueError, match=r"here: real.pt's entries add up to \d+ bytes but the file holds"):
        bounded.check_torch_file(str(real), where="here")


def _torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------------- item 3: saves never delete


def test_a_save_never_replaces_a_folder_holding_files_co2_did_not_write(tmp_path):
    target = tmp_path / "run"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files CO2 did not write there \(notes.txt\)"):
        published(str(target), {"a.bin": b"abc"})
    assert (target / "notes.txt").read_text() == "mine" and sorted(os.listdir(target)) == ["notes.txt"]
    folder = published(str(tmp_path / "ckpt"), {"a.bin": b"abc"})  # a CO2 checkpoint is replaced whole ...
    published(folder, {"a.bin": b"new"})
    assert (tmp_path / "ckpt" / "a.bin").read_bytes() == b"new"
    (tmp_path / "ckpt" / "events.out").write_text("tensorboard")  # ... unless someone added to it
    with pytest.raises(ValueError, match=r"\(events.out\)"):
        published(folder, {"a.bin": b"newer"})
    assert (tmp_path / "ckpt" / "a.bin").read_bytes() == b"new"


def test_staging_is_unique_per_save_and_run_and_clears_only_this_runs_killed_saves(tmp_path):
    area = tmp_path / publish.STAGING_DIR
    other = area / f"ckpt.{'b' * 16}.{'0' * 16}" / "ckpt"
    other.mkdir(parents=True)
    (other / "half_written.bin").write_bytes(b"x")  # another run's save of the same folder, in progress
    older = area / f"ckpt.{'2' * 16}" / "ckpt"  # staged by a co2_hf that did not record runs: not ours
    older.mkdir(parents=True)
    killed = area / f"ckpt.{RUN}.{'1' * 16}" / "ckpt"
    killed.mkdir(parents=True)  # a killed save of this run: ours to clear
    seen = []
    original = publish.publish

    def spy(staging, final_dir, **kwargs):
        seen.append(staging)
        return original(staging, final_dir, **kwargs)

    publish.publish = spy
    try:
        published(str(tmp_path / "ckpt"), {"a.bin": b"a"})
        published(str(tmp_path / "ckpt"), {"a.bin": b"b"})
    finally:
        publish.publish = original
    assert len(set(seen)) == 2 and all(os.path.basename(os.path.dirname(s)).startswith(f"ckpt.{RUN}.") for s in seen)
    assert (other / "half_written.bin").exists() and older.exists() and not killed.exists()


def test_a_run_never_publishes_over_another_runs_checkpoint_and_names_both(tmp_path):
    """Run A stages checkpoint-8 while run B, in the same folder, saves checkpoint-4 (which A published):
    B is refused naming both runs, and neither B's start of a save nor its refusal touches A's work."""
    run_a, run_b = "a" * 16, "b" * 16
    ckpt4 = published(str(tmp_path / "checkpoint-4"), {"a.bin": b"A"}, run=run_a)
    staging_a = publish.begin_save(
        str(tmp_path / "checkpoint-8"), rank=0, leader=0, run=run_a, leftovers="checkpoint-*"
    )
    with open(os.path.join(staging_a, "a.bin"), "wb") as f:
        f.write(b"A, half written")
    refusal = rf"checkpoint-4: it is a checkpoint of another run \(run {run_a}, step 4\), and this is run {run_b}"
    with pytest.raises(ValueError, match=refusal):
        publish.begin_save(ckpt4, rank=0, leader=0, run=run_b, leftovers="checkpoint-*")
    staging_b = publish.begin_save(
        str(tmp_path / "checkpoint-12"), rank=0, leader=0, run=run_b, leftovers="checkpoint-*"
    )
    assert os.path.isdir(staging_a) and (tmp_path / "checkpoint-4" / "a.bin").read_bytes() == b"A"
    published(ckpt4, {"a.bin": b"A again"}, run=run_a)  # a re-save of the same run replaces it
    # B published checkpoint-8 while A was staging it: A's rename is refused in turn
    torch.save({"co2": {}, "model": {}, "optimizer": None, "scaler": None}, rank_files.rank_file(staging_b, 0))
    publish.publish(
        staging_b,
        str(tmp_path / "checkpoint-8"),
        rank=0,
        leader=0,
        world_size=1,
        step=8,
        own="co2_rank0.pt",
        run=run_b,
    )
    with pytest.raises(RuntimeError, match=rf"another run \(run {run_b}, step 8\), and this is run {run_a}"):
        publish.publish(
            staging_a, str(tmp_path / "checkpoint-8"), rank=0, leader=0, world_size=1, step=8, own="x", run=run_a
        )
    assert read_manifest(str(tmp_path / "checkpoint-8"))["run"] == run_b


def test_a_save_that_cannot_stage_says_why(tmp_path, monkeypatch):
    def read_only(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(publish.os, "makedirs", read_only)
    with pytest.raises(ValueError, match=r"CO2 cannot save .*ckpt: it writes a checkpoint into .*_co2_staging.*Make"):
        publish.begin_save(str(tmp_path / "ckpt"), rank=0, leader=0, run=RUN)
    monkeypatch.undo()
    (tmp_path / "mounted").mkdir()
    monkeypatch.setattr(publish.os.path, "ismount", lambda path: str(path).endswith("mounted"))
    with pytest.raises(ValueError, match="is a mount point"):
        publish.begin_save(str(tmp_path / "mounted"), rank=0, leader=0, run=RUN)


# ---------------------------------------------------------------------- item 5: durable before visible


def test_every_file_is_flushed_before_the_manifest_and_the_parent_after_the_rename(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src, dst):
        events.append(("rename", str(dst)))
        replace(src, dst)

    monkeypatch.setattr(publish.os, "fsync", recording_fsync)
    monkeypatch.setattr(publish.os, "replace", recording_replace)
    final = str(tmp_path / "ckpt")
    published(final, {"model.safetensors": b"w", "optimizer.pt": b"o"})
    manifest_at = next(i for i, (k, p) in enumerate(events) if k == "rename" and p.endswith(MANIFEST_FILE))
    for name in ("model.safetensors", "optimizer.pt", "co2_rank0.pt"):
        flushed_at = [i for i, (k, p) in enumerate(events) if k == "fsync" and p.endswith(name)]
        assert flushed_at and flushed_at[0] < manifest_at, (name, events)
    published_at = events.index(("rename", final))
    assert ("fsync", str(tmp_path)) in events[published_at:]  # the rename itself is on disk


# ---------------------------------------------------------------------- item 6: the Trainer's contract


def test_output_dir_is_the_first_positional_argument_as_with_training_arguments():
    from transformers import TrainingArguments

    args = CO2TrainingArguments("out", report_to="none", use_cpu=True)
    assert args.output_dir == "out" and args.co2_enabled is True
    ours = list(inspect.signature(CO2TrainingArguments).parameters.values())
    theirs = [p.name for p in inspect.signature(TrainingArguments).parameters.values()]
    assert [p.name for p in ours[: len(theirs)]] == theirs
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs) :])


def test_default_fragments_fit_a_model_smaller_than_tau_and_an_explicit_value_is_refused(caplog):
    tiny = torch.nn.Linear(1, 1)  # 2 elements: tau 12 would be 12 fragments
    with caplog.at_level(logging.WARNING, logger="co2_hf"):
        co2 = CO2(tiny, CO2Config(), communicator=FakeCommunicator())
    assert len(co2.fragments) == 2 and co2.config.co2_fragments == 2
    assert "co2_fragments is not set" in caplog.text and "using co2_fragments=2" in caplog.text
    optimizer = torch.optim.SGD(tiny.parameters(), lr=0.1)
    for _ in range(24):
        tiny(torch.ones(1, 1)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        co2.step()
    with pytest.raises(ValueError, match="co2_fragments=12 is more than the 2 elements"):
        CO2(torch.nn.Linear(1, 1), CO2Config(co2_fragments=12), communicator=FakeCommunicator())


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
    np = pytest.importorskip("numpy")
    config = CO2Config(co2_local_steps=np.int64(4), co2_outer_lr=np.float32(0.5), co2_fragments=np.int32(2))
    assert type(config.co2_local_steps) is int and type(config.co2_outer_lr) is float
    json.dumps(config.co2_dict())
    with pytest.raises(TypeError):
        CO2Config(4)  # keyword arguments only: a positional value would be taken for another setting


def test_inline_json_accelerator_config_is_read_as_training_arguments_reads_it(caplog):
    with caplog.at_level(logging.WARNING, logger="co2_hf"):
        args = CO2TrainingArguments(
            "out", report_to="none", use_cpu=True, accelerator_config='{"dispatch_batches": true}'
        )
    assert args.accelerator_config.dispatch_batches is True  # was FileNotFoundError
    assert "dispatch_batches=True applies to evaluation and prediction only" in caplog.text
    with pytest.raises(ValueError, match="neither inline JSON .* nor an existing JSON file"):
        CO2TrainingArguments("out", report_to="none", use_cpu=True, accelerator_config="no_such.json")


def test_the_single_worker_warning_names_a_launch_that_starts_several_processes_on_cpus(caplog, monkeypatch):
    from co2_hf.integrations import arguments

    monkeypatch.setattr(arguments.torch.accelerator, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="co2_hf"):
        CO2TrainingArguments("out", report_to="none", use_cpu=True)
    assert "torchrun --nproc_per_node N" in caplog.text and "cpu_2proc.yaml" in caplog.text


def test_accelerate_helper_refuses_a_dict_config_naming_co2config():
    from co2_hf import CO2Accelerate

    with pytest.raises(TypeError, match=r"takes a CO2Config, not a dict: pass config=CO2Config\("):
        CO2Accelerate(object(), torch.nn.Linear(1, 1), None, config={"co2_local_steps": 4})


# ---------------------------------------------------------------------- item 7: metrics at any interval


@pytest.mark.parametrize("every", [5, 7, 12])
def test_metrics_mean_the_same_at_any_logging_interval(every):
    """tau 12, 12 fragments, the penalty off: penalty_mean is exactly 1 and comm_s one round's
    (12 fragments of 2 ms each) whether or not the logging interval divides tau."""
    delay = 0.002
    model = TinyNet(seed=0)
    optimizer = make_optimizer(model)
    co2 = CO2(model, CO2Config(), optimizer=optimizer, communicator=FakeCommunicator(delay_s=delay))
    logged = []
    for step in range(36):
        optimizer.zero_grad()
        loss_on(model, 0, step).backward()
        optimizer.step()
        co2.step()
        if (step + 1) % every == 0:
            logged.append(co2.pop_metrics())
    windows = [m for m in logged if "co2/comm_s" in m]
    assert len(windows) >= 36 // every - 1
    for metrics in windows:
        assert metrics["co2/penalty_mean"] == 1.0
        assert metrics["co2/comm_s"] == pytest.approx(12 * delay, rel=1e-3)
        assert metrics["co2/comm_wait_s"] >= 0.0  # real sleeps: their length depends on the machine's load


def _trainer_run(tmp_path, steps: int, every: int, **overrides):
    from trainer_workers import dataset, make_args, tiny_gpt2

    from co2_hf import CO2Trainer

    args = make_args(str(tmp_path), max_steps=steps, save_strategy="steps", save_steps=every, **overrides)
    return CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset(64))


def test_a_second_live_run_in_an_output_dir_is_refused_before_it_trains_naming_the_first(tmp_path):
    """Run B starts while run A is saving checkpoint-8 into the same output_dir: B is refused at
    once (before training, naming A), A's save and checkpoints are untouched; a resume of A
    continues run A and may save over its checkpoints."""
    a, b, refused = _trainer_run(tmp_path, 8, every=4), _trainer_run(tmp_path, 4, every=2), []
    save_rank_file = a._save_rank_file

    def b_starts_meanwhile(staging: str) -> None:
        if a.state.global_step == 8:
            with pytest.raises(ValueError) as info:
                b.train()
            refused.append((str(info.value), b.state.global_step))
        save_rank_file(staging)

    a._save_rank_file = b_starts_meanwhile
    a.train()  # publishes checkpoint-8 although B tried to start in the middle of it
    run_a = read_manifest(str(tmp_path / "checkpoint-4"))["run"]
    assert read_manifest(str(tmp_path / "checkpoint-8"))["run"] == run_a
    message, b_steps = refused[0]
    assert f"another run is training into it now (run {run_a}, host " in message and b_steps == 0
    assert f"(this is run {b._co2_run})" in message and "own output_dir" in message
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-8"]  # the lease went with A
    resumed = _trainer_run(tmp_path, 8, every=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))  # saves checkpoint-8 again
    assert resumed._co2_run == run_a and not (tmp_path / publish.STAGING_DIR).exists()


def test_a_rerun_into_a_finished_runs_folder_replaces_its_checkpoints_as_the_trainer_does(tmp_path, caplog):
    """transformers' own tests train twice into one folder (``test_trainer_with_datasets``, ...): the
    second run's first save used to fail ("it is a checkpoint of another run"). Now it replaces the
    earlier run's checkpoint, and one WARNING at the start names the earlier run."""
    first = _trainer_run(tmp_path, 4, every=2)
    first.train()
    earlier = read_manifest(str(tmp_path / "checkpoint-4"))["run"]
    rerun = _trainer_run(tmp_path, 4, every=2)
    with caplog.at_level(logging.WARNING, logger="co2_hf"):
        rerun.train()
    assert rerun._co2_run != earlier
    assert {read_manifest(str(tmp_path / f"checkpoint-{s}"))["run"] for s in (2, 4)} == {rerun._co2_run}
    named = [r.message for r in caplog.records if "holds checkpoints of earlier runs" in r.message]
    assert len(named) == 1 and f"run {earlier}: checkpoint-2, checkpoint-4" in named[0]


def test_rotation_deletes_only_its_own_runs_checkpoints(tmp_path):
    """A run with save_total_limit=1 beside an earlier run's checkpoints: the Trainer's rotation
    (oldest first, whoever wrote them) used to delete the other run's checkpoint-4 and -8 too."""
    _trainer_run(tmp_path, 8, every=4).train()
    earlier = read_manifest(str(tmp_path / "checkpoint-4"))["run"]
    (tmp_path / "checkpoint-5").mkdir()  # a folder CO2 did not write: never deleted either
    limited = _trainer_run(tmp_path, 6, every=3, save_total_limit=1)
    limited.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-4",
        "checkpoint-5",
        "checkpoint-6",
        "checkpoint-8",
    ]
    assert read_manifest(str(tmp_path / "checkpoint-8"))["run"] == earlier
    assert read_manifest(str(tmp_path / "checkpoint-6"))["run"] == limited._co2_run


def test_the_lease_excludes_a_live_process_and_a_dead_ones_lease_is_free(tmp_path):
    """The lease is the kernel's lock: another process holding it refuses this one, naming it; once
    that process is killed (SIGKILL: no clean-up of its own) the folder is free again."""
    import subprocess
    import sys

    from co2_hf.checkpoints import lease

    holder = (
        "import sys, time; from co2_hf.checkpoints import lease; "
        f"held = lease.take({str(tmp_path)!r}, run='aaaaaaaaaaaaaaaa'); print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"run aaaaaaaaaaaaaaaa, host \S+, pid {proc.pid}, since "):
            lease.take(str(tmp_path), run="bbbbbbbbbbbbbbbb")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    held = lease.take(str(tmp_path), run="bbbbbbbbbbbbbbbb")  # the killed holder's file, reused
    assert held is not None and json.loads((tmp_path / lease.LEASE_FILE).read_text())["run"] == "bbbbbbbbbbbbbbbb"
    held.release()
    assert not (tmp_path / lease.LEASE_FILE).exists()
