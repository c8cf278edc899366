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


@pytest.mark.slow
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
    assert {"eval_loss", "perplexity", "train_runtime", "eval_accuracy"} <= set(results)
    assert 0 <= results["eval_accuracy"] <= 1  # run_clm's next-token accuracy
    final = json.loads((folder / "eval_results.json").read_text())
    assert "train_runtime" in json.loads((folder / "train_results.json").read_text())
    assert (folder / "loss_curve.png").exists() and (folder / "trainer_state.json").exists()
    # one tokenizer (push_to_hub uploads the folder), limited to the model's positions
    assert not (folder / "tokenizer").exists()
    assert tokenizer.model_max_length == model.config.n_positions == 128
    _check_card(folder, final, task="text-generation", dataset="Shakespeare", world_size=2)
    from transformers import pipeline

    generated = pipeline("text-generation", model=str(folder))("To be", max_new_tokens=3, do_sample=False)
    assert generated[0]["generated_text"].startswith("To be")


def _check_card(folder: Path, final: dict, *, task: str, dataset: str, world_size: int, base: str | None = None):
    """The card says what was trained from what on what, and reports the final evaluation (after
    finalize), not the last one during training."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(folder / "README.md")
    assert card.data.pipeline_tag == task and card.data.license == "apache-2.0"
    assert "co2" in card.data.tags and card.data.co2["world_size"] == world_size
    origin = f"fine-tuned version of `{base}`" if base else "trained from scratch"
    assert origin in card.text and dataset in card.text and "[](https://huggingface.co/)" not in card.text
    assert f"- Loss: {final['eval_loss']:.4f}" in card.text


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_vit_recipe_offline_default_through_a_baseline_method_with_fsdp2_inside_one_worker(tmp_path):
    """The ViT recipe, local SGD, its 2 processes one worker (co2_worker_size 2) sharded by FSDP2."""
    from transformers import ViTForImageClassification

    flags = ("--co2_local_steps", "2", "--co2_worker_size", "2", "--fsdp", "full_shard")
    (line,) = _compare(tmp_path, "vit", ["local_sgd"], *flags, port=29562)
    assert line["method"] == "local_sgd" and 0 <= line["eval_accuracy"] <= 1 and line["world_size"] == 2
    folder = tmp_path / "local_sgd_seed0"
    model = ViTForImageClassification.from_pretrained(folder)
    assert model.config.num_labels == 10
    summary = json.loads((folder / "run_summary.json").read_text())
    assert summary["co2"]["co2_overlap"] is False and summary["co2"]["co2_outer_momentum"] == 0.0
    assert summary["co2"]["co2_worker_size"] == 2 and summary["fsdp2_inside_workers"] is True
    final = json.loads((folder / "eval_results.json").read_text())
    _check_card(folder, final, task="image-classification", dataset="digits", world_size=2)
    _pipeline_matches_training_preprocessing(folder, model)


def _pipeline_matches_training_preprocessing(folder: Path, model) -> None:
    """The saved processor turns a raw 8x8 digit into what the model was trained on."""
    import finetune_vit
    import numpy as np
    import torch
    from PIL import Image
    from sklearn.datasets import load_digits
    from transformers import pipeline

    raw = load_digits().images[0]
    picture = Image.fromarray((raw * 255 / 16).astype(np.uint8)).convert("RGB")
    scores = {
        int(r["label"]): r["score"] for r in pipeline("image-classification", model=str(folder), top_k=10)(picture)
    }
    with torch.no_grad():
        probs = model(pixel_values=torch.as_tensor(finetune_vit.digit_pixels(raw, 16))[None]).logits.softmax(-1)[0]
    assert max(abs(scores[i] - probs[i].item()) for i in range(10)) < 1e-3


@pytest.mark.research
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
    assert rows[3] == "| CO2 (the recipe's defaults) | 1 | 5.1000 | nan | 1.020 |"


@pytest.mark.research
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
def test_paper_scale_commands_parse_and_build_their_config(capsys, monkeypatch):
    import finetune_vit
    import pretrain_gpt
    import yaml

    from co2_hf.integrations import launch

    gpt = _readme_commands("pretrain_gpt.py")
    vit = _readme_commands("finetune_vit.py")
    assert len(gpt) >= 2 and len(vit) >= 1
    # one CO2 worker per node, as multi_node.yaml says and docs/trainer.md explains; checked against the
    # world that config launches
    config = yaml.safe_load((ROOT / "recipes/accelerate_configs/multi_node.yaml").read_text())
    per_node = config["num_processes"] // config["num_machines"]
    trainer_md = (ROOT / "docs/trainer.md").read_text().replace("\\\n", " ")
    examples = re.findall(r"multi_node\.yaml train\.py\s+([^\n]*)", trainer_md)
    assert examples and all(argv[argv.index("--co2_worker_size") + 1] == str(per_node) for argv in gpt + vit)
    assert all(f"--co2_worker_size {per_node} " in example for example in examples)
    monkeypatch.setattr(launch, "launched_world_size", lambda: config["num_processes"])
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


# ---------------------------------------------------------------------- run_clm parity (GPT recipe)


def _text_file(tmp_path: Path) -> Path:
    lines = []
    for i in range(60):
        lines.append(f"Line {i} of the tale, where the king speaks.")
        if i % 5 == 0:
            lines.append("")
    path = tmp_path / "tale.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _no_barrier():
    import contextlib
    from types import SimpleNamespace

    return SimpleNamespace(main_process_first=lambda desc: contextlib.nullcontext())


@pytest.mark.timeout(60)
def test_text_file_keeps_document_order_and_the_text_as_written(tmp_path):
    """run_clm's train[:N%] / train[N%:] split of the lines, line breaks kept, no EOS per line."""
    import pretrain_gpt

    path = _text_file(tmp_path)
    data = pretrain_gpt.DataArguments(train_file=str(path), validation_split_percentage=10, block_size=16)
    raw = pretrain_gpt.load_text(data)
    text = path.read_text()
    rows = text.splitlines(keepends=True)
    assert raw["validation"]["text"] == rows[:7] and raw["train"]["text"] == rows[7:]
    tokenizer = pretrain_gpt.train_bpe(raw["train"]["text"], 300)
    blocks = pretrain_gpt.tokenize_and_group(raw, tokenizer, data, _no_barrier())["train"]
    decoded = "".join(tokenizer.decode(b["input_ids"]) for b in blocks)
    assert decoded == "".join(rows[7:])[: len(decoded)] and len(decoded) > 500
    assert tokenizer.eos_token not in decoded and "\n\n" in decoded


