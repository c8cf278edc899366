"""Multi-process properties of the engine: the worked example, the equivalence with DDP, the wire
dtype over real gloo, and a stop mid-round resumed bit for bit in fresh processes."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_processes
from tables import CO2_ROWS, DILOCO_ROWS
from workers import SPEC_DEFAULTS, ddp_versus_co2, resume, run_then_stop, train_engine, wire_dtypes, worked_example

pytestmark = pytest.mark.slow  # every test runs two gloo processes

# co2_global_second_moment_every over gloo, streaming fragments in flight beside the exchange
MOMENTS = {**SPEC_DEFAULTS, "co2_local_steps": 3, "co2_fragments": 3, "co2_global_second_moment_every": 1}
CO2_EXAMPLE = dict(co2_outer_momentum=0.5, co2_gap_penalty=1.0, co2_clip_threshold=0.25)
DILOCO_EXAMPLE = dict(co2_overlap=False, co2_nesterov=True, co2_outer_lr=0.7, co2_outer_momentum=0.9)


def _two_process_checks(rank: int, world: int) -> dict:
    return {
        "co2": worked_example(rank, world, CO2_EXAMPLE),
        "diloco": worked_example(rank, world, DILOCO_EXAMPLE),
        "ddp": ddp_versus_co2(rank, world),
        "wire": wire_dtypes(rank, world),
        "moments": train_engine(rank, world, MOMENTS, steps=14),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return run_processes(_two_process_checks, 2, timeout_s=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "table"), [("co2", CO2_ROWS), ("diloco", DILOCO_ROWS)])
def test_engine_reproduces_the_worked_example(two_ranks, name, table):
    """Four boundaries and finalize (which changes nothing in synchronous mode), in fp32."""
    for rank in (0, 1):
        rows = two_ranks[rank][name]
        assert len(rows) == 5
        if name == "diloco":
            assert rows[4] == rows[3]
        for boundary, ((anchor, m), want) in enumerate(zip(rows, table)):
            assert anchor == pytest.approx(list(want[0]), abs=1e-6), (name, boundary)
            assert m == pytest.approx(list(want[1]), abs=1e-6), (name, boundary)


@pytest.mark.timeout(120)
def test_tau_one_synchronous_plain_average_equals_ddp_with_sgd(two_ranks):
    for rank in (0, 1):
        ddp, co2 = two_ranks[rank]["ddp"]["ddp"], two_ranks[rank]["ddp"]["co2"]
        for name, value in co2.items():
            if value.requires_grad:
                torch.testing.assert_close(value, ddp[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.timeout(120)
def test_bfloat16_wire_over_gloo_stays_close_and_agrees_across_ranks(two_ranks):
    fp32 = two_ranks[0]["wire"]["float32"]["anchors"][-1]
    bf16 = [two_ranks[r]["wire"]["bfloat16"]["anchors"][-1] for r in (0, 1)]
    for name, value in fp32.items():
        assert torch.equal(bf16[0][name], bf16[1][name]), name
        torch.testing.assert_close(bf16[0][name], value, rtol=3e-2, atol=3e-2, msg=name)


@pytest.mark.timeout(120)
def test_the_second_moment_exchange_over_gloo_is_the_simulated_one(two_ranks):
    """Its all-reduce on the outer group beside the fragments' (launched in the same order on every
    rank): the anchors of the simulated network's run, to float32 rounding (the processes' matmuls
    may round otherwise), and not those of a run without it."""
    from simulated import Workers

    from co2_hf import CO2Config

    def simulated(every: int) -> list[dict]:
        workers = Workers(CO2Config(**{**MOMENTS, "co2_global_second_moment_every": every}), 2)
        workers.train(0, 14)
        return workers.finish()

    on, off = simulated(1), simulated(0)
    final = two_ranks[0]["moments"]["anchors"][-1]
    assert any(not torch.allclose(value, off[0][name].double(), rtol=1e-4, atol=1e-5) for name, value in final.items())
    for name, value in final.items():
        torch.testing.assert_close(value, on[0][name].double(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(150)
def test_stop_mid_round_with_all_reduce_in_flight_resumes_bit_for_bit(tmp_path):
    path = os.path.join(tmp_path, "state")
    uninterrupted = run_processes(run_then_stop, 2, path, timeout_s=100)
    resumed = run_processes(resume, 2, path, timeout_s=100)
    for rank in (0, 1):
        for name, value in uninterrupted[rank].items():
            assert torch.equal(resumed[rank][name], value), (rank, name)
