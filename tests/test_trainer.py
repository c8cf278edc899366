"""CO2Trainer with 2 gloo processes and a tiny GPT-2 built from a config (no downloads)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import yaml
from distributed import run_processes
from trainer_workers import (
    STOP_AT,
    dataset,
    make_args,
    resumed,
    resumed_on_another_world,
    tiny_gpt2,
    two_process_suite,
)

from co2_hf import CO2Trainer, CO2TrainingArguments


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trainer"))
    return out, run_processes(two_process_suite, 2, out, timeout_s=230)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_no_collective_on_the_default_group_during_local_steps(suite):
    _, ranks = suite
    for result in (r["co2"] for r in ranks):
        assert result["world"] == 2
        assert result["wrapped"] == "GPT2LMHeadModel"  # not DistributedDataParallel
        assert result["windows"] and all(n == 0 for n in result["windows"]), result["windows"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_anchors_are_equal_across_ranks_after_every_round(suite):
    _, ranks = suite
    first, second = ranks[0]["co2"], ranks[1]["co2"]
    assert len(first["anchor_sums"]) == 3  # boundaries after steps 4, 8 and 12
    assert first["anchor_sums"] == second["anchor_sums"]
    for name, value in first["final"].items():
        assert torch.equal(value, second["final"][name]), name


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_co2_metrics_reach_the_log_history(suite):
    _, ranks = suite
    history = ranks[0]["co2"]["log_history"]
    logs = [entry for entry in history if "loss" in entry]
    later = logs[-1]
    for key in (
        "comm_wait_s",
        "comm_s",
        "hidden_frac",
        "outer_grad_norm",
        "momentum_norm",
        "clip_ratio",
        "penalty_mean",
        "amp_skipped_steps",
        "skipped_rounds",
    ):
        assert f"co2/{key}" in later, key
    assert any("eval_loss" in entry for entry in history[:-2])  # evaluated mid-run


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_load_best_model_at_end_saves_and_evaluates_the_best_checkpoint_bit_for_bit(suite):
    """As with the plain Trainer: after training with ``load_best_model_at_end`` the model is the best
    checkpoint's (step 4 here, not the last round's anchor), in ``save_model`` and in ``evaluate``."""
    from safetensors.torch import load_file

    out, ranks = suite
    best = os.path.join(out, "best", "checkpoint-4")
    for result in (r["best"] for r in ranks):
        assert result["best"] == best
        assert result["evaluated_after"] == result["evals"][4]  # the best checkpoint's own evaluation
        assert result["evaluated_after"] != result["evals"][12]
    saved = load_file(os.path.join(out, "best", "saved", "model.safetensors"))
    kept = load_file(os.path.join(best, "model.safetensors"))
    assert saved.keys() == kept.keys() and all(torch.equal(saved[k], kept[k]) for k in kept)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_saved_folder_is_the_anchor_and_loads_with_from_pretrained(suite):
    out, ranks = suite
    folder = os.path.join(out, "co2")
    for name in ("config.json", "model.safetensors", "co2_config.json", "README.md", "training_args.bin"):
        assert os.path.exists(os.path.join(folder, name)), name
    result = ranks[0]["co2"]
    assert result["eval_loaded"] == pytest.approx(result["eval_trained"], abs=1e-6)
    with open(os.path.join(folder, "co2_config.json")) as f:
        saved = json.load(f)
    assert saved["co2_local_steps"] == 4 and saved["world_size"] == 2 and saved["num_workers"] == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_model_card_has_tags_hyperparameters_and_citation(suite):
    out, _ = suite
    text = open(os.path.join(out, "co2", "README.md")).read()
    meta = yaml.safe_load(text.split("---")[1])
    assert {"co2", "arxiv:2401.16265"} <= set(meta["tags"])
    assert meta["co2"]["co2_local_steps"] == 4 and meta["co2"]["world_size"] == 2
    assert "2401.16265" in text and "@inproceedings{sun2024co2" in text
    assert "| `co2_outer_momentum` | `0.2` |" in text
    assert "- distributed_type: multi-CPU\n" in text  # two gloo processes, not the Trainer's "multi-GPU"
    assert "[co2_hf](https://arxiv.org" not in text  # the paper's link names the paper


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_co2_disabled_is_the_plain_trainer(suite):
    _, ranks = suite
    for result in ranks:
        assert result["disabled"]["wrapped"] == "DistributedDataParallel"
        assert result["disabled"]["disabled"] == result["disabled"]["plain"]
        assert len(result["disabled"]["plain"]) == 12


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stopped_mid_round_and_resumed_is_bit_identical(suite):
    out, ranks = suite
    assert ranks[0]["resume"]["stopped_at"] == STOP_AT
    checkpoint = os.path.join(out, "resume", f"checkpoint-{STOP_AT}")
    assert sorted(f for f in os.listdir(checkpoint) if f.startswith("co2_rank")) == ["co2_rank0.pt", "co2_rank1.pt"]
    final = run_processes(resumed, 2, os.path.join(out, "resume"), timeout_s=150)
    for rank in (0, 1):
        for name, value in ranks[rank]["resume"]["full"].items():
            assert torch.equal(final[rank][name], value), (rank, name)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_checkpoint_model_files_hold_the_anchor(suite):
    from transformers import AutoModelForCausalLM

    out, _ = suite
    checkpoint = os.path.join(out, "resume", f"checkpoint-{STOP_AT}")
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    state = torch.load(os.path.join(checkpoint, "co2_rank0.pt"), weights_only=True)
    anchor, local = state["co2"]["anchor"], state["model"]
    wte = model.transformer.wte.weight.detach().reshape(-1)
    assert torch.equal(wte, anchor[: wte.numel()])  # the first synchronised tensor
    assert not torch.equal(local["transformer.wte.weight"].reshape(-1), wte)  # mid-round: local != anchor


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_with_co2_elastic_a_two_process_checkpoint_resumes_on_one_and_on_three(suite, tmp_path):
    from transformers import AutoModelForCausalLM

    out, _ = suite
    saved = os.path.join(out, "resume")
    ckpt = os.path.join(saved, f"checkpoint-{STOP_AT}")
    rank_files = [torch.load(os.path.join(ckpt, f"co2_rank{r}.pt"), weights_only=True) for r in (0, 1)]
    one = [resumed_on_another_world(0, 1, saved, str(tmp_path / "one"))]  # in this process
    three = run_processes(resumed_on_another_world, 3, saved, str(tmp_path / "three"), timeout_s=300)
    for runs, target, words in ((one, "one", "seen a second time"), (three, "three", "skipped")):
        for rank, run in enumerate(runs):
            source = rank_files[rank % 2]  # new worker w takes old worker w mod 2
            # the defaults: streaming fragments; the one in flight at the save was waited for (its D
            # received), and every new fragment starts afresh at the clock's round with D applied
            fragments = source["co2"]["fragments"]
            assert len(fragments) > 1 and [f["counters"]["have_d"] for f in fragments].count(True) == 1
            clock = source["co2"]["counters"]
            assert run["begin"]["counters"]["clock"] == clock
            first = run["begin"]["counters"]["fragment"]
            assert not first["have_d"] and first["round"] == clock["round"]
            assert run["begin"]["live_is_anchor"]
            for index, entry in source["optimizer"]["state"].items():
                for name, value in entry.items():
                    assert torch.equal(run["begin"]["optimizer"][index][name], value), (target, rank, name)
            assert run["global_step"] == 12 and all(math.isfinite(x) for x in run["losses"])
            for name, value in runs[0]["anchor"].items():
                assert torch.equal(run["anchor"][name], value), (target, rank, name)
        assert len(runs[0]["warnings"]) == 1 and "saved by 2 processes" in runs[0]["warnings"][0]
        assert words in runs[0]["warnings"][0] and "Reset:" in runs[0]["warnings"][0]
        assert all(not run["warnings"] for run in runs[1:])  # once: rank 0 only
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / target))
        anchor = runs[0]["anchor"]["transformer.wte.weight"]
        assert torch.equal(model.transformer.wte.weight.detach(), anchor)


# ---------------------------------------------------------------- single process: refusals and the Hub


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_with_other_settings_or_world_size_is_refused(suite, tmp_path):
    out, _ = suite
    two_rank_checkpoint = os.path.join(out, "resume", f"checkpoint-{STOP_AT}")
    trainer = CO2Trainer(model=tiny_gpt2(), args=make_args(str(tmp_path / "a")), train_dataset=dataset())
    with pytest.raises(ValueError, match="saved by 2 processes and this run has 1"):
        trainer.train(resume_from_checkpoint=two_rank_checkpoint)
    one = CO2Trainer(
        model=tiny_gpt2(),
        args=make_args(str(tmp_path / "b"), save_strategy="steps", save_steps=6),
        train_dataset=dataset(),
    )
    one.train()
    other = CO2Trainer(
        model=tiny_gpt2(), args=make_args(str(tmp_path / "b"), co2_local_steps=5), train_dataset=dataset()
    )
    with pytest.raises(ValueError, match="co2_local_steps: checkpoint 4, now 5"):
        other.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-6"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("co2_enabled", [True, False])
def test_resume_true_as_the_command_line_gives_it_takes_the_last_checkpoint(tmp_path, co2_enabled):
    """``--resume_from_checkpoint true`` parses to the string "true": train() takes it as True does."""
    fresh = CO2Trainer(
        model=tiny_gpt2(), args=make_args(str(tmp_path), co2_enabled=co2_enabled), train_dataset=dataset()
    )
    with pytest.raises(ValueError, match=r"--resume_from_checkpoint true: --output_dir .* holds no checkpoint-N"):
        fresh.train(resume_from_checkpoint="true")
    args = make_args(str(tmp_path), max_steps=8, save_strategy="steps", save_steps=4, co2_enabled=co2_enabled)
    CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset()).train()
    resumed = []

    from transformers import TrainerCallback

    class Seen(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            resumed.append(state.global_step)

    trainer = CO2Trainer(
        model=tiny_gpt2(),
        args=make_args(str(tmp_path), co2_enabled=co2_enabled),
        train_dataset=dataset(),
        callbacks=[Seen()],
    )
    trainer.train(resume_from_checkpoint="TRUE")  # any case, as the recipes take it
    assert resumed == [8] and trainer.state.global_step == 12  # from checkpoint-8, the last one


@pytest.mark.timeout(120)
def test_resume_from_a_save_only_model_checkpoint_is_refused(tmp_path):
    args = make_args(str(tmp_path), save_strategy="steps", save_steps=6, save_only_model=True)
    CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset()).train()
    trainer = CO2Trainer(model=tiny_gpt2(), args=make_args(str(tmp_path)), train_dataset=dataset())
    with pytest.raises(ValueError, match="save_only_model"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(deepspeed={"train_batch_size": 8}), "CO2 does not support DeepSpeed"),
        (dict(fsdp="full_shard"), "would shard the model across CO2 workers"),
        (dict(include_num_input_tokens_seen="all"), "include_num_input_tokens_seen='all'"),
        (dict(co2_local_steps=0), "co2_local_steps=0"),
    ],
)
def test_unsupported_settings_are_refused_before_training(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_args(str(tmp_path), **overrides)


@pytest.mark.timeout(60)
def test_an_unknown_fault_tolerance_is_refused_naming_the_allowed_values(tmp_path):
    with pytest.raises(ValueError, match="co2_fault_tolerance='bogus': allowed are 'none', 'torchft'"):
        make_args(str(tmp_path), co2_fault_tolerance="bogus")


@pytest.mark.timeout(60)
def test_torchft_without_its_extra_is_refused_naming_the_extra(tmp_path, monkeypatch):
    import sys

    import co2_hf

    # as if not installed: importing it, or any of its modules an earlier test imported, fails
    for name in ["torchft", *(n for n in list(sys.modules) if n.startswith("torchft."))]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [n for n in list(sys.modules) if n == "co2_hf.torchft" or n.startswith("co2_hf.torchft.")]:
        monkeypatch.delitem(sys.modules, name)  # imported by an earlier test: imported anew, and refused
    monkeypatch.delattr(co2_hf, "torchft", raising=False)
    with pytest.raises(ValueError, match=r"needs torchft: pip install 'co2_hf\[ft\]'"):
        make_args(str(tmp_path), co2_fault_tolerance="torchft")


@pytest.mark.timeout(60)
def test_hub_checkpoint_strategy_warns_and_flags_parse(tmp_path):
    from transformers import HfArgumentParser

    with pytest.warns(UserWarning, match="every rank's local parameters"):
        make_args(str(tmp_path), hub_strategy="checkpoint")
    (args,) = HfArgumentParser(CO2TrainingArguments).parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--co2_local_steps",
            "12",
            "--co2_outer_momentum",
            "0.5",
            "--co2_clip_threshold",
            "1.0",
            "--co2_start_rule",
            "eager",
            "--learning_rate",
            "1e-4",
        ]
    )
    assert (args.co2_local_steps, args.co2_outer_momentum, args.co2_start_rule) == (12, 0.5, "eager")
    assert args.average_tokens_across_devices is False
    with pytest.raises(SystemExit):  # argparse names the flag and the allowed choices
        HfArgumentParser(CO2TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--co2_start_rule", "latest"]
        )


@pytest.mark.timeout(120)
def test_push_to_hub_uploads_the_anchor_folder_with_the_card(tmp_path, monkeypatch):
    import transformers.trainer as trainer_module

    uploads = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            return type("Url", (), {"repo_id": repo_id})()

        def upload_folder(self, *, repo_id, folder_path, **kwargs):
            files = sorted(os.listdir(folder_path))
            uploads.append((repo_id, files, open(os.path.join(folder_path, "README.md")).read()))

    monkeypatch.setattr(trainer_module, "hf_api", lambda: FakeApi())
    args = make_args(str(tmp_path), push_to_hub=True, hub_model_id="someone/co2-tiny")
    trainer = CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
    trainer.train()
    trainer.push_to_hub()
    repo, files, card = uploads[-1]
    assert repo == "someone/co2-tiny"
    assert {"config.json", "model.safetensors", "co2_config.json", "README.md"} <= set(files)
    assert "arxiv:2401.16265" in card and "## Trained with CO2" in card


@pytest.mark.timeout(60)
def test_one_process_driving_several_gpus_is_refused_naming_the_launch(tmp_path, monkeypatch):
    """Plain ``python train.py`` on a multi-GPU node: the Trainer would use nn.DataParallel."""
    from transformers import TrainingArguments

    args = make_args(str(tmp_path))
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    launch = r"n_gpu=2.*nn\.DataParallel.*accelerate launch --num_processes 2.*torchrun --nproc_per_node 2"
    with pytest.raises(ValueError, match=launch):
        make_args(str(tmp_path))
    with pytest.raises(ValueError, match=launch):  # args made before the GPUs were seen: the Trainer refuses
        CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
    assert make_args(str(tmp_path), co2_enabled=False).n_gpu == 2  # the plain Trainer keeps DataParallel


@pytest.mark.timeout(60)
def test_settings_changed_behind_the_users_back_are_warned_once_with_why(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="co2_hf"):
        make_args(str(tmp_path), ddp_find_unused_parameters=True, ddp_bucket_cap_mb=25)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    expected = {
        "average_tokens_across_devices turned off: it all-gathers": 1,
        "ddp_timeout not set, so it follows co2_timeout_s: 900 s instead of the Trainer's 1800 s": 1,
        "ddp_find_unused_parameters=True, ddp_bucket_cap_mb=25 have no effect": 1,
        "CO2 with a single worker (1 process(es), co2_worker_size=1): there is nobody to average with": 1,
    }
    for words, count in expected.items():
        assert sum(words in m for m in said) == count, (words, said)
    caplog.clear()
    with caplog.at_level("WARNING", logger="co2_hf"):
        make_args(str(tmp_path), ddp_timeout=60, co2_enabled=False, co2_local_steps=12)  # 12: the default
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    with caplog.at_level("WARNING", logger="co2_hf"):  # dispatch_batches unset -> False matters for these
        CO2Trainer(model=tiny_gpt2(), args=make_args(str(tmp_path)), train_dataset=dataset(16).to_iterable_dataset())
    assert "the iterable train dataset is not dispatched from rank 0" in caplog.text


@pytest.mark.timeout(120)
def test_evaluation_runs_on_the_anchor_and_gives_the_live_weights_back_exactly(tmp_path):
    from transformers import TrainerCallback

    seen = {}

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 6:  # mid-round (tau 4): live != anchor
                seen["live"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
                seen["anchor"] = {k: v.clone() for k, v in trainer.co2.anchor_state().items()}

        def on_evaluate(self, args, state, control, **kw):
            if state.global_step == 6:  # (the last step evaluates too)
                seen["during"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 6:
                seen["after"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    args = make_args(str(tmp_path), eval_strategy="steps", eval_steps=6, max_steps=8)
    trainer = CO2Trainer(
        model=tiny_gpt2(), args=args, train_dataset=dataset(), eval_dataset=dataset(16, seed=1), callbacks=[Watch()]
    )
    trainer.train()
    assert any(not torch.equal(v, seen["anchor"][k]) for k, v in seen["live"].items())
    assert all(torch.equal(seen["during"][k], v) for k, v in seen["anchor"].items())
    assert all(torch.equal(seen["after"][k], v) for k, v in seen["live"].items())


# the private Trainer methods CO2Trainer overrides or calls, with the parameters it relies on
PRIVATE_TRAINER_API = {
    "_prepare_for_training": ["self", "max_steps", "train_dataloader", "resume_from_checkpoint"],
    "_finalize_training": ["self", "trial", "num_train_samples", "start_time"],
    "_save": ["self", "output_dir", "state_dict"],
    "_save_checkpoint": ["self", "model", "trial"],
    "_get_output_dir": ["self", "trial"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
    "_push_from_checkpoint": ["self", "checkpoint_folder"],
    "_load_best_model": ["self"],
    "_get_train_sampler": ["self", "train_dataset"],
    "_load_rng_state": ["self", "checkpoint"],
    "_load_callback_state": ["self"],  # called on torchft (integrations/fault_tolerance.py)
    # passed through as keywords: the names CO2Trainer reads and sets
    "_run_epoch": [
        "self",
        "model",
        "epoch",
        "train_dataloader",
        "steps_in_epoch",
        "num_update_steps_per_epoch",
        "trial",
        "ignore_keys_for_eval",
        "start_time",
        "resume_from_checkpoint",
        "epochs_trained",
        "steps_trained_in_current_epoch",
    ],
}


@pytest.mark.timeout(30)
def test_every_private_trainer_method_co2trainer_overrides_is_guarded():
    """An override of a private Trainer method breaks silently when transformers renames it: each one
    must be in PRIVATE_TRAINER_API (checked against the installed transformers below) and named in
    the module docstring's list."""
    from transformers import Trainer

    import co2_hf.integrations.trainer as module

    ours = [c for c in CO2Trainer.__mro__ if c.__module__.startswith("co2_hf.")]  # CO2Trainer and its mixins
    assert len(ours) == 3, ours
    overridden = {
        n for c in ours for n in vars(c) if n.startswith("_") and not n.startswith("__") and hasattr(Trainer, n)
    }
    assert overridden >= {"_save_checkpoint", "_run_epoch", "_prepare_for_training"}  # one of each class
    assert overridden <= PRIVATE_TRAINER_API.keys(), overridden - PRIVATE_TRAINER_API.keys()
    listed = module.__doc__.split("The private Trainer methods overridden")[1]
    assert all(f"``{name}``" in listed for name in overridden), [n for n in overridden if f"``{n}``" not in listed]


