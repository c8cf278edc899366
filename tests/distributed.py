"""Tests launch their ranks with the library's own launcher."""

from co2_hf.testing import run_processes

__all__ = ["run_processes"]
