"""CO2Accelerate: no collective during local steps, and save_state/load_state resume bit for bit."""

from __future__ import annotations

import json
import os

import pytest
import torch
from accelerate_workers import SAVE_AT, refused_loads, resumed, uninterrupted_and_stopped
from distributed import run_processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("accelerate") / "state")
    first = run_processes(uninterrupted_and_stopped, 2, out, timeout_s=150)
    return out, first, run_processes(resumed, 2, out, timeout_s=150)


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_no_collective_on_the_default_group_during_local_steps(runs):
    _, first, _ = runs
    for rank in (0, 1):
        full = first[rank]["full"]
        assert full["wrapped"] == "DistributedDataParallel"  # as accelerator.prepare made it
        assert full["local_collectives"] == [0] * 12


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_each_rank_saved_its_own_optimizer_state(runs):
    out, _, _ = runs
    states = [torch.load(os.path.join(out, f"co2_rank{r}.pt"), weights_only=True) for r in (0, 1)]
    moments = [s["optimizer"]["state"][0]["exp_avg"] for s in states]
    assert not torch.equal(moments[0], moments[1])  # the ranks' Adam moments differ
    assert torch.equal(states[0]["co2"]["anchor"], states[1]["co2"]["anchor"])


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_save_state_is_published_with_a_manifest_of_every_rank(runs):
    from co2_hf.checkpoints import publish, rank_files

    out, _, _ = runs
    manifest = rank_files.check_complete(out, 1, 2, step=SAVE_AT)
    assert sorted(manifest["ranks"]) == ["0", "1"] and "model.safetensors" in manifest["files"]
    assert not os.path.exists(os.path.join(os.path.dirname(out), publish.STAGING_DIR))


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_load_state_resumes_bit_for_bit(runs):
    _, first, final = runs
    for rank in (0, 1):
        for name, value in first[rank]["full"]["final"].items():
            assert torch.equal(final[rank]["final"][name], value), (rank, name)


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_saved_model_file_is_the_anchor(runs):
    from safetensors.torch import load_file

    out, _, _ = runs
    weights = load_file(os.path.join(out, "model.safetensors"))
    anchor = torch.load(os.path.join(out, "co2_rank0.pt"), weights_only=True)["co2"]["anchor"]
    key = next(k for k in weights if k.endswith("wte.weight"))
    assert torch.equal(weights[key].reshape(-1), anchor[: weights[key].numel()])
    assert SAVE_AT == 6
    pretrained = load_file(out + "_pretrained/model.safetensors")  # co2.save_pretrained, same step
    assert pretrained.keys() == weights.keys() and all(torch.equal(pretrained[k], weights[k]) for k in weights)
    assert os.path.exists(out + "_pretrained/co2_config.json") and os.path.exists(out + "_pretrained/README.md")


