"""Soak: a 2-process CO2Trainer run killed and resumed again and again must end exactly where an
uninterrupted run ends.

Each cycle resumes from the last checkpoint (``resume_from_checkpoint=True``) and meets one fault
at a random step: a rank is SIGKILLed or SIGSTOPped after an optimizer step (mostly mid-round), or
SIGKILLed inside a save (before its own CO2 file, before publishing, or -- rank 0 -- just before
the rename). After each fault the script checks that the other rank stopped by itself with an
error, and that every visible ``checkpoint-N`` is complete (its manifest matches its files). The
last cycle trains to the end; its final anchor is compared bit for bit with the uninterrupted
run's. Ranks are started without torchrun (whose agent would kill the survivor itself).

    python scripts/soak.py --steps 3000 --cycles 8 --out soak_out     # prints one JSON line
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import signal
import sys
import time

from co2_hf.checkpoints.publish import staged_parts
from co2_hf.testing import HF_PRELOAD, run_with_faults

SAVE_PHASES = ("rank_file", "publish", "rename")  # where a kill inside a save lands


def settings(steps: int, *, save_steps: int, timeout_s: float) -> dict:
    return dict(
        max_steps=steps,
        save_steps=save_steps,
        save_strategy="steps",
        save_total_limit=2,
        logging_steps=max(save_steps // 2, 1),
        co2_local_steps=4,
        co2_outer_momentum=0.5,
        co2_clip_threshold=1.0,
        co2_timeout_s=timeout_s,
        lr_scheduler_type="cosine",
    )


def train(rank: int, world: int, out: str, config: dict, fault: dict | None) -> dict:
    """One cycle on one rank: resume if there is a checkpoint, meet ``fault`` if it is this rank's."""
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback
    from transformers.trainer_utils import get_last_checkpoint

    from co2_hf import CO2Trainer, CO2TrainingArguments

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    import torch

    torch.manual_seed(0)
    gpt2 = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(gpt2)
    args = CO2TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        report_to="none",
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        **config,
    )
    trainer = CO2Trainer(model=model, args=args, train_dataset=_dataset())
    trainer.remove_callback(PrinterCallback)  # the logs still gather the loss across ranks
    if fault is not None and fault["rank"] == rank:
        _arm(trainer, fault, out)
    resume = os.path.isdir(out) and get_last_checkpoint(out) is not None
    try:
        trainer.train(resume_from_checkpoint=True if resume else None)
    except Exception as error:  # a peer died: record when this rank noticed, and how
        return {"error": f"{type(error).__name__}: {error}"[:600], "at": time.time()}
    return {"final": {k: v.clone() for k, v in trainer.model.state_dict().items()}, "resumed": resume}