@pytest.mark.timeout(30)
def test_the_private_trainer_methods_co2_relies_on_exist_in_the_installed_transformers():
    import inspect

    from transformers import Trainer

    for name, parameters in PRIVATE_TRAINER_API.items():
        assert list(inspect.signature(getattr(Trainer, name)).parameters) == parameters, name
    # the checkpoint folder comes from _get_output_dir, the push and rotation after every file is written
    source = inspect.getsource(Trainer._save_checkpoint)
    order = ["self._get_output_dir(", "self.state.save_to_json(", "self._push_from_checkpoint(", "rotate_checkpoints("]
    positions = [source.find(call) for call in order]
    assert -1 not in positions and positions == sorted(positions), dict(zip(order, positions))


# ---------------------------------------------------------------------- the plain Trainer's contract
# (found by running transformers' own tests/trainer suite with Trainer replaced by CO2Trainer)


@pytest.mark.timeout(60)
def test_the_callbacks_are_the_plain_trainers_and_removing_them_keeps_the_rounds(tmp_path):
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import DefaultFlowCallback

    plain_args = TrainingArguments(str(tmp_path / "plain"), report_to="none", disable_tqdm=True)
    plain = Trainer(model=tiny_gpt2(), args=plain_args)
    args = make_args(str(tmp_path / "co2"), max_steps=8)
    trainer = CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset())
    assert [type(c) for c in trainer.callback_handler.callbacks] == [type(c) for c in plain.callback_handler.callbacks]
    trainer.remove_callback(DefaultFlowCallback)
    trainer.train()
    assert trainer.co2.inner_steps == trainer.state.global_step > 0  # every optimizer step still counted


