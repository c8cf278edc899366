"""Per-rank training loops for FSDP2 inside a CO2 worker (tests/test_fsdp.py)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from workers import TinyNet, batch, loss_on, make_optimizer, train_steps

from co2_hf import CO2, CO2Config
from co2_hf.core import worker_mesh
from co2_hf.core.wire import header_numel


def sharded_tiny_net(k: int) -> TinyNet:
    """TinyNet (tied weights, a frozen layer) sharded by FSDP2 over the k processes of a worker."""
    model = TinyNet(seed=0, batchnorm=False)
    fully_shard(model, mesh=worker_mesh(k, "cpu"))
    return model


def full_anchor(co2: CO2, names: list[str]) -> dict[str, torch.Tensor]:
    """The anchor as whole tensors (an all-gather over the worker for every FSDP2 shard)."""
    state = co2.anchor_state()
    return {n: _full(state[n]).detach().double().clone() for n in names}


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def train_fsdp(rank: int, world: int, cfg_kwargs: dict, steps: int) -> dict:
    """Every process trains on its own batch; FSDP2 averages the gradients inside the worker."""
    k = cfg_kwargs["co2_worker_size"]
    model = sharded_tiny_net(k)
    names = [n for n in model.state_dict() if not n.startswith("frozen.")]
    optimizer = make_optimizer(model, "sgd")
    co2 = CO2(model, CO2Config(**cfg_kwargs), optimizer=optimizer)
    launched = []
    launch = co2.comm.launch
    header = header_numel(co2.num_workers)
    co2.comm.launch = lambda t: launched.append(t.numel() - header) or launch(t)
    anchors = []
    for step in range(steps):
        optimizer.zero_grad()
        loss_on(model, rank, step).backward()
        co2.average_gradients()  # a no-op after the warm-up: FSDP2 already averaged the worker
        optimizer.step()
        if co2.step():
            anchors.append(full_anchor(co2, names))
    co2.finalize()
    anchors.append(full_anchor(co2, names))
    live = {n: _full(t).detach().double().clone() for n, t in model.state_dict().items() if n in names}
    return {
        "anchors": anchors,
        "live": live,
        "launched_elements": launched,
        "params": sum(s.global_numel for s in co2.layout.segments if s.is_param),
        "nbytes": co2.outer_state_nbytes(),
    }


def fsdp_stop_and_resume(rank: int, world: int, cfg_kwargs: dict, path: str) -> dict:
    """Uninterrupted 14 steps; a run stopped at step 6 (mid-round, in flight) saved per rank; a
    third model, built anew, that loads it and finishes. Returns the first and the last."""
    k = cfg_kwargs["co2_worker_size"]

    def fresh():
        model = sharded_tiny_net(k)
        optimizer = make_optimizer(model)
        return model, optimizer, CO2(model, CO2Config(**cfg_kwargs), optimizer=optimizer)

    def train(model, optimizer, co2, start, stop):
        train_steps(model, optimizer, co2, rank, start, stop)

    def final(model, co2):
        co2.finalize()
        return {n: _full(v).detach().clone() for n, v in model.state_dict().items()}

    model, optimizer, co2 = fresh()
    train(model, optimizer, co2, 0, 14)
    full = final(model, co2)
    model, optimizer, co2 = fresh()
    train(model, optimizer, co2, 0, 6)
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "co2": co2.state_dict()},
        f"{path}.rank{rank}",
    )
    model, optimizer, co2 = fresh()
    saved = torch.load(f"{path}.rank{rank}", weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    co2.load_state_dict(saved["co2"])
    train(model, optimizer, co2, 6, 14)
    return {"full": full, "resumed": final(model, co2)}


def fsdp_over_every_process(rank: int, world: int) -> str:
    """FSDP2 over all 4 processes (across workers) with co2_worker_size=2: must be refused."""
    from torch.distributed.device_mesh import init_device_mesh

    model = TinyNet(seed=0, batchnorm=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    try:
        CO2(model, CO2Config(co2_worker_size=2))
    except ValueError as error:
        return str(error)
    return "not refused"


def _whole_state(model) -> dict[str, torch.Tensor]:
    return {k: _full(v).detach().clone() for k, v in model.state_dict().items()}


def trainer_fsdp_suite(rank: int, world: int, out: str) -> dict:
    """CO2Trainer with co2_worker_size=2: replicated workers, FSDP2 inside each worker (with
    evaluations during training and a saved model), and FSDP2 stopped mid-round then resumed."""
    from trainer_workers import STOP_AT, _env, _StopAt, dataset, make_args, tiny_gpt2
    from transformers import AutoModelForCausalLM

    from co2_hf import CO2Trainer

    _env(rank, world)
    # SGD: Adam would amplify the rounding noise of gradients that are ~0 (attention key biases).
    # The eager start: live models differ from the anchor at every step, so an evaluation on the
    # anchor that leaked into training would show.
    # one fragment: FSDP2 cuts fragments on its own local shards, so F > 1 would differ from replicas
    k2 = dict(co2_worker_size=2, optim="sgd", learning_rate=0.1, co2_start_rule="eager", co2_fragments=1)
    fsdp = dict(k2, fsdp="full_shard")

    replicated = CO2Trainer(model=tiny_gpt2(), args=make_args(f"{out}/replicated", **k2), train_dataset=dataset())
    replicated.train()

    sharded = CO2Trainer(
        model=tiny_gpt2(),
        args=make_args(f"{out}/fsdp", eval_strategy="steps", eval_steps=3, **fsdp),  # mid-round (tau 4)
        train_dataset=dataset(),
        eval_dataset=dataset(64, seed=1),
    )
    sharded.train()
    eval_trained = sharded.evaluate()["eval_loss"]
    sharded.save_model(f"{out}/fsdp_model")
    torch.distributed.barrier()
    loaded = AutoModelForCausalLM.from_pretrained(f"{out}/fsdp_model")
    plain = CO2Trainer(
        model=loaded, args=make_args(f"{out}/eval", co2_enabled=False), eval_dataset=dataset(64, seed=1)
    )

    stopped = CO2Trainer(
        model=tiny_gpt2(),
        args=make_args(f"{out}/resume", save_strategy="steps", save_steps=STOP_AT, **fsdp),
        train_dataset=dataset(),
        callbacks=[_StopAt(STOP_AT)],
    )
    stopped.train()
    torch.manual_seed(1234)  # a different process state: the checkpoint must restore everything
    resumed = CO2Trainer(model=tiny_gpt2(), args=make_args(f"{out}/resume", **fsdp), train_dataset=dataset())
    resumed.train(resume_from_checkpoint=f"{out}/resume/checkpoint-{STOP_AT}")
    return {
        "replicated": _whole_state(replicated.model),
        "fsdp": _whole_state(sharded.model),
        "fsdp_type": type(sharded.model).__name__,
        "evals": [e["eval_loss"] for e in sharded.state.log_history if "eval_loss" in e],
        "eval_trained": eval_trained,
        "eval_loaded": plain.evaluate()["eval_loss"],
        "resumed": _whole_state(resumed.model),
        "losses": [e["loss"] for e in sharded.state.log_history if "loss" in e],
    }


def accelerate_fsdp_run(rank: int, world: int, out: str, *, save_at: int | None, load: bool) -> dict:
    """A custom Accelerate loop with FSDP2 inside workers of 2: 12 steps; optionally saved with
    ``co2.save_state`` at ``save_at`` and loaded back with ``co2.load_state`` right away
    (into a model moved elsewhere in between), which must not change the run at all."""
    from accelerate import Accelerator
    from trainer_workers import _env, tiny_gpt2

    from co2_hf import CO2Accelerate

    _env(rank, world)
    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    mesh = worker_mesh(2, "cpu")
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model = accelerator.prepare_model(model, evaluation_mode=True)  # no DDP: FSDP2 syncs the worker
    optimizer = accelerator.prepare_optimizer(optimizer)
    g = torch.Generator().manual_seed(rank)
    with CO2Accelerate(accelerator, model, optimizer, config=CO2Config(co2_worker_size=2, co2_local_steps=4)) as co2:
        for step in range(12):
            ids = torch.randint(0, 64, (4, 16), generator=g)
            accelerator.backward(model(input_ids=ids, labels=ids).loss)
            co2.average_gradients()
            optimizer.step()
            optimizer.zero_grad()
            co2.step()
            if step + 1 == save_at:
                co2.save_state(f"{out}/ckpt")
                if load:
                    with torch.no_grad():  # disturb everything the checkpoint must bring back
                        for p in model.parameters():
                            p.to_local().add_(1.0)
                    optimizer.state.clear()
                    co2.load_state(f"{out}/ckpt")
    return _whole_state(model)


def evaluation_on_the_anchor(rank: int, world: int) -> dict:
    """``anchor_in_place`` under FSDP2 (eager start: live models differ from the anchor): the
    forward inside it is the anchor's, and forwards after it are the live model's again."""
    model = sharded_tiny_net(2)
    optimizer = make_optimizer(model, "sgd")
    co2 = CO2(model, CO2Config(co2_worker_size=2, co2_local_steps=2, co2_start_rule="eager"), optimizer=optimizer)
    train_steps(model, optimizer, co2, rank, 0, 5)  # mid-round, live != anchor
    tokens, _ = batch(0, 99)
    whole = TinyNet(seed=1, batchnorm=False)  # an unsharded copy to run the anchor on
    whole.load_state_dict({k: v for k, v in full_anchor(co2, list(whole.state_dict())).items()})
    with torch.no_grad():
        live_before = model(tokens).clone()
        with co2.anchor_in_place():
            on_anchor = model(tokens).clone()
        live_after = model(tokens).clone()
        expected = whole.double()(tokens).float()
    return {"live_before": live_before, "on_anchor": on_anchor, "live_after": live_after, "expected": expected}


def trainer_fsdp_elastic(rank: int, world: int, saved: str, out: str) -> dict:
    """``trainer_fsdp_suite``'s 4-process checkpoint (2 workers of 2 under FSDP2) resumed with
    co2_elastic by 2 processes (1 worker of 2 under FSDP2), trained to the end and saved."""
    from trainer_workers import STOP_AT, _AtTrainBegin, _env, dataset, make_args, tiny_gpt2

    from co2_hf import CO2Trainer

    _env(rank, world)
    fsdp = dict(
        co2_worker_size=2, optim="sgd", learning_rate=0.1, co2_start_rule="eager", co2_fragments=1, fsdp="full_shard"
    )  # the settings of the checkpoint (trainer_fsdp_suite's)
    begin = _AtTrainBegin()
    trainer = CO2Trainer(
        model=tiny_gpt2(), args=make_args(out, co2_elastic=True, **fsdp), train_dataset=dataset(), callbacks=[begin]
    )
    begin.trainer = trainer
    trainer.train(resume_from_checkpoint=f"{saved}/checkpoint-{STOP_AT}")
    trainer.save_model(out)
    torch.distributed.barrier()  # rank 0 writes the folder
    return {
        "begin": begin.seen["counters"],
        "live_is_anchor": begin.seen["live_is_anchor"],
        "step": trainer.state.global_step,
        "final": _whole_state(trainer.model),
        "fsdp_type": type(trainer.model).__name__,
    }