@pytest.mark.timeout(60)
def test_independent_replicas_are_refused(monkeypatch):
    """Accelerator() without cpu=True on a GPU-less machine: each launched process trains alone."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from co2_hf import CO2Config
    from co2_hf.integrations.accelerate import _check_launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    alone = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO)
    with pytest.raises(RuntimeError, match=r"Accelerator\(cpu=True\)"):
        _check_launch(alone, CO2Config())
    deepspeed = SimpleNamespace(num_processes=2, distributed_type=DistributedType.DEEPSPEED)
    with pytest.raises(ValueError, match="does not support Accelerate's DEEPSPEED"):
        _check_launch(deepspeed, CO2Config())
    fsdp = SimpleNamespace(num_processes=2, distributed_type=DistributedType.FSDP)
    refusal = r"FSDP: it shards across every process.*worker_mesh\(k, timeout_s=co2_timeout_s\)"
    with pytest.raises(ValueError, match=refusal):
        _check_launch(fsdp, CO2Config())


@pytest.mark.timeout(60)
def test_training_arguments_use_the_cpu_when_launched_without_an_accelerator(monkeypatch):
    from types import SimpleNamespace

    from co2_hf.integrations.arguments import _use_cpu_without_accelerator

    monkeypatch.setenv("WORLD_SIZE", "2")
    args = SimpleNamespace(use_cpu=False)
    _use_cpu_without_accelerator(args)
    assert args.use_cpu is (not torch.accelerator.is_available())


class _OneProcess:
    """What CO2Accelerate uses of an Accelerator, for one process without process groups."""

    num_processes, process_index, is_main_process = 1, 0, True
    optimizer_step_was_skipped, scaler = False, None

    def __init__(self):
        from accelerate.utils import DistributedType

        self._custom_objects = []

        self.distributed_type = DistributedType.NO
        self.hooks = []

    def unwrap_model(self, model):
        return model

    def register_save_state_pre_hook(self, hook):
        from types import SimpleNamespace

        self.hooks.append(hook)
        return SimpleNamespace(remove=lambda: self.hooks.remove(hook))

    register_load_state_pre_hook = register_save_state_pre_hook

    def register_for_checkpointing(self, obj):
        self._custom_objects.append(obj)

    def wait_for_everyone(self):
        pass


def _one_step(model, optimizer, co2) -> None:
    tokens = torch.arange(16)[None] % 64
    model(input_ids=tokens, labels=tokens).loss.backward()
    co2.average_gradients()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["enabled=False", "co2_enabled=False"])
def test_disabled_is_a_pass_through_for_the_baseline(tmp_path, how):
    from trainer_workers import tiny_gpt2

    from co2_hf import CO2Accelerate, CO2Config

    accelerator, model = _OneProcess(), tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config, enabled = (CO2Config(), False) if how == "enabled=False" else (CO2Config(co2_enabled=False), True)
    with CO2Accelerate(accelerator, model, optimizer, config=config, enabled=enabled) as co2:
        for _ in range(3):
            _one_step(model, optimizer, co2)
            assert co2.step() is False and co2.pop_metrics() == {}
        assert co2.anchor_state().keys() == model.state_dict().keys()
    assert co2.co2 is None and accelerator.hooks == []  # no CO2 state, no checkpoint hooks
    co2.save_pretrained(str(tmp_path), dataset="a test sequence")
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "co2_config.json").exists()
    assert "trained from scratch on a test sequence" in (tmp_path / "README.md").read_text()


@pytest.mark.timeout(60)
def test_save_pretrained_of_a_plain_module_writes_safetensors_of_the_anchor(tmp_path):
    from huggingface_hub import ModelCard
    from safetensors.torch import load_file

    from co2_hf import CO2Accelerate, CO2Config

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CO2Accelerate(_OneProcess(), model, optimizer, config=CO2Config(co2_local_steps=4)) as co2:
        for _ in range(3):  # inside a round: the live weights have moved off the anchor
            model(torch.randn(2, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            co2.step()
        anchor = {k: v.clone() for k, v in co2.anchor_state().items()}
        live = model[0].weight.detach().clone()
        co2.save_pretrained(str(tmp_path / "mid"), dataset="random vectors")
    saved = load_file(tmp_path / "mid" / "model.safetensors")
    assert saved.keys() == anchor.keys() and all(torch.equal(saved[k], anchor[k]) for k in anchor)
    assert not torch.equal(saved["0.weight"], live)  # the anchor, not the live weights
    card = ModelCard.load(tmp_path / "mid" / "README.md")
    assert card.data.library_name == "pytorch" and card.data.co2["co2_local_steps"] == 4
    assert (tmp_path / "mid" / "co2_config.json").exists()


@pytest.mark.timeout(60)
def test_one_process_warns_and_an_exception_skips_the_collective_finalize(tmp_path, caplog):
    from huggingface_hub import ModelCard
    from trainer_workers import tiny_gpt2

    from co2_hf import CO2Accelerate, CO2Config

    accelerator, model = _OneProcess(), tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with caplog.at_level("WARNING", logger="co2_hf"):
        co2 = CO2Accelerate(accelerator, model, optimizer, config=CO2Config(co2_local_steps=2))
    assert "nobody to average with" in caplog.text
    finalized = []
    co2.co2.finalize = lambda: finalized.append(True)  # the collective that must not run
    with pytest.raises(KeyError), caplog.at_level("WARNING", logger="co2_hf"):
        with co2:
            _one_step(model, optimizer, co2)
            co2.step()
            raise KeyError("a bug in the loop")
    assert finalized == [] and "leaving on KeyError without finalize" in caplog.text
    assert accelerator.hooks == []  # the hooks are removed all the same
    co2.save_pretrained(str(tmp_path), base_model="openai-community/gpt2", license="mit")
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model == "openai-community/gpt2" and card.data.license == "mit"
    assert card.data.pipeline_tag == "text-generation" and card.data.co2["world_size"] == 1
    assert json.loads((tmp_path / "co2_config.json").read_text())["co2_local_steps"] == 2


@pytest.mark.timeout(60)
def test_objects_registered_for_checkpointing_are_refused_naming_them(tmp_path):
    """Accelerate loads a registered object's file with weights_only=False: a payload swapped into
    custom_checkpoint_0.pkl (its manifest rewritten to match) would run in load_state. CO2Accelerate refuses
    such objects, whenever they were registered, before anything is saved or loaded."""
    from trainer_workers import tiny_gpt2

    from co2_hf import CO2Accelerate, CO2Config

    class Counter:
        def state_dict(self):
            return {"n": 1}

        def load_state_dict(self, state):
            pass

    accelerator, model = _OneProcess(), tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator.register_for_checkpointing(Counter())
    refusal = r"1 object\(s\) are registered with accelerator.register_for_checkpointing \(Counter\).*weights_only off"
    with pytest.raises(ValueError, match="CO2Accelerate: " + refusal):
        CO2Accelerate(accelerator, model, optimizer, config=CO2Config(co2_local_steps=2))
    accelerator._custom_objects.clear()
    with CO2Accelerate(accelerator, model, optimizer, config=CO2Config(co2_local_steps=2)) as co2:
        accelerator.register_for_checkpointing(Counter())  # after construction
        for method in ("save_state", "load_state"):
            with pytest.raises(ValueError, match=f"CO2Accelerate.{method}: " + refusal):
                getattr(co2, method)(str(tmp_path / "ckpt"))
    assert not os.listdir(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_accelerate_loop_recipe_runs_the_baseline(tmp_path):
    """recipes/accelerate_loop.py --co2_enabled false (it used to crash in CO2's constructor)."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "recipes", "accelerate_loop.py")
    flags = ["--co2_enabled", "false", "--max_steps", "2", "--log_every", "1", "--output_dir", str(tmp_path)]
    done = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "co2_enabled=False" in done.stdout and "step 2: loss" in done.stdout
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "co2_config.json").exists()


