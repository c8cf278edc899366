"""Per-rank loops for resuming on another number of workers (tests/test_reshard.py).

Two runs are saved by 2 processes mid-round with an all-reduce in flight: ``flat`` (2 workers of
one process, BatchNorm buffers, the gap-aware penalty) and ``fsdp`` (1 worker of 2 processes under
FSDP2). Each is then resumed by other worlds: 3 processes (``flat``: 3 workers; ``fsdp``: 1
worker of 3 under FSDP2, uneven shards) and 1 process (plain).
"""

from __future__ import annotations

import torch
from fsdp_workers import full_anchor, sharded_tiny_net
from torch.distributed.tensor import DTensor
from workers import TinyNet, make_optimizer, train_steps

from co2_hf import CO2, CO2Config
from co2_hf.core import reshard

SAVE_AT, TAU, AFTER = 6, 4, 8  # saved 2 steps into round 1; the next boundary is at step 8
BASE = dict(co2_local_steps=TAU, co2_outer_momentum=0.5, co2_start_rule="eager", co2_fragments=1, co2_gap_penalty=1.0)
RUNS = {
    "flat": dict(BASE),  # with the gap-aware penalty: exact too, each worker holds the whole vector
    "fsdp": dict(BASE, co2_gap_penalty=0.0, co2_worker_size=2),
    # streaming, 2 fragments of k = 2 steps: saved with fragment 0 in flight (launched at step 6),
    # whose average the old run applies at step 8; Nesterov, the lookahead start, an int8 wire
    "stream": dict(BASE, co2_fragments=2, co2_start_rule="lookahead", co2_nesterov=True, co2_comm_dtype="int8"),
}
# (world, run) -> (co2_worker_size of the resumed run, FSDP2 inside it)
RESUMED = {
    (3, "flat"): (1, False),
    (3, "fsdp"): (3, True),
    (3, "stream"): (1, False),
    (1, "flat"): (1, False),
    (1, "fsdp"): (1, False),
    (1, "stream"): (1, False),
}


def _model(run: str, k: int, fsdp: bool, seed: int = 0) -> torch.nn.Module:
    if fsdp:
        torch.manual_seed(seed)
        return sharded_tiny_net(k)
    return TinyNet(seed=seed, batchnorm=run == "flat")


def _names(co2: CO2) -> list[str]:
    return [s.names[0] for s in co2.layout.segments]


def _whole(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def _cloned(value):
    """A state dict's tensors cloned (nested in lists and dicts): saved before training goes on."""
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value.clone() if torch.is_tensor(value) else value


def _optimizer_whole(optimizer: torch.optim.Optimizer) -> dict:
    """Every tensor of the optimizer's state, whole (FSDP2 shards gathered), by (parameter index, name)."""
    state = optimizer.state_dict()["state"]
    return {(i, name): _whole(v) for i, entry in state.items() for name, v in entry.items() if torch.is_tensor(v)}


def save_runs(rank: int, world: int, path: str) -> dict:
    """Both runs, saved at SAVE_AT; each continued to its next boundary to record the anchor there."""
    out = {}
    for run, kwargs in RUNS.items():
        k = kwargs.get("co2_worker_size", 1)
        model = _model(run, k, fsdp=k > 1)
        optimizer = make_optimizer(model)
        co2 = CO2(model, CO2Config(**kwargs), optimizer=optimizer)
        train_steps(model, optimizer, co2, rank, 0, SAVE_AT)
        assert co2._pending is not None, "the test must save with an all-reduce in flight"
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "co2": co2.state_dict()}
        torch.save(state, f"{path}/{run}.rank{rank}")
        saved = {
            "co2": _cloned(state["co2"]),
            "optimizer": _optimizer_whole(optimizer),
            "anchor": full_anchor(co2, _names(co2)),
        }
        train_steps(model, optimizer, co2, rank, SAVE_AT, AFTER)  # the boundary at AFTER applies D
        saved["anchor_next"] = full_anchor(co2, _names(co2))
        out[run] = saved
    return out


def resume_runs(rank: int, world: int, path: str) -> dict:
    """Each run resumed on this world: what was loaded, then 2 more rounds and finalize."""
    out = {}
    for run, kwargs in RUNS.items():
        k, fsdp = RESUMED[(world, run)]
        cfg = CO2Config(**{**kwargs, "co2_worker_size": k})
        model = _model(run, k, fsdp, seed=7)  # another init: everything must come from the checkpoint
        optimizer = make_optimizer(model)
        co2 = CO2(model, cfg, optimizer=optimizer)
        old_k = kwargs.get("co2_worker_size", 1)
        sources = reshard.source_ranks(2 // old_k, old_k, co2.comm.worker_index)
        states = [torch.load(f"{path}/{run}.rank{r}", weights_only=False) for r in sources]
        saved = [s["co2"] for s in states]
        result = {"sources": sources, "needs": reshard.needs_reshard(saved[0], co2)}
        carried = reshard.resharded_state(saved, co2)
        result["carried"] = _cloned(carried)
        reshard.load_resharded(co2, saved)
        optimizer.load_state_dict(reshard.resharded_optimizer_state([s["optimizer"] for s in states], optimizer))
        after = co2.state_dict()
        result["progress"] = {"clock": after["counters"], "fragment": after["fragments"][0]["counters"]}
        result["fragment_counters"] = [f["counters"] for f in after["fragments"]]
        result["anchor"] = full_anchor(co2, _names(co2))
        live = {n: _whole(t).double() for n, t in model.state_dict().items() if n in result["anchor"]}
        result["live"] = live
        result["optimizer"] = _optimizer_whole(optimizer)
        train_steps(model, optimizer, co2, rank, SAVE_AT, AFTER + 2 * TAU)  # 2 more boundaries
        co2.finalize()
        result["final"] = full_anchor(co2, _names(co2))
        result["refusals"] = _refusals(run, saved, k, fsdp) if run == "flat" else []
        out[run] = result
    return out


def _refusals(run: str, saved: list[dict], k: int, fsdp: bool) -> list[str]:
    """What cannot carry over is refused, naming it: another co2_local_steps, another model, fragments."""
    messages = []
    other_tau = CO2(_model(run, k, fsdp), CO2Config(**{**RUNS[run], "co2_local_steps": TAU + 1}))
    wider = torch.nn.Sequential(torch.nn.Linear(4, 4))
    streamed = CO2(_model(run, k, fsdp), CO2Config(**{**RUNS[run], "co2_fragments": 2}))
    for co2 in (other_tau, CO2(wider, CO2Config(**RUNS[run])), streamed):
        try:
            reshard.resharded_state(saved, co2)
            messages.append("not refused")
        except ValueError as error:
            messages.append(str(error))
    return messages
