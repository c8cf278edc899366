import os
import sys

# Spawned test processes import tests/ modules (workers, reference) by their top-level names.
sys.path.insert(0, os.path.dirname(__file__))
