"""The sparse wire (co2_hf.core.codecs.sparse, ``co2_comm_dtype='sparse'``): block-local top-k with 2- and
4-bit values; error feedback that loses nothing over rounds; the all-gather against a naive dense
reference on 2 gloo processes, with the bytes it sent equal to the prediction; the engine with it
(identical averages on every rank, resumed bit for bit with its residual, re-sharded onto another
number of workers); the settings' validation."""

from __future__ import annotations

import logging

import pytest
import torch
from quant_workers import sparse_engine_over_the_wire, sparse_rounds
from simulated import Workers

from co2_hf import CO2Config
from co2_hf.config import max_paying_workers
from co2_hf.core.codecs.sparse import (
    SparseFeedback,
    decode,
    encode,
    payload_nbytes,
    sent_nbytes,
    sparse_all_reduce_,
    sparse_padded_numel,
)
from co2_hf.core.reshard import resharded_state
from co2_hf.core.wire import header_numel
from co2_hf.testing import LocalCollectives, SimulatedNetwork, run_processes

pytestmark = pytest.mark.timeout(120)
BITS = [2, 4]


def _x(numel: int = 64 * 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel // 64).repeat_interleave(64)
    x[:64] = 0.0  # an all-zero block
    return x


@pytest.mark.parametrize("bits", BITS)
def test_each_block_sends_its_largest_values_within_half_a_step(bits):
    x, keep = _x(), 5
    indices, codes, scales = encode(x, block=64, keep=keep, bits=bits, stochastic=False)
    back = decode(indices, codes, scales, block=64, keep=keep, bits=bits)
    blocks, sent = x.view(-1, 64), back.view(-1, 64)
    assert torch.equal(back[:64], torch.zeros(64))  # an all-zero block sends zeros
    for b in range(1, blocks.shape[0]):
        kept = sent[b] != 0
        assert kept.sum() == keep
        assert blocks[b].abs()[kept].min() >= blocks[b].abs()[~kept].max()  # the top-k by magnitude
        step = scales[b]  # one code step: the grid is (code - (L-1)/2) * scale
        assert torch.all((sent[b][kept] - blocks[b][kept]).abs() <= 0.5 * step * (1 + 1e-6))
    nbytes = indices.numel() + codes.numel() + 4 * scales.numel()
    assert indices.dtype == codes.dtype == torch.uint8
    assert nbytes == payload_nbytes(x.numel(), block=64, keep=keep, bits=bits) == 16 * (5 + 4) + 16 * 5 * bits // 8


@pytest.mark.parametrize("bits", BITS)
def test_every_code_packs_and_unpacks_exactly(bits):
    levels = 2**bits
    half = (levels - 1) / 2
    grid = (torch.arange(levels, dtype=torch.float32) - half) / half  # every code, scale 1
    x = torch.zeros(16 * 16)
    x.view(16, 16)[:, :levels] = grid  # each block: every code once, then zeros
    indices, codes, scales = encode(x, block=16, keep=levels, bits=bits, stochastic=False)
    back = decode(indices, codes, scales, block=16, keep=levels, bits=bits)
    torch.testing.assert_close(back, x, rtol=1e-6, atol=0)  # (code - half) * (1 / half): one rounding


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_error_feedback_loses_nothing_and_the_residual_stays_bounded(bits, stochastic):
    n = sparse_padded_numel(64 * 16, block=64)
    feedback = SparseFeedback(n)
    how = dict(block=64, keep=2, bits=bits, stochastic=stochastic, generator=torch.Generator().manual_seed(0))
    meant, sent, norms = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64), []
    for t in range(400):
        x = _x(seed=t)
        payload = feedback.compress(x, **how)
        meant += x.double()
        sent += decode(*payload, block=64, keep=2, bits=bits).double()
        norms.append(float(feedback.residual.norm()))
    # what was sent = what was meant - the residual still held, up to fp32 rounding
    torch.testing.assert_close(sent, meant - feedback.residual.double(), atol=1e-3, rtol=1e-5)
    # unbiased over rounds: the residual does not grow with the rounds (sent/T -> meant/T)
    assert max(norms[300:]) < 1.5 * max(norms[50:150])
    assert (meant - sent).norm() < 0.05 * meant.norm() + 20 * x.norm()


