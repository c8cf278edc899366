"""Per-rank custom Accelerate loops for tests/test_accelerate.py."""

from __future__ import annotations

import torch
from trainer_workers import _env, tiny_gpt2

from co2_hf import CO2Accelerate, CO2Config

CFG = dict(co2_local_steps=4, co2_outer_momentum=0.5, co2_clip_threshold=2.0)
STEPS, SAVE_AT = 12, 6  # boundaries after steps 4 and 8: step 6 is mid-round, all-reduce in flight


def _tokens(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    start = torch.randint(0, 64, (4, 1), generator=g)
    return (start + torch.arange(16)) % 64


def _default_group_seq() -> int:
    return torch.distributed.distributed_c10d._get_default_group()._get_sequence_number_for_group()


def loop(rank: int, world: int, out: str, *, save_at: int | None = None, resume: bool = False) -> dict:
    from accelerate import Accelerator

    _env(rank, world)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(1000 + rank if resume else 0)  # a resumed process starts from other weights
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    start, local_collectives = 0, []
    with CO2Accelerate(accelerator, model, optimizer, config=CO2Config(**CFG)) as co2:
        if resume:
            co2.load_state(out)
            start = SAVE_AT
        for step in range(start, STEPS):
            before = _default_group_seq()
            tokens = _tokens(rank, step)
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            co2.step()
            local_collectives.append(_default_group_seq() - before)
            if step + 1 == save_at:
                co2.save_pretrained(out + "_pretrained")  # mid-round: the anchor, not this rank's model
                co2.save_state(out)  # accelerator.save_state, published atomically
                return {"wrapped": type(model).__name__}
    return {
        "final": {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "local_collectives": local_collectives,
        "wrapped": type(model).__name__,
    }


def uninterrupted_and_stopped(rank: int, world: int, out: str) -> dict:
    return {"full": loop(rank, world, out + "_unused"), "stopped": loop(rank, world, out, save_at=SAVE_AT)}


def resumed(rank: int, world: int, out: str) -> dict:
    return loop(rank, world, out, resume=True)


def refused_loads(rank: int, world: int, folders: str) -> dict:
    """``co2.load_state`` of each damaged or hostile copy under ``folders``: its error, and whether
    anything had been loaded before the refusal; then what else must be refused on every rank: a
    plain ``accelerator.load_state`` of a CO2 folder, a save into a folder of the user's, a save after
    the ``with`` block, an exception that is not a ValueError on one rank, per-node disks that hold
    different steps."""
    import glob
    import os

    from accelerate import Accelerator

    from co2_hf.checkpoints import agreement

    _env(rank, world)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(1000 + rank)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    co2 = CO2Accelerate(accelerator, model, optimizer, config=CO2Config(**CFG))
    before = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    errors = {}
    for folder in sorted(glob.glob(os.path.join(folders, "*"))):
        errors[os.path.basename(folder)] = _error(co2.load_state, folder)
    after = accelerator.unwrap_model(model).state_dict()
    untouched = all(torch.equal(after[k], v) for k, v in before.items())
    refused = {
        "plain_load_state": _error(accelerator.load_state, os.path.join(folders, "hostile_custom_object")),
        "save_into_users_folder": _error(co2.save_state, os.path.join(os.path.dirname(folders), "users")),
        "one_rank_oserror": _error(agreement.agree, _fails_on_rank_1, rank),
        "different_steps": _error(agreement.agree_on_checkpoint, "ckpt", step=6 + rank, digest="d", leader=0),
    }
    with co2:
        pass
    refused["save_after_the_block"] = _error(co2.save_state, os.path.join(folders, "late"), kind=RuntimeError)
    return {"errors": errors, "untouched": untouched, "refused": refused}


def _error(call, *args, kind: type = ValueError, **kwargs) -> str | None:
    try:
        call(*args, **kwargs)
    except kind as refused:
        return str(refused)
    return None


def _fails_on_rank_1(rank: int) -> None:
    if rank == 1:
        raise OSError(5, "Input/output error", "co2_rank1.pt")