@pytest.fixture(scope="module")
def refusals(runs, tmp_path_factory):
    """Damaged and hostile copies of the saved folder, loaded on 2 processes (`refused_loads`)."""
    import shutil

    from reliability_workers import corrupt
    from tampering import Payload, rehash, rewrite_manifest

    out, _, _ = runs
    root = tmp_path_factory.mktemp("refusals")
    folders = root / "folders"
    for name in DAMAGED:
        shutil.copytree(out, folders / name)
        corrupt(str(folders / name / name))
    for case, name in HOSTILE.items():  # a payload, with the manifest rewritten to match it
        folder = folders / case
        shutil.copytree(out, folder)
        if name == "co2_rank1.pt":
            torch.save(
                {"co2": Payload(str(root / "code_ran")), "model": {}, "optimizer": None, "scaler": None}, folder / name
            )
        else:
            torch.save(Payload(str(root / "code_ran")), folder / name)
        rewrite_manifest(str(folder), rehash(str(folder)))
        if name not in json.loads((folder / "co2_manifest.json").read_text())["files"]:
            rewrite_manifest(str(folder), _list(name, str(folder)))
    (root / "users").mkdir()
    (root / "users" / "notes.txt").write_text("mine")
    ranks = run_processes(refused_loads, 2, str(folders), timeout_s=150)
    return root, ranks


DAMAGED = ["co2_rank1.pt", "model.safetensors", "optimizer.bin"]
# accelerate's custom-object file (loaded with weights_only off, were an object registered) and a rank file
HOSTILE = {"hostile_custom_object": "custom_checkpoint_0.pkl", "hostile_rank_file": "co2_rank1.pt"}


def _list(name: str, folder: str):
    from co2_hf.checkpoints.manifest import file_checksum

    def change(manifest):
        path = os.path.join(folder, name)
        manifest["files"][name] = {"bytes": os.path.getsize(path), "sha256": file_checksum(path)}
        return manifest

    return change


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_load_state_refuses_a_same_size_corruption_naming_the_file_on_every_rank(refusals):
    """8 bytes overwritten in the middle of a rank file, the model or the optimizer: every rank
    refuses before Accelerate loads anything (rank 0 says rank 1 refused its own file)."""
    _, ranks = refusals
    for rank, result in enumerate(ranks):
        assert result["untouched"], rank
        for name in DAMAGED:
            error = result["errors"][name]
            assert error is not None and f"is corrupted: {name} has sha256" in error, (rank, name, error)
    assert ranks[0]["errors"]["co2_rank1.pt"].startswith("rank 1 refused the checkpoint: ")


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_nothing_in_a_hostile_checkpoint_runs(runs, refusals):
    """No custom-object pickle is written or read; a rank file carrying a payload, with a manifest
    rewritten to match, is refused on every rank naming it, before the payload runs."""
    out, _, _ = runs
    root, ranks = refusals
    assert not [n for n in os.listdir(out) if n.startswith("custom_checkpoint")]
    for rank, result in enumerate(ranks):
        # a custom-object file is never opened: refused, as no object is registered
        assert (
            "1 custom-object file(s) (custom_checkpoint_0.pkl) and 0 object(s) are registered"
            in (result["errors"]["hostile_custom_object"])
        ), rank
        error = result["errors"]["hostile_rank_file"]
        assert "co2_rank1.pt holds something other than tensors" in error, (rank, error)
        assert "co2.load_state" in result["refused"]["plain_load_state"], rank
    assert not (root / "code_ran").exists()


