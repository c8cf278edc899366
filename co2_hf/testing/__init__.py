"""Test helpers for code built on CO2, yours included: local gloo process launching and the
communicator fakes (one worker recording its calls, a recording wrapper, a slow-link wrapper, G
simulated workers in one process).

Why this package ships inside the library, public: it is to CO2 what ``accelerate.test_utils`` is to
Accelerate. Whoever writes a training loop, a Trainer subclass or a communicator on top of CO2 needs
the same things our tests need: N real ranks on one CPU machine, a communicator that records *when*
the engine launches and waits, a link that is slow on purpose, G workers in one process. It needs
torch only (importing it loads no transformers; tests/test_imports.py checks that), and nothing in
the library imports it. Every communicator fake of the repository is here, the one place to change
when the `Communicator` interface does. Research tools (the simulated-worker training harness built
on `SimulatedNetwork`, the benchmarks) are not: they live in ``scripts/``, which is not installed.

One module per job, every public name importable from ``co2_hf.testing``:

- ``processes``: `run_processes`, `run_with_faults`, `HF_PRELOAD` (N local gloo ranks);
- ``communicators``: `FakeCommunicator`, `QuorumCommunicator`, `ForwardingCommunicator`,
  `RecordingCommunicator`, `DelayedCommunicator`;
- ``simulated``: `SimulatedNetwork`, `SimulatedCommunicator`, `SimulatedCollectives`,
  `LocalCollectives`;
- ``trace``: `DispatchTrace` (what a block dispatches, and what would make a GPU's host wait).
"""

from .communicators import (
    DelayedCommunicator,
    FakeCommunicator,
    ForwardingCommunicator,
    QuorumCommunicator,
    RecordingCommunicator,
)
from .processes import HF_PRELOAD, run_processes, run_with_faults
from .simulated import LocalCollectives, SimulatedCollectives, SimulatedCommunicator, SimulatedNetwork
from .trace import DispatchTrace

__all__ = [
    "HF_PRELOAD",
    "DelayedCommunicator",
    "DispatchTrace",
    "FakeCommunicator",
    "ForwardingCommunicator",
    "LocalCollectives",
    "QuorumCommunicator",
    "RecordingCommunicator",
    "SimulatedCollectives",
    "SimulatedCommunicator",
    "SimulatedNetwork",
    "run_processes",
    "run_with_faults",
]
