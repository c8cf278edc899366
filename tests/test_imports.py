"""What importing co2_hf loads, and where each third-party import is declared.

`import co2_hf`, `import co2_hf.core` and `import co2_hf.checkpoints` must load torch only, never
transformers/accelerate. Every third-party module a folder imports must come from a distribution
declared for it in pyproject.toml: co2_hf/ from the dependencies (so a plain `pip install co2_hf`
imports it), recipes/ and scripts/ from those plus the `recipes` extra, tests/ from those plus the
`test` extra.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("co2_hf", "recipes", "scripts", "tests")  # the repository's own code


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_core_import_loads_torch_only():
    code = (
        "import sys, co2_hf, co2_hf.core, co2_hf.config, co2_hf.testing\n"
        "heavy = [m for m in ('transformers', 'accelerate', 'datasets', 'evaluate') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_checkpoints_import_loads_neither_transformers_nor_accelerate():
    """co2_hf/checkpoints/ is framework-neutral: the Trainer and Accelerate both call it, neither is its."""
    modules = sorted(p.stem for p in (ROOT / "co2_hf" / "checkpoints").glob("*.py") if p.stem != "__init__")
    code = (
        f"import sys, importlib\nfor name in {modules!r}: importlib.import_module('co2_hf.checkpoints.' + name)\n"
        "heavy = [m for m in ('transformers', 'accelerate', 'datasets', 'evaluate') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    assert {"bounded", "manifest", "publish", "rank_files"} <= set(modules)
    subprocess.run([sys.executable, "-c", code], check=True)


def _name(requirement: str) -> str:
    """``'torch>=2.6,<3'`` -> ``'torch'``, normalised as PyPI compares names."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def _declared(extras: tuple[str, ...]) -> set[str]:
    """Distributions the dependencies and ``extras`` declare, self-references (co2_hf[x]) followed."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; what is declared is the same on every version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names, todo, seen = set(), [*project["dependencies"]], set()
    todo += [r for extra in extras for r in project["optional-dependencies"][extra]]
    while todo:
        requirement = todo.pop()
        if _name(requirement) == "co2-hf":
            for extra in re.search(r"\[(.*)\]", requirement).group(1).split(","):
                if extra not in seen:
                    seen.add(extra)
                    todo += project["optional-dependencies"][extra.strip()]
        else:
            names.add(_name(requirement))
    return names


def _third_party_imports(folder: Path) -> dict[str, str]:
    """Top-level module -> first file importing it, for every absolute import under ``folder``
    (those inside functions included) that is neither the standard library nor the repository's
    own code (a package or a module of one of its folders, e.g. a recipe a test imports)."""
    own = [p for name in FOLDERS for p in (ROOT / name).rglob("*")]
    local = set(FOLDERS) | {p.stem for p in own if p.suffix == ".py"} | {p.name for p in own if p.is_dir()}
    found: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "folder, extras",
    # the ft extra's torchft: imported by co2_hf/torchft/ and tests/test_ft.py
    # (which skips without it); the tensorboard extra's tensorboard: tests/test_trainer.py's event-file
    # test (skips without it)
    [
        ("co2_hf", ("ft",)),
        ("recipes", ("recipes",)),
        ("scripts", ("recipes", "ft")),
        ("tests", ("test", "ft", "tensorboard")),
    ],
)
def test_every_import_is_declared_for_its_folder(folder, extras):
    providers = importlib.metadata.packages_distributions()  # module -> the installed distributions
    declared = _declared(extras)
    undeclared = {
        module: where
        for module, where in _third_party_imports(ROOT / folder).items()
        if not {_name(d) for d in providers.get(module, [module])} & declared
    }
    assert not undeclared, f"{folder}/ imports these, but pyproject.toml does not declare them for it: {undeclared}"
