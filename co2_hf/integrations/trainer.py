"""`CO2TrainingArguments` and `CO2Trainer`: CO2 in the transformers Trainer.

Swap ``Trainer`` for ``CO2Trainer`` and ``TrainingArguments`` for ``CO2TrainingArguments``; every
``--co2_*`` flag of `CO2Config` is then accepted beside the usual ones. ``--co2_enabled false``
runs the very same script as the plain Trainer (data parallel), the baseline.

What CO2Trainer changes, each a few lines around ``super()``:

- the model is placed, autocast and compiled by Accelerate but **not** wrapped in DDP: workers
  train alone, and no collective crosses workers between two logging steps (`_prepare_for_training`);
- one ``CO2.step()`` after every optimizer-step call, AMP-skipped ones included (`_CO2StepCallback`);
- logs carry the ``co2/*`` metrics (`log`); evaluation runs on the anchor (`evaluate`);
- the saved model is the anchor, checkpoints add each rank's own state (`_save`, `_save_checkpoint`),
  and ``resume_from_checkpoint`` restores it exactly (`_restore_co2`);
- training ends with ``CO2.finalize()`` (`_finalize_training`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import warnings
from dataclasses import dataclass

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..config import CO2Config
from ..core import CO2
from . import checkpoint, model_card

logger = logging.getLogger(__name__)


@dataclass
class CO2TrainingArguments(TrainingArguments, CO2Config):
    """``TrainingArguments`` plus every field of `CO2Config` (declared there, once)."""

    def __post_init__(self) -> None:
        # CO2's own checks first: they need no device and no process group
        self.validate_co2()
        _use_cpu_without_accelerator(self)
        if self.co2_enabled:
            self.check_world(int(os.environ.get("WORLD_SIZE", "1")))
            _refuse_unsupported(self)
        TrainingArguments.__post_init__(self)
        if self.co2_enabled:
            _turn_off_per_step_collectives(self)
            if self.hub_strategy == "checkpoint":
                warnings.warn(
                    "hub_strategy='checkpoint' uploads the last checkpoint folder, which with CO2 "
                    "holds every rank's local parameters and optimizer state (co2_rank*.pt)",
                    stacklevel=2,
                )


def _use_cpu_without_accelerator(args: CO2TrainingArguments) -> None:
    """Launched as several processes on a machine without GPUs, TrainingArguments would otherwise
    set up one independent process each (world size 1): every replica would train alone."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and not args.use_cpu and not torch.accelerator.is_available():
        logger.warning("no GPU or other accelerator found: training on the CPU (use_cpu=True)")
        args.use_cpu = True


def _refuse_unsupported(args: CO2TrainingArguments) -> None:
    env_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    env_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if args.deepspeed or env_deepspeed:
        raise ValueError(
            "CO2 does not support DeepSpeed: with co2_enabled=True every process is a CO2 worker and "
            "ZeRO would shard state across workers. Drop --deepspeed, or pass --co2_enabled false."
        )
    if args.fsdp or env_fsdp:
        raise ValueError(
            "CO2 does not support FSDP across workers (--fsdp): with co2_worker_size=1 every process "
            "is its own worker. Drop --fsdp, or pass --co2_enabled false."
        )
    if args.include_num_input_tokens_seen not in ("no", False, None):
        raise ValueError(
            f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r} gathers a token "
            "count across workers at every step, which CO2 exists to avoid: allowed value with CO2 "
            "is 'no'"
        )


def _turn_off_per_step_collectives(args: CO2TrainingArguments) -> None:
    if args.average_tokens_across_devices:
        logger.info("CO2: average_tokens_across_devices turned off (it gathers at every step)")
        args.average_tokens_across_devices = False
    accelerator_config = args.accelerator_config
    if getattr(accelerator_config, "dispatch_batches", None):
        raise ValueError(
            "accelerator_config.dispatch_batches=True broadcasts every batch from rank 0, a "
            "collective at every step: with CO2 each worker must read its own data (set it to false)"
        )
    if accelerator_config is not None and hasattr(accelerator_config, "dispatch_batches"):
        accelerator_config.dispatch_batches = False