@pytest.mark.timeout(60)
def test_streaming_renames_the_text_column_and_a_missing_one_names_the_flag(tmp_path):
    import pretrain_gpt

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"content": f"document {i}", "id": i}) + "\n" for i in range(5)))
    data = pretrain_gpt.DataArguments(
        train_file=str(path), streaming=True, text_column="content", streaming_validation_documents=2, block_size=6
    )
    raw = pretrain_gpt.load_text(data)
    assert [row["text"] for row in raw["train"]] == ["document 2", "document 3", "document 4"]
    assert [row["text"] for row in raw["validation"]] == ["document 0", "document 1"]
    tokenizer = pretrain_gpt.train_bpe(["document 0 1 2 3 4"] * 20, 270)
    blocks = pretrain_gpt.tokenize_and_group(raw, tokenizer, data, _no_barrier())["train"]
    first = next(iter(blocks))
    assert set(first) == {"input_ids", "labels"} and len(first["input_ids"]) == data.block_size
    assert tokenizer.decode(first["input_ids"]).startswith("document 2" + tokenizer.eos_token + "document 3")
    with pytest.raises(ValueError, match=r"--text_column='body'.*\['content', 'id'\]"):
        pretrain_gpt.load_text(pretrain_gpt.DataArguments(train_file=str(path), text_column="body"))