def _dataset():
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = (torch.randint(0, 64, (256, 1), generator=g) + torch.arange(16)) % 64  # counting: learnable
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def _arm(trainer, fault: dict, out: str) -> None:
    """Make this rank signal itself at ``fault["step"]``, after the optimizer step or inside the save."""
    from transformers import TrainerCallback

    from co2_hf.checkpoints import publish, rank_files

    def strike() -> None:
        _write_json(os.path.join(out, "fault.json"), {**fault, "at": time.time()})
        os.kill(os.getpid(), getattr(signal, fault["signal"]))
        time.sleep(600)  # frozen (SIGSTOP) until the launcher kills it

    if fault["where"] == "step":

        class Strike(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == fault["step"]:
                    strike()

        trainer.add_callback(Strike())
        return
    module, name = {
        "rank_file": (rank_files, "save_rank_state"),
        "publish": (publish, "publish"),
        "rename": (publish, "_rename"),
    }[fault["where"]]
    original = getattr(module, name)

    def struck(*args, **kwargs):
        if trainer.state.global_step == fault["step"]:
            strike()
        return original(*args, **kwargs)

    setattr(module, name, struck)


def _write_json(path: str, payload: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)


def plan_fault(rng: random.Random, start: int, steps: int, *, save_steps: int, left: int) -> dict:
    """A fault at a random step after ``start`` (the step the cycle resumes from); ``left`` faults
    remain, so that they spread over the whole run."""
    span = max(2 * save_steps, (steps - start) // (left + 1) * 2)
    step = rng.randint(start + 1, min(start + span, steps - 1))
    kind = rng.choice(("SIGKILL", "SIGSTOP", "save"))
    save = -(-step // save_steps) * save_steps  # the first save at or after that step
    if kind != "save" or save > steps:
        signame = "SIGKILL" if kind == "save" else kind
        return {"rank": rng.randint(0, 1), "signal": signame, "where": "step", "step": step}
    where, step = rng.choice(SAVE_PHASES), save
    rank = 0 if where == "rename" else rng.randint(0, 1)  # only the leader renames
    return {"rank": rank, "signal": "SIGKILL", "where": where, "step": step}


def visible_checkpoints_are_complete(out: str, world: int) -> list[str]:
    """Every ``checkpoint-N`` that resume could pick must pass the manifest check on every rank."""
    from co2_hf.checkpoints import rank_files

    found = sorted(glob.glob(os.path.join(out, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[1]))
    for folder in found:
        for rank in range(world):
            rank_files.check_complete(folder, rank, world)
    return found


def last_step(out: str) -> int:
    found = glob.glob(os.path.join(out, "checkpoint-*"))
    return max((int(p.rsplit("-", 1)[1]) for p in found), default=0)


def soak(out: str, *, steps: int, faults: list[dict] | None = None, cycles: int = 0, seed: int = 0, **kw) -> dict:
    """The uninterrupted run, then the faulted one; ``faults`` fixed, or ``cycles`` random ones."""
    save_steps, timeout_s = kw.get("save_steps", 50), kw.get("timeout_s", 10.0)
    config = settings(steps, save_steps=save_steps, timeout_s=timeout_s)
    shutil.rmtree(out, ignore_errors=True)
    start = time.time()
    reference = _run(os.path.join(out, "uninterrupted"), config, None)
    uninterrupted_s = time.time() - start
    rng, faulted = random.Random(seed), os.path.join(out, "faulted")
    planned = list(faults) if faults is not None else [None] * cycles
    log = []
    for i, fault in enumerate(planned):
        left = len(planned) - i
        fault = fault or plan_fault(rng, last_step(faulted), steps, save_steps=save_steps, left=left)
        log.append(_cycle(faulted, config, fault))
    final = _run(faulted, config, None)
    names = reference[0]["final"].keys()
    differ = [n for n in names if not _equal(final[0]["final"][n], reference[0]["final"][n])]
    return {
        "steps": steps,
        "cycles_survived": len(log),
        "cycles": log,
        "final_resumed": final[0]["resumed"],
        "ranks_agree": all(_equal(final[0]["final"][n], final[1]["final"][n]) for n in names),
        "tensors_differing": differ,
        "max_abs_diff": max((_max_diff(final[0]["final"][n], reference[0]["final"][n]) for n in names), default=0.0),
        "uninterrupted_s": round(uninterrupted_s, 1),
        "total_s": round(time.time() - start, 1),
    }


def _cycle(out: str, config: dict, fault: dict) -> dict:
    resumed_from = last_step(out)
    start = time.time()
    survivor = 1 - fault["rank"]
    outcomes = run_with_faults(train, 2, out, config, fault, wait_for=[survivor], timeout_s=300, preload=HF_PRELOAD)
    outcome = outcomes[survivor]
    if outcome is None or not outcome["ok"] or "error" not in outcome["result"]:
        raise RuntimeError(f"cycle {fault}: the survivor did not stop with an error: {_summary(outcome)}")
    with open(os.path.join(out, "fault.json")) as f:
        struck = json.load(f)
    os.remove(os.path.join(out, "fault.json"))
    visible = visible_checkpoints_are_complete(out, 2)
    return {
        **fault,
        "resumed_from": resumed_from,
        "survivor_stopped_after_s": round(outcome["result"]["at"] - struck["at"], 2),
        "survivor_error": outcome["result"]["error"].splitlines()[0][:200],
        "visible_checkpoints": [os.path.basename(p) for p in visible],
        # each save stages in its own <name>.<run>.<token>: the names, without the run and token
        "staged_leftovers": sorted(staged_parts(e)[0] for e in os.listdir(os.path.join(out, "_co2_staging")))
        if os.path.isdir(os.path.join(out, "_co2_staging"))
        else [],
        "wall_s": round(time.time() - start, 1),
    }


def _run(out: str, config: dict, fault: dict | None) -> list[dict]:
    outcomes = run_with_faults(train, 2, out, config, fault, timeout_s=1800, preload=HF_PRELOAD)
    if any(o is None or not o["ok"] or "final" not in o["result"] for o in outcomes):
        raise RuntimeError(f"a run without faults did not finish: {[_summary(o) for o in outcomes]}")
    return [o["result"] for o in outcomes]


def _summary(outcome: dict | None) -> str:
    if outcome is None:
        return "killed"
    if not outcome["ok"]:
        return outcome["error"][-1500:]
    return outcome["result"].get("error", "finished training")


def _equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--cycles", type=int, default=8, help="kill-and-resume cycles, each at a random step")
    parser.add_argument("--save_steps", type=int, default=50)
    parser.add_argument(
        "--timeout_s", type=float, default=10.0, help="co2_timeout_s (and ddp_timeout); a frozen rank costs this much"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="soak_out")
    a = parser.parse_args()
    result = soak(a.out, steps=a.steps, cycles=a.cycles, seed=a.seed, save_steps=a.save_steps, timeout_s=a.timeout_s)
    print(json.dumps(result))
    sys.exit(0 if not result["tensors_differing"] and result["ranks_agree"] else 1)


if __name__ == "__main__":
    main()
