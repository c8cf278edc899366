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

Checkpoints: ``co2.save_state(folder)`` and ``co2.load_state(folder)``, inside the block: an exact
resume, saved atomically as the Trainer's checkpoints are (``accelerate_checkpoints.py``, on the
framework-neutral ``co2_hf/checkpoints/``).

FSDP2 inside a worker (``co2_worker_size = k``): shard the model with ``fully_shard(module,
mesh=co2_hf.core.worker_mesh(k, timeout_s=co2_timeout_s))`` before making the optimizer, and prepare it with
``accelerator.prepare_model(model, evaluation_mode=True)`` (no DDP: FSDP2 averages the worker's
gradients). Checkpoints then hold each rank's own shards; the model file is the whole anchor.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from ..allowed import refuse_elastic, refuse_torchft
from ..checkpoints import config_file, rank_files
from ..config import CO2Config
from ..core import CO2
from . import launch, model_card
from .accelerate_checkpoints import AccelerateCheckpoints, refuse_custom_objects

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
        self._checkpoints: AccelerateCheckpoints | None = None
        self._closed = False
        self._no_sync = contextlib.ExitStack()
        if self.enabled:
            self._start(accelerator, optimizer)
        else:  # the baseline too must not run as independent replicas
            _check_replicas(accelerator)

    def _start(self, accelerator: Any, optimizer: Any) -> None:
        _check_launch(accelerator, self.config)
        refuse_custom_objects(accelerator, "CO2Accelerate")
        if accelerator.num_processes == 1:
            logger.warning(
                "CO2Accelerate: one process, nobody to average with: CO2 runs as a single worker and "
                "averages nothing (the outer step only delays its own updates). Launch 2+ processes "
                "(e.g. accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml) or "
                "pass enabled=False"
            )
        inner = getattr(optimizer, "optimizer", optimizer)
        self.co2 = CO2(self.module, self.config, optimizer=inner)
        self._checkpoints = AccelerateCheckpoints(accelerator, self.module, optimizer, self.co2)

    def __enter__(self) -> CO2Accelerate:
        if self.co2 is not None and not self.co2.in_warmup:
            self._stop_gradient_sync()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._no_sync.close()
        if self._checkpoints is not None:
            self._checkpoints.close()
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
        state = rank_files.anchor_for_saving(self.co2) if self.co2 is not None else None
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
                config_file.write_co2_config(output_dir, self.co2.config, **ran)
                model_card.add_co2_section(card, self.co2.config, **ran)
        accelerator.wait_for_everyone()

    def save_state(self, output_dir: str, **kwargs: Any) -> None:
        """``accelerator.save_state(output_dir)``, made atomic: written into a staging folder beside
        it and renamed to ``output_dir`` only once every rank's files are there (`rank_files.saving`). An
        ``output_dir`` holding files CO2 did not write is refused, not replaced. Collective: every rank
        calls it, inside the ``with`` block. Disabled: ``accelerator.save_state`` as it is."""
        if self.co2 is None:
            self.accelerator.save_state(output_dir, **kwargs)
            return
        self._check_open("save_state", "co2.save_pretrained(folder) saves the final model")
        self._checkpoints.save(output_dir, **kwargs)

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
        self._checkpoints.load(input_dir, **kwargs)

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


def _check_replicas(accelerator: Any) -> None:
    launch.check_processes(
        accelerator.num_processes,
        who="the Accelerator sees",
        fix="every process would train alone. On a machine without GPUs create it as Accelerator(cpu=True).",
    )
