import os
import sys

# Spawned test processes import tests/ modules (workers, reference) by their top-level names.
sys.path.insert(0, os.path.dirname(__file__))

# Markers (pyproject.toml): every test file marks its own `slow` and `research` tests. The two files
# marked from nowhere, test_engine_local.py and test_fragments.py, need none: each of their tests
# takes under half a second on 2 cores (the engine on one process and on simulated workers). Should
# one become slow, mark it here by node id in `pytest_collection_modifyitems`, or in its file.
