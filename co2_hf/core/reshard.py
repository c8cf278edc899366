"""Resume on another number of workers: the outer state of G workers of k processes, re-sharded for
G' workers of k' processes (torchrun's elastic agent restarts the survivors with a new world size).

What carries over, and how (``docs/reliability.md``, "Losing a node"):

- the anchor, the outer momentum, the received mean ``D`` (the completed or in-flight average,
  buffer with ``have_d``) and the `Progress` counters: exactly, re-sharded. They are the same on
  every worker (each worker applies the same ``D`` to the same anchor), so new worker ``w'`` takes
  them from the k processes of old worker ``w' mod G`` (`source_ranks`), whose shards together
  hold the whole of each tensor;
- the live parameters do not: new worker ``w'`` is not old worker ``w'``. Every new rank starts
  from the anchor with the in-flight average applied (`start_from_anchor`: the step the next
  boundary would have taken with that ``D``, taken now), so the start rule's offsets are reset
  (they described each old worker's own round), and so are an int8/int4 wire's error-feedback
  residuals (what an old rank's codes left out of its own outer gradients and of the slice of the
  sum it owned: at most one round's rounding error, and the slices are cut anew);
- what a coded wire's residuals carry by position (a sparse wire's: most of each outer gradient,
  still owed to the average; ``codecs/``, `carried_residual`) is re-sharded like the anchor, and
  weighed so that the mean over the new workers of what they still owe is the old workers' mean,
  where every old worker has a taker (`_owed_weight`);
- the inner optimizer state of new worker ``w'`` is old worker ``w' mod G``'s, re-sharded under
  FSDP2 (`resharded_optimizer_state`): the statistics of a worker that trained the same model on
  the same data distribution, rather than a cold restart (an Adam reset makes the next steps as
  large as the first ones of a run).

Only the settings in `ELASTIC_CHANGES` (and ``RESUMABLE_CHANGES``) may differ; another model or
``co2_local_steps`` is refused, naming what differs (`check_reshardable`).

Why by hand, not ``torch.distributed.checkpoint`` (DCP)? DCP re-shards DTensors (FSDP2's
parameters and optimizer state) between world sizes, but CO2's outer state is not a DTensor: it is
one flat fp32 vector per process whose padding depends on k (a global size DCP would refuse to load
into another k: "Size mismatch between saved ... and current"), replicated over the G workers,
and it must sit beside the rank files that the checkpoint manifest hashes and publishes
atomically (``co2_hf/checkpoints/``). Expressing it for DCP would mean a second checkpoint
format (``.distcp`` files and their metadata, planned collectively) for one case. The layouts
here are simple enough to invert exactly: a flat split (contiguous shards of one padded vector) or
FSDP2's ``Shard(0)`` (``torch.chunk`` of dim 0). So each tensor is rebuilt whole from the source
worker's shards on the CPU (`_whole_segments`) and cut again for this rank (`_own_shard`). Memory:
each new rank holds the whole model in fp32 once per tensor kind, at load time only.

The format-specific keys of a saved state (format 2, or 1 upgraded; ``core/state.py``) are read in
`_tensors`, `_counters` and `_layout` only, and written in `_state_like` only (a fragment's
``residuals``, a codec's own state, through ``codecs/`` alone); `start_from_anchor` works on the
engine's clock (`Progress`).

Streaming fragments (``co2_fragments > 1``, docs/algorithm.md section 7b): fragments are cut on each
process's shard, so another layout cuts them elsewhere, and each old fragment's received average has
no new fragment to wait in. Those averages (a fragment's ``D`` is never stale: ``P = 1``) are applied
here, element by element on the re-sharded state, with the engine's own operations
(`_apply_received`); every new fragment then starts from the anchor with nothing received, and its
round counter is the engine's round (the same on every new rank). Clipping is per fragment, over a
norm the old layout's fragments defined: refused with fragments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from . import update
from .codecs import carried_residual, resharded_residuals
from .layout import fragment_edges
from .state import RESUMABLE_CHANGES, STATE_FORMAT, check_same_config, upgrade
from .wire import header_numel

# Settings that may differ between the checkpoint and a resume on another number of workers
# co2_global_second_moment_every: its state (moments.py) is each worker's own and starts afresh on the
# new world, as a quarantined worker's does; unset, it resolves per world (0 with one worker)
ELASTIC_CHANGES = RESUMABLE_CHANGES + ("co2_worker_size", "co2_global_second_moment_every")


# ------------------------------------------------------------------ the one place that knows the format


def _tensors(saved: dict[str, Any]) -> dict[str, Tensor]:
    """The outer tensors of one saved rank that carry over, re-sharded, each over its own shard: the
    anchor, the momentum, the fragments' payloads end to end, ``received`` (1 where that fragment's
    buffer holds a received ``D``) and, where the codec carries one (`carried_residual`), its
    ``residual`` by the payloads' positions. The start rule's offset does not: it is reset."""
    saved = upgrade(saved)
    header = header_numel(saved["num_workers"])
    edges = fragment_edges(saved["anchor"].numel(), len(saved["fragments"]))
    payloads = [
        # a fragment with nothing received saves no buffer (its values would not be read)
        torch.zeros(hi - lo)
        if fragment["buffer"] is None
        else fragment["buffer"][: fragment["buffer"].numel() - header]
        for fragment, lo, hi in zip(saved["fragments"], edges[:-1], edges[1:])
    ]
    received = [
        torch.full_like(d, float(fragment["counters"]["have_d"])) for d, fragment in zip(payloads, saved["fragments"])
    ]
    carried = {
        "anchor": saved["anchor"],
        "momentum": saved["momentum"],
        "payload": torch.cat(payloads),
        "received": torch.cat(received),
    }
    residuals = [carried_residual(f.get("residuals"), d.numel()) for f, d in zip(saved["fragments"], payloads)]
    if residuals[0] is not None:  # one codec for every fragment
        carried["residual"] = torch.cat(residuals)
    return carried


def _counters(saved: dict[str, Any]) -> dict[str, Any]:
    """The engine's clock and its fragments' counters."""
    saved = upgrade(saved)
    return {"clock": saved["counters"], "fragments": [fragment["counters"] for fragment in saved["fragments"]]}


def _layout(saved: dict[str, Any]) -> dict[str, Any]:
    return saved["layout"]


def _state_like(fresh: dict[str, Any], tensors: dict[str, Tensor], counters: dict[str, Any]) -> dict[str, Any]:
    """A state for this rank in its own format and identity (``fresh``: its ``state_dict()``), holding
    ``tensors`` and ``counters``; the start rule's offsets are zero (reset). One fragment: its buffer
    holds the received ``D``. Several: nothing is received (`_apply_received` applied it), and every
    fragment's round is the clock's."""
    one = len(fresh["fragments"]) == 1
    edges = fragment_edges(fresh["anchor"].numel(), len(fresh["fragments"]))
    fragments = []
    for fragment in fresh["fragments"]:
        buffer = None  # several fragments: nothing is received, so no buffer is needed
        if one:
            buffer = torch.zeros_like(fragment["buffer"])  # the header is rewritten at the next launch
            buffer[: tensors["payload"].numel()] = tensors["payload"]
            kept = dict(counters["fragments"][0])
        else:
            round_index = counters["clock"]["round"]
            kept = {**fragment["counters"], "round": round_index, "sent_round": round_index, "have_d": False}
            kept["consecutive_skipped"] = kept["skipped_rounds"] = 0
        offset = fragment["own_outer_grad"]
        zero = None if offset is None else torch.zeros_like(offset)
        lo, hi = edges[len(fragments)], edges[len(fragments) + 1]
        carried = tensors["residual"][lo:hi] if "residual" in tensors else None  # this fragment's cut
        residuals = resharded_residuals(fragment.get("residuals"), carried)  # else reset, as the offsets are
        fragments.append({"buffer": buffer, "own_outer_grad": zero, "counters": kept, "residuals": residuals})
    if not one:  # the skipped rounds, summed, are kept on the first fragment
        fragments[0]["counters"]["skipped_rounds"] = sum(c["skipped_rounds"] for c in counters["fragments"])
    return {
        **fresh,
        "anchor": tensors["anchor"].to(fresh["anchor"]),
        "momentum": tensors["momentum"].to(fresh["momentum"]),
        "counters": dict(counters["clock"]),
        "fragments": fragments,
    }


def _owed_weight(old_workers: int, new_workers: int, worker_index: int) -> float:
    """The weight of the residual new worker ``w'`` takes from old worker ``w = w' mod G``: ``G' / (G m_w)``,
    ``m_w`` the new workers taking it. Then ``sum_w' r_w' / G' = sum_w r_w / G``, the average still
    owed, whenever every old worker has a taker (``G' >= G``); fewer workers keep their takers' share."""
    source = worker_index % old_workers
    takers = sum(1 for w in range(new_workers) if w % old_workers == source)
    return new_workers / (old_workers * takers)


def _apply_received(tensors: dict[str, Tensor], engine: Any) -> None:
    """Fragments: where an old fragment had received its ``D``, apply it as its in-round apply would
    have (``P = 1``): ``m <- beta m + D``, ``v`` (Nesterov: ``beta m + D``), ``a <- a - alpha v`` on
    parameters, ``a <- D`` on buffers. The same in-place operations as the engine's, on a copy."""
    cfg, n = engine.config, engine.layout.param_local
    d, where = tensors["payload"], tensors["received"] > 0.5
    anchor, momentum = tensors["anchor"].clone(), tensors["momentum"].clone()
    step = update.outer_step_(momentum[:n], d[:n].clone(), cfg.co2_outer_momentum, cfg.co2_nesterov)
    update.move_anchor_(anchor, step, d, n, cfg.co2_outer_lr)
    tensors["momentum"] = torch.where(where, momentum, tensors["momentum"])
    tensors["anchor"] = torch.where(where, anchor, tensors["anchor"])


# ------------------------------------------------------------------ public functions


def source_ranks(saved_num_workers: int, saved_worker_size: int, worker_index: int) -> list[int]:
    """The old global ranks whose states new worker ``worker_index`` takes, in shard order: the
    processes of old worker ``worker_index mod G`` (rank = worker * k + shard, as ``comm.py`` groups them)."""
    w = worker_index % saved_num_workers
    return [w * saved_worker_size + j for j in range(saved_worker_size)]


def needs_reshard(saved: dict[str, Any], engine: Any) -> bool:
    """Whether ``saved`` (one old rank's ``CO2.state_dict()``) comes from another number of workers
    or another worker size than ``engine`` has (False: load it with ``load_state_dict``, exactly)."""
    layout = _layout(saved)
    return (saved["num_workers"], layout["worker_size"]) != (engine.num_workers, engine.layout.worker_size)


def check_reshardable(saved: list[dict[str, Any]], engine: Any) -> None:
    """Raise ``ValueError`` naming what differs unless ``saved`` (the states of every process of one
    old worker, any order) can be re-sharded into ``engine``: same model, same settings but
    `ELASTIC_CHANGES`, one whole worker, ``co2_fragments`` 1."""
    saved = [upgrade(state) for state in saved]  # format 1 (co2_hf before fragments) as format 2
    for state in saved:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown CO2 checkpoint format {state.get('format')!r}")
    fresh = engine.state_dict()
    check_same_config(saved[0]["config"], fresh["config"], may_change=ELASTIC_CHANGES)
    if engine.config.fragments > 1 and engine.config.co2_clip_threshold is not None:
        raise ValueError(
            f"resuming on another number of workers with co2_fragments={engine.config.fragments} supports "
            f"co2_clip_threshold=None only, not {engine.config.co2_clip_threshold} (each fragment's clip "
            "depends on where the old layout cut it): resume with the checkpoint's world size and co2_worker_size"
        )
    _check_same_model(_layout(saved[0]), engine.layout)
    k = _layout(saved[0])["worker_size"]
    workers = {state["worker_index"] for state in saved}
    shards = sorted(_layout(state)["shard_index"] for state in saved)
    if len(workers) != 1 or shards != list(range(k)):
        raise ValueError(
            f"re-sharding needs the states of the {k} processes of one old worker, got worker(s) "
            f"{sorted(workers)} with shard(s) {shards}"
        )


def resharded_state(saved: list[dict[str, Any]], engine: Any) -> dict[str, Any]:
    """The CO2 state this rank of ``engine`` loads, from the states of one old worker's processes
    (`source_ranks`): anchor, momentum, the received ``D`` and the counters re-sharded exactly, the
    start rule's offset zero. In ``engine``'s format and identity: ``engine.load_state_dict`` takes it."""
    check_reshardable(saved, engine)
    saved = sorted(saved, key=lambda state: _layout(state)["shard_index"])
    layouts, parts = [_layout(state) for state in saved], [_tensors(state) for state in saved]
    tensors = {key: _own_shard(_whole_segments([p[key] for p in parts], layouts), engine.layout) for key in parts[0]}
    if "residual" in tensors:  # what each worker still owes the average
        tensors["residual"].mul_(_owed_weight(saved[0]["num_workers"], engine.num_workers, engine.comm.worker_index))
    if engine.config.fragments > 1:
        _apply_received(tensors, engine)
    return _state_like(engine.state_dict(), tensors, _counters(saved[0]))


def load_resharded(engine: Any, saved: list[dict[str, Any]]) -> None:
    """`resharded_state` loaded into ``engine``, then `start_from_anchor`. Collective inside the worker
    (the in-flight average's statistics, the anchor's all-gather): every rank calls it.

    During the warm-up (``co2_sync_warmup_steps`` not reached) the live parameters are the global
    model, not the anchor: load them as for any resume (the checkpoint's model files)."""
    engine.load_state_dict(resharded_state(saved, engine))
    start_from_anchor(engine)


def start_from_anchor(engine: Any) -> None:
    """Apply the received ``D`` now, with the rule the next boundary would have used (the penalty of
    a stale update; none with a partial-overlap window), and set every live tensor to the anchor.

    Through the public API: ``finalize()`` does exactly this once nothing is in flight and no round
    is under way; the clock it resets is given back after (the fragment's ``have_d`` is cleared by
    the apply itself)."""
    clock = dataclasses.replace(engine.progress)
    if not clock.warmup_done:
        return  # the warm-up: the live tensors are the global model, the anchor is taken at its end
    engine.progress.round = engine.progress.round_step = 0  # no round under way: finalize runs no boundary
    engine.finalize()  # nothing in flight after a load: D applied, offsets cleared, live <- anchor
    engine.progress = clock


def resharded_optimizer_state(saved: list[dict[str, Any]], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The inner optimizer state for this rank from the ``optimizer.state_dict()`` of every process
    of one old worker (shard order): its tensors shaped like FSDP2 shards are rebuilt whole and cut
    for this rank's parameters (plain or FSDP2); the rest (``step``, hyperparameters) are the first's."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    first = saved[0]
    saved_count = sum(len(group["params"]) for group in first["param_groups"])
    if saved_count != len(params):
        raise ValueError(
            f"the checkpoint's inner optimizer has {saved_count} parameters and this one {len(params)}: "
            "resume with the same model and optimizer"
        )
    state = {}
    for index, entry in first["state"].items():
        param = params[index]
        state[index] = {
            name: _optimizer_tensor([s["state"][index][name] for s in saved], param)
            if isinstance(value, Tensor) and value.dim() > 0
            else value
            for name, value in entry.items()
        }
    return {"state": state, "param_groups": first["param_groups"]}


# ------------------------------------------------------------------ layouts


def _check_same_model(saved: dict[str, Any], layout: Any) -> None:
    now = {"names": [s.names[0] for s in layout.segments], "shapes": [list(_global_shape(s)) for s in layout.segments]}
    before = {"names": saved["names"], "shapes": _saved_global_shapes(saved)}
    for what in ("names", "shapes"):
        if before[what] != now[what]:
            raise ValueError(
                f"the CO2 checkpoint holds another model (parameter {what} differ): checkpoint "
                f"{before[what]}, now {now[what]}; resume with the model it was saved from"
            )


def _saved_global_shapes(saved: dict[str, Any]) -> list[list[int]]:
    if not saved.get("presharded"):
        return saved["shapes"]
    # FSDP2 shards every parameter (layout.py checks it) and lists their global shapes; buffers are whole
    sharded = iter(saved["global_shapes"])
    return [next(sharded) if is_param else shape for is_param, shape in zip(saved["is_param"], saved["shapes"])]


def _global_shape(segment: Any) -> torch.Size:
    return segment.dtensor.shape if segment.dtensor is not None else segment.tensor.shape


def _whole_segments(shards: list[Tensor], layouts: list[dict[str, Any]]) -> list[Tensor]:
    """Each synchronised tensor whole (fp32, CPU), from one worker's shards of a flat state."""
    if not layouts[0].get("presharded"):  # contiguous slices of one padded vector
        flat = torch.cat([s.float().cpu() for s in shards])
        sizes = [_numel(shape) for shape in layouts[0]["shapes"]]
        pieces = flat[: sum(sizes)].split(sizes)
        return [p.view(shape) for p, shape in zip(pieces, layouts[0]["shapes"])]
    # FSDP2: each shard is its process's local pieces (dim-0 chunks) in the named order
    per_shard = [
        s.float().cpu().split([_numel(shape) for shape in layout["shapes"]]) for s, layout in zip(shards, layouts)
    ]
    whole = []
    for i, is_param in enumerate(layouts[0]["is_param"]):
        pieces = [p[i].view(layout["shapes"][i]) for p, layout in zip(per_shard, layouts)]
        whole.append(torch.cat(pieces) if is_param else pieces[0])  # buffers are whole on every process
    return whole


def _own_shard(whole: list[Tensor], layout: Any) -> Tensor:
    """This process's shard of the flat state in ``layout``, from the whole tensors."""
    if not layout.presharded:
        flat = torch.zeros(layout.padded_numel)
        torch.cat([w.reshape(-1) for w in whole], out=flat[: layout.numel])
        return flat[layout.shard_start : layout.shard_start + layout.shard_numel]
    pieces = [
        w if s.dtensor is None else _local_chunk(w, s.dtensor, s.tensor.shape) for w, s in zip(whole, layout.segments)
    ]
    return torch.cat([p.reshape(-1) for p in pieces]) if pieces else torch.zeros(0)


def _local_chunk(whole: Tensor, like: DTensor, local_shape: torch.Size) -> Tensor:
    """This process's dim-0 chunk of ``whole``, as FSDP2 cuts it (``torch.chunk``, empty past the end)."""
    mesh = like.device_mesh
    chunks = list(torch.chunk(whole, mesh.size(), dim=0))
    index = mesh.get_local_rank()
    chunk = chunks[index] if index < len(chunks) else whole.new_empty((0, *whole.shape[1:]))
    if chunk.shape != local_shape:  # FSDP2 cut it another way: say so rather than load garbage
        raise RuntimeError(
            f"CO2 re-sharding expected a local shard of shape {tuple(local_shape)}, got {tuple(chunk.shape)}"
        )
    return chunk


def _optimizer_tensor(saved: list[Tensor], param: Tensor) -> Tensor:
    """One optimizer state tensor of one parameter: whole from the old shards, cut like ``param``."""
    if isinstance(saved[0], DTensor):
        whole = torch.cat([s.to_local().cpu() for s in saved])
    else:  # an unsharded worker: every process holds the same replica
        whole = saved[0].cpu()
    if not isinstance(param, DTensor):
        return whole
    own = param.to_local()
    local = _local_chunk(whole, param, own.shape).to(own.device)
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
