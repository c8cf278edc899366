"""`CO2Trainer` (with `CO2TrainingArguments`, from ``arguments.py``): CO2 in the transformers Trainer.

Swap ``Trainer`` for ``CO2Trainer`` and ``TrainingArguments`` for ``CO2TrainingArguments``; every
``--co2_*`` flag of `CO2Config` is then accepted beside the usual ones. ``--co2_enabled false``
runs the very same script as the plain Trainer (data parallel), the baseline.

Beside another Trainer subclass (TRL's ``SFTTrainer``, a project's own), compose the two: every
override here calls ``super()``, so ``class CO2SFTTrainer(CO2Trainer, SFTTrainer)`` trains that
subclass with CO2 (put CO2Trainer first: its ``training_step``, ``evaluate`` and saving then wrap
the other class's). The arguments class mixes the same way (see ``arguments.py``).

What CO2Trainer changes, each a few lines around ``super()``:

- the model is placed, autocast and compiled by Accelerate but **not** wrapped in DDP: workers
  train alone, and no collective crosses workers between two logging steps (`_prepare_for_training`);
  metric gathers inside a training step (``accelerator.gather_for_metrics``, e.g. TRL's entropy and
  token accuracy) are made local to each process (`training_step`);
- one ``CO2.step()`` after every optimizer-step call, AMP-skipped ones included (`_count_optimizer_steps`);
- logs carry the ``co2/*`` metrics (`log`); evaluation runs on the anchor (`evaluate`);
- the saved model is the anchor, checkpoints add each rank's own state (`_save`, `_save_checkpoint`),
  and ``resume_from_checkpoint`` restores it exactly (`train`, `_restore_co2`); with ``--co2_elastic``
  a checkpoint of another world size is re-sharded instead (``core/reshard.py``), with one WARNING
  of what carried over and what was reset (`_restore_co2_resharded`);
- a checkpoint is written under ``_co2_staging/`` and renamed to ``checkpoint-N`` only once every
  rank's files are on disk and listed in its manifest, so a save killed halfway is never resumed
  from, and the Trainer's rotation and Hub push only ever see published folders (`_save_checkpoint`,
  ``checkpoints/publish.py``); nothing in a checkpoint is unpickled on resume (``checkpoints/rank_files.py``);
- while it trains the run holds its ``output_dir``'s lease, so a second live run there is refused before
  it trains, a finished run's checkpoints are replaced as the Trainer replaces them, and rotation
  deletes only this run's own (`train`, ``checkpoints/lease.py``);
- with ``load_best_model_at_end`` the best checkpoint's model becomes the anchor (`_load_best_model`);
- ``ddp_timeout`` follows ``co2_timeout_s`` unless set, and is applied to the default group even
  where Accelerate does not pass it on (CPU), so a dead peer stops every rank (`_follow_ddp_timeout`);
- training ends with ``CO2.finalize()`` (`_finalize_training`);
- with ``--fsdp`` (FSDP2) and ``co2_worker_size = k > 1``, the model is sharded with ``fully_shard``
  over the k processes of each worker before the optimizer is made (`_shard_inside_workers`); each
  rank's checkpoint file then holds its own shards, and evaluation writes the anchor into the
  shards for its duration (FSDP2 gathers them itself).

The private Trainer methods overridden, each where the Trainer has no public hook, and each keeping
the Trainer's own behaviour around CO2's part (``super()`` does the Trainer's work):

- ``_prepare_for_training``: the one place the optimizer is made, the model prepared and a
  checkpoint's optimizer loaded; CO2 is built right after (the Trainer's preparation as it is);
- ``_finalize_training``: every worker's last steps reach the anchor before the Trainer's end of
  training (its metrics, state and ``load_best_model_at_end``);
- ``_load_best_model``: the Trainer loads the best checkpoint; CO2 takes it as its anchor;
- ``_save`` (`CheckpointOverrides`): the Trainer's model files, written from the anchor;
- ``_save_checkpoint``, ``_get_output_dir`` (`CheckpointOverrides`): the Trainer's checkpoint, its
  rotation and Hub push, staged in a folder of its own and published whole;
- ``_load_optimizer_and_scheduler`` (`CheckpointOverrides`): the Trainer's loading, except the
  optimizer under FSDP2 inside workers (each rank's comes from its own file);
- on torchft only (`fault_tolerance.ReplicaOverrides`): ``_get_train_sampler`` (a replica group's
  shard), ``_run_epoch`` (the Trainer's skipping of trained batches, for a replacement) and
  ``_load_rng_state`` (the Trainer's restore, except a replacement keeps its own RNG).

They are those of transformers 5.x: tests/test_trainer.py checks that every private override of
these classes is listed here and exists in the installed transformers with these signatures, and
that ``_save_checkpoint`` takes its folder, pushes and rotates the way `CheckpointOverrides` relies
on. Two Trainer attributes are replaced instead, having no hook either (``callback_handler.on_optimizer_step``:
`_count_optimizer_steps`; ``accelerator.gather_for_metrics`` during a step: `_local_metric_gathers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

import torch
from transformers import Trainer

from ..config import CO2Config
from ..core import CO2
from ..core.schedule import Plan
from . import fault_tolerance, launch, model_card
from .arguments import (
    CO2TrainingArguments,
    _follow_ddp_timeout,
    refuse_data_parallel,
    resolve_resume_from_checkpoint,
)
from .fault_tolerance import ReplicaOverrides
from .trainer_checkpoints import CheckpointOverrides

__all__ = ["CO2Trainer", "CO2TrainingArguments"]

logger = logging.getLogger(__name__)


class CO2Trainer(CheckpointOverrides, ReplicaOverrides, Trainer):
    """A ``Trainer`` that trains with CO2 when ``args.co2_enabled`` (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not all(hasattr(self.args, f.name) for f in dataclasses.fields(CO2Config)):
            raise TypeError(
                "CO2Trainer needs CO2TrainingArguments (or any args with the co2_* fields; beside TRL, a "
                "dataclass deriving from both CO2TrainingArguments and the TRL config, e.g. SFTConfig)"
            )
        launch.check_processes(
            self.args.world_size,
            who="the Trainer set up",
            fix="each would train alone. Pass --use_cpu on a machine without GPUs.",
        )
        self.co2_config = CO2Config.from_object(self.args) if self.args.co2_enabled else None
        self.co2: CO2 | None = None
        self._co2_verified: str | None = None  # the checkpoint whose checksums `_check_resumable` verified
        self._co2_sources: list[int] | None = None  # the saved ranks it read, after a change of world
        self._co2_run: str | None = None  # this run's id (publish.py, "Runs"): a resume takes its checkpoint's
        self._co2_sole_run = False  # while training: the only live run in output_dir (its lease held)
        self._warned_local_gathers = False
        torchft = self.co2_config is not None and self.co2_config.co2_fault_tolerance == "torchft"
        self._replica = fault_tolerance.Replica(self) if torchft else None  # this replica group, on torchft
        if self.co2_config is not None:
            refuse_data_parallel(self.args)  # also for args that are not CO2TrainingArguments
            self._count_optimizer_steps()
            _follow_ddp_timeout(self.args)
            self._warn_iterable_not_dispatched()

    def _count_optimizer_steps(self) -> None:
        """One ``CO2.step()`` after every optimizer-step call, AMP-skipped ones included, on every rank:
        run by the callback handler's ``on_optimizer_step`` after every callback's. Not a callback in
        the list: the Trainer's callbacks stay exactly those of the plain Trainer, and
        ``remove_callback``/``pop_callback`` cannot switch CO2's round boundaries off."""
        handler = self.callback_handler
        callbacks_then_co2 = handler.on_optimizer_step

        def on_optimizer_step(args, state, control):
            control = callbacks_then_co2(args, state, control)
            if self.co2 is not None:
                step = self.co2.step if self._replica is None else self._replica.step
                step(skipped=bool(self.accelerator.optimizer_step_was_skipped))
            return control

        handler.on_optimizer_step = on_optimizer_step

    def _warn_iterable_not_dispatched(self) -> None:
        """Unset, Accelerate would dispatch an iterable training set's batches from rank 0 (a
        broadcast at every step); `get_train_dataloader` keeps them local."""
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset) and self.is_world_process_zero():
            logger.warning(
                "CO2: the iterable train dataset is not dispatched from rank 0 (dispatching broadcasts every batch "
                "at every step); each process iterates it and keeps its own share of the batches. Shard the stream "
                "per process (datasets.distributed.split_dataset_by_node) so that each reads only its part."
            )

    def get_train_dataloader(self):
        """The Trainer's, with batches never dispatched from rank 0 (a collective at every step);
        evaluation and prediction loaders are prepared as the plain Trainer prepares them."""
        if self.co2_config is None:
            return super().get_train_dataloader()
        config = self.accelerator.dataloader_config
        given, config.dispatch_batches = config.dispatch_batches, False
        try:
            return super().get_train_dataloader()
        finally:
            config.dispatch_batches = given

    # ------------------------------------------------------------------ training

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint`` may also be the string ``"true"`` (what
        ``--resume_from_checkpoint true`` parses to), resolved as ``True`` is (`resolve_resume_from_checkpoint`);
        a CO2 checkpoint is checked to be complete before any file is read."""
        resume_from_checkpoint = resolve_resume_from_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if self.co2_config is not None and resume_from_checkpoint is not None:
            if not os.path.isdir(resume_from_checkpoint):
                raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}: no such folder")
            self._check_resumable(resume_from_checkpoint)
        if self.co2_config is None:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        with self._training_alone_in_output_dir():
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        # the Trainer's one place where the optimizer is made, the model prepared and a checkpoint's
        # optimizer loaded: CO2 is built right after, and restores its own state over them
        if self.co2_config is None:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        fsdp = getattr(self.args, "worker_fsdp", None)
        if fsdp is not None:
            self._shard_inside_workers(fsdp)
        self._prepare_without_ddp()
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):  # would all-reduce at every step
            raise RuntimeError("CO2: the Trainer wrapped the model in DistributedDataParallel; please report this")
        if self._replica is not None:  # on torchft: joined to the job below
            self.co2 = self._replica.build(self.model, self._inner_optimizer())
        else:
            self.co2 = CO2(self.model, self.co2_config, optimizer=self._inner_optimizer())
        if resume_from_checkpoint is not None:
            self._restore_co2(resume_from_checkpoint)
        if self._replica is not None:  # a live peer's state, if one is ahead, replaces the checkpoint's
            self._replica.join()
        return model, train_dataloader

    def _prepare_without_ddp(self) -> None:
        """Let Accelerate place, autocast and compile the model, but not wrap it in DDP.

        ``Accelerator.prepare_model(..., evaluation_mode=True)`` is Accelerate's public path for a
        model that handles its gradient reduction itself (the Trainer uses it for models sharded at
        load time). Accelerate never prepares a model twice, so the Trainer's own ``prepare`` call
        that follows leaves this one as it is and prepares the optimizer only.
        """
        if self.model_wrapped is self.model:  # not wrapped yet (a second train() finds it prepared)
            self.model_wrapped = self.accelerator.prepare_model(self.model, evaluation_mode=True)

    def _shard_inside_workers(self, fsdp: dict) -> None:
        """FSDP2 over the processes of this worker: each layer of the configured (or the model's
        ``_no_split_modules``) classes, then the root. Before the optimizer exists, so that it is
        made over the sharded parameters; once only (a second ``train()`` finds it sharded)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from ..core import worker_mesh

        if isinstance(self.model, FSDPModule):
            return
        if self.optimizer is not None:
            raise ValueError(
                "FSDP2 inside a CO2 worker shards the model before the optimizer is made: let the "
                "Trainer create it (do not pass optimizers=...)"
            )
        mesh = worker_mesh(self.args.co2_worker_size, self.args.device.type, timeout_s=self.args.co2_timeout_s)
        layers = set(fsdp["layer_classes"] or getattr(self.model, "_no_split_modules", None) or [])
        reshard = fsdp["reshard_after_forward"]
        for module in list(self.model.modules())[1:]:
            if type(module).__name__ in layers:
                fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=reshard)

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step (loss, backward, its scaling and accumulation untouched), then the gradient
        average CO2 needs before the optimizer step; in-step metric gathers stay local."""
        if self.co2 is None:
            return super().training_step(model, inputs, num_items_in_batch)
        with self._local_metric_gathers():
            loss = super().training_step(model, inputs, num_items_in_batch)
        # before clipping: every process during co2_sync_warmup_steps (plain data parallel), then
        # the k processes of a worker when co2_worker_size = k > 1; nothing otherwise
        if self.accelerator.sync_gradients:
            self.co2.average_gradients()
        return loss

    @contextlib.contextmanager
    def _local_metric_gathers(self):
        """During a training step, ``accelerator.gather_for_metrics`` returns this process's value.

        Trainer subclasses gather per-step metrics in ``compute_loss`` (TRL's SFTTrainer: the token
        count, entropy and mean token accuracy, at every step): a collective across workers on every
        step, the very thing CO2 removes. They have no switch for it, so this one method of this
        trainer's accelerator is replaced for the step (evaluation still gathers as usual).
        """
        accelerator = self.accelerator
        own = vars(accelerator).get("gather_for_metrics")

        def local(data, use_gather_object=False):
            if not self._warned_local_gathers and self.is_world_process_zero():
                logger.warning(
                    "CO2: a metric gathered inside the training step (accelerator.gather_for_metrics, e.g. TRL's "
                    "num_tokens, entropy, mean_token_accuracy) is kept local to each process: gathering it would "
                    "put a collective across workers on every step. Logged values are rank 0's own."
                )
            self._warned_local_gathers = True
            return data

        accelerator.gather_for_metrics = local
        try:
            yield
        finally:
            if own is None:
                del accelerator.gather_for_metrics  # the class's method again
            else:
                accelerator.gather_for_metrics = own

    def _finalize_training(self, trial, num_train_samples, start_time):
        """The Trainer's end of training (metrics, state, ``load_best_model_at_end`` after it), with every
        worker's last steps in the anchor first: the model it ends with is the one all workers share."""
        if self.co2 is not None:
            self.co2.finalize()  # every worker's last steps reach the anchor; live model == anchor
        output = super()._finalize_training(trial, num_train_samples, start_time)
        if self._replica is not None:
            self._replica.shutdown()  # leaves the torchft job: the next train() joins it again
        return output

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the Trainer loads the best checkpoint's model (its anchor) into
        the live model after training; CO2 then takes it as its anchor too, so that ``save_model``,
        ``push_to_hub`` and ``evaluate`` use the best model, as with the plain Trainer."""
        super()._load_best_model()
        if self.co2 is not None:
            self.co2.adopt_model()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's ``log``, with the ``co2/*`` metrics added at each logging step (training logs
        only): every callback and ``--report_to`` integration gets them as it gets the loss."""
        # co2/comm_wait_s is the max over ranks; the norms, clip ratio and penalty are global (equal
        # on every rank); co2/comm_s and co2/amp_skipped_steps are rank 0's, which is what is logged
        if self.co2 is not None and "loss" in logs:
            logs = {**logs, **self.co2.pop_metrics()}
        super().log(logs, start_time)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, *args, **kwargs):
        """Evaluate the anchor (the model all workers share), not this rank's local model.

        The anchor is copied into the live tensors for the evaluation and their own values are
        copied back after (`CO2.anchor_in_place`, one copy of the model in memory; it works with
        host-memory state and FSDP2 shards alike), and the random number generators are restored,
        so training continues exactly as if no evaluation had run.
        """
        if self.co2 is None:
            return super().evaluate(*args, **kwargs)
        with self.co2.anchor_in_place(), _rng_untouched():
            return super().evaluate(*args, **kwargs)

    # ------------------------------------------------------------------ saving and resuming

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model`` (``_save`` on the main process, Hub push on its own terms), and for
        a user's own call a model card with CO2's section."""
        super().save_model(output_dir, _internal_call)  # on torchft, by replica group 0 only (ReplicaOverrides)
        # a card describes a transformers model: a plain nn.Module has no config to fill one with
        card = self.co2_config is not None and getattr(self.model, "config", None) is not None
        if card and not _internal_call and self.is_world_process_zero():
            directory = output_dir if output_dir is not None else self.args.output_dir
            self._write_model_card(directory)

    def create_model_card(self, *args, tags=None, **kwargs) -> None:
        """The Trainer's card (its metadata, training results and hyperparameters), tagged ``co2`` and the
        paper, with a section of the settings as they ran."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        if self.co2_config is not None:
            tags += [t for t in model_card.TAGS if t not in tags]
        super().create_model_card(*args, tags=tags, **kwargs)
        if self.co2_config is not None and self.is_world_process_zero():
            card = os.path.join(self.args.output_dir, "README.md")
            ran = dict(world_size=self.args.world_size, device_type=self.args.device.type)
            model_card.add_co2_section(card, **self._ran_with(), **ran)

    def _ran_with(self) -> dict:
        """The settings and plan the engine ran with (before training: as they resolve from the
        arguments, without the model's size to fit the default fragments to)."""
        if self.co2 is None:
            return {"config": self.co2_config, "plan": Plan.resolve(self.co2_config)}
        return {"config": self.co2.config, "plan": self.co2.plan}

    def _write_model_card(self, directory: str) -> None:
        if os.path.abspath(directory) == os.path.abspath(self.args.output_dir):
            self.create_model_card()
        else:
            card = os.path.join(directory, "README.md")
            model_card.add_co2_section(card, **self._ran_with(), world_size=self.args.world_size)


@contextlib.contextmanager
def _rng_untouched():
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
