"""The peers: what a user would pick instead of CO2, each run through its own library's documented API.

- ``torchft_diloco`` and ``torchft_streaming``: torchft's ``DiLoCo`` (``torchft.local_sgd``), one
  Lighthouse (served by rank 0, on its node's address) and one replica group per rank, each a
  torchft ``Manager`` as this project builds one (``co2_hf.torchft.job.build_manager``: torchft's
  Manager and reconfigurable gloo group with every listener on the node's address, and the signed
  recovery transport instead of torchft's, which unpickles what it receives). ``torchft_diloco``:
  one fragment, the whole model, ``fragment_sync_delay=0`` (the default: the round's all-reduce
  blocks). ``torchft_streaming``: the model cut into ``--torchft-fragments`` runs of consecutive
  modules (embeddings, blocks, final norm), each with its own outer optimizer, synced in turn every
  tau / F steps and launched ``--torchft-delay`` steps before it is waited for (unset: tau / F - 1,
  the most torchft allows). Outer optimizer: SGD, lr 0.7, Nesterov momentum 0.9 (the DiLoCo paper's
  and torchft's example's).
- ``accelerate_local_sgd``: ``accelerate.local_sgd.LocalSGD`` around the model an ``Accelerator``
  prepared (DDP, kept in ``no_sync``), ``local_sgd.step()`` after each optimizer step: every tau
  steps a barrier and a blocking mean of the parameters, one all-reduce per tensor.
- ``torch_post_local_sgd``: ``torch.distributed.optim.PostLocalSGDOptimizer`` with a
  ``PeriodicModelAverager`` (period tau) and DDP's ``post_localSGD_hook`` on subgroups of the ranks
  of one node, as torch documents them, with the warm-up of global gradient all-reduces cut to one
  step (the benchmark times the steady state).

A peer's package missing (``PEERS`` in ``plan.py``) skips its runs with a message before any rank
starts (`skip_missing`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import secrets
from datetime import timedelta

from .plan import PEERS

INSTALL = {"torchft": "pip install 'co2_hf[ft]'", "accelerate": "pip install accelerate"}
OUTER = dict(lr=0.7, momentum=0.9, nesterov=True)  # DiLoCo's outer SGD (torchft's example)
FT_TIMEOUT_S = 300.0  # a collective, a quorum, a commit: far above a round on the slowest link


def skip_missing(methods: list[str]) -> list[str]:
    """``methods`` less the peers whose package is not installed, each skip said once on stdout."""
    kept = []
    for method in methods:
        package = PEERS.get(method)
        if package is not None and importlib.util.find_spec(package) is None:
            how = INSTALL.get(package, f"pip install {package}")
            print(f"# skipping {method}: {package} is not installed ({how})", flush=True)
        else:
            kept.append(method)
    return kept


class Loop:
    """One method's training step around a model, as its user writes it: ``module`` is what the
    forward pass runs on; ``backward``, then ``step`` (the optimizer's step and whatever the method
    does after it), ``record`` once the step is timed; ``close`` at the end of the run. ``waits``,
    ``comms`` and ``engine`` (host seconds in its ``step()``): the CO2 engine's, per round (empty
    for the others)."""

    library: str | None = None  # a peer's package, whose version the JSON line records

    def __init__(self, module, optimizer) -> None:
        self.module, self.optimizer = module, optimizer
        self.waits: list[float] = []
        self.comms: list[float] = []
        self.engine: list[float] = []

    def version(self) -> str | None:
        """``library`` and its installed version (None: the CO2 engine or plain torch)."""
        return None if self.library is None else f"{self.library} {importlib.metadata.version(self.library)}"

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()

    def record(self) -> None:
        """After the step's time was taken: read what the method measured of it."""

    def global_state(self, model) -> dict | None:
        """The global model (what every rank agrees on) as ``model``'s state_dict, read-only, if the
        method holds one after this step; None between a round's averages (``time_to_loss.py``
        snapshots it). Data parallel: the model itself at every step."""
        return model.state_dict()

    def close(self) -> None:
        pass


class TorchFTLoop(Loop):
    """torchft's DiLoCo (``fragments`` 1, ``delay`` 0) or streaming DiLoCo: its hooks on the inner
    optimizer run the quorums and the syncs, so the loop is the plain one."""

    library = "torchft"

    def __init__(self, model, optimizer, *, tau: int, fragments: int, delay: int | None, rank: int) -> None:
        import torch
        from torchft.local_sgd import DiLoCo

        from co2_hf.torchft.job import build_manager, job_interface
        from co2_hf.torchft.transport import RecoveryTransport

        super().__init__(model, optimizer)
        lighthouse, secret, self._server = _serve_lighthouse(rank)
        host, timeout = job_interface(lighthouse), timedelta(seconds=FT_TIMEOUT_S)
        transport = RecoveryTransport(host, timeout, secret=secret)
        self.manager, _, self._store = build_manager(  # the store lives as long as the Manager
            host, transport, replica_id=f"bench_{rank}", lighthouse=lighthouse, timeout=timeout, quorum_timeout=timeout
        )
        parts = split_modules(model, fragments)
        outers = [torch.optim.SGD(part.parameters(), **OUTER) for part in parts]
        delay = tau // fragments - 1 if delay is None else delay
        self._diloco = DiLoCo(
            self.manager, parts, optimizer, outers, sync_every=tau, pin_memory=False, fragment_sync_delay=delay
        )
        self._diloco.__enter__()

    def global_state(self, model) -> dict:
        """Each fragment's global copy (torchft keeps it as ``original_parameters``, on the host, and
        offers no public reader: its private fragment list is read here)."""
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        state = dict(model.state_dict())
        for fragment in self._diloco._fragments:
            for name, p in fragment._model_fragment.named_parameters():
                for full in names[id(p)]:
                    state[full] = fragment.original_parameters[name]
        return state

    def close(self) -> None:
        self._diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if self._server is not None:
            self._server.shutdown()


