"""Resuming on another world size (``--co2_elastic``): which saved ranks' files a new rank reads, and
how their state becomes this rank's (``core/reshard.py`` re-shards it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core import CO2, reshard
from .config_file import saved_world
from .rank_files import load_rank_file


def elastic_sources(directory: str, rank: int, world_size: int, worker_size: int) -> list[int] | None:
    """The saved ranks whose files rank ``rank`` reads to resume on ``world_size`` processes of
    ``worker_size`` per worker: the processes of old worker ``w mod G`` for new worker ``w``
    (``core/reshard.py``). None when the checkpoint was saved by this very world: an exact resume."""
    saved_size, saved_k = saved_world(directory)
    if (saved_size, saved_k) == (world_size, worker_size):
        return None
    return reshard.source_ranks(saved_size // saved_k, saved_k, rank // worker_size)


def read_states(directory: str, ranks: list[int]) -> list[dict[str, Any]]:
    """The rank files of ``ranks`` (checked before by `check_complete` with ``sources=ranks``)."""
    return [load_rank_file(directory, r) for r in ranks]


def apply_resharded_state(states: list[dict[str, Any]], *, co2: CO2, optimizer: Any, scaler: Any = None) -> None:
    """Resume this rank from the files of another world's ranks (`elastic_sources`): CO2's state
    re-sharded, every live tensor restarted from the anchor with the received average applied (the
    saved local parameters are not used), the inner optimizer state of the source worker re-sharded,
    the first source rank's AMP scaler. Collective inside the worker."""
    reshard.load_resharded(co2, [s["co2"] for s in states])
    if optimizer is not None and states[0]["optimizer"] is not None:
        optimizer.load_state_dict(reshard.resharded_optimizer_state([s["optimizer"] for s in states], optimizer))
    if scaler is not None and states[0]["scaler"] is not None:
        scaler.load_state_dict(states[0]["scaler"])


def warn_world_changed(
    directory: str, *, co2: CO2, world_size: int, samples_per_step: int, step: int, log: Callable[..., None]
) -> None:
    """Say once (``log``: WARNING on rank 0, INFO elsewhere) what a resume on another world carried and
    what it reset, and where the data resumes: the Trainer fast-forwards by steps, not by samples
    (``samples_per_step``: one process's samples per optimizer step)."""
    old_world, old_k = saved_world(directory)
    world, k = world_size, co2.config.co2_worker_size
    was, now = step * samples_per_step * old_world, step * samples_per_step * world
    data = (
        f"samples {now} to {was - 1} of the epoch's order are seen a second time"
        if now < was
        else f"samples {was} to {now - 1} of the epoch's order are skipped"
        if now > was
        else "no sample is seen twice or skipped"
    )
    log(
        "CO2: resuming %s, saved by %d processes (%d workers of %d), on %d processes (%d workers of %d). "
        "Carried over exactly, re-sharded: the anchor, the outer momentum, the outer average received "
        "before the save (applied now, as the next boundary would have), the counters (step %d, round %d, "
        "%d steps into it) and the learning-rate schedule; new worker w takes old worker w mod %d's inner "
        "optimizer state and AMP scaler. Reset: every worker's local parameters restart from the anchor "
        "(the steps each took since its round started are lost), and the start offsets. The data resumes "
        "by steps: the saved run had read %d samples and this one skips %d, so %s (in the first epoch; "
        "later the epochs shift too). Ranks >= %d find no RNG state of their own.",
        directory,
        old_world,
        old_world // old_k,
        old_k,
        world,
        world // k,
        k,
        step,
        co2.round,
        co2.round_step,
        old_world // old_k,
        was,
        now,
        data,
        old_world,
    )
