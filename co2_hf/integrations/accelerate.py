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
``co2_sync_warmup_steps`` DDP synchronises as usual.

Checkpoints: ``co2.save_state(folder)`` and ``co2.load_state(folder)``, inside the block. Saving
wraps ``accelerator.save_state``: a save hook puts the anchor in the model file and makes every rank
write its own ``co2_rank{r}.pt`` (local parameters, inner optimizer, scaler, CO2 state), and the
folder appears only once complete, with a manifest of sizes and checksums (``publish.py``); a folder
holding other files is refused, never replaced. Loading checks the folder on every rank before
anything is read (refusing a missing, truncated, corrupted or unlisted file by name), runs
``accelerator.load_state``, then restores this rank's own file, read with ``weights_only=True``.
Nothing is registered with ``accelerator.register_for_checkpointing``: Accelerate unpickles those
objects as full pickles (``weights_only`` off), so a checkpoint from elsewhere could run code; an
object the user registered is refused (at construction, ``save_state`` and ``load_state``). A plain
``accelerator.save_state`` inside the block writes the rank files too (no manifest); a plain
``accelerator.load_state`` of a folder with rank files is refused, naming ``co2.load_state``.

FSDP2 inside a worker (``co2_worker_size = k``): shard the model with ``fully_shard(module,
mesh=co2_hf.core.worker_mesh(k, timeout_s=co2_timeout_s))`` before making the optimizer, and prepare it with
``accelerator.prepare_model(model, evaluation_mode=True)`` (no DDP: FSDP2 averages the worker's
gradients). Checkpoints then hold each rank's own shards; the model file is the whole anchor.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from collections import OrderedDict
from typing import Any

import torch

