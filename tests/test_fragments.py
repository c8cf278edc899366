"""Streaming fragments (``co2_fragments``): one fragment is today's engine bit for bit; F > 1 resumes
bit for bit with a fragment in flight, quarantines per fragment and reports one round's metrics.
(The engine against the naive reference with fragments: test_engine_vs_reference.py and
test_hierarchical.py.)"""

from __future__ import annotations

import hashlib

import pytest
import torch
from simulated import Workers
from workers import SPEC_DEFAULTS, TinyNet, sim_task

from co2_hf import CO2Config
from co2_hf.core import CO2
from co2_hf.core.wire import header_numel
from scripts.sim import Task, train_simulated

pytestmark = pytest.mark.timeout(60)

# sha256 (first 16 hex digits) of every engine's anchor and live state after 16 steps of 3 simulated
# workers at tau 3 on one intra-op thread (the bits of a matmul depend on the thread count), computed
# with the engine as it was before fragments existed (commit e5f4305): co2_fragments = 1 must
# reproduce them bit for bit. The bits of a float32 matmul also depend on the CPU's kernels: the
# second digest of each pair is the same engine's (commit 1a35d5a, which gave the first digests on
# the machine they were recorded on) on a 2026-12 Xeon whose kernels round differently; bf16 on
# the wire rounds the difference away.
GOLDEN = {
    "default": ({}, ("328294269aec5bef", "228eea3eba5f3ebc")),
    "eager_b0": (
        dict(co2_start_rule="eager", co2_outer_momentum=0.0, co2_gap_penalty=0.0),
        ("196ec6949a98723a", "5e345ff31aebba51"),
    ),
    "lookahead_nesterov": (
        dict(co2_start_rule="lookahead", co2_outer_momentum=0.5, co2_nesterov=True, co2_gap_penalty=0.0),
        ("7985f18fa6fb335a", "b9c8a120cea2bba1"),
    ),
    "window_eager": (
        dict(co2_overlap_steps=1, co2_start_rule="eager", co2_outer_momentum=0.5),
        ("98ffaf6f364fa9d1", "221da52ff1667a1f"),
    ),
    "window_anchor_clip": (
        dict(co2_overlap_steps=2, co2_outer_momentum=0.5, co2_clip_threshold=0.05),
        ("e3e7fccf00ff405a", "d4263352816a6c7e"),
    ),
    "slowmo": (dict(co2_overlap=False, co2_outer_momentum=0.5), ("29aa4192b4801c8b", "1789e20cfa6e976e")),
    "bf16_constant": (
        dict(co2_comm_dtype="bfloat16", co2_gap_penalty=2.0, co2_gap_penalty_mode="constant"),
        ("407ff40269dafe5d",),
    ),
    "warmup_eager_w": (
        dict(co2_sync_warmup_steps=2, co2_start_rule="eager", co2_eager_weight=0.5),
        ("9efa733ae22b26c1", "45d0d4156f4b8e5e"),
    ),
}


def _task() -> Task:
    return sim_task()


