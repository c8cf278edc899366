"""CO2 on torchft (``--co2_fault_tolerance torchft``): a worker that dies mid-round never stops the
others, and its replacement takes its state from a live peer (``docs/algorithm.md``, "Surviving
failures"; docs/reliability.md, "torchft: who can reach what").

- ``communicator.py``: the engine's communicator over torchft's Manager, and the coded wires'
  collectives over the quorum's group;
- ``job.py``: the Manager and its listeners, `TorchFT` (the engine on one replica group), the job
  from the environment;
- ``transport.py``: a peer's state between the job's own replicas, signed with the job's secret;
- ``launch.py``: ``co2-ft-launch``, a Lighthouse and N replica groups on one machine.

The Trainer's side (a replica group's data shard, rejoining) is ``integrations/fault_tolerance.py``.
Needs the ``ft`` extra (``pip install 'co2_hf[ft]'``): importing any module here without torchft
raises an ImportError that says so.
"""

try:
    import torchft  # noqa: F401
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("co2_hf.torchft needs torchft: pip install 'co2_hf[ft]'") from error
