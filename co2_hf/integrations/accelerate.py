"""`CO2Accelerate`: CO2 in a custom Accelerate training loop, in the spirit of accelerate's LocalSGD.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with CO2Accelerate(accelerator, model, optimizer, config=CO2Config(co2_local_steps=12)) as co2:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            co2.step()                     # every tau steps: a round boundary
    # on exit: finalize, so the model is the final anchor

Inside the ``with`` block the DDP wrapper (if any) is kept in ``no_sync``, so no collective crosses
workers during local steps (DDP also skips its buffer broadcast then); during
``co2_sync_warmup_steps`` DDP synchronises as usual. Checkpoints go through
``accelerator.save_state`` / ``load_state``: a save hook puts the anchor in the model file and
makes every rank write its own ``co2_rank{r}.pt`` (local parameters, inner optimizer, scaler, CO2
state), which a registered checkpoint object restores after Accelerate has loaded the rest.
``co2.save_state(folder)`` does the same atomically: the folder appears only once complete, with a
manifest that ``load_state`` checks (a plain ``accelerator.save_state`` folder has none).

FSDP2 inside a worker (``co2_worker_size = k``): shard the model with ``fully_shard(module,
mesh=co2_hf.core.worker_mesh(k))`` before making the optimizer, and prepare it with
``accelerator.prepare_model(model, evaluation_mode=True)`` (no DDP: FSDP2 averages the worker's
gradients). Checkpoints then hold each rank's own shards; the model file is the whole anchor.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from typing import Any

import torch

from ..config import CO2Config
from ..core import CO2
from . import checkpoint


class CO2Accelerate:
    """CO2 around an Accelerate-prepared model and optimizer; see the module docstring."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any, *, config: CO2Config | None = None):
        self.config = config if config is not None else CO2Config()
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        _check_launch(accelerator, self.config)
        self.module = accelerator.unwrap_model(model)
        inner = getattr(optimizer, "optimizer", optimizer)
        self.co2 = CO2(self.module, self.config, optimizer=inner)
        self._no_sync = contextlib.ExitStack()
        self._load_dir: str | None = None
        self._skipped_loads: _SkippedLoads | None = None
        self._hooks = [
            accelerator.register_save_state_pre_hook(self._save_hook),
            accelerator.register_load_state_pre_hook(self._load_hook),
        ]
        accelerator.register_for_checkpointing(_RankStateRestorer(self))

    def __enter__(self) -> CO2Accelerate:
        if not self.co2.in_warmup:
            self._stop_gradient_sync()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._no_sync.close()
        for hook in self._hooks:
            hook.remove()
        if exc_type is None:
            self.co2.finalize()

    def step(self) -> bool:
        """Call after every optimizer step (skipped by AMP or not); True when a boundary ran."""
        was_warming_up = self.co2.in_warmup
        boundary = self.co2.step(skipped=bool(self.accelerator.optimizer_step_was_skipped))
        if was_warming_up and not self.co2.in_warmup:
            self._stop_gradient_sync()
        return boundary

    def average_gradients(self) -> None:
        """Call between ``backward`` and the optimizer step when ``co2_worker_size > 1`` (it averages
        gradients over the processes of the worker) or when the model is not wrapped in DDP
        (during the warm-up, over every process); a no-op otherwise."""
        ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        if not (ddp and self.co2.in_warmup):  # DDP itself synchronises during the warm-up
            self.co2.average_gradients()

    def anchor_state(self) -> dict[str, torch.Tensor]:
        """The shared model's state dict, for evaluation with ``torch.func.functional_call``."""
        return self.co2.anchor_state()

    def pop_metrics(self) -> dict[str, float]:
        return self.co2.pop_metrics()

    def save_state(self, output_dir: str, **kwargs: Any) -> None:
        """``accelerator.save_state(output_dir)``, made atomic: written into a staging folder and
        renamed to ``output_dir`` only once every rank's files are there (``checkpoint.publish``).
        Collective: every rank calls it."""
        accelerator, project = self.accelerator, self.accelerator.project_configuration
        if project.automatic_checkpoint_naming:
            raise ValueError(
                "CO2Accelerate.save_state needs the folder's name: with "
                "ProjectConfiguration(automatic_checkpoint_naming=True) call accelerator.save_state() "
                "instead (not atomic)"
            )
        rank = accelerator.process_index
        leader = rank - accelerator.local_process_index if project.save_on_each_node else 0
        staging = checkpoint.begin_save(output_dir, is_leader=rank == leader)
        accelerator.save_state(staging, **kwargs)
        world, step = accelerator.num_processes, self.co2.inner_steps
        checkpoint.publish(staging, output_dir, rank=rank, leader=leader, world_size=world, step=step)

    def _stop_gradient_sync(self) -> None:
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self._no_sync.enter_context(self.model.no_sync())

    # ------------------------------------------------------------------ checkpoints

    def _save_hook(self, models: list, weights: list[dict], output_dir: str) -> None:
        """The model file gets the anchor; every rank writes its own state beside it."""
        for i, model in enumerate(models):
            if self.accelerator.unwrap_model(model) is self.module and i < len(weights):
                anchor = checkpoint.anchor_for_saving(self.co2)
                # an OrderedDict, like a module's state dict: Accelerate then drops tied duplicates
                weights[i] = OrderedDict((key, anchor[_strip(key, anchor)]) for key in weights[i])
        checkpoint.save_rank_state(
            output_dir,
            self.accelerator.process_index,
            co2=self.co2,
            model=self.module,
            optimizer=self.optimizer,
            scaler=self.accelerator.scaler,
        )

    def _load_hook(self, models: list, input_dir: str) -> None:
        # Accelerate loads the anchor and rank 0's optimizer next; the restorer runs after that
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        checkpoint.read_rank_state(input_dir, rank, world, require_manifest=False)
        self._load_dir = input_dir
        if self.co2.layout.presharded:
            # FSDP2: the model file is the whole anchor and optimizer.bin rank 0's shards; neither
            # fits this rank's shards, and its own file restores both right after
            self._skipped_loads = _SkippedLoads(self.module, self.optimizer)