@pytest.mark.slow
@pytest.mark.timeout(320)
def test_refusals_reach_every_rank_at_once(refusals):
    root, ranks = refusals
    for rank, result in enumerate(ranks):
        refused = result["refused"]
        assert "holds files CO2 did not write there (notes.txt)" in refused["save_into_users_folder"], rank
        assert "OSError: [Errno 5] Input/output error: 'co2_rank1.pt'" in refused["one_rank_oserror"], rank
        assert "from different steps (rank 0: step 6, rank 1: step 7)" in refused["different_steps"], rank
        assert "save_state after its with block" in refused["save_after_the_block"], rank
    assert os.listdir(root / "users") == ["notes.txt"]


@pytest.mark.timeout(90)
def test_a_random_states_file_accelerate_drops_is_refused_naming_it(tmp_path, monkeypatch):
    """Accelerate loads random_states_0.pkl safely, but one it cannot apply (a torch.save zip of other
    data, its manifest rewritten to match) it dropped with an INFO line, and the resume went on no
    longer bit for bit: refused, naming the file and the checkpoint. An untampered one loads."""
    from accelerate import Accelerator
    from accelerate.utils import load
    from tampering import rehash, rewrite_manifest
    from trainer_workers import tiny_gpt2

    from co2_hf import CO2Accelerate, CO2Config

    monkeypatch.chdir(tmp_path)
    accelerator, model = Accelerator(cpu=True), tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CO2Accelerate(accelerator, model, optimizer, config=CO2Config(co2_local_steps=2)) as co2:
        _one_step(model, optimizer, co2)
        co2.step()
        co2.save_state("ckpt")
        saved = torch.get_rng_state()
        torch.rand(3)  # the RNG moves on; load_state must bring it back
        co2.load_state("ckpt")
        assert torch.equal(torch.get_rng_state(), saved)
        states = load("ckpt/random_states_0.pkl")  # weights_only, as Accelerate reads it
        bad = ({"junk": 1}, {**states, "random_state": (3, (1, 2), None)}, {**states, "numpy_random_seed": ("x",)})
        for tampered in bad:
            torch.save(tampered, "ckpt/random_states_0.pkl")
            rewrite_manifest("ckpt", rehash("ckpt"))
            torch.rand(3)  # as training would, between the save and the resume
            refusal = "checkpoint ckpt: random_states_0.pkl was not applied by accelerator.load_state"
            with pytest.raises(ValueError, match=refusal + r".*not be bit for bit"):
                co2.load_state("ckpt")


@pytest.mark.timeout(90)
def test_a_rerun_replaces_a_finished_runs_save_and_a_live_run_saving_there_is_refused(tmp_path, monkeypatch):
    """As ``accelerator.save_state`` does, a rerun of a script saves over the folder a finished run
    left (it used to be refused: "a checkpoint of another run"); while a run is alive (its block
    open), another run's save beside it is refused, naming the live run."""
    from accelerate import Accelerator
    from trainer_workers import tiny_gpt2

    from co2_hf import CO2Accelerate, CO2Config
    from co2_hf.checkpoints.manifest import read_manifest

    monkeypatch.chdir(tmp_path)

    def run() -> tuple[CO2Accelerate, torch.nn.Module, torch.optim.Optimizer]:
        accelerator, model = Accelerator(cpu=True), tiny_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return CO2Accelerate(accelerator, model, optimizer, config=CO2Config(co2_local_steps=2)), model, optimizer

    first, model, optimizer = run()
    with first:
        _one_step(model, optimizer, first)
        first.step()
        first.save_state("ckpt")
    rerun, model, optimizer = run()
    with rerun:
        rerun.save_state("ckpt")
        assert read_manifest("ckpt")["run"] == rerun._checkpoints.run != first._checkpoints.run
        beside, _, _ = run()
        with (
            beside,
            pytest.raises(ValueError, match=f"another run is training into it now \\(run {rerun._checkpoints.run}"),
        ):
            beside.save_state("other")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
