"""What the launcher says about the world, read in one place, and the check that the framework agrees.

``torchrun`` and ``accelerate launch`` export ``WORLD_SIZE`` to every process. Transformers'
``TrainingArguments`` and Accelerate's ``Accelerator`` then set up their own view of the world; on
a machine without GPUs, created without their CPU flag, each launched process becomes a run of its
own (world size 1), and CO2 would train G workers that never meet. The arguments, the Trainer and
the Accelerate helper all check the launch here, before any process group of CO2's starts.
"""

from __future__ import annotations

import os


def launched_world_size() -> int:
    """The number of processes the launcher started (1 when not launched)."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={value!r} is not an integer: launch with torchrun or accelerate") from None


def check_processes(seen: int, *, who: str, fix: str) -> None:
    """Raise ``RuntimeError`` unless ``who`` (the framework's own view) sees the ``seen`` processes
    the launcher started; ``fix`` says what to change."""
    expected = launched_world_size()
    if seen != expected:
        raise RuntimeError(f"WORLD_SIZE={expected} but {who} {seen} process(es): {fix}")
