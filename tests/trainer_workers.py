"""Per-rank Trainer runs for tests/test_trainer.py: a tiny GPT-2 built from a config, no downloads."""

from __future__ import annotations

import os

import torch

TAU = 4


def _env(rank: int, world: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29555",
    )


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def dataset(n: int = 256, seq: int = 16, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 64, (n, 1), generator=g)
    ids = (base + torch.arange(seq)) % 64  # counting sequences: learnable
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def make_args(output_dir: str, config_class=None, **overrides):
    """The small runs' arguments (``config_class``: CO2TrainingArguments, or a subclass mixing in another)."""
    from co2_hf import CO2TrainingArguments

    kwargs = dict(
        output_dir=output_dir,
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        logging_steps=4,
        report_to="none",
        seed=0,
        save_strategy="no",
        eval_strategy="no",
        per_device_eval_batch_size=8,
        co2_local_steps=TAU,
        disable_tqdm=True,
        use_cpu=True,
        lr_scheduler_type="constant",
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return (config_class or CO2TrainingArguments)(**kwargs)


class SequenceProbe:
    """Default-group collectives (C++ ones included) issued during local steps, per logging window,
    and a checksum of the anchor after every round boundary."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Probe(TrainerCallback):
            def __init__(self):
                self.windows, self.anchor_sums, self._start, self.trainer = [], [], None, None

            @staticmethod
            def _seq():
                import torch.distributed as dist

                return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()

            def on_log(self, args, state, control, logs=None, **kw):
                if "loss" in (logs or {}):
                    self._start = self._seq()  # after the logging step's own gathers

            def on_evaluate(self, args, state, control, **kw):
                if self._start is not None:  # evaluation is not a local step: restart the window
                    self._start = self._seq()

            def on_step_end(self, args, state, control, **kw):
                co2 = self.trainer.co2
                if co2 is not None and co2.round_step == 0:
                    self.anchor_sums.append(float(co2._anchor.double().sum()))
                # just before the next logging step gathers its loss: the window held local steps only
                if self._start is not None and state.global_step % args.logging_steps == 0:
                    self.windows.append(self._seq() - self._start)
                    self._start = None

        return _Probe()


def co2_run(rank: int, world: int, out: str) -> dict:
    """Train with CO2, evaluating during training, then save; report what the tests check."""
    from transformers import AutoModelForCausalLM

    from co2_hf import CO2Trainer

    _env(rank, world)
    probe = SequenceProbe()
    args = make_args(out, eval_strategy="steps", eval_steps=4)
    trainer = CO2Trainer(
        model=tiny_gpt2(), args=args, train_dataset=dataset(), eval_dataset=dataset(64, seed=1), callbacks=[probe]
    )
    probe.trainer = trainer
    trainer.train()
    eval_trained = trainer.evaluate()["eval_loss"]
    trainer.save_model(out)
    torch.distributed.barrier()  # rank 0 writes the folder
    loaded = AutoModelForCausalLM.from_pretrained(out)
    plain_eval = CO2Trainer(
        model=loaded, args=make_args(out + "_eval", co2_enabled=False), eval_dataset=dataset(64, seed=1)
    )
    return {
        "windows": probe.windows,
        "anchor_sums": probe.anchor_sums,
        "log_history": trainer.state.log_history,
        "wrapped": type(trainer.model_wrapped).__name__,
        "final": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "eval_trained": eval_trained,
        "eval_loaded": plain_eval.evaluate()["eval_loss"],
        "world": torch.distributed.get_world_size(),
    }


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def disabled_versus_plain(rank: int, world: int, out: str) -> dict:
    """--co2_enabled false must be the plain Trainer: same data parallel loss curve."""
    from transformers import Trainer, TrainingArguments

    from co2_hf import CO2Trainer

    _env(rank, world)
    disabled = CO2Trainer(
        model=tiny_gpt2(), args=make_args(out + "_off", co2_enabled=False, logging_steps=1), train_dataset=dataset()
    )
    disabled.train()
    plain_args = {k: v for k, v in vars(make_args(out + "_plain", logging_steps=1)).items()}
    plain_kwargs = {
        f: plain_args[f]
        for f in TrainingArguments.__dataclass_fields__
        if f in plain_args and TrainingArguments.__dataclass_fields__[f].init
    }
    plain = Trainer(model=tiny_gpt2(), args=TrainingArguments(**plain_kwargs), train_dataset=dataset())
    plain.train()
    return {"disabled": _losses(disabled), "plain": _losses(plain), "wrapped": type(disabled.model_wrapped).__name__}


class _StopAt:
    def __new__(cls, step: int):
        from transformers import TrainerCallback

        class _Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                if state.global_step == step:
                    control.should_training_stop = True

        return _Stop()


STOP_AT = 6  # boundaries after steps 4 and 8: step 6 is mid-round with the all-reduce in flight


def uninterrupted_and_stopped(rank: int, world: int, out: str, overrides: dict | None = None) -> dict:
    """An uninterrupted run, and one that saves at step 6 and is stopped there by a callback."""
    from co2_hf import CO2Trainer

    _env(rank, world)
    extra = overrides or {}
    full = CO2Trainer(model=tiny_gpt2(), args=make_args(out + "_full", **extra), train_dataset=dataset())
    full.train()
    stopped = CO2Trainer(
        model=tiny_gpt2(),
        args=make_args(out, save_strategy="steps", save_steps=STOP_AT, **extra),
        train_dataset=dataset(),
        callbacks=[_StopAt(STOP_AT)],
    )
    stopped.train()
    return {
        "full": {k: v.clone() for k, v in full.model.state_dict().items()},
        "stopped_at": stopped.state.global_step,
    }


def resumed(rank: int, world: int, out: str, overrides: dict | None = None) -> dict:
    from co2_hf import CO2Trainer

    _env(rank, world)
    torch.manual_seed(1234)  # a different process state: the checkpoint must restore everything
    trainer = CO2Trainer(model=tiny_gpt2(), args=make_args(out, **(overrides or {})), train_dataset=dataset())
    trainer.train(resume_from_checkpoint=f"{out}/checkpoint-{STOP_AT}")
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def stopped_then_resumed_in_process(rank: int, world: int, out: str, overrides: dict | None = None) -> dict:
    """``uninterrupted_and_stopped`` and ``resumed`` in one spawn: for the 4-process variant, where a
    second spawn costs more than the test; fresh-process resume is covered with 2 processes."""
    first = uninterrupted_and_stopped(rank, world, out, overrides)
    return {**first, "final": resumed(rank, world, out, overrides)}


def best_model_run(rank: int, world: int, out: str) -> dict:
    """``load_best_model_at_end`` with a metric whose best is the first checkpoint (the loss, higher
    is better): after training the model, ``evaluate`` and ``save_model`` must be that checkpoint's."""
    from co2_hf import CO2Trainer

    _env(rank, world)
    every = dict(save_strategy="steps", save_steps=4, eval_strategy="steps", eval_steps=4, save_total_limit=2)
    best = dict(load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    args = make_args(out, **every, **best)
    trainer = CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset(), eval_dataset=dataset(64, seed=1))
    trainer.train()
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}  # in training
    evaluated = trainer.evaluate()["eval_loss"]
    trainer.save_model(out + "/saved")
    torch.distributed.barrier()  # rank 0 writes the folder
    return {"best": trainer.state.best_model_checkpoint, "evals": evals, "evaluated_after": evaluated}


