"""After a change of world, keep the old workers' inner optimizer state or reset it? Measured.

A 3-process CO2Trainer run (tiny GPT-2, AdamW) saves at step ``--save-at``; it is resumed with
``--co2_elastic`` on 2 processes twice: as co2_hf does it (new worker w takes old worker w mod G's
Adam moments) and with the inner optimizer state cleared after the resume (Adam then restarts its
moments and bias correction). Both train to ``--steps``; printed per seed: the training loss of the
logging windows after the resume and the held-out loss of the final anchor. Gloo on one machine.

    python scripts/elastic_optimizer_choice.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from co2_hf.testing import run_processes


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _trainer(out: str, steps: int, seed: int, save_at: int | None, callbacks=()):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback

    from co2_hf import CO2Trainer, CO2TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    args = CO2TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=4,
        save_strategy="steps" if save_at else "no",
        save_steps=save_at or 1,
        report_to="none",
        seed=seed,
        data_seed=seed,
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        co2_local_steps=4,
        co2_elastic=True,
    )
    trainer = CO2Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=_dataset(512, seed))
    trainer.remove_callback(PrinterCallback)
    for callback in callbacks:
        trainer.add_callback(callback)
    return trainer


def _dataset(n: int, seed: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, 64, (n, 1), generator=g) + torch.arange(16)) % 64
    return [{"input_ids": row, "labels": row} for row in ids]


def save(rank: int, world: int, out: str, save_at: int, seed: int) -> None:
    _env(rank, world, 29571)
    _trainer(out, save_at, seed, save_at).train()


def resume(rank: int, world: int, out: str, save_at: int, steps: int, seed: int, reset: bool) -> dict:
    import torch
    from transformers import TrainerCallback

    _env(rank, world, 29572 + int(reset))

    class Reset(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if reset:
                trainer._inner_optimizer().state.clear()

    trainer = _trainer(out + ("_reset" if reset else "_carry"), steps, seed, None, [Reset()])
    trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{save_at}"))
    ids = torch.stack([x["input_ids"] for x in _dataset(128, 10_000 + seed)])
    with trainer.co2.anchor_in_place(), torch.no_grad():
        held_out = float(trainer.model(input_ids=ids, labels=ids).loss)
    # the log history includes the saved run's: keep the windows after the resume
    after = [e["loss"] for e in trainer.state.log_history if "loss" in e and e["step"] > save_at]
    return {"losses": after, "held_out": held_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--save-at", type=int, default=24)
    parser.add_argument("--steps", type=int, default=64)
    a = parser.parse_args()
    rows = []
    for seed in a.seeds:
        with tempfile.TemporaryDirectory() as out:
            run_processes(save, 3, out, a.save_at, seed, timeout_s=600)
            row = {"seed": seed}
            for reset in (False, True):
                result = run_processes(resume, 2, out, a.save_at, a.steps, seed, reset, timeout_s=600)[0]
                row["reset" if reset else "carry"] = result
            rows.append(row)
            print(json.dumps(row), flush=True)
    diffs = [r["reset"]["held_out"] - r["carry"]["held_out"] for r in rows]
    first = [r["reset"]["losses"][0] - r["carry"]["losses"][0] for r in rows]
    summary = {"held_out_reset_minus_carry": diffs, "first_window_reset_minus_carry": first}
    if len(diffs) > 1:
        summary["mean_held_out_diff"] = statistics.mean(diffs)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