def _digest(engines: list[CO2]) -> str:
    h = hashlib.sha256()
    for engine in engines:
        for key, value in sorted(engine.anchor_state().items()):
            h.update(key.encode())
            h.update(value.detach().double().contiguous().numpy().tobytes())
        for _, value in sorted(engine.model.state_dict().items()):
            h.update(value.detach().double().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_one_fragment_reproduces_the_engine_before_fragments_bit_for_bit(name, one_thread):
    knobs, digests = GOLDEN[name]
    config = CO2Config(**{**SPEC_DEFAULTS, "co2_local_steps": 3, **knobs})  # CO2Config() was SPEC_DEFAULTS
    sim = train_simulated(workers=3, config=config, task=_task(), steps=16)
    assert _digest(sim.engines) in digests


FRAGMENTED = dict(co2_local_steps=6, co2_fragments=3, co2_outer_momentum=0.5, co2_gap_penalty=0.0)


@pytest.mark.parametrize("start_rule", ["eager", "lookahead", "anchor"])
def test_a_checkpoint_with_a_fragment_in_flight_resumes_bit_for_bit(start_rule):
    config = CO2Config(co2_start_rule=start_rule, co2_nesterov=start_rule == "lookahead", **FRAGMENTED)
    straight = Workers(config)
    straight.train(0, 20)
    expected = straight.finish()
    first = Workers(config)
    first.train(0, 9)  # fragment 1 launched at step 8 of 6-step rounds... in flight at 9 (k = 2)
    assert first.engines[0]._pending is not None
    saved = first.save()
    assert [len(s["co2"]["fragments"]) for s in saved] == [3, 3, 3]
    resumed = Workers(config, saved=saved)
    resumed.train(9, 20)
    for got, want in zip(resumed.finish(), expected):
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def test_format_1_checkpoints_of_one_fragment_still_load():
    config = CO2Config(co2_local_steps=3, co2_start_rule="eager", co2_fragments=1)
    run = Workers(config, workers=2)
    run.train(0, 4)
    saved = run.save()
    for state in saved:  # the format written before fragments: one buffer, every counter on top
        co2 = state["co2"]
        (fragment,) = co2.pop("fragments")
        counters = {**co2["counters"], **fragment["counters"]}
        for new in ("consecutive_skipped", "have_d", "sent_round"):  # then named like private attributes
            counters["_" + new] = counters.pop(new)
        del co2["config"]["co2_fragments"]
        co2.update(format=1, buffer=fragment["buffer"], own_outer_grad=fragment["own_outer_grad"], counters=counters)
    resumed = Workers(config, workers=2, saved=saved)
    for engine, state in zip(resumed.engines, run.save()):
        assert torch.equal(engine.state_dict()["fragments"][0]["buffer"], state["co2"]["fragments"][0]["buffer"])
        assert engine.state_dict()["counters"] == state["co2"]["counters"]


def test_a_non_finite_worker_sits_out_one_fragment_and_restarts_all_of_its_rounds(caplog):
    config = CO2Config(co2_start_rule="eager", **FRAGMENTED)
    run = Workers(config)
    run.train(0, 13, poison=(1, 10))  # worker 1 turns NaN after step 10, mid-round of every fragment
    # fragment 2 (boundary at step 12 of each 6-step round) found it: worker 1 sent weight 0 ...
    assert "worker 1 has a non-finite outer gradient" in caplog.text
    for model in run.models:  # ... and every one of its fragments restarted from a finite point
        assert all(torch.isfinite(t).all() for t in model.state_dict().values())
    run.train(13, 24)
    final = run.finish()
    assert run.engines[0].skipped_rounds == 0  # the others were finite: no round was skipped
    assert all(torch.isfinite(v).all() for state in final for v in state.values())


def test_metrics_sum_the_fragments_waits_and_combine_their_norms():
    config = CO2Config(co2_clip_threshold=1e-4, **FRAGMENTED)
    run = Workers(config, workers=2)
    run.train(0, 12)
    per_part = run.engines[0].fragment_metrics()  # each fragment's means over its boundaries
    assert len(per_part) == 3 and all({"comm_s", "momentum_norm", "clip_ratio"} <= set(m) for m in per_part)
    metrics = run.engines[0].pop_metrics()

    assert metrics["co2/comm_s"] == pytest.approx(sum(m["comm_s"] for m in per_part))
    norms = [m["momentum_norm"] for m in per_part]
    assert metrics["co2/momentum_norm"] == pytest.approx(sum(n * n for n in norms) ** 0.5)
    # each fragment is clipped to phi * sqrt(its share): the whole momentum's norm is <= phi
    assert metrics["co2/momentum_norm"] <= 1e-4 * (1 + 1e-5)
    assert metrics["co2/clip_ratio"] == pytest.approx(sum(m["clip_ratio"] for m in per_part) / 3)
    assert run.engines[0].fragment_metrics() == [{}, {}, {}]  # popped: a new window


def test_fragments_send_bfloat16_on_the_wire_and_stay_close_to_float32():
    finals = {}
    for dtype in ("float32", "bfloat16"):
        run = Workers(CO2Config(co2_comm_dtype=dtype, **FRAGMENTED), workers=2)
        sent = []
        for engine in run.engines:
            launch = engine.comm.launch
            engine.comm.launch = lambda t, launch=launch, sent=sent: sent.append(t.dtype) or launch(t)
        run.train(0, 14)
        finals[dtype] = run.finish()[0]
        assert set(sent) == {getattr(torch, dtype)} and len(sent) >= 2 * 7  # a fragment every 2 steps
    for key, value in finals["float32"].items():
        torch.testing.assert_close(finals["bfloat16"][key], value, rtol=2e-2, atol=2e-2)
    assert any(not torch.equal(finals["bfloat16"][k], v) for k, v in finals["float32"].items())


def test_the_default_outer_state_holds_one_buffer_for_all_fragments():
    """Anchor, momentum and the lookahead start's offset (4 bytes each per element), and one buffer:
    streaming fragments hold theirs only from their boundary until their average is applied, one
    at a time, so they share one of the largest fragment's size. Within 1.10 x the paper form's 12."""
    model = TinyNet(seed=0)
    co2 = CO2(model, CO2Config())
    n, params = co2.layout.padded_numel, co2.layout.param_numel
    edges = co2.layout.fragment_edges
    largest = max(hi - lo for lo, hi in zip(edges[:-1], edges[1:]))
    assert len(co2.fragments) == 12 and all(part.wire is None for part in co2.fragments)
    expected = 8 * n + 4 * params + 4 * (largest + header_numel(1))
    assert co2.outer_state_nbytes() == expected
    train = Workers(CO2Config(), workers=2)
    train.train(0, 30)  # two rounds and a half: every fragment launched and applied twice
    engine = train.engines[0]
    assert sum(part.wire is not None for part in engine.fragments) == 1  # the one in flight
    # with two workers and Adam, the default's second-moment exchange adds its offset (4 bytes per
    # element Adam trains) and one step count per tensor Adam trains (moments.py)
    trained = [p for group in engine.optimizer.param_groups for p in group["params"]]
    moments = 4 * sum(p.numel() for p in trained) + 4 * len(trained)
    assert (
        engine.outer_state_nbytes()
        == 8 * engine.layout.padded_numel
        + 4 * engine.layout.param_numel
        + 4
        * (
            max(hi - lo for lo, hi in zip(engine.layout.fragment_edges[:-1], engine.layout.fragment_edges[1:]))
            + header_numel(2)
        )
        + moments
    )