from ..allowed import refuse_elastic, refuse_torchft
from ..config import CO2Config
from ..core import CO2
from . import checkpoint, launch, model_card, publish

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
        if config is not None and not isinstance(config, CO2Config):
            raise TypeError(
                f"CO2Accelerate(config=...) takes a CO2Config, not a {type(config).__name__}: pass "
                "config=CO2Config(co2_local_steps=12, ...) (CO2Config(**settings) from a dict)"
            )
        self.config = config if config is not None else CO2Config()
        refuse_elastic(self.config, "CO2Accelerate")  # what it does not run, refused before anything starts
        refuse_torchft(self.config, "CO2Accelerate")
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
        _refuse_custom_objects(accelerator, "CO2Accelerate")
        if accelerator.num_processes == 1:
            logger.warning(
                "CO2Accelerate: one process, nobody to average with: CO2 runs as a single worker and "
                "averages nothing (the outer step only delays its own updates). Launch 2+ processes "
                "(e.g. accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml) or "
                "pass enabled=False"
            )
        inner = getattr(optimizer, "optimizer", optimizer)
        self.co2 = CO2(self.module, self.config, optimizer=inner)
        self._loading: str | None = None  # the folder `load_state` is loading, checked already
        self._run: str | None = None  # this run's id (publish.py, "Runs"): load_state takes its folder's
        self._closed = False
        self._skipped_loads: _SkippedLoads | None = None
        # No object registered for accelerate's checkpointing: accelerate unpickles those with
        # full pickles (weights_only off). This rank's state comes back in `load_state`, after theirs.
        self._hooks = [
            accelerator.register_save_state_pre_hook(self._save_hook),
            accelerator.register_load_state_pre_hook(self._load_hook),
        ]

    def __enter__(self) -> CO2Accelerate:
        if self.co2 is not None and not self.co2.in_warmup:
            self._stop_gradient_sync()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._no_sync.close()
        for hook in self._hooks:
            hook.remove()
        self._closed = True
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
        every rank calls it (with ``co2_worker_size > 1`` the anchor is gathered in the worker).
        A model without ``save_pretrained`` (a plain ``nn.Module``) is written as
        ``accelerator.save_model`` writes one: ``model.safetensors``, shared tensors stored once."""
        accelerator = self.accelerator
        state = checkpoint.anchor_for_saving(self.co2) if self.co2 is not None else None
        transformers_model = hasattr(self.module, "save_pretrained")
        if transformers_model:
            self.module.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, state_dict=state)
        elif accelerator.is_main_process:
            _save_module(self.module.state_dict() if state is None else state, output_dir)
        if accelerator.is_main_process:
            card = os.path.join(output_dir, "README.md")
            about = dict(base_model=base_model, dataset=dataset, license=license, pipeline_tag=pipeline_tag)
            model_card.write_card(card, **about, library_name="transformers" if transformers_model else "pytorch")
            if self.co2 is not None:
                world = accelerator.num_processes
                ran = dict(world_size=world, plan=self.co2.plan)
                checkpoint.write_co2_config(output_dir, self.co2.config, **ran)
                model_card.add_co2_section(card, self.co2.config, **ran)
        accelerator.wait_for_everyone()

    def save_state(self, output_dir: str, **kwargs: Any) -> None:
        """``accelerator.save_state(output_dir)``, made atomic: written into a staging folder beside
        it and renamed to ``output_dir`` only once every rank's files are there (``publish.py``). An
        ``output_dir`` holding files CO2 did not write is refused, not replaced. Collective: every rank
        calls it, inside the ``with`` block. Disabled: ``accelerator.save_state`` as it is."""
        if self.co2 is None:
            self.accelerator.save_state(output_dir, **kwargs)
            return
        self._check_open("save_state", "co2.save_pretrained(folder) saves the final model")
        _refuse_custom_objects(self.accelerator, "CO2Accelerate.save_state")
        accelerator, project = self.accelerator, self.accelerator.project_configuration
        if project.automatic_checkpoint_naming:
            raise ValueError(
                "CO2Accelerate.save_state needs the folder's name: with "
                "ProjectConfiguration(automatic_checkpoint_naming=True) call accelerator.save_state() "
                "instead (not atomic)"
            )
        rank = accelerator.process_index
        leader = rank - accelerator.local_process_index if project.save_on_each_node else 0
        self._run = run = self._run or publish.new_run_id()
        staging = publish.begin_save(output_dir, rank=rank, leader=leader, run=run)
        with publish.writing(output_dir, staging):  # a full disk says so, naming the folder
            accelerator.save_state(staging, **kwargs)
        world, step, own = accelerator.num_processes, self.co2.inner_steps, checkpoint.RANK_FILE.format(rank=rank)
        publish.publish(staging, output_dir, rank=rank, leader=leader, world_size=world, step=step, own=own, run=run)

    def load_state(self, input_dir: str, **kwargs: Any) -> None:
        """``accelerator.load_state(input_dir)``, then this rank's own state (local parameters, inner
        optimizer, scaler, CO2's outer state) from its ``co2_rank{r}.pt``: an exact resume. The folder
        is checked first, on every rank (manifest, sizes, checksums; a plain ``accelerator.save_state``
        folder by its rank files), and nothing in it is unpickled. Collective. Disabled:
        ``accelerator.load_state`` as it is."""
        if self.co2 is None:
            self.accelerator.load_state(input_dir, **kwargs)
            return
        self._check_open("load_state", "load it into a new CO2Accelerate")
        _refuse_custom_objects(self.accelerator, "CO2Accelerate.load_state")
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        # before Accelerate reads anything: sizes and checksums of what this rank reads, every rank
        # refusing when one does; the rank file is then checked by size only
        self._run = checkpoint.agree(self._check_loadable, input_dir, rank, world) or self._run
        self._loading = input_dir
        try:
            self.accelerator.load_state(input_dir, **kwargs)
        finally:
            self._loading = None
            if self._skipped_loads is not None:
                self._skipped_loads.undo()
                self._skipped_loads = None
        saved = checkpoint.read_rank_state(input_dir, rank, world, require_manifest=False, verify=False)
        accelerator = self.accelerator
        checkpoint.apply_rank_state(
            saved, co2=self.co2, model=self.module, optimizer=self.optimizer, scaler=accelerator.scaler
        )

    def _check_loadable(self, input_dir: str, rank: int, world: int) -> str | None:
        """Refuse what cannot be loaded; return the run that saved the folder (None: not recorded)."""
        checkpoint.check_rank_state(input_dir, rank, world, require_manifest=False)
        # Accelerate refuses a folder whose custom-object files outnumber the registered objects, but
        # only after loading the model and optimizer: say so first. co2_hf before this version saved
        # one of its own (custom_checkpoint_<i>.pkl), a full pickle that is never loaded now.
        found = sorted(glob.glob(os.path.join(input_dir, "custom_checkpoint_*.pkl")))
        registered = len(getattr(self.accelerator, "_custom_objects", []))
        if len(found) != registered:
            names = ", ".join(os.path.basename(f) for f in found)
            raise ValueError(
                f"{input_dir} holds {len(found)} custom-object file(s) ({names}) and {registered} object(s) are "
                "registered with accelerator.register_for_checkpointing. CO2Accelerate registers none (Accelerate "
                "unpickles those files in full, so a checkpoint from elsewhere could run code): a folder saved by "
                "an earlier co2_hf holds one of CO2's, which this version does not load; resume it with that co2_hf "
                "release, or start from its model (co2.save_pretrained / from_pretrained)"
            )
        if not os.path.lexists(os.path.join(input_dir, checkpoint.MANIFEST_FILE)):
            return None  # a plain accelerator.save_state folder
        return publish.read_manifest(input_dir).get("run")

    def _check_open(self, method: str, instead: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"CO2Accelerate.{method} after its with block: training was finalized there and CO2's "
                f"checkpoint hooks are gone, so no rank would write its state; call {method} inside the "
                f"block ({instead})"
            )

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
        """Accelerate loads the anchor and rank 0's optimizer next; `load_state` restores this rank's
        own state after that. A plain ``accelerator.load_state`` of a CO2 folder would resume every
        rank with rank 0's optimizer and the anchor as its local model: refused, saying what to call."""
        if self._loading is None:
            if glob.glob(os.path.join(input_dir, checkpoint.RANK_FILE.format(rank="*"))):
                raise ValueError(
                    f"{input_dir} holds CO2 state: resume it with co2.load_state({input_dir!r}) (the "
                    "CO2Accelerate object), which restores every rank's own state after accelerator.load_state"
                )
            return
        if self.co2.layout.presharded:
            # FSDP2: the model file is the whole anchor and optimizer.bin rank 0's shards; neither
            # fits this rank's shards, and its own file restores both right after
            self._skipped_loads = _SkippedLoads(self.module, self.optimizer)


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