@pytest.mark.timeout(60)
def test_dispatch_batches_true_applies_to_evaluation_only_with_a_warning(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="co2_hf"):
        args = make_args(str(tmp_path), accelerator_config={"dispatch_batches": True})
    assert "dispatch_batches=True applies to evaluation and prediction only" in caplog.text
    stream = dataset(64).to_iterable_dataset()
    trainer = CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=stream, eval_dataset=stream)
    assert trainer.accelerator.dispatch_batches is True  # the user's setting, as the Trainer keeps it
    assert type(trainer.get_train_dataloader()).__name__ == "DataLoaderShard"
    assert type(trainer.get_eval_dataloader()).__name__ == "DataLoaderDispatcher"


@pytest.mark.timeout(60)
def test_accelerator_config_from_a_path_and_dispatching_left_to_accelerate_outside_training(tmp_path):
    import pathlib

    config = tmp_path / "accelerator.json"
    config.write_text(json.dumps({"split_batches": False}))
    args = make_args(str(tmp_path), accelerator_config=pathlib.Path(config))
    assert args.accelerator_config.dispatch_batches is None  # as the plain Trainer leaves it
    stream = dataset(64).to_iterable_dataset()
    trainer = CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=stream, eval_dataset=stream)
    assert type(trainer.get_train_dataloader()).__name__ == "DataLoaderShard"  # each process reads its own
    assert trainer.accelerator.dataloader_config.dispatch_batches is None
    assert type(trainer.get_eval_dataloader()).__name__ == "DataLoaderDispatcher"  # as without CO2


