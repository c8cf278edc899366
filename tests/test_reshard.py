"""Resume on another number of workers (``co2_hf/core/reshard.py``): saved by 2 gloo processes,
resumed by 3 and by 1. What must carry over does so exactly; what cannot is refused, naming it."""

from __future__ import annotations

import pytest
import torch
from distributed import run_processes
from reshard_workers import RESUMED, RUNS, resume_runs, save_runs

pytestmark = pytest.mark.slow  # every test reads runs of one, two and three gloo processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("reshard"))
    saved = run_processes(save_runs, 2, path, timeout_s=120)
    resumed = {world: run_processes(resume_runs, world, path, timeout_s=120) for world in (3, 1)}
    return saved, resumed


def _every(resumed):
    for world, ranks in resumed.items():
        for rank, out in enumerate(ranks):
            for run in RUNS:
                yield world, rank, run, out[run]


@pytest.mark.timeout(300)
def test_a_new_worker_takes_its_state_from_old_worker_index_modulo_g(runs):
    _, resumed = runs
    assert [r["flat"]["sources"] for r in resumed[3]] == [[0], [1], [0]]  # 2 old workers of 1
    assert [r["fsdp"]["sources"] for r in resumed[3]] == [[0, 1]] * 3  # 1 old worker of 2 processes
    assert all(out["needs"] for *_, out in _every(resumed))


@pytest.mark.timeout(300)
def test_anchor_momentum_average_and_counters_carry_over_exactly(runs):
    saved, resumed = runs
    for world, rank, run, out in _every(resumed):
        if run == "stream":
            continue  # below
        source = saved[out["sources"][0]][run]["co2"]
        carried = out["carried"]
        (fragment,), (kept,) = source["fragments"], carried["fragments"]
        assert carried["counters"] == source["counters"], (world, rank, run)
        assert kept["counters"] == fragment["counters"], (world, rank, run)
        assert fragment["counters"]["have_d"]  # saved with an average in flight: it was waited for
        if RESUMED[(world, run)] == (1, False) and run == "flat":  # whole flat vectors on both sides
            for key in ("anchor", "momentum"):
                assert torch.equal(carried[key], source[key]), (world, rank, key)
            n = source["anchor"].numel()
            assert torch.equal(kept["buffer"][:n], fragment["buffer"][:n])
        # the start offsets were each old worker's own: reset
        assert kept["own_outer_grad"] is not None and not kept["own_outer_grad"].any()
        assert fragment["own_outer_grad"].any()
        # after the load: the average applied (the old run's next boundary gives the same anchor)
        for name, value in saved[0][run]["anchor_next"].items():
            assert torch.equal(out["anchor"][name], value), (world, rank, run, name)
            assert torch.equal(out["live"][name], value), (world, rank, run, name)
        assert out["progress"] == {"clock": source["counters"], "fragment": {**fragment["counters"], "have_d": False}}


@pytest.mark.timeout(300)
def test_with_fragments_the_received_average_is_applied_and_every_fragment_starts_afresh(runs):
    saved, resumed = runs
    for world, rank, run, out in _every(resumed):
        if run != "stream":
            continue
        source = saved[out["sources"][0]][run]["co2"]
        assert [f["counters"]["have_d"] for f in source["fragments"]] == [True, False]  # fragment 0 in flight
        # the anchor (and every live tensor) is the old run's after fragment 0's in-round apply, exactly
        for name, value in saved[0][run]["anchor_next"].items():
            assert torch.equal(out["anchor"][name], value), (world, rank, name)
            assert torch.equal(out["live"][name], value), (world, rank, name)
        assert out["progress"]["clock"] == source["counters"]
        clock_round = source["counters"]["round"]
        for counters in out["fragment_counters"]:
            assert not counters["have_d"] and counters["round"] == clock_round
        for fragment in out["carried"]["fragments"]:
            assert not fragment["own_outer_grad"].any()
            residuals = fragment["residuals"]  # int8: reset like the offsets (none with one worker)
            assert (residuals is None) is (world == 1) and all(not r.any() for r in (residuals or {}).values())
        assert all(f["residuals"]["sent"].any() for f in source["fragments"])  # there was something to reset


@pytest.mark.timeout(300)
def test_inner_optimizer_state_is_the_source_workers_resharded(runs):
    saved, resumed = runs
    for world, rank, run, out in _every(resumed):
        expected = saved[out["sources"][0]][run]["optimizer"]
        assert expected.keys() == out["optimizer"].keys()
        for key, value in expected.items():
            assert torch.equal(out["optimizer"][key], value), (world, rank, run, key)


@pytest.mark.timeout(300)
def test_training_continues_on_the_new_world_with_equal_anchors(runs):
    saved, resumed = runs
    for world, ranks in resumed.items():
        for run in RUNS:
            finals = [r[run]["final"] for r in ranks]
            for name, value in finals[0].items():
                assert torch.isfinite(value).all()
                for other in finals[1:]:
                    assert torch.equal(other[name], value), (world, run, name)
            moved = any(not torch.equal(finals[0][n], v) for n, v in saved[0][run]["anchor_next"].items())
            assert moved, (world, run)


@pytest.mark.timeout(300)
def test_another_local_steps_model_or_fragments_is_refused_naming_it(runs):
    _, resumed = runs
    for ranks in resumed.values():
        tau, model, fragments = ranks[0]["flat"]["refusals"]
        assert "co2_local_steps: checkpoint 4, now 5" in tau
        assert "another model (parameter names differ)" in model
        assert "co2_fragments: checkpoint 1, now 2" in fragments
