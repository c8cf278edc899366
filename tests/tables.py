"""Numbers that more than one test module reads, so that no test module imports another (pytest
would collect it twice under another name, and a test file would stop being a leaf).

The worked example (docs/algorithm.md): two workers, tau 1, four boundaries. ``OUTER[t]`` holds each
worker's outer gradient d^i_t; ``CO2_ROWS`` and ``DILOCO_ROWS`` what the update gives after each
boundary, checked through the naive reference in float64 (tests/test_update.py) and through the
engine on two gloo processes in float32 (tests/test_engine_distributed.py).
"""

from __future__ import annotations

# Outer gradients d^i_t of the worked example: OUTER[t] = (worker 0, worker 1)
OUTER = [
    ((0.10, -0.20), (0.30, 0.00)),
    ((0.05, 0.10), (0.15, -0.10)),
    ((-0.20, 0.40), (0.00, 0.20)),
    ((0.10, 0.10), (0.10, 0.30)),
]
CO2_ROWS = [  # anchor, momentum, penalty after each boundary, then after finalize
    ((1.0, -2.0), (0.0, 0.0), None),
    ((0.8, -1.9), (0.2, -0.1), (1.0, 1.0)),
    ((0.675, -1.85), (0.125, -0.05), (0.25, 0.5)),
    ((0.7087783, -2.0977075), (-0.0337783, 0.2477075), (1.0, 1.0)),
    ((0.6284560, -2.3344528), (0.0803223, 0.2367453), (1.0, 0.6055528)),
]
DILOCO_ROWS = [
    ((0.7340000, -1.8670000), (0.2000000, -0.1000000)),
    ((0.4876000, -1.8103000), (0.2800000, -0.0900000)),
    ((0.4618400, -2.1582700), (0.1520000, 0.2190000)),
    ((0.2426560, -2.5484430), (0.2368000, 0.3971000)),
]

# scheduling noise on a loaded 2-core machine: how far a measured stop may fall from its timeout
# (tests/test_reliability.py, tests/test_gpu_readiness.py)
SLACK_S = 1.5
