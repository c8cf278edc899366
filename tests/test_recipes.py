"""The recipes on their offline defaults with 2 processes, through compare_methods.py (which is thus
smoke-tested too), and the paper-scale commands of recipes/README.md as dry runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))


def _compare(
    tmp_path: Path, recipe: str, methods: list[str], *extra: str, port: int, options: tuple[str, ...] = ()
) -> list[dict]:
    command = [
        sys.executable,
        str(ROOT / "scripts/compare_methods.py"),
        "--recipe",
        recipe,
        "--methods",
        *methods,
        "--seeds",
        "0",
        "--max_steps",
        "4",
        "--port",
        str(port),
        "--timeout_s",
        "150",
        "--out",
        str(tmp_path),
        *options,
        "--",
        "--eval_steps",
        "2",
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert "| method | runs |" in done.stdout  # the summary table
    return [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]


@pytest.mark.timeout(180)
def test_gpt_recipe_offline_default_two_processes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (line,) = _compare(
        tmp_path,
        "gpt",
        ["co2"],
        "--max_eval_samples",
        "8",
        "--vocab_size",
        "512",
        "--co2_local_steps",
        "2",
        "--lr_spike_round",
        "1",
        "--logging_steps",
        "2",
        port=29561,
        options=("--plot_co2_metric", "co2/momentum_norm"),
    )
    assert (tmp_path / "co2_momentum_norm.png").stat().st_size > 10_000
    assert line["world_size"] == 2 and line["max_steps"] == 4 and line["perplexity"] > 1
    folder = tmp_path / "co2_seed0"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)  # the trained BPE travels with the model
    assert model.config.vocab_size == len(tokenizer) <= 512
    results = json.loads((folder / "all_results.json").read_text())
    assert {"eval_loss", "perplexity", "train_runtime"} <= set(results)
    assert (folder / "loss_curve.png").exists() and (folder / "README.md").exists()


@pytest.mark.timeout(180)
def test_vit_recipe_offline_default_through_a_baseline_method_with_fsdp2_inside_one_worker(tmp_path):
    """The ViT recipe, local SGD, its 2 processes one worker (co2_worker_size 2) sharded by FSDP2."""
    from transformers import ViTForImageClassification

    flags = ("--co2_local_steps", "2", "--co2_worker_size", "2", "--fsdp", "full_shard")
    (line,) = _compare(tmp_path, "vit", ["local_sgd"], *flags, port=29562)
    assert line["method"] == "local_sgd" and 0 <= line["eval_accuracy"] <= 1 and line["world_size"] == 2
    model = ViTForImageClassification.from_pretrained(tmp_path / "local_sgd_seed0")
    assert model.config.num_labels == 10
    summary = json.loads((tmp_path / "local_sgd_seed0" / "run_summary.json").read_text())
    assert summary["co2"]["co2_overlap"] is False and summary["co2"]["co2_outer_momentum"] == 0.0
    assert summary["co2"]["co2_worker_size"] == 2 and summary["fsdp2_inside_workers"] is True


@pytest.mark.timeout(20)
def test_compare_methods_table_gives_mean_std_and_ratios_by_hand():
    from scripts import compare_methods

    lines = [
        {"method": "slowmo", "eval_loss": 4.0},
        {"method": "slowmo", "eval_loss": 6.0},
        {"method": "co2", "eval_loss": 5.1},
    ]
    rows = compare_methods.table(lines, "eval_loss").splitlines()
    assert rows[0] == "| method | runs | eval_loss mean | std | / slowmo |"
    assert rows[2] == "| SlowMo-style | 2 | 5.0000 | 1.4142 | 1.000 |"
    assert rows[3] == "| CO2 (overlapped) | 1 | 5.1000 | nan | 1.020 |"


@pytest.mark.timeout(20)
def test_compare_methods_tables_every_recorded_run_with_the_latest_line_of_each(tmp_path):
    from scripts import compare_methods

    records = [
        {"method": "dp", "seed": 0, "eval_loss": 5.0},
        {"method": "co2", "seed": 0, "eval_loss": 9.0},  # replaced by the rerun below
        {"method": "co2", "seed": 1, "eval_loss": 6.0},  # its folder is gone: not a run any more
        {"method": "co2", "seed": 0, "eval_loss": 5.5},
    ]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name in ("dp_seed0", "co2_seed0"):
        (tmp_path / name).mkdir()
    assert compare_methods.recorded_runs(tmp_path) == [records[0], records[3]]
    assert compare_methods.recorded_runs(tmp_path / "missing") == []


def _readme_commands(marker: str) -> list[list[str]]:
    """The paper-scale commands of recipes/README.md (one per line, after ``recipes/<script>``)."""
    text = (ROOT / "recipes/README.md").read_text().replace("\\\n", " ")
    commands = re.findall(rf"recipes/{marker}\s+([^\n`]*)", text)
    return [c.split() for c in commands if "--dataset_name" in c]


@pytest.mark.timeout(60)
def test_paper_scale_commands_parse_and_build_their_config(capsys):
    import finetune_vit
    import pretrain_gpt

    gpt = _readme_commands("pretrain_gpt.py")
    vit = _readme_commands("finetune_vit.py")
    assert len(gpt) >= 2 and len(vit) >= 1
    # --use_cpu: TrainingArguments checks --bf16 against this machine, which has no GPU
    local = ["--dry_run", "--use_cpu", "--output_dir", "/tmp/co2_dry_run"]
    for argv in gpt:
        pretrain_gpt.main([*argv, *local])
    for argv in vit:
        finetune_vit.main([*argv, *local])
    out = capsys.readouterr().out
    assert "GPT-2 small n_embd=768 n_layer=12 ~124M" in out
    assert "co2_local_steps=12" in out and "co2_local_steps=48" in out
    assert "ViT hidden=768 layers=12 image=224 patch=16" in out or "dry run: ViT" in out


@pytest.mark.timeout(20)
def test_lr_spike_multiplies_the_rate_for_exactly_one_round():
    from types import SimpleNamespace

    from common import LRSpike

    spike = LRSpike(round_index=1, factor=10.0, tau=3)
    optimizer = SimpleNamespace(param_groups=[{"lr": 1.0}])
    seen = []
    for step in range(9):
        optimizer.param_groups[0]["lr"] = 1.0  # what the scheduler sets after every step
        spike.on_step_begin(None, SimpleNamespace(global_step=step), None, optimizer=optimizer)
        seen.append(optimizer.param_groups[0]["lr"])
    assert seen == [1, 1, 1, 10, 10, 10, 1, 1, 1]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("flags", [["--lr_spike_round", "-1"], ["--lr_spike_factor", "0"]])
def test_bad_spike_flags_are_refused_with_the_flag_named(flags):
    import pretrain_gpt

    with pytest.raises(ValueError, match=flags[0]):
        pretrain_gpt.parse(["--output_dir", "unused", *flags])


@pytest.mark.timeout(30)
def test_both_recipes_draw_the_initial_weights_from_the_seed():
    """Same --seed, same first weights, whatever the process's RNG did before (every run of one
    command must start from the same model: the Trainer seeds only once the model exists)."""
    import finetune_vit
    import pretrain_gpt
    import torch
    from transformers import GPT2TokenizerFast

    def first_weights(build):
        torch.manual_seed(torch.seed())  # a fresh, random process state
        return next(build().parameters()).detach().clone()

    vit_args = finetune_vit.ModelArguments()
    vit = [first_weights(lambda: finetune_vit.build_model(vit_args, list("0123456789"), seed=3)) for _ in range(2)]
    assert torch.equal(vit[0], vit[1])
    tokenizer = GPT2TokenizerFast(tokenizer_object=_tiny_bpe())
    gpt_args = pretrain_gpt.ModelArguments(model_size="tiny")
    gpt = [first_weights(lambda: pretrain_gpt.build_model(gpt_args, tokenizer, 64, seed=3)) for _ in range(2)]
    assert torch.equal(gpt[0], gpt[1])
    other = first_weights(lambda: pretrain_gpt.build_model(gpt_args, tokenizer, 64, seed=4))
    assert not torch.equal(gpt[0], other)


def _tiny_bpe():
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["to be or not to be"] * 10, vocab_size=300, special_tokens=["<|endoftext|>"])
    return bpe