@pytest.mark.timeout(90)
def test_a_best_checkpoint_saved_before_the_evaluation_that_made_it_best_is_recorded_and_kept(tmp_path):
    """Evaluating every epoch (4 steps) and saving every step: checkpoint-4 is saved before the
    evaluation at the end of epoch 1 makes it the best; the Trainer finds it at the next save."""
    best = dict(metric_for_best_model="loss", greater_is_better=True)  # the first evaluation is the best
    args = make_args(
        str(tmp_path), eval_strategy="epoch", save_strategy="steps", save_steps=1, save_total_limit=2, **best
    )
    trainer = CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset(16), eval_dataset=dataset(16, seed=1))
    trainer.train()
    assert trainer.state.best_global_step == 4
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-4"]  # kept


@pytest.mark.timeout(180)
def test_a_state_that_cannot_be_applied_on_one_rank_fails_every_rank_with_one_message(tmp_path):
    """Rank 1's ``co2`` state emptied (the structure intact, the manifest rehashed), then its RNG
    file replaced: rank 1 alone used to fail mid-restore while rank 0 trained on and died later as
    "a peer may have died". Now both ranks fail at once, before any step, naming the same cause."""
    from trainer_workers import unappliable_resumes

    ranks = run_processes(unappliable_resumes, 2, str(tmp_path), timeout_s=170)
    for tamper, cause in (("co2_state", "co2_rank1.pt"), ("rng_state", "rank 1's RNG state")):
        (own, own_step), (peer, peer_step) = ranks[1][tamper], ranks[0][tamper]
        assert own_step == peer_step == 4, (tamper, own, peer)  # the checkpoint's step: no step trained
        assert peer == f"rank 1 refused the checkpoint: {own}", (tamper, own, peer)
        assert f"checkpoint {tmp_path}/{tamper}: " in own and cause in own, own


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("rank", "said"), [("0", 1), ("1", 0)])
def test_no_accelerator_found_is_said_by_rank_0_only(monkeypatch, caplog, rank, said):
    from types import SimpleNamespace

    from co2_hf.integrations import arguments

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    args = SimpleNamespace(use_cpu=False)
    with caplog.at_level("WARNING", logger=arguments.logger.name):
        arguments._use_cpu_without_accelerator(args)
    assert args.use_cpu is True  # on every rank
    assert sum("no GPU or other accelerator found" in r.getMessage() for r in caplog.records) == said


