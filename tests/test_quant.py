"""Block quantization for the wire (co2_hf.core.codecs.quant, ``co2_comm_dtype`` int8/int4): round-trip
error bounds, unbiased stochastic rounding, error feedback that loses nothing over rounds, the
quantized all-reduce against a naive reference of the same quantizer on 2 and 3 gloo processes,
and the engine with a coded wire: over gloo (2 and 3 workers, workers of 2 processes), off the main
thread, resumed bit for bit with its residuals, with a non-finite worker."""

from __future__ import annotations

import threading

import pytest
import torch
from quant_workers import engine_over_the_wire, hierarchical_over_the_wire, quantized_rounds_every_width
from simulated import Workers
from workers import reference_hierarchical

from co2_hf import CO2Config
from co2_hf.core.codecs.quant import (
    ErrorFeedback,
    coded_nbytes,
    dequantize,
    padded_numel,
    quantize,
    quantized_all_reduce_,
)
from co2_hf.testing import FakeCommunicator, LocalCollectives, run_processes

pytestmark = pytest.mark.timeout(120)
BITS = [8, 4]


def _x(numel: int = 64 * 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel // 64).repeat_interleave(64)
    x[:64] = 0.0  # an all-zero block
    return x


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_round_trip_error_is_within_half_a_step_nearest_and_one_step_stochastic(bits, stochastic):
    x = _x()
    codes, scales = quantize(x, bits=bits, block=64, stochastic=stochastic, generator=torch.Generator().manual_seed(1))
    back = dequantize(codes, scales, bits=bits, block=64)
    step = scales.repeat_interleave(64)  # one code step, per element
    bound = step * (1.0 if stochastic else 0.5) * (1 + 1e-6) + 1e-12
    assert torch.all((back - x).abs() <= bound)
    assert torch.equal(back[:64], torch.zeros(64))  # zero stays exactly zero
    assert codes.numel() * codes.element_size() + 4 * scales.numel() == coded_nbytes(x.numel(), bits=bits, block=64)


def test_coded_bytes_are_a_quarter_and_an_eighth_of_fp32_plus_scales():
    n = 1 << 20
    assert coded_nbytes(n, bits=8, block=256) / (4 * n) == pytest.approx(0.25 + 1 / 256)
    assert coded_nbytes(n, bits=4, block=256) / (4 * n) == pytest.approx(0.125 + 1 / 256)


@pytest.mark.parametrize("bits", BITS)
def test_stochastic_rounding_is_unbiased(bits):
    x = _x(numel=64 * 4, seed=3)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack(
        [
            dequantize(*quantize(x, bits=bits, block=64, stochastic=True, generator=g), bits=bits, block=64)
            for _ in range(4000)
        ]
    )
    _, scales = quantize(x, bits=bits, block=64, stochastic=False)
    step = scales.repeat_interleave(64)
    # the mean of 4000 draws, each within one step: standard error <= step / (2 sqrt(4000)) ~ 0.008 step
    assert torch.all((draws.mean(0) - x).abs() <= 0.05 * step + 1e-12)


def test_four_bit_codes_pack_two_per_byte_and_unpack_exactly():
    x = torch.arange(-7, 8, dtype=torch.float32).repeat(2)[:16] * 0.5  # every code value
    codes, scales = quantize(x, bits=4, block=16, stochastic=False)
    assert codes.dtype == torch.uint8 and codes.numel() == 8
    torch.testing.assert_close(dequantize(codes, scales, bits=4, block=16), x)


@pytest.mark.parametrize("bits", BITS)
def test_error_feedback_loses_nothing_over_rounds(bits):
    feedback, how = ErrorFeedback(64 * 8), dict(bits=bits, block=64, stochastic=False)
    meant, sent = torch.zeros(64 * 8, dtype=torch.float64), torch.zeros(64 * 8, dtype=torch.float64)
    for t in range(50):
        x = _x(numel=64 * 8, seed=t)
        codes, scales = feedback.compress(x, **how)
        meant += x.double()
        sent += dequantize(codes, scales, bits=bits, block=64).double()
    # what was sent = what was meant - the residual still held, up to fp32 rounding over 50 rounds
    torch.testing.assert_close(sent, meant - feedback.residual.double(), atol=1e-4, rtol=1e-5)
    # and the residual stays bounded (half a step of the last round's scales), never accumulating
    last_step = quantize(_x(numel=64 * 8, seed=49), **how)[1].repeat_interleave(64)
    assert feedback.residual.abs().max() <= 2 * last_step.max()


def test_bad_widths_and_lengths_are_refused():
    with pytest.raises(ValueError, match=r"bits=3: allowed values are \[4, 8\]"):
        quantize(torch.zeros(8), bits=3, block=8, stochastic=False)


@pytest.fixture(scope="module")
def reduced():
    return {world: run_processes(quantized_rounds_every_width, world, tuple(BITS), 4) for world in (2, 3)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bits", BITS)
def test_quantized_all_reduce_equals_the_naive_reference_bitwise_on_every_rank(reduced, world, bits):
    runs = [by_width[bits] for by_width in reduced[world]]
    for t in range(4):
        expected = runs[0]["rounds"][t]["expected"]
        for rank in range(world):
            assert torch.equal(runs[rank]["rounds"][t]["got"], expected), (rank, t)
            assert torch.equal(runs[rank]["rounds"][t]["expected"], expected)  # the reference agrees too
            assert torch.equal(runs[rank]["rounds"][t]["header"], runs[rank]["rounds"][t]["exact_header"])
        exact = runs[0]["exact"][t]
        err = (expected - exact).abs().max() / exact.abs().max()
        assert err < (0.05 if bits == 8 else 0.6), err  # a sum through codes, near the true sum


def test_any_length_is_coded_zero_padded_to_whole_blocks_per_rank():
    assert padded_numel(100, world=3, block=8) == 120 and padded_numel(120, world=3, block=8) == 120

    x = _x(numel=64 * 3)[:150]
    got = quantized_all_reduce_(x.clone(), LocalCollectives(), bits=8, block=64)  # one rank: each copies
    once = dequantize(*quantize(torch.cat([x, torch.zeros(42)]), bits=8, block=64, stochastic=False), bits=8, block=64)
    assert got.shape == x.shape
    assert torch.equal(got, dequantize(*quantize(once, bits=8, block=64, stochastic=False), bits=8, block=64)[:150])


# ---------------------------------------------------------------- the engine with a coded wire

WIRES = ("float32", "int8", "int4")


@pytest.fixture(scope="module")
def over_gloo():
    return {world: run_processes(engine_over_the_wire, world, WIRES, 12) for world in (2, 3)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_coded_wire_agrees_across_ranks_and_stays_near_float32(over_gloo, world):
    ranks = over_gloo[world]
    for dtype, tolerance in (("int8", 0.02), ("int4", 0.2)):
        final = ranks[0]["runs"][dtype]["anchors"][-1]
        for rank in range(1, world):  # every rank decodes the same codes: bit for bit the same model
            for got, want in zip(ranks[rank]["runs"][dtype]["anchors"], ranks[0]["runs"][dtype]["anchors"]):
                assert all(torch.equal(got[k], want[k]) for k in want), (dtype, rank)
        exact = ranks[0]["runs"]["float32"]["anchors"][-1]
        for key, value in exact.items():
            torch.testing.assert_close(final[key], value, rtol=tolerance, atol=tolerance)
        assert any(not torch.equal(final[k], v) for k, v in exact.items()), dtype  # it was coded


@pytest.mark.slow
def test_the_coded_all_reduce_runs_off_the_main_thread(over_gloo):
    for rank in over_gloo[2]:
        assert rank["threads"] == ["co2-coded-all-reduce"] and rank["main"] not in rank["threads"]


@pytest.mark.slow
def test_workers_of_two_processes_each_code_their_own_slice():
    runs = run_processes(hierarchical_over_the_wire, 4, 12)
    exact = reference_hierarchical(2, 2, dict(co2_local_steps=4), 12)
    for rank in range(1, 4):
        assert all(torch.equal(runs[rank]["anchors"][-1][k], v) for k, v in runs[0]["anchors"][-1].items())
    for key, value in exact[-1].items():
        torch.testing.assert_close(
            runs[0]["anchors"][-1][key], value.to(runs[0]["anchors"][-1][key]), rtol=0.02, atol=0.02
        )


CODED = dict(co2_local_steps=6, co2_fragments=3, co2_comm_dtype="int8", co2_quant_block=8)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_checkpoint_with_residuals_and_a_fragment_in_flight_resumes_bit_for_bit(rounding):
    config = CO2Config(co2_quant_rounding=rounding, **CODED)
    straight = Workers(config)
    straight.train(0, 20)
    expected = straight.finish()
    first = Workers(config)
    first.train(0, 9)
    assert first.engines[0]._pending is not None
    saved = first.save()
    residuals = saved[0]["co2"]["fragments"][0]["residuals"]
    assert residuals["sent"].abs().sum() > 0 and residuals["owned"].abs().sum() > 0  # there is state to keep
    resumed = Workers(config, saved=saved)
    resumed.train(9, 20)
    for got, want in zip(resumed.finish(), expected):
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def test_a_non_finite_worker_sends_zeros_with_weight_0_and_keeps_its_residual(caplog):
    run = Workers(CO2Config(co2_start_rule="eager", **CODED))
    run.train(0, 10)
    poisoned = run.engines[1].fragments[2]  # its boundary, after inner step 12, is the first to see the NaN
    before = poisoned.codec.sent.residual.clone()
    run.train(10, 12, poison=(1, 10))
    assert "worker 1 has a non-finite outer gradient" in caplog.text
    assert torch.equal(poisoned.codec.sent.residual, before)  # nothing of its own went out
    run.train(13, 24)
    final = run.finish()
    assert run.engines[0].skipped_rounds == 0
    assert all(torch.isfinite(v).all() for state in final for v in state.values())


def test_a_coded_wire_holds_two_residuals_beside_the_outer_state():
    from workers import TinyNet

    from co2_hf.core import CO2

    def two_workers():  # only what the constructor reads: nothing travels here
        return FakeCommunicator(num_workers=2)

    plain = CO2(TinyNet(seed=0), CO2Config(co2_local_steps=6, co2_fragments=3), communicator=two_workers())
    coded = CO2(TinyNet(seed=0), CO2Config(**CODED), communicator=two_workers())
    # per fragment: its own residual (the payload padded to whole blocks per worker), and the
    # residual of the half of the sum it owns
    residuals = sum(4 * padded_numel(part.layout.shard_numel, world=2, block=8) * 3 // 2 for part in coded.fragments)
    assert coded.outer_state_nbytes() == plain.outer_state_nbytes() + residuals


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_trainer_resumes_an_int8_wire_bit_for_bit_from_its_checkpoint(tmp_path):
    """Through CO2Trainer's checkpoints (the residuals travel in each rank's file) on 2 processes."""
    from trainer_workers import STOP_AT, stopped_then_resumed_in_process

    out = str(tmp_path / "int8")
    runs = run_processes(stopped_then_resumed_in_process, 2, out, {"co2_comm_dtype": "int8"}, timeout_s=200)
    saved = torch.load(f"{out}/checkpoint-{STOP_AT}/co2_rank0.pt", weights_only=True)["co2"]
    assert all(fragment["residuals"]["sent"].abs().sum() > 0 for fragment in saved["fragments"])
    for rank in runs:
        assert rank["stopped_at"] == STOP_AT
        for name, value in rank["full"].items():
            assert torch.equal(rank["final"][name], value), name


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("stochastic", [False, True])
def test_error_feedback_keeps_exactly_what_decoding_its_codes_leaves_out(bits, stochastic):
    """`ErrorFeedback` multiplies its rounded values back by the scales instead of decoding the codes
    (scripts/codec_cost.py): the residual must be the plain formula's, ``(x + r) - deQ(Q(x + r))``, bit for bit."""
    feedback, how = ErrorFeedback(64 * 8), dict(bits=bits, block=64, stochastic=stochastic)
    for t in range(3):
        x = _x(numel=64 * 8, seed=t)
        target = feedback.residual.clone() + x
        codes, scales = feedback.compress(x, generator=torch.Generator().manual_seed(t), **how)
        plain = quantize(target, generator=torch.Generator().manual_seed(t), **how)
        assert torch.equal(codes, plain[0]) and torch.equal(scales, plain[1])
        assert torch.equal(feedback.residual, target - dequantize(*plain, bits=bits, block=64))


class _ThreadGroup:
    """The coded wire's two collectives between threads of one process: a group that may change
    from round to round, as a torchft quorum does (co2_hf/torchft/)."""

    def __init__(self, world: int) -> None:
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world)

    def member(self, rank: int):
        group = self

        class Member:
            world_size = group.world

            def __init__(self) -> None:
                self.rank = rank

            def all_to_all_(self, output: torch.Tensor, input: torch.Tensor) -> None:
                rows = group._exchange(rank, input.view(group.world, -1))
                output.view(group.world, -1).copy_(torch.stack([row[rank] for row in rows]))

            def all_gather_(self, output: torch.Tensor, input: torch.Tensor) -> None:
                output.view(group.world, -1).copy_(torch.stack(group._exchange(rank, input)))

        return Member()

    def _exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        every = list(self.slots)
        self.barrier.wait()
        return every


def _reduce_in_threads(wires: list, members: list[int], vectors: dict, round_index: int) -> dict:
    """One coded all-reduce of ``vectors`` (by worker) over the workers ``members``, in rank order."""
    group, outputs = _ThreadGroup(len(members)), {}

    def one(w: int, rank: int) -> None:
        x = vectors[w].clone()
        wires[w].all_reduce_(x, torch.ones(1), group.member(rank), feedback=True, round_index=round_index)
        outputs[w] = x

    threads = [threading.Thread(target=one, args=(w, rank)) for rank, w in enumerate(members)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outputs


@pytest.mark.parametrize("bits", BITS)
def test_a_coded_wire_loses_nothing_when_its_group_changes_between_rounds(bits):
    """A torchft quorum changes who takes part: each worker sums another slice, of another length.
    Over rounds, what every worker got equals what the participants sent, less what the residuals
    of all workers still hold (each owned residual at its slice): nothing is lost in the regroup."""
    from co2_hf.core.codecs.quant import QuantizedWire

    numel, block = 200, 8
    wires = [QuantizedWire(numel, 3, bits=bits, block=block, stochastic=False, seed=0, device="cpu") for _ in range(3)]
    groups = [[0, 1, 2], [0, 2], [2], [1, 2, 0], [0, 1, 2], [1, 0]]  # members in rank order
    received, meant = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    for t, members in enumerate(groups):
        vectors = {w: _x(numel=256, seed=10 * t + w)[:numel] for w in members}
        outputs = _reduce_in_threads(wires, members, vectors, t)
        assert all(torch.equal(outputs[w], outputs[members[0]]) for w in members)  # the same sum on all
        received += outputs[members[0]].double()
        meant += sum(vectors.values()).double()
    held = torch.zeros(numel, dtype=torch.float64)
    for wire in wires:
        held += wire.sent.residual[:numel].double()
        owned = wire.owned.residual
        start = wire._rank * owned.numel()
        held[start : min(start + owned.numel(), numel)] += owned[: max(0, numel - start)].double()
    assert [wire.world for wire in wires] == [2, 2, 3]  # each as it last took part
    assert wires[1].sent.residual.numel() == padded_numel(numel, world=2, block=block)
    assert torch.allclose(received, meant - held, atol=1e-4), (received - meant + held).abs().max()


def test_residuals_saved_over_a_smaller_group_load_and_regroup_on_the_next_all_reduce():
    """A torchft replica's checkpoint may hold residuals coded over a quorum of 2 of its 3 workers."""
    from co2_hf.core.codecs.quant import QuantizedWire

    def wire():
        return QuantizedWire(200, 3, bits=8, block=8, stochastic=False, seed=0, device="cpu")

    saved = wire()
    saved._make_residuals(2)
    saved.sent.residual.fill_(1.0)
    saved.owned.residual.fill_(2.0)
    loaded = wire()
    loaded.load_(saved.state())
    assert loaded.world == 2
    assert all(torch.equal(a, b) for a, b in zip(loaded.state().values(), saved.state().values()))
    x = torch.zeros(200)
    loaded.all_reduce_(x, torch.ones(1), LocalCollectives(), feedback=True, round_index=0)  # a group of one
    assert loaded.world == 1 and loaded.owned.residual.numel() == padded_numel(200, world=1, block=8)
