"""The README's two first commands are what a new user runs and what CI runs: keep them true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert first_block, "the README must start with a code block holding its two commands"
    return [line for line in first_block.group(1).splitlines() if line and not line.startswith("#")]


@pytest.mark.timeout(10)
def test_readme_starts_with_exactly_two_commands():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert all("pip install torch==2.13.0 -e" in c for c in commands)


@pytest.mark.timeout(10)
def test_ci_runs_the_readme_test_command_verbatim():
    test_command = _readme_commands()[1]
    assert "pytest" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()
