"""Throughput and hidden communication on bandwidth-limited links: data parallel, local SGD, DiLoCo, CO2.

    sudo .venv/bin/python scripts/bench_bandwidth.py --out results/bench_bandwidth.jsonl \
        --plot docs/bench_bandwidth.png
    python scripts/bench_bandwidth.py --dry-run      # the plan, its estimate and every ip/tc command; no root
    python scripts/bench_bandwidth.py --loopback --rates unshaped --model tiny   # no namespaces, no root
    python scripts/bench_bandwidth.py --help         # what it measures, every field of its JSON lines

The command of the package ``scripts.bandwidth`` (its docstring describes the benchmark); each rank
it starts runs this file again with ``--worker``.
"""

import sys
from pathlib import Path

if not __package__:  # run as a file: import the package `scripts` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bandwidth.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