class _CO2StepCallback(TrainerCallback):
    """Counts every optimizer-step call as an inner step, on every rank, skipped or not."""

    def __init__(self, trainer: CO2Trainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        trainer = self.trainer
        trainer.co2.step(skipped=bool(trainer.accelerator.optimizer_step_was_skipped))


class CO2Trainer(Trainer):
    """A ``Trainer`` that trains with CO2 when ``args.co2_enabled`` (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not all(hasattr(self.args, f.name) for f in dataclasses.fields(CO2Config)):
            raise TypeError("CO2Trainer needs CO2TrainingArguments (or any args with the co2_* fields)")
        expected = int(os.environ.get("WORLD_SIZE", "1"))
        if self.args.world_size != expected:
            raise RuntimeError(
                f"WORLD_SIZE={expected} but the Trainer set up {self.args.world_size} process(es): "
                "each would train alone. Pass --use_cpu on a machine without GPUs."
            )
        self.co2_config = CO2Config.from_object(self.args) if self.args.co2_enabled else None
        self.co2: CO2 | None = None
        if self.co2_config is not None:
            self.add_callback(_CO2StepCallback(self))

    # ------------------------------------------------------------------ training

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.co2_config is None:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        with _without_ddp(self.accelerator):
            model, train_dataloader = super()._prepare_for_training(
                max_steps, train_dataloader, resume_from_checkpoint
            )
        self.co2 = CO2(self._co2_wrap_model(self.model), self.co2_config, optimizer=self._inner_optimizer())
        if resume_from_checkpoint is not None:
            self._restore_co2(resume_from_checkpoint)
        return model, train_dataloader

    def _co2_wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The one place where a worker's model would be wrapped (DDP/FSDP over the processes of
        one worker). With ``co2_worker_size=1`` each process is a worker: nothing to wrap."""
        return model

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        # during co2_sync_warmup_steps the workers are plain data parallel: average before clipping
        if self.co2 is not None and self.co2.in_warmup and self.accelerator.sync_gradients:
            self.co2.average_gradients()
        return loss

    def _finalize_training(self, trial, num_train_samples, start_time):
        if self.co2 is not None:
            self.co2.finalize()  # every worker's last steps reach the anchor; live model == anchor
        return super()._finalize_training(trial, num_train_samples, start_time)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # co2/comm_wait_s is the max over ranks; the norms, clip ratio and penalty are global (equal
        # on every rank); co2/comm_s and co2/amp_skipped_steps are rank 0's, which is what is logged
        if self.co2 is not None and "loss" in logs:
            logs = {**logs, **self.co2.pop_metrics()}
        super().log(logs, start_time)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, *args, **kwargs):
        """Evaluate the anchor (the model all workers share), not this rank's local model.

        The anchor is swapped in without a copy (as ``torch.func.functional_call`` does) and the
        random number generators are restored afterwards, so training continues exactly as if no
        evaluation had run.
        """
        if self.co2 is None:
            return super().evaluate(*args, **kwargs)
        with _on_anchor(self.model, self.co2), _rng_untouched():
            return super().evaluate(*args, **kwargs)

    # ------------------------------------------------------------------ saving and resuming

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.co2 is not None and state_dict is None and self.args.should_save:
            state_dict = checkpoint.anchor_for_saving(self.co2)
        super()._save(output_dir, state_dict=state_dict)
        if self.co2_config is not None and self.args.should_save:
            directory = output_dir if output_dir is not None else self.args.output_dir
            checkpoint.write_co2_config(directory, self.co2_config, world_size=self.args.world_size)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if self.co2_config is not None and not _internal_call and self.is_world_process_zero():
            directory = output_dir if output_dir is not None else self.args.output_dir
            self._write_model_card(directory)

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.co2 is None or self.args.save_only_model:
            return
        directory = os.path.join(self._get_output_dir(trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        checkpoint.save_rank_state(
            directory,
            self.args.process_index,
            co2=self.co2,
            model=self.model,
            optimizer=self._inner_optimizer(),
            scaler=getattr(self.accelerator, "scaler", None),
        )

    def _restore_co2(self, directory: str) -> None:
        """This rank's own local parameters, optimizer, scaler and CO2 state (after the Trainer
        restored the anchor into the model and rank 0's optimizer everywhere)."""
        state = checkpoint.read_rank_state(directory, self.args.process_index, self.args.world_size)
        checkpoint.apply_rank_state(
            state,
            co2=self.co2,
            model=self.model,
            optimizer=self._inner_optimizer(),
            scaler=getattr(self.accelerator, "scaler", None),
        )

    def create_model_card(self, *args, tags=None, **kwargs) -> None:
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        if self.co2_config is not None:
            tags += [t for t in model_card.TAGS if t not in tags]
        super().create_model_card(*args, tags=tags, **kwargs)
        if self.co2_config is not None and self.is_world_process_zero():
            card = os.path.join(self.args.output_dir, "README.md")
            model_card.add_co2_section(card, self.co2_config, world_size=self.args.world_size)

    def _write_model_card(self, directory: str) -> None:
        if os.path.abspath(directory) == os.path.abspath(self.args.output_dir):
            self.create_model_card()
        else:
            card = os.path.join(directory, "README.md")
            model_card.add_co2_section(card, self.co2_config, world_size=self.args.world_size)


@contextlib.contextmanager
def _without_ddp(accelerator):
    """Let Accelerate place, autocast and compile the model, but not wrap it in DDP.

    ``prepare_model(..., evaluation_mode=True)`` is Accelerate's own path for a model that handles
    its gradient reduction itself (Trainer uses it for models sharded at load time).
    """
    original = accelerator.prepare_model
    accelerator.prepare_model = functools.partial(original, evaluation_mode=True)
    try:
        yield
    finally:
        accelerator.prepare_model = original


@contextlib.contextmanager
def _on_anchor(model: torch.nn.Module, co2: CO2):
    from torch.nn.utils.stateless import _reparametrize_module  # what functional_call uses

    with _reparametrize_module(model, co2.anchor_state(), tie_weights=True, strict=False):
        yield


@contextlib.contextmanager
def _rng_untouched():
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
