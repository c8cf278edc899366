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


@pytest.mark.timeout(10)
def test_the_readme_is_a_front_page():
    """At most 150 lines: the details live in docs/, which the README links."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (code blocks skipped)."""
    anchors, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#+\s+(.*)", line)
        if heading:
            anchors.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.timeout(10)
def test_every_relative_link_of_the_docs_leads_somewhere():
    """Every ``](path)`` and ``](path#anchor)`` of README.md, recipes/README.md and docs/*.md that is not
    a URL names a file that exists, and a heading of it."""
    broken = []
    for page in [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} names no heading")
    assert not broken, broken


@pytest.mark.timeout(10)
def test_the_layout_page_names_every_module():
    text = (ROOT / "docs" / "layout.md").read_text()
    missing = [
        str(module.relative_to(ROOT))
        for module in sorted((ROOT / "co2_hf").rglob("*.py"))
        if f"`{module.name}`" not in text
    ]
    assert not missing, missing