@pytest.mark.parametrize("bits", BITS)
def test_a_fading_residual_sends_the_top_k_of_the_new_values_plus_the_decayed_leftovers(bits):
    n = sparse_padded_numel(64 * 16, block=64)
    feedback, decay = SparseFeedback(n, decay=0.9), 0.9
    how = dict(block=64, keep=2, bits=bits)
    for t in range(20):
        x = _x(seed=t)
        target = decay * feedback.residual + x  # what this round owes: the new values and 0.9 x the old
        payload = feedback.compress(x, stochastic=False, **how)
        for got, want in zip(payload, encode(target.clone(), stochastic=False, **how)):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(feedback.residual, target - decode(*payload, **how), atol=1e-5, rtol=1e-6)
    # the leftovers fade instead of piling up: a block never sent holds a geometric sum, not 20 rounds
    assert feedback.residual.norm() < 10 * x.norm()


def test_one_rank_reduces_to_its_own_decoded_payload_and_the_exact_tail():
    # 200 values: 4 blocks of 64, 12 index bytes and 3 code bytes, so the scales start unaligned
    x, header = _x()[:200], torch.tensor([1.0, 2.5])
    got = sparse_all_reduce_(x.clone(), LocalCollectives(), block=64, keep=3, bits=2, exact=header)
    padded = torch.cat([x, torch.zeros(sparse_padded_numel(200, block=64) - 200)])
    once = decode(*encode(padded, block=64, keep=3, bits=2, stochastic=False), block=64, keep=3, bits=2)
    assert torch.equal(got, once[:200]) and torch.equal(header, torch.tensor([1.0, 2.5]))
    assert once.count_nonzero() == 9  # the first block is all zeros: its 3 values are sent as 0


