"""`import co2_hf` and `import co2_hf.core` must load torch only, never transformers/accelerate."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_core_import_loads_torch_only():
    code = (
        "import sys, co2_hf, co2_hf.core, co2_hf.config, co2_hf.testing\n"
        "heavy = [m for m in ('transformers', 'accelerate', 'datasets', 'evaluate') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
