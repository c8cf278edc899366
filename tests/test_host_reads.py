"""The engine never makes the host wait for the device between logging steps, and a boundary's work does
not grow with the number of parameter tensors: the CPU-checkable guards of what a GPU needs (issue 41;
docs/gpus.md, "No host reads between logging steps"). ``co2_hf.testing.DispatchTrace`` sees, on the
CPU, every operation that would make a GPU's host wait: a device value read into Python, a tensor made
from host data, a blocking copy between devices, an output sized by values."""

from __future__ import annotations

import pytest
from distributed import run_processes
from host_read_workers import (
    GLOO_SETTINGS,
    LOCAL_SETTINGS,
    TAU,
    WORKER_GROUP_SETTINGS,
    gloo_host_reads,
    host_reads_of,
    ops_per_step,
)

from co2_hf import CO2Config


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(LOCAL_SETTINGS))
def test_no_host_read_in_a_step_that_does_not_log(name):
    assert host_reads_of(CO2Config(co2_local_steps=TAU, **LOCAL_SETTINGS[name])) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["streaming", "paper_gap_aware", "synchronous"])
def test_a_non_finite_worker_and_a_skipped_round_are_decided_on_the_device(name, caplog):
    """One worker turning NaN is non-finite and, alone, leaves no finite worker: it sends zeros with
    weight 0, the round is skipped, the inner optimizer is cleared; none of it is read on the host in
    the step (the warning comes from the tally's copy in host memory, tally.py)."""
    reads = host_reads_of(CO2Config(co2_local_steps=TAU, **LOCAL_SETTINGS[name]), poison_at=9)
    assert reads == []
    assert "worker 0 has a non-finite outer gradient" in caplog.text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_no_host_read_with_coded_wires_and_worker_groups():
    """Coded wires on two gloo ranks (their codec reads the finite flag in the communicator's thread,
    off the compute path), and worker groups of two processes on four ranks."""
    for reads in run_processes(gloo_host_reads, 2, GLOO_SETTINGS, timeout_s=200):
        assert reads == {name: [] for name in GLOO_SETTINGS}
    for reads in run_processes(gloo_host_reads, 4, WORKER_GROUP_SETTINGS, timeout_s=200):
        assert reads == {name: [] for name in WORKER_GROUP_SETTINGS}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "knobs",
    [
        {},
        dict(co2_fragments=1, co2_start_rule="anchor", co2_gap_penalty=1.0, co2_clip_threshold=1e-3),
        dict(co2_overlap=False, co2_nesterov=True),
    ],
    ids=["streaming", "paper_gap_aware_clip", "synchronous_nesterov"],
)
def test_a_boundary_dispatches_as_many_operations_for_400_tensors_as_for_10(knobs):
    few, many = ops_per_step(10, knobs), ops_per_step(400, knobs)
    assert max(few) > 20  # the boundaries ran
    assert many == few
