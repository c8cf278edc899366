"""Block quantization for the wire (co2_hf.core.quant): round-trip error bounds, unbiased stochastic
rounding, error feedback that loses nothing over rounds, and the quantized all-reduce against a
naive reference of the same quantizer on 2 and 3 gloo processes."""

from __future__ import annotations

import pytest
import torch
from quant_workers import quantized_rounds_every_width

from co2_hf.core.quant import ErrorFeedback, coded_nbytes, dequantize, quantize
from co2_hf.testing import run_processes

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
        [dequantize(*quantize(x, bits=bits, block=64, stochastic=True, generator=g), bits=bits, block=64)
         for _ in range(4000)]
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


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bits", BITS)
def test_quantized_all_reduce_equals_the_naive_reference_bitwise_on_every_rank(reduced, world, bits):
    runs = [by_width[bits] for by_width in reduced[world]]
    for t in range(4):
        expected = runs[0]["rounds"][t]["expected"]
        for rank in range(world):
            assert torch.equal(runs[rank]["rounds"][t]["got"], expected), (rank, t)
            assert torch.equal(runs[rank]["rounds"][t]["expected"], expected)  # the reference agrees too
        exact = runs[0]["exact"][t]
        err = (expected - exact).abs().max() / exact.abs().max()
        assert err < (0.05 if bits == 8 else 0.6), err  # a sum through codes, near the true sum