def _save_module(state: dict, output_dir: str) -> None:
    """``model.safetensors`` of the state dict of a module without ``save_pretrained``, tied tensors
    stored once, as ``accelerator.save_model`` stores them."""
    from accelerate.utils import clean_state_dict_for_safetensors
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    state = clean_state_dict_for_safetensors({k: v.detach().contiguous() for k, v in state.items()})
    save_file(state, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})


def _refuse_custom_objects(accelerator: Any, what: str) -> None:
    """Objects registered with ``accelerator.register_for_checkpointing`` are saved by Accelerate as
    pickles and loaded back with ``weights_only`` off: a checkpoint from elsewhere would run code."""
    objects = list(getattr(accelerator, "_custom_objects", []))
    if objects:
        names = ", ".join(type(obj).__name__ for obj in objects)
        raise ValueError(
            f"{what}: {len(objects)} object(s) are registered with accelerator.register_for_checkpointing "
            f"({names}), and CO2Accelerate neither saves nor loads them: Accelerate loads them back with a full "
            "pickle (weights_only off), so a checkpoint from elsewhere could run code in load_state. Do not "
            "register them: save what they hold beside the checkpoint yourself (torch.save of its state_dict(), "
            "read back with torch.load(..., weights_only=True))"
        )


def _check_replicas(accelerator: Any) -> None:
    launch.check_processes(
        accelerator.num_processes,
        who="the Accelerator sees",
        fix="every process would train alone. On a machine without GPUs create it as Accelerator(cpu=True).",
    )