class _RankStateRestorer:
    """Registered for checkpointing: Accelerate calls its ``load_state_dict`` on every rank after
    models and optimizers, which is when this rank's own state must go back in."""

    def __init__(self, owner: CO2Accelerate) -> None:
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        return {"format": 1, "num_processes": self.owner.accelerator.num_processes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        owner = self.owner
        if owner._load_dir is None:
            raise RuntimeError("CO2Accelerate: checkpoint object loaded outside accelerator.load_state")
        rank = owner.accelerator.process_index
        world = owner.accelerator.num_processes
        if owner._skipped_loads is not None:
            owner._skipped_loads.undo()
            owner._skipped_loads = None
        saved = checkpoint.read_rank_state(owner._load_dir, rank, world, require_manifest=False)
        checkpoint.apply_rank_state(
            saved, co2=owner.co2, model=owner.module, optimizer=owner.optimizer, scaler=owner.accelerator.scaler
        )
        owner._load_dir = None


class _SkippedLoads:
    """Makes a module's and an optimizer's state loading no-ops until ``undo`` (instance
    attributes shadowing their methods), for the span of one ``accelerator.load_state``."""

    def __init__(self, module: torch.nn.Module, optimizer: Any) -> None:
        self.objects = [module, optimizer]
        module.state_dict = lambda *a, **k: {}
        module.load_state_dict = lambda *a, **k: torch.nn.modules.module._IncompatibleKeys([], [])
        optimizer.load_state_dict = lambda *a, **k: None

    def undo(self) -> None:
        for obj in self.objects:
            for name in ("state_dict", "load_state_dict"):
                obj.__dict__.pop(name, None)


def _strip(key: str, anchor: dict) -> str:
    """State-dict key of the wrapped model (``module.`` from DDP) -> key of the unwrapped one."""
    while key not in anchor and "." in key:
        key = key.split(".", 1)[1]
    return key


def _check_launch(accelerator: Any, config: CO2Config) -> None:
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != expected:
        raise RuntimeError(
            f"WORLD_SIZE={expected} but the Accelerator sees {accelerator.num_processes} process(es): "
            "every process would train alone. On a machine without GPUs create it as "
            "Accelerator(cpu=True)."
        )
    if accelerator.distributed_type.value in ("DEEPSPEED", "FSDP", "MEGATRON_LM"):
        raise ValueError(
            f"CO2Accelerate does not support Accelerate's {accelerator.distributed_type.value}: it shards "
            "across every process, that is across CO2 workers. To shard inside each worker of "
            "co2_worker_size=k processes, apply FSDP2 yourself: fully_shard(module, "
            "mesh=co2_hf.core.worker_mesh(k)), then accelerator.prepare_model(model, evaluation_mode=True)"
        )
    config.check_world(accelerator.num_processes)