def _serve_lighthouse(rank: int):
    """Rank 0 serves the run's Lighthouse on its node's address (MASTER_ADDR) for every rank's
    replica group; all learn its port and the run's secret (signing recovery transfers) from rank 0
    through the default group, as tensors: nothing is unpickled. Returns (address, secret, server
    or None)."""
    import torch
    import torch.distributed as dist

    host, world = os.environ["MASTER_ADDR"], dist.get_world_size()
    server, sent = None, torch.zeros(33, dtype=torch.int64)  # the port, then 32 bytes of secret
    if rank == 0:
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(bind=f"{host}:0", min_replicas=world, join_timeout_ms=60_000, quorum_tick_ms=10)
        sent[0] = int(server.address().rsplit(":", 1)[1])
        sent[1:] = torch.tensor(list(secrets.token_bytes(32)))
    dist.broadcast(sent, src=0)
    return f"http://{host}:{int(sent[0])}", bytes(sent[1:].tolist()), server


def split_modules(model, parts: int) -> list:
    """``model`` cut into ``parts`` runs of consecutive modules (module lists opened: embeddings,
    each block, the final norm; a module whose parameters an earlier one holds, a tied head, is
    left out), each cut at the module boundary nearest an equal share of the parameters."""
    from torch import nn

    units, seen = [], set()
    for unit in _units(model):
        params = {id(p) for p in unit.parameters()}
        if params - seen:
            units.append(unit)
            seen |= params
    if parts > len(units):
        raise ValueError(f"--torchft-fragments={parts}: the model has only {len(units)} modules to cut between")
    sizes = [sum(p.numel() for p in unit.parameters()) for unit in units]
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    cuts = [0]
    for k in range(1, parts):  # the unit boundary nearest k / parts of the parameters, after the last cut
        share = k * ends[-1] / parts
        cuts.append(min(range(cuts[-1] + 1, len(units) - parts + k + 1), key=lambda i: abs(ends[i - 1] - share)))
    cuts.append(len(units))
    return [nn.ModuleList(units[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]


def _units(module):
    """``module``'s sub-modules in order, every ModuleList opened into its items."""
    from torch import nn

    for child in module.children():
        if isinstance(child, nn.ModuleList):
            yield from child
        elif any(isinstance(m, nn.ModuleList) for m in child.modules()):
            yield from _units(child)
        else:
            yield child


class AccelerateLoop(Loop):
    """accelerate's ``LocalSGD``, as its documentation writes the loop."""

    library = "accelerate"

    def __init__(self, model, optimizer, *, tau: int, device: str) -> None:
        from accelerate import Accelerator
        from accelerate.local_sgd import LocalSGD

        self.accelerator = Accelerator(cpu=device == "cpu")
        super().__init__(*self.accelerator.prepare(model, optimizer))
        self._local_sgd = LocalSGD(accelerator=self.accelerator, model=self.module, local_sgd_steps=tau, enabled=True)
        self._local_sgd.__enter__()

    def backward(self, loss) -> None:
        self.accelerator.backward(loss)

    def step(self) -> None:
        self.optimizer.step()
        self._local_sgd.step()

    def global_state(self, model) -> dict | None:
        """After the step that averaged (LocalSGD averages every ``local_sgd_steps`` of its steps)."""
        return model.state_dict() if self._local_sgd.num_steps % self._local_sgd.local_sgd_steps == 0 else None

    def close(self) -> None:
        self._local_sgd.__exit__(None, None, None)  # one more average, untimed


class PostLocalSGDLoop(Loop):
    """torch's post-local SGD: the documented DDP hook and optimizer wrapper, warm-up of one step."""

    library = "torch"
    WARMUP_STEPS = 1  # start_localSGD_iter and warmup_steps, which torch says must be equal

    def __init__(self, model, optimizer, *, tau: int, device: str, ranks_per_node: int) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.algorithms.model_averaging.averagers as averagers
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )
        from torch.distributed.optim import PostLocalSGDOptimizer

        ids = [torch.device(device).index] if device.startswith("cuda") else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        # torch's default subgroup is a node's GPUs (torch.cuda.device_count()): here, a node's ranks
        node, _ = dist.new_subgroups(group_size=ranks_per_node)
        state = PostLocalSGDState(None, node, start_localSGD_iter=self.WARMUP_STEPS)
        ddp.register_comm_hook(state, post_localSGD_hook)
        averager = averagers.PeriodicModelAverager(period=tau, warmup_steps=self.WARMUP_STEPS)
        super().__init__(ddp, PostLocalSGDOptimizer(optim=optimizer, averager=averager))

    def global_state(self, model) -> dict | None:
        """After the step whose averager averaged (it averages at its counter's value c when c >=
        warmup_steps and (c - warmup_steps) % period == 0, then counts one more)."""
        averager = self.optimizer.averager
        c = averager.step - 1
        averaged = c >= averager.warmup_steps and (c - averager.warmup_steps) % averager.period == 0
        return model.state_dict() if averaged else None
