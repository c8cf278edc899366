"""scripts/gpu_overhead.py (the one-device boundary-cost check meant for a GPU) as a CPU smoke run."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


@pytest.mark.timeout(60)
def test_smoke_run_on_the_cpu_reports_every_run(capsys):
    import gpu_overhead

    argv = ["--device", "cpu", "--model", "tiny", "--seq", "32", "--batch", "1", "--tau", "3", "--steps", "6"]
    lines = gpu_overhead.main([*argv, "--repeats", "1"])
    assert [x["run"] for x in lines] == list(gpu_overhead.RUNS)
    assert all(x["median_step_s"] > 0 for x in lines)
    assert lines[0]["outer_state_bytes"] == 0 and lines[1]["outer_state_bytes"] > 0
    assert "# co2: median step" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # round 0 is excluded: at least two rounds are needed
        gpu_overhead.main([*argv[:-2], "--steps", "5"])
