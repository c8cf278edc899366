"""The documented CPU launch command really starts two distributed processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tables import SLACK_S  # scheduling noise on a loaded 2-core machine

pytestmark = pytest.mark.slow  # each test launches processes and runs a script end to end

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_accelerate_launch_with_the_cpu_config_runs_two_processes(tmp_path):
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [
        str(accelerate),
        "launch",
        "--config_file",
        str(ROOT / "recipes/accelerate_configs/cpu_2proc.yaml"),
        "--main_process_port",
        "29517",
        str(ROOT / "recipes/accelerate_loop.py"),
        "--max_steps",
        "8",
        "--co2_local_steps",
        "4",
        "--output_dir",
        str(tmp_path / "out"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=110, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^2 processes, tau=4", result.stdout, re.M), result.stdout
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.research
@pytest.mark.timeout(150)
def test_a_users_script_ends_with_no_gloo_thread_left_for_interpreter_exit(tmp_path):
    """A CO2Trainer script that ends without trainer.end(): co2_hf destroys the process groups at exit,
    so no gloo worker thread meets interpreter finalization (the cause of the rare
    ``terminate called without an active exception`` abort; scripts/exit_check.py runs it 100 times)."""
    from scripts import exit_check

    result = exit_check.one_run(str(tmp_path / "run"), steps=8, wire="float32", amplify_ms=0, shim=None, timeout_s=140)
    assert result["clean"], result["tail"]
    assert result["gloo_threads_at_exit"] == [0, 0], result


@pytest.mark.research
@pytest.mark.timeout(60)
@pytest.mark.parametrize("gather", [False, True], ids=["in_co2s_wait", "in_a_default_group_collective"])
def test_a_frozen_peers_survivor_exits_with_status_1_within_the_timeout(tmp_path, gather):
    """Rank 1 freezes (SIGSTOP): rank 0 stops with an error after co2_timeout_s (CO2's own; with ``gather``
    torch's, in a collective of the default group such as the Trainer's loss gather, CO2's all-reduce still
    in flight) and exits with status 1 at once. It used to hang at interpreter exit, joining a gloo thread
    blocked in CO2's all-reduce until its group's timeout (a minute later), and die of SIGABRT
    (scripts/exit_check.py --freeze runs the CO2Trainer script so, 20 times)."""
    from scripts import exit_check

    timeout_s = 2.0
    freeze_at = 4 if gather else 5  # gather: the survivor launches round 1's all-reduce at step 4, alone
    result = exit_check.one_frozen_run(
        str(tmp_path / "run"),
        steps=0,
        freeze_at=freeze_at,
        co2_timeout_s=timeout_s,
        timeout_s=30,
        gather=gather,
        engine=True,
    )
    assert result["rc"] == 1 and result["terminate_called"] == 0, result["tail"]
    assert result["error"] == ("torch" if gather else "co2"), result["tail"]
    assert result["exit_after_fault_s"] < timeout_s + 2 * SLACK_S, result
