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
    co2.save_pretrained("out", dataset="...")  # the anchor, co2_config.json and a model card

``enabled=False`` (like LocalSGD's) makes the helper a pass-through: DDP synchronises every step,
``step()`` returns False, nothing is saved besides Accelerate's own files; so one script runs the
data-parallel baseline and CO2. ``CO2Config(co2_enabled=False)`` does the same.

On an exception the block does not finalize. ``finalize`` is collective (it waits for the in-flight
all-reduce and averages the last partial round); after an error on one rank its peers are gone or
still training, so it would block until ``co2_timeout_s`` and hide the error, or pair with a peer's
next boundary and average the wrong rounds. The model then holds this rank's local weights, not
the anchor (a WARNING says so): resume from the last ``save_state``. Call ``co2.finalize()`` in an
``except`` yourself if every rank is known to take the same path.

Inside the ``with`` block the DDP wrapper (if any) is kept in ``no_sync``, so no collective crosses
workers during local steps (DDP also skips its buffer broadcast then); during
``co2_sync_warmup_steps`` DDP synchronises as usual. Checkpoints go through
``accelerator.save_state`` / ``load_state``: a save hook puts the anchor in the model file and
makes every rank write its own ``co2_rank{r}.pt`` (local parameters, inner optimizer, scaler, CO2
state), which a registered checkpoint object restores after Accelerate has loaded the rest.
``co2.save_state(folder)`` does the same atomically: the folder appears only once complete, with a
manifest of sizes and checksums that ``load_state`` checks before reading anything, refusing a
missing, truncated or corrupted file by name (a plain ``accelerator.save_state`` folder has none).

FSDP2 inside a worker (``co2_worker_size = k``): shard the model with ``fully_shard(module,
mesh=co2_hf.core.worker_mesh(k, timeout_s=co2_timeout_s))`` before making the optimizer, and prepare it with
``accelerator.prepare_model(model, evaluation_mode=True)`` (no DDP: FSDP2 averages the worker's
gradients). Checkpoints then hold each rank's own shards; the model file is the whole anchor.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from typing import Any

import torch

from ..config import CO2Config
from ..core import CO2
from . import checkpoint, model_card

logger = logging.getLogger(__name__)


class CO2Accelerate:
    """CO2 around an Accelerate-prepared model and optimizer; see the module docstring.

    ``enabled=False`` (or ``config.co2_enabled`` False): a pass-through, plain data parallel.
    """

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        optimizer: Any,
        *,
        config: CO2Config | None = None,
        enabled: bool = True,
    ):
        self.config = config if config is not None else CO2Config()
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        self.module = accelerator.unwrap_model(model)
        self.enabled = enabled and self.config.co2_enabled
        self.co2: CO2 | None = None
        self._hooks: list = []
        self._no_sync = contextlib.ExitStack()
        if self.enabled:
            self._start(accelerator, optimizer)
        else:  # the baseline too must not run as independent replicas
            _check_replicas(accelerator)

    def _start(self, accelerator: Any, optimizer: Any) -> None:
        _check_launch(accelerator, self.config)
        if accelerator.num_processes == 1:
            logger.warning(
                "CO2Accelerate: one process, nobody to average with: CO2 runs as a single worker and "
                "averages nothing (the outer step only delays its own updates). Launch 2+ processes "
                "(e.g. accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml) or "
                "pass enabled=False"
            )
        inner = getattr(optimizer, "optimizer", optimizer)
        self.co2 = CO2(self.module, self.config, optimizer=inner)
        self._load_dir: str | None = None
        self._skipped_loads: _SkippedLoads | None = None
        self._hooks = [
            accelerator.register_save_state_pre_hook(self._save_hook),
            accelerator.register_load_state_pre_hook(self._load_hook),
        ]
        accelerator.register_for_checkpointing(_RankStateRestorer(self))

    def __enter__(self) -> CO2Accelerate:
        if self.co2 is not None and not self.co2.in_warmup:
            self._stop_gradient_sync()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._no_sync.close()
        for hook in self._hooks:
            hook.remove()
        if self.co2 is None:
            return
        if exc_type is None:
            self.co2.finalize()
        else:  # not collective after an error: see the module docstring
            logger.warning(
                "CO2Accelerate: leaving on %s without finalize (a collective its peers may never join): "
                "the model holds this rank's local weights, not the anchor; resume from the last save_state",
                exc_type.__name__,
            )

    def step(self) -> bool:
        """Call after every optimizer step (skipped by AMP or not); True when a boundary ran."""
        if self.co2 is None:
            return False
        was_warming_up = self.co2.in_warmup
        boundary = self.co2.step(skipped=bool(self.accelerator.optimizer_step_was_skipped))
        if was_warming_up and not self.co2.in_warmup:
            self._stop_gradient_sync()
        return boundary

    def average_gradients(self) -> None:
        """Call between ``backward`` and the optimizer step when ``co2_worker_size > 1`` (it averages
        gradients over the processes of the worker) or when the model is not wrapped in DDP
        (during the warm-up, over every process); a no-op otherwise."""
        if self.co2 is None:  # data parallel: DDP averages in backward
            return
        ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        if not (ddp and self.co2.in_warmup):  # DDP itself synchronises during the warm-up
            self.co2.average_gradients()

    def anchor_state(self) -> dict[str, torch.Tensor]:
        """The shared model's state dict, for evaluation with ``torch.func.functional_call``."""
        if self.co2 is None:  # data parallel: the live model is the shared one
            return self.module.state_dict()
        return self.co2.anchor_state()

    def pop_metrics(self) -> dict[str, float]:
        return {} if self.co2 is None else self.co2.pop_metrics()

    def save_pretrained(
        self,
        output_dir: str,
        *,
        base_model: str | None = None,
        dataset: str | None = None,
        license: str | None = None,
        pipeline_tag: str | None = None,
    ) -> None:
        """``save_pretrained`` of the anchor (the model all workers share, also mid-training), with
        ``co2_config.json`` and a model card: ``base_model`` (None: trained from scratch),
        ``dataset``, ``license``, ``pipeline_tag`` (None: from the model's class). Collective:
        every rank calls it (with ``co2_worker_size > 1`` the anchor is gathered in the worker)."""
        accelerator = self.accelerator
        state = checkpoint.anchor_for_saving(self.co2) if self.co2 is not None else None
        self.module.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, state_dict=state)
        if accelerator.is_main_process:
            card = os.path.join(output_dir, "README.md")
            about = dict(base_model=base_model, dataset=dataset, license=license, pipeline_tag=pipeline_tag)
            model_card.write_card(card, **about)
            if self.co2 is not None:
                world = accelerator.num_processes
                checkpoint.write_co2_config(output_dir, self.config, world_size=world)
                model_card.add_co2_section(card, self.config, world_size=world)
        accelerator.wait_for_everyone()

    def save_state(self, output_dir: str, **kwargs: Any) -> None:
        """``accelerator.save_state(output_dir)``, made atomic: written into a staging folder and
        renamed to ``output_dir`` only once every rank's files are there (``checkpoint.publish``).
        Collective: every rank calls it. Disabled: ``accelerator.save_state`` as it is."""
        if self.co2 is None:
            self.accelerator.save_state(output_dir, **kwargs)
            return
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
        # before Accelerate reads anything: sizes and checksums of what this rank reads, every rank
        # refusing when one does (`checkpoint.agree`); the restorer then checks sizes only
        checkpoint.agree(checkpoint.check_rank_state, input_dir, rank, world, require_manifest=False)
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
        saved = checkpoint.read_rank_state(owner._load_dir, rank, world, require_manifest=False, verify=False)
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
    _check_replicas(accelerator)
    if accelerator.distributed_type.value in ("DEEPSPEED", "FSDP", "MEGATRON_LM"):
        raise ValueError(
            f"CO2Accelerate does not support Accelerate's {accelerator.distributed_type.value}: it shards "
            "across every process, that is across CO2 workers. To shard inside each worker of "
            "co2_worker_size=k processes, apply FSDP2 yourself: fully_shard(module, "
            "mesh=co2_hf.core.worker_mesh(k, timeout_s=co2_timeout_s)), then "
            "accelerator.prepare_model(model, evaluation_mode=True)"
        )
    config.check_world(accelerator.num_processes)


def _check_replicas(accelerator: Any) -> None:
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != expected:
        raise RuntimeError(
            f"WORLD_SIZE={expected} but the Accelerator sees {accelerator.num_processes} process(es): "
            "every process would train alone. On a machine without GPUs create it as "
            "Accelerator(cpu=True)."
        )
