"""scripts/gpu_overhead.py (the one-device boundary-cost check meant for a GPU): its arithmetic on
synthetic step times, and a CPU smoke run."""

import statistics

import pytest
import torch

from scripts import gpu_overhead

pytestmark = pytest.mark.research  # the benchmark code of scripts/


def _line(run: str, step_times: list[float], tau: int, repeat: int = 0) -> dict:
    """What ``gpu_overhead.run`` reports for steps that took ``step_times`` (whole rounds of tau)."""
    total, steps = sum(step_times), len(step_times)
    line = {"run": run, "repeat": repeat, "rounds": steps // tau, "steps": steps, "total_s": total}
    return {**line, "time_per_step_s": total / steps}


@pytest.mark.timeout(10)
def test_a_boundary_that_only_one_step_in_tau_pays_shows_in_the_totals():
    tau, rounds = 12, 5
    plain = [0.100] * (tau * rounds)
    co2 = [0.100 if (i + 1) % tau else 0.160 for i in range(tau * rounds)]  # each boundary step +60 ms
    assert statistics.median(co2) == statistics.median(plain)  # a median step never sees the boundary
    summary = gpu_overhead.summarize([_line("plain", plain, tau), _line("co2", co2, tau)])
    assert summary["co2"]["vs_plain"] == pytest.approx(1.05)  # 60 ms per 1.2 s round
    assert summary["co2"]["boundary_s"] == pytest.approx(0.060)
    assert summary["co2"]["boundary_steps"] == pytest.approx(0.6)
    assert summary["plain"]["vs_plain"] == 1.0 and summary["plain"]["boundary_s"] == 0.0


@pytest.mark.timeout(10)
def test_each_run_is_compared_with_plain_of_its_own_repeat():
    tau = 2
    lines = [  # the device slows down by 2x in repeat 1: both runs move together
        _line("plain", [1.0] * 4, tau, repeat=0),
        _line("co2", [1.0, 1.2] * 2, tau, repeat=0),
        _line("plain", [2.0] * 4, tau, repeat=1),
        _line("co2", [2.0, 2.4] * 2, tau, repeat=1),
        _line("plain", [1.0] * 4, tau, repeat=2),
        _line("co2", [1.0, 1.2] * 2, tau, repeat=2),
    ]
    summary = gpu_overhead.summarize(lines)["co2"]
    assert summary["vs_plain"] == pytest.approx(1.1)  # 10% in every repeat
    assert summary["boundary_steps"] == pytest.approx(0.2)
    assert summary["boundary_s"] == pytest.approx(0.2)  # at plain's median step, 1.0 s


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_smoke_run_on_the_cpu_reports_every_run(capsys):
    argv = ["--device", "cpu", "--model", "tiny", "--seq", "32", "--batch", "1", "--tau", "2"]
    lines = gpu_overhead.main([*argv, "--rounds", "2", "--repeats", "1"])
    runs, codecs = lines[: len(gpu_overhead.DEFAULT_RUNS)], lines[len(gpu_overhead.DEFAULT_RUNS) :]
    assert [x["run"] for x in runs] == gpu_overhead.DEFAULT_RUNS
    assert all(x["total_s"] > 0 and x["steps"] == 4 for x in runs)
    assert [x["round_ends"] for x in runs] == [0, 2, 2, 2, 2]  # whole rounds, fragments or not
    assert runs[0]["outer_state_bytes"] == 0 and runs[1]["outer_state_bytes"] > 0
    # the quantized wire's own work per round, which one process never runs
    assert [x["run"] for x in codecs] == ["codec_int8", "codec_int4"]
    assert all(x["seconds_per_round"] > 0 and x["vs_plain_round"] > 0 and x["numel"] > 0 for x in codecs)
    out = capsys.readouterr().out
    assert "# co2: " in out and " x plain (target <= 1.03: " in out and "# codec_int8: " in out
    with pytest.raises(SystemExit):
        gpu_overhead.main([*argv, "--rounds", "0"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_times_whole_rounds_with_gpu_and_host_state(capsys):
    argv = ["--device", "cuda", "--model", "tiny", "--seq", "128", "--batch", "2", "--tau", "4", "--rounds", "2"]
    lines = gpu_overhead.main([*argv, "--repeats", "1", "--codecs"])
    assert [x["round_ends"] for x in lines] == [0, 2, 2, 2, 2] and all(x["total_s"] > 0 for x in lines)
    assert lines[4]["outer_state_bytes"] > 0  # co2_cpu_state: the state in host memory, trained on the GPU
    assert "# co2_cpu_state: " in capsys.readouterr().out


@pytest.mark.timeout(10)
def test_the_gpu_report_table_gives_each_row_its_target():
    from scripts import gpu_report

    engine = {
        "plain": {"time_per_step_s": 0.058, "vs_plain": 1.0, "boundary_steps": 0.0},
        "co2": {"time_per_step_s": 0.059, "vs_plain": 1.02, "boundary_steps": 0.24},
        "co2_cpu_state": {"time_per_step_s": 0.062, "vs_plain": 1.07, "boundary_steps": 0.84},
        "co2_f6": {"time_per_step_s": 0.06, "vs_plain": 1.01, "boundary_steps": 0.12},
    }
    report = gpu_report.table(engine, {"co2_trainer_compiled": 1.029}, "NVIDIA H200").splitlines()
    assert report[0] == "plain training: 0.0580 s per step on NVIDIA H200"
    assert "| defaults (F = tau streaming, lookahead) | 1.020x | 0.24 | <= 1.03x: met |" in report
    assert "| host-memory state (co2_state_device=cpu), defaults | 1.070x | 0.84 | <= 1.05x: missed |" in report
    assert "| F = 6 | 1.010x | 0.12 |  |" in report  # the sweep has no target of its own
    assert report[-1] == "| CO2Trainer vs Trainer, --torch_compile | 1.029x | | <= 1.03x: met |"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_trainer_pair_runs_on_the_cpu():
    import argparse

    from scripts import gpu_report

    args = argparse.Namespace(device="cpu", model="tiny", seq=16, batch=2, tau=2, steps=5)
    for co2 in (False, True):
        line = gpu_report.run_trainer(co2=co2, compiled=False, args=args)
        assert line["run"] == ("co2_trainer" if co2 else "plain_trainer") and line["time_per_step_s"] > 0