def test_sparse_stops_paying_against_int4_where_the_all_gather_outgrows_the_ring():
    # per value: sparse (keep + keep*bits/8 + 4)/block bytes, int4 (block/2 + 4)/block
    assert max_paying_workers(block=256, keep=4, bits=2, int4_block=256) == 29  # 2 x 132 / 9 = 29.3
    assert max_paying_workers(block=128, keep=2, bits=2, int4_block=128) == 20  # 2 x 68 / 6.5 = 20.9
    n = 256 * 16 * 10  # whole blocks: no padding
    for world, pays in ((29, True), (30, False)):
        sparse = sent_nbytes(n, world=world, block=256, keep=4, bits=2)
        int4 = 2 * (world - 1) / world * (n // 2 + 4 * n // 256)
        assert (sparse < int4) is pays


# ---------------------------------------------------------------- over gloo


@pytest.fixture(scope="module")
def over_gloo():
    return {bits: run_processes(sparse_rounds, 2, bits, 4) for bits in BITS}


@pytest.mark.parametrize("bits", BITS)
def test_the_all_gather_equals_the_naive_reference_on_every_rank_and_sends_the_predicted_bytes(over_gloo, bits):
    ranks = over_gloo[bits]
    predicted = sent_nbytes(1000, world=2, block=64, keep=3, bits=bits, exact_numel=2)
    for rank in ranks:
        for t, result in enumerate(rank["rounds"]):
            assert torch.equal(result["got"], ranks[0]["rounds"][t]["got"])  # bit for bit on every rank
            # the reference adds dense decoded vectors: the same fp32 sums, where kept sets overlap too
            torch.testing.assert_close(result["got"], result["expected"], rtol=0, atol=1e-6)
            assert torch.equal(result["header"], torch.tensor([2.0, 0.25 + 2 * t]))  # summed exactly
        assert rank["sizes"] == [predicted] * 4  # one peer: (G-1) rows of exactly the predicted size


@pytest.mark.slow
def test_the_engine_applies_identical_averages_on_every_rank():
    ranks = run_processes(sparse_engine_over_the_wire, 2, 12)
    for got, want in zip(ranks[1]["run"]["anchors"], ranks[0]["run"]["anchors"]):
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert len(ranks[0]["sizes"]) == 15 and ranks[0]["sizes"] == ranks[1]["sizes"]  # one row per launch


# ---------------------------------------------------------------- the engine, simulated

SPARSE = dict(
    co2_local_steps=6, co2_fragments=3, co2_comm_dtype="sparse", co2_quant_block=16, co2_sparse_density=0.125
)


def test_the_engine_sends_each_fragment_s_predicted_bytes(monkeypatch):
    from co2_hf import testing

    sizes, original = [], testing.SimulatedCollectives.all_gather_

    def counted(self, output, input):
        if self.rank == 0:
            sizes.append(input.numel() * input.element_size())
        original(self, output, input)

    monkeypatch.setattr(testing.SimulatedCollectives, "all_gather_", counted)
    run = Workers(CO2Config(**SPARSE), workers=3)
    run.train(0, 12)
    run.finish()
    fragments = run.engines[0].fragments
    assert all(f.codec.sparse_numel == f.layout.param_local for f in fragments)  # the buffers travel exactly
    assert all(f.codec.feedback.residual.abs().sum() > 0 for f in fragments)  # what is not sent yet
    # a ring all-gather sends the row to G - 1 peers: the prediction is (G - 1) x the row counted here
    predicted = [f.codec.sent_nbytes(3, header_numel(3)) // 2 for f in fragments]
    blocks = [sparse_padded_numel(f.codec.sparse_numel, block=16) // 16 for f in fragments]
    by_hand = [b * (2 + 4) + b * 2 * 2 // 8 + 4 * (f.codec.dense + header_numel(3)) for b, f in zip(blocks, fragments)]
    assert predicted == by_hand
    # 12 steps of tau 6 with 3 fragments: 3, 3 and 2 launches (counted as each completes)
    assert [f.progress.round for f in fragments] == [3, 3, 2]
    assert sorted(sizes) == sorted(predicted[0:1] * 3 + predicted[1:2] * 3 + predicted[2:3] * 2)


@pytest.mark.parametrize("keep_unsent", [True, False])
def test_without_overlap_each_worker_starts_its_round_at_the_anchor_less_its_unsent_progress(keep_unsent):
    config = CO2Config(co2_overlap=False, co2_sparse_keep_unsent=keep_unsent, **{**SPARSE, "co2_fragments": 1})
    run = Workers(config)
    for stop in (6, 12, 18):  # three boundaries
        run.train(stop - 6, stop)
        for model, engine in zip(run.models, run.engines):
            anchor = engine.anchor_state()
            trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # the layout's order
            live = torch.cat([p.detach().flatten() for _, p in trained])
            held = torch.cat([anchor[name].flatten() for name, _ in trained])
            unsent = engine.fragments[0].codec.unsent[: live.numel()]
            assert unsent.abs().sum() > 0
            # kept: the model is ahead of the anchor by exactly what it still owes the average
            torch.testing.assert_close(live, held - unsent if keep_unsent else held, rtol=0, atol=1e-6)


def test_a_checkpoint_written_before_the_sparse_settings_were_added_resumes_only_as_it_trained():
    config = CO2Config(**SPARSE)
    run = Workers(config)
    run.train(0, 7)
    saved = run.save()
    for state in saved:  # as an earlier version wrote it
        for name in ("co2_sparse_keep_unsent", "co2_sparse_feedback_decay"):
            del state["co2"]["config"][name]
    with pytest.raises(ValueError, match=r"co2_sparse_keep_unsent: checkpoint False, now True"):
        Workers(CO2Config(co2_sparse_keep_unsent=True, **SPARSE), saved=saved)
    resumed = Workers(config, saved=saved)
    resumed.train(7, 9)
    run.train(7, 9)
    for got, want in zip(resumed.finish(), run.finish()):
        assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(("rounding", "keep_unsent"), [("nearest", True), ("stochastic", True), ("nearest", False)])
def test_a_checkpoint_with_its_residual_and_a_fragment_in_flight_resumes_bit_for_bit(rounding, keep_unsent):
    config = CO2Config(co2_quant_rounding=rounding, co2_sparse_keep_unsent=keep_unsent, **SPARSE)
    straight = Workers(config)
    straight.train(0, 20)
    expected = straight.finish()
    first = Workers(config)
    first.train(0, 9)
    assert first.engines[0].fragments[0].in_flight or first.engines[0].fragments[1].in_flight
    saved = first.save()
    assert all(f["residuals"]["unsent"].abs().sum() > 0 for f in saved[0]["co2"]["fragments"])
    resumed = Workers(config, saved=saved)
    resumed.train(9, 20)
    for got, want in zip(resumed.finish(), expected):
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def test_re_sharding_onto_more_workers_keeps_the_mean_still_owed():
    config = CO2Config(**SPARSE)
    old = Workers(config, workers=2)
    old.train(0, 9)
    saved = [state["co2"] for state in old.save()]
    owed = sum(torch.cat([f["residuals"]["unsent"] for f in s["fragments"]]) for s in saved) / 2
    new = Workers(config, workers=3)
    states = [resharded_state([saved[e.comm.worker_index % 2]], e) for e in new.engines]
    held = sum(torch.cat([f["residuals"]["unsent"] for f in s["fragments"]]) for s in states) / 3
    assert owed.abs().sum() > 0
    torch.testing.assert_close(held, owed, rtol=1e-6, atol=1e-7)
    # worker 2 takes old worker 0's residual, as worker 0 does: each at weight 3 / (2 x 2)
    first = torch.cat([f["residuals"]["unsent"] for f in saved[0]["fragments"]])
    torch.testing.assert_close(torch.cat([f["residuals"]["unsent"] for f in states[2]["fragments"]]), 0.75 * first)


def test_re_sharding_onto_one_worker_holds_no_residual():
    """One worker codes nothing (no residual to hold what was owed): the state loads and trains on."""
    config = CO2Config(**SPARSE)
    old = Workers(config, workers=2)
    old.train(0, 9)
    saved = [state["co2"] for state in old.save()]
    new = Workers(config, workers=1)
    (engine,) = new.engines
    state = resharded_state([saved[0]], engine)
    assert all(f["residuals"] is None for f in state["fragments"])
    engine.load_state_dict(state)
    new.train(9, 15)
    assert all(torch.isfinite(v).all() for v in new.finish()[0].values())


def test_a_non_finite_worker_sends_zeros_with_weight_0_and_keeps_its_residual(caplog):
    run = Workers(CO2Config(co2_start_rule="eager", **SPARSE))
    run.train(0, 10)
    poisoned = run.engines[1].fragments[2]
    before = poisoned.codec.feedback.residual.clone()
    run.train(10, 12, poison=(1, 10))
    assert "worker 1 has a non-finite outer gradient" in caplog.text
    assert torch.equal(poisoned.codec.feedback.residual, before)
    run.train(13, 24)
    final = run.finish()
    assert all(torch.isfinite(v).all() for state in final for v in state.values())


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (dict(co2_sparse_density=0.0), r"co2_sparse_density=0.0 is not allowed: it must be a number in \(0, 1\]"),
        (dict(co2_sparse_density=1.5), r"co2_sparse_density=1.5 is not allowed"),
        (dict(co2_sparse_bits=3), r"co2_sparse_bits=3 is not allowed: it must be 2 or 4"),
        (
            dict(co2_sparse_feedback_decay=0),
            r"co2_sparse_feedback_decay=0.0 is not allowed: it must be a number in \(0, 1\]",  # stored as float
        ),
        (
            dict(co2_comm_dtype="sparse", co2_quant_block=512),
            r"co2_quant_block=512 is not allowed with co2_comm_dtype='sparse'",
        ),
    ],
)
def test_bad_sparse_settings_are_refused_naming_the_flag(knobs, message):
    with pytest.raises(ValueError, match=message):
        CO2Config(**knobs)


def test_a_launch_where_sparse_sends_more_than_int4_is_refused_naming_the_flags():
    config = CO2Config(co2_comm_dtype="sparse")  # block 128, 2 values of 2 bits: pays up to 20 workers
    assert config.check_world(20) == 20
    with pytest.raises(
        ValueError, match=r"co2_comm_dtype='sparse' with co2_sparse_density=0.015625.*beyond 20 workers.*got 21"
    ):
        config.check_world(21)


def test_a_density_rounded_to_whole_values_per_block_is_said_once(caplog):
    config = CO2Config(
        co2_local_steps=6, co2_fragments=3, co2_comm_dtype="sparse", co2_quant_block=16, co2_sparse_density=0.1
    )
    assert config.sparse_keep == 2
    with caplog.at_level(logging.WARNING, logger="co2_hf.core.co2"):
        Workers(config, workers=2)
        Workers(config, workers=2)
    said = [r for r in caplog.records if "co2_sparse_density=0.1 keeps" in r.getMessage()]
    assert len(said) == 1 and "the wire's density is 0.125" in said[0].getMessage()


def test_one_worker_codes_nothing():
    network = SimulatedNetwork(1)
    from workers import TinyNet

    from co2_hf.core import CO2

    engine = CO2(TinyNet(seed=0), CO2Config(**SPARSE), communicator=network.communicator(0))
    assert all(f.codec is None for f in engine.fragments)
