"""The CO2 engine in plain PyTorch: no transformers or accelerate import happens here."""

from .co2 import CO2
from .comm import Communicator, LocalCommunicator, Pending, ProcessGroupCommunicator
from .groups import worker_mesh
from .layout import FlatLayout

__all__ = [
    "CO2",
    "Communicator",
    "FlatLayout",
    "LocalCommunicator",
    "Pending",
    "ProcessGroupCommunicator",
    "worker_mesh",
]