@pytest.mark.timeout(120)
def test_co2_scalars_land_in_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = make_args(str(tmp_path), report_to="tensorboard")
    CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset()).train()
    tags = set()
    for events in tmp_path.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    assert "train/loss" in tags and "train/co2/comm_wait_s" in tags, sorted(tags)


@pytest.mark.timeout(120)
def test_the_second_moment_setting_parses_trains_and_resumes_bit_for_bit(tmp_path):
    """``--co2_global_second_moment_every`` through HfArgumentParser, and a run saved with the
    exchange in flight (tau 4, a checkpoint at step 8) resumed to the same weights and Adam state."""
    from transformers import HfArgumentParser

    from co2_hf import CO2TrainingArguments

    (parsed,) = HfArgumentParser(CO2TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--co2_global_second_moment_every", "2"]
    )
    assert parsed.co2_global_second_moment_every == 2
    knobs = dict(max_steps=12, save_strategy="steps", save_steps=8, co2_global_second_moment_every=1)
    straight = CO2Trainer(model=tiny_gpt2(), args=make_args(str(tmp_path / "a"), **knobs), train_dataset=dataset())
    straight.train()
    first = CO2Trainer(model=tiny_gpt2(), args=make_args(str(tmp_path / "b"), **knobs), train_dataset=dataset())
    first.train()
    again = CO2Trainer(model=tiny_gpt2(), args=make_args(str(tmp_path / "b"), **knobs), train_dataset=dataset())
    again.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-8"))
    for name, value in straight.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], value), name
    for a, b in zip(straight.optimizer.state_dict()["state"].values(), again.optimizer.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