@pytest.mark.timeout(60)
def test_a_tokenizer_left_in_the_output_folder_is_not_reused_for_another_corpus(tmp_path, caplog):
    from types import SimpleNamespace

    import pretrain_gpt
    from datasets import Dataset, DatasetDict

    stale = pretrain_gpt.train_bpe(["zebra quagga okapi"] * 50, 280)
    stale.save_pretrained(tmp_path / "tokenizer")  # the folder earlier versions reused silently
    raw = DatasetDict(train=Dataset.from_dict({"text": ["to be or not to be, that is the question"] * 50}))
    args = SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint=None, process_index=0)
    with caplog.at_level("WARNING"):
        fresh = pretrain_gpt.get_tokenizer(pretrain_gpt.ModelArguments(vocab_size=280), raw, args)
    assert fresh.get_vocab() == pretrain_gpt.train_bpe(raw["train"]["text"], 280).get_vocab() != stale.get_vocab()
    assert "is not used" in caplog.text and "--tokenizer_name" in caplog.text


@pytest.mark.timeout(30)
def test_one_json_file_of_arguments_keeps_the_recipe_defaults(tmp_path):
    import finetune_vit
    import pretrain_gpt

    path = tmp_path / "args.json"
    # 13 steps: one more than a round of the library's tau 12 (fewer would be refused: no round completes)
    path.write_text(json.dumps({"output_dir": str(tmp_path), "max_steps": 13, "model_name_or_path": "gpt2"}))
    model_args, _, training_args = pretrain_gpt.parse([str(path)])
    assert model_args.model_name_or_path == "gpt2" and training_args.max_steps == 13
    # the recipe's defaults, and the library's CO2 defaults (the recipes no longer override them)
    assert training_args.learning_rate == 1e-3 and training_args.co2_start_rule == "lookahead"
    path.write_text(json.dumps({"output_dir": str(tmp_path), "image_column_name": "img"}))
    _, data_args, training_args = finetune_vit.parse([str(path)])
    assert data_args.image_column_name == "img" and training_args.co2_local_steps == 2
    assert (training_args.co2_fragments, training_args.co2_start_rule) == (1, "eager")  # its own measurement


@pytest.mark.timeout(30)
def test_resume_true_in_a_json_file_means_the_last_checkpoint_and_block_size_zero_is_refused(tmp_path):
    import pretrain_gpt

    path = tmp_path / "args.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path), "resume_from_checkpoint": True}))
    with pytest.raises(ValueError, match="--resume_from_checkpoint true: --output_dir .* holds no checkpoint-N"):
        pretrain_gpt.parse([str(path)])
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-12").mkdir()
    assert pretrain_gpt.parse([str(path)])[2].resume_from_checkpoint == str(tmp_path / "checkpoint-12")
    flags = ["--output_dir", str(tmp_path), "--resume_from_checkpoint", "true"]
    assert pretrain_gpt.parse(flags)[2].resume_from_checkpoint == str(tmp_path / "checkpoint-12")
    with pytest.raises(ValueError, match="--block_size=0: allowed values are integers >= 1"):
        pretrain_gpt.parse(["--output_dir", str(tmp_path), "--block_size", "0"])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_shows_in_a_terminal_unless_turned_off(monkeypatch, tmp_path, tty):
    import pretrain_gpt

    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    _, _, args = pretrain_gpt.parse(["--output_dir", str(tmp_path)])
    assert args.disable_tqdm is (not tty)
    _, _, args = pretrain_gpt.parse(["--output_dir", str(tmp_path), "--disable_tqdm", "true"])
    assert args.disable_tqdm is True