def two_process_suite(rank: int, world: int, out: str) -> dict:
    return {
        "co2": co2_run(rank, world, out + "/co2"),
        "disabled": disabled_versus_plain(rank, world, out + "/dp"),
        "resume": uninterrupted_and_stopped(rank, world, out + "/resume"),
        "best": best_model_run(rank, world, out + "/best"),
    }


class _AtTrainBegin:
    """What the resumed trainer holds when training starts: CO2's counters, whether every live
    tensor is the anchor, and the inner optimizer's state (as tensors by parameter index)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Begin(TrainerCallback):
            trainer, seen = None, {}

            def on_train_begin(self, args, state, control, **kw):
                co2 = self.trainer.co2
                anchor, live = co2.anchor_state(), self.trainer.model.state_dict()
                names = [s.names[0] for s in co2.layout.segments]
                optimizer = self.trainer._inner_optimizer().state_dict()["state"]
                state = co2.state_dict()
                self.seen = {
                    "counters": {"clock": state["counters"], "fragment": state["fragments"][0]["counters"]},
                    "live_is_anchor": all(torch.equal(live[n], anchor[n]) for n in names),
                    "optimizer": {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.items()},
                }

        return _Begin()


def resumed_on_another_world(rank: int, world: int, out: str, target: str) -> dict:
    """``uninterrupted_and_stopped``'s 2-process checkpoint resumed with co2_elastic on this world,
    trained to the end and saved; what it held at the start, the warnings, the final anchor."""
    import logging

    from co2_hf import CO2Trainer

    if world > 1:
        _env(rank, world)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("co2_hf.integrations.trainer").addHandler(handler)
    torch.manual_seed(1234)
    begin = _AtTrainBegin()
    args = make_args(target, co2_elastic=True)
    trainer = CO2Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset(), callbacks=[begin])
    begin.trainer = trainer
    try:
        trainer.train(resume_from_checkpoint=f"{out}/checkpoint-{STOP_AT}")
    finally:
        logging.getLogger("co2_hf.integrations.trainer").removeHandler(handler)
    trainer.save_model(target)
    if world > 1:
        torch.distributed.barrier()  # rank 0 writes the folder
    return {
        "begin": begin.seen,
        "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING and "resuming" in r.getMessage()],
        "global_step": trainer.state.global_step,
        "anchor": {k: v.clone() for k, v in trainer.co2.anchor_state().items()},
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }


def unappliable_resumes(rank: int, world: int, out: str) -> dict:
    """A 2-process checkpoint whose files pass the checks (manifest rehashed) but cannot be applied on
    rank 1 only: its ``co2`` state emptied, then its RNG file replaced. What each rank said, and the
    step it reached."""
    import shutil

    import torch.distributed as dist
    from tampering import rehash, rewrite_manifest

    from co2_hf import CO2Trainer

    _env(rank, world)
    saved = make_args(out + "/run", max_steps=4, save_strategy="steps", save_steps=4)
    CO2Trainer(model=tiny_gpt2(), args=saved, train_dataset=dataset()).train()
    good, outcomes = out + "/run/checkpoint-4", {}
    for tamper in ("co2_state", "rng_state"):
        folder = f"{out}/{tamper}"
        if rank == 0:
            shutil.copytree(good, folder)
            if tamper == "co2_state":
                state = torch.load(f"{folder}/co2_rank1.pt", weights_only=True)
                torch.save({**state, "co2": {}}, f"{folder}/co2_rank1.pt")
            else:
                torch.save({"python": "not a state"}, f"{folder}/rng_state_1.pth")
            rewrite_manifest(folder, rehash(folder))
        dist.barrier()
        again = CO2Trainer(model=tiny_gpt2(), args=make_args(out + "/again", max_steps=8), train_dataset=dataset())
        try:
            again.train(resume_from_checkpoint=folder)
            outcomes[tamper] = ("trained", again.state.global_step)
        except ValueError as error:
            outcomes[tamper] = (str(error), again.state.global_step)
    return outcomes