def _tiny_checkpoint(folder: Path) -> None:
    """A small GPT-2 and its tokenizer saved as a 'pretrained' checkpoint to continue from."""
    import pretrain_gpt
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = pretrain_gpt.train_bpe([f"Line {i} of the tale, where the king speaks." for i in range(50)], 300)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_continued_pretraining_of_a_checkpoint_on_a_text_file(tmp_path):
    """--model_name_or_path: the run starts from the checkpoint's weights (at learning rate 0 it
    ends on them), with run_clm's flags; a pipeline runs on the output folder."""
    from safetensors.torch import load_file
    from transformers import pipeline

    base, out = tmp_path / "base", tmp_path / "out"
    _tiny_checkpoint(base)
    flags = ["--model_name_or_path", str(base), "--train_file", str(_text_file(tmp_path)), "--block_size", "16"]
    flags += ["--max_train_samples", "6", "--max_eval_samples", "3", "--preprocessing_num_workers", "1"]
    flags += ["--max_steps", "2", "--per_device_train_batch_size", "2", "--learning_rate", "0", "--eval_steps", "1"]
    flags += ["--validation_split_percentage", "20", "--co2_local_steps", "1", "--output_dir", str(out)]
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes/pretrain_gpt.py"), *flags], capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = load_file(base / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch_equal(before[k], after[k]) for k in before)
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["train_batch_size"] == 2
    final = json.loads((out / "eval_results.json").read_text())
    _check_card(out, final, task="text-generation", dataset="tale.txt", world_size=1, base=str(base))
    assert pipeline("text-generation", model=str(out))("Line 3", max_new_tokens=2)[0]["generated_text"]


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.mark.timeout(30)
def test_embeddings_grow_to_the_tokenizer_and_model_type_overrides_apply(tmp_path):
    import pretrain_gpt
    from transformers import AutoTokenizer

    _tiny_checkpoint(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.add_tokens(["<new_a>", "<new_b>"])
    args = pretrain_gpt.ModelArguments(model_name_or_path=str(tmp_path))
    model = pretrain_gpt.build_model(args, tokenizer, 16, seed=0)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    scratch = pretrain_gpt.ModelArguments(model_type="gpt2", config_overrides="n_layer=1,n_embd=16,n_head=2")
    assert pretrain_gpt.build_model(scratch, tokenizer, 16, seed=0).config.n_layer == 1
    with pytest.raises(ValueError, match="--config_overrides"):
        pretrain_gpt.parse(
            ["--output_dir", str(tmp_path), "--config_overrides", "n_layer=1", "--model_name_or_path", "x"]
        )
    with pytest.raises(ValueError, match="--block_size=512"):
        pretrain_gpt.fit_tokenizer_to_model(tokenizer, model, 512)


# ---------------------------------------------------------------------- run_image_classification parity


def _image_folder(root: Path) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name, color in (("cat", (200, 30, 30)), ("dog", (30, 30, 200))):
            (root / split / name).mkdir(parents=True)
            for i in range(4):
                pixels = np.clip(rng.normal(0, 20, (20, 24, 3)) + color, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_vit_on_an_imagefolder_with_augmentation_and_a_pipeline_on_the_output(tmp_path):
    from PIL import Image
    from transformers import pipeline

    images, out = _image_folder(tmp_path / "pets"), tmp_path / "out"
    flags = ["--train_dir", str(images / "train"), "--validation_dir", str(images / "val"), "--output_dir", str(out)]
    flags += ["--max_steps", "2", "--per_device_train_batch_size", "4", "--eval_steps", "1"]
    flags += ["--image_column_name", "image", "--label_column_name", "label"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes/finetune_vit.py"), *flags], capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0, done.stderr[-3000:]
    final = json.loads((out / "eval_results.json").read_text())
    _check_card(out, final, task="image-classification", dataset=str(images / "train"), world_size=1)
    result = pipeline("image-classification", model=str(out))(Image.open(images / "val/dog/0.png"))
    assert {r["label"] for r in result} == {"cat", "dog"}


@pytest.mark.timeout(60)
def test_vit_columns_are_named_by_flags_not_guessed(tmp_path):
    import finetune_vit

    images = _image_folder(tmp_path)
    data = finetune_vit.DataArguments(train_dir=str(images / "train"), label_column_name="labels")
    with pytest.raises(ValueError, match=r"--label_column_name='labels'.*\['image', 'label'\]"):
        finetune_vit.load_images(data)
    data = finetune_vit.DataArguments(train_dir=str(images / "train"), image_column_name="img")
    with pytest.raises(ValueError, match="--image_column_name='img'"):
        finetune_vit.load_images(data)


@pytest.mark.timeout(30)
def test_vit_transforms_follow_the_processor_and_augment_training_only():
    import finetune_vit
    import numpy as np
    import torch
    from PIL import Image
    from transformers import ViTImageProcessor

    processor = ViTImageProcessor(size={"shortest_edge": 8}, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.2, 0.2])
    train, evaluate = finetune_vit.image_transforms(processor)
    gradient = np.tile(np.linspace(0, 255, 24, dtype=np.float32), (12, 1))
    picture = Image.fromarray(np.stack([gradient] * 3, axis=-1).astype(np.uint8))  # 24 wide, 12 high
    torch.manual_seed(0)
    crops = [train(picture) for _ in range(6)]
    assert all(c.shape == (3, 8, 8) for c in crops) and len({c.sum().item() for c in crops}) > 1
    first, second = evaluate(picture), evaluate(picture)
    assert first.shape == (3, 8, 8) and torch.equal(first, second)
    # resize 12x24 -> 8x16, center crop 8x8: the middle of the gradient, normalised per channel
    middle = np.asarray(picture.resize((16, 8), Image.BILINEAR))[:, 4:12, :].astype(np.float32) / 255
    expected = (torch.from_numpy(middle).permute(2, 0, 1) - torch.tensor([0.5, 0.4, 0.3]).view(3, 1, 1)) / 0.2
    assert torch.allclose(first, expected, atol=1e-5)


@pytest.mark.timeout(60)
def test_vit_checkpoint_with_other_labels_needs_ignore_mismatched_sizes(tmp_path):
    import finetune_vit

    finetune_vit.build_model(finetune_vit.ModelArguments(), list("abc"), seed=0).save_pretrained(tmp_path)
    args = finetune_vit.ModelArguments(model_name_or_path=str(tmp_path))
    with pytest.raises(Exception, match="ignore_mismatched_sizes"):
        finetune_vit.build_model(args, ["cat", "dog"], seed=0)
    args.ignore_mismatched_sizes = True
    model = finetune_vit.build_model(args, ["cat", "dog"], seed=0)
    assert model.config.id2label == {0: "cat", 1: "dog"} and type(model).__name__ == "ViTForImageClassification"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("metric", ["eval_accuracy", "eval_loss"])
def test_the_curve_says_whose_loss_it_plots_and_its_legend_covers_no_point(tmp_path, monkeypatch, metric):
    from types import SimpleNamespace

    import common
    import matplotlib.figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    label = common.training_loss_label
    assert label(SimpleNamespace(world_size=2, co2_enabled=True)) == "training loss (mean over the 2 processes)"
    assert label(SimpleNamespace(world_size=1, co2_enabled=False)) == "training loss (one process)"
    torchft = SimpleNamespace(world_size=1, co2_enabled=True, co2_fault_tolerance="torchft")
    assert label(torchft) == "training loss (replica group 0's own)"  # each replica group is a launch of one

    saved = []
    real_savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    history = [{"step": s, "loss": 2.0 - s / 10} for s in range(1, 11)] + [{"step": 10, metric: 0.9}]
    history += [{"step": 10, "train_runtime": 1.0}, {"step": 10, metric: 0.92}]  # after training
    loss_label = label(SimpleNamespace(world_size=16, co2_enabled=True))  # the longest label a recipe writes
    common.plot_curves(history, str(tmp_path / "c.png"), title="t", metric=metric, loss_label=loss_label)
    (fig,) = saved
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts == [loss_label, f"{metric} (anchor)", f"{metric}, final model"]  # both axes' lines
    box = legend.get_window_extent(renderer)
    assert all(box.y1 <= ax.get_window_extent(renderer).y0 for ax in fig.axes)  # under the axes, over no point
    inside = fig.bbox
    assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, (box, inside)
    real_savefig(fig, tmp_path / "real.png", dpi=120)  # as plot_curves saves it
    assert (tmp_path / "real.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_refused_setting_is_the_last_line_printed_once_without_a_traceback(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    command = [
        sys.executable,
        str(ROOT / "recipes/pretrain_gpt.py"),
        "--output_dir",
        str(tmp_path),
        "--co2_local_steps",
        "0",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: co2_local_steps=0") and "co2_local_steps=0" in lines[-1]
    assert done.stderr.count("co2_local_steps=0") == 1 and "Traceback" not in done.stderr
