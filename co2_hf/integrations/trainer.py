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
  ``publish.py``); nothing in a checkpoint is unpickled on resume (``checkpoint.py``);
- with ``load_best_model_at_end`` the best checkpoint's model becomes the anchor (`_load_best_model`);
- ``ddp_timeout`` follows ``co2_timeout_s`` unless set, and is applied to the default group even
  where Accelerate does not pass it on (CPU), so a dead peer stops every rank (`_follow_ddp_timeout`);
- training ends with ``CO2.finalize()`` (`_finalize_training`);
- with ``--fsdp`` (FSDP2) and ``co2_worker_size = k > 1``, the model is sharded with ``fully_shard``
  over the k processes of each worker before the optimizer is made (`_shard_inside_workers`); each
  rank's checkpoint file then holds its own shards, and evaluation writes the anchor into the
  shards for its duration (FSDP2 gathers them itself).

The private Trainer methods overridden (``_prepare_for_training``, ``_finalize_training``, ``_save``,
``_save_checkpoint``, ``_get_output_dir``, ``_load_optimizer_and_scheduler``, ``_load_best_model``, and
on torchft ``_get_train_sampler``, ``_run_epoch``, ``_load_rng_state``) are those of transformers 5.x;
tests/test_trainer.py checks that every private override is listed here and exists in the installed
transformers with these signatures, and that ``_save_checkpoint`` takes its folder, pushes and rotates
the way this module relies on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os

import torch
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, get_last_checkpoint, rotate_checkpoints

from ..config import CO2Config
from ..core import CO2
from ..core.schedule import Plan
from . import checkpoint, fault_tolerance, launch, model_card, publish
from .arguments import CO2TrainingArguments, _follow_ddp_timeout, refuse_data_parallel

__all__ = ["CO2Trainer", "CO2TrainingArguments"]

# the save strategies under which the Trainer looks up the best checkpoint at each save
SAVES_BY_SCHEDULE = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)

logger = logging.getLogger(__name__)


class CO2Trainer(Trainer):
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

    def _get_train_sampler(self, train_dataset=None):
        """On torchft, this replica group's shard (every group would read the whole set otherwise)."""
        if self._replica is None:
            return super()._get_train_sampler(train_dataset)
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        shuffle = self.args.train_sampling_strategy != "sequential"
        return self._replica.sampler(dataset, seed=seed, drop_last=self.args.dataloader_drop_last, shuffle=shuffle)

    # ------------------------------------------------------------------ training

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train``; a CO2 checkpoint is checked to be complete before any file is read."""
        if self.co2_config is not None and resume_from_checkpoint not in (None, False):
            if resume_from_checkpoint is True:  # the Trainer's own lookup; None: let it raise its error
                resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
            if isinstance(resume_from_checkpoint, str) and not os.path.isdir(resume_from_checkpoint):
                raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}: no such folder")
            if resume_from_checkpoint is not True:
                self._check_resumable(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def _check_resumable(self, directory: str) -> None:
        """An incomplete, copied, corrupted, tampered-with or mismatched checkpoint is refused, saying
        why, on every rank at once (`checkpoint.agree`), before any file is read; the ranks resume from
        one step and, per disk, one manifest (`publish.agree_on_checkpoint`)."""
        checked = checkpoint.agree(self._checked_sources, directory, verify=True)
        self._co2_sources, step, digest, self._co2_run = checked  # the resumed run goes on as that run
        leader = self._save_leader()
        publish.agree_on_checkpoint(directory, step=step, digest=digest, leader=leader)
        self._co2_verified = directory  # `_restore_co2` then checks sizes only: no second hashing

    def _checked_sources(
        self, directory: str, *, verify: bool
    ) -> tuple[list[int] | None, int | None, str, str | None]:
        """The manifest and the shared files first (before anything in the folder is parsed), then the
        rank files this rank reads: its own, or with ``co2_elastic`` after a change of world those of the
        old worker it takes over. Returns those (None: its own), the step, the manifest's digest and the
        run that saved it (None: a co2_hf that did not record runs)."""
        manifest = checkpoint.check_shared(directory, verify=verify)
        sources = self._elastic_sources(directory)
        step, rank, world = _saved_step(directory), self.args.process_index, self.args.world_size
        checkpoint.check_complete(directory, rank, world, step=step, verify=verify, sources=sources, manifest=manifest)
        return sources, step, publish.manifest_digest(directory), manifest.get("run")

    def _save_leader(self) -> int:
        """The rank that publishes this rank's checkpoint files: 0 on a shared disk, the node's local
        rank 0 with per-node disks (``save_on_each_node``)."""
        args = self.args
        return args.process_index - args.local_process_index if args.save_on_each_node else 0

    def _elastic_sources(self, directory: str) -> list[int] | None:
        if not self.co2_config.co2_elastic:
            return None
        rank, world = self.args.process_index, self.args.world_size
        return checkpoint.elastic_sources(directory, rank, world, self.co2_config.co2_worker_size)

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

    def _run_epoch(self, **kwargs):
        """A replacement on torchft skips the epochs and batches its peers trained before it rejoined,
        as a resume from a checkpoint at that step would (the Trainer's own skipping)."""
        replica = self._replica
        if replica is None or replica.rejoined_at is None:
            return super()._run_epoch(**kwargs)
        epoch, skip = replica.epoch_position(
            kwargs["num_update_steps_per_epoch"], self.args.gradient_accumulation_steps
        )
        if kwargs["epoch"] < epoch:
            return None  # trained by the peers
        replica.rejoined_at = None
        kwargs.update(
            epochs_trained=epoch, steps_trained_in_current_epoch=skip, resume_from_checkpoint=fault_tolerance.REJOINED
        )
        return super()._run_epoch(**kwargs)

    def _load_rng_state(self, checkpoint):
        """A replacement keeps its own seeded RNG: the one its predecessor had is gone with it (the data
        order does not depend on it: the shard's sampler follows the seed and the epoch)."""
        if checkpoint is not fault_tolerance.REJOINED:
            super()._load_rng_state(checkpoint)

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

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's ``_save`` (safetensors, config, tokenizer, training args) of the anchor instead of
        this rank's local model, plus ``co2_config.json``."""
        # with co2_worker_size > 1 the anchor is all-gathered inside the worker: every rank joins
        needs_gather = self.co2 is not None and self.co2_config.co2_worker_size > 1
        if self.co2 is not None and state_dict is None and (self.args.should_save or needs_gather):
            state_dict = checkpoint.anchor_for_saving(self.co2)
        super()._save(output_dir, state_dict=state_dict)
        if self.co2_config is not None and self.args.should_save:
            directory = output_dir if output_dir is not None else self.args.output_dir
            checkpoint.write_co2_config(directory, **self._ran_with(), world_size=self.args.world_size)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model`` (``_save`` on the main process, Hub push on its own terms), and for
        a user's own call a model card with CO2's section."""
        if self._replica is not None and not self._replica.saves:
            return  # replica group 0 writes the model every group holds (warned at start)
        super().save_model(output_dir, _internal_call)
        # a card describes a transformers model: a plain nn.Module has no config to fill one with
        card = self.co2_config is not None and getattr(self.model, "config", None) is not None
        if card and not _internal_call and self.is_world_process_zero():
            directory = output_dir if output_dir is not None else self.args.output_dir
            self._write_model_card(directory)

    def is_world_process_zero(self) -> bool:
        """On torchft the job's main process is replica group 0's: the one that saves, reports and
        logs (each replica group is a launch of its own, and each would be its own process zero)."""
        replica = getattr(self, "_replica", None)  # the Trainer's __init__ asks before ours has run
        return super().is_world_process_zero() and (replica is None or replica.saves)

    def push_to_hub(self, *args, **kwargs):
        """The Trainer's push; on torchft only from replica group 0, which holds the saved model."""
        if self._replica is not None and not self._replica.saves:
            return None
        return super().push_to_hub(*args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint plus every rank's ``co2_rank{r}.pt``, published as ``checkpoint-N``
        only when complete.

        The Trainer writes into ``_co2_staging/checkpoint-N.<run>.<token>/checkpoint-N``, a folder of this
        save's own (its run folder for this call: `_get_output_dir`), with its Hub push held;
        `publish.publish` then flushes every file, writes the manifest and renames the folder. Only
        then do the Trainer's rotation and push run, on the published folder: rotation never deletes
        a good checkpoint for one that is not complete or not yet on disk, and the background upload
        never reads a folder about to be renamed.

        Why not let the Trainer write ``checkpoint-N`` in place, with the manifest as its commit mark
        written after ``super()``? Because the Trainer pushes and rotates at the end of its own
        ``_save_checkpoint``, before any point where CO2's files could follow: the push would upload,
        and rotation (``save_total_limit=1``: deleting the last good checkpoint) would count, a folder
        without its manifest, and ``get_last_checkpoint`` (``resume_from_checkpoint=True``) would pick
        a save killed halfway. Staged, an incomplete save is simply not a ``checkpoint-*`` folder.
        """
        if self.co2_config is None:
            return super()._save_checkpoint(model, trial)
        if self._replica is not None and not self._replica.saves:
            return None  # replica group 0 writes the checkpoints (warned at start)
        args = self.args
        run_dir = self._get_output_dir(trial)
        final = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")  # the Trainer's name
        leader, rank = self._save_leader(), args.process_index
        self._co2_run = run = self._co2_run or publish.new_run_id()
        # this run's own staged checkpoints (killed saves) are cleared: nothing else in run_dir is
        staging = publish.begin_save(final, rank=rank, leader=leader, run=run, leftovers=f"{PREFIX_CHECKPOINT_DIR}-*")
        with publish.writing(final, staging):  # a full disk says so, naming the folder
            with self._saving_into(os.path.dirname(staging)):
                super()._save_checkpoint(model, trial)
            self._save_rank_file(staging)
        self._point_best_checkpoint_at(staging, final)
        own, step, world = checkpoint.RANK_FILE.format(rank=rank), self.state.global_step, args.world_size
        publish.publish(staging, final, rank=rank, leader=leader, world_size=world, step=step, own=own, run=run)
        self._rotate_and_push(run_dir, final)

    def _save_rank_file(self, staging: str) -> None:
        if self.co2 is not None and not self.args.save_only_model:
            checkpoint.save_rank_state(
                staging,
                self.args.process_index,
                co2=self.co2,
                model=self.model,
                optimizer=self._inner_optimizer(),
                scaler=getattr(self.accelerator, "scaler", None),
            )

    def _rotate_and_push(self, run_dir: str, final: str) -> None:
        """What the Trainer's ``_save_checkpoint`` ends with, the same calls, on the published folder
        (inside the staging area its rotation saw one folder, and its push was held)."""
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        if self.args.push_to_hub:
            self._push_from_checkpoint(final)

    def _get_output_dir(self, trial) -> str:
        """The Trainer's run folder, except while a checkpoint is being staged (`_saving_into`)."""
        return getattr(self, "_co2_staging_root", None) or super()._get_output_dir(trial)

    @contextlib.contextmanager
    def _saving_into(self, staging_root: str):
        """Let the Trainer write its checkpoint under ``staging_root``; hold its Hub push (it
        uploads in the background, from a folder about to be renamed) until it is published."""
        push, self.args.push_to_hub = self.args.push_to_hub, False
        self._co2_staging_root = staging_root
        try:
            yield
        finally:
            self._co2_staging_root = None
            self.args.push_to_hub = push

    def _point_best_checkpoint_at(self, staging: str, final: str) -> None:
        """The best checkpoint under its published name, as the plain Trainer records it. Inside the
        staging area the Trainer saw only this save's folder: it recorded this checkpoint under its
        staging path, and could not find an earlier one (saved before the evaluation that made it the
        best: evaluating every epoch and saving every step), which it would have taken from run_dir."""
        state, best = self.state, self.state.best_model_checkpoint
        if best is not None and os.path.normpath(best) == os.path.normpath(staging):
            state.best_model_checkpoint = final
        elif state.best_global_step and self.args.save_strategy in SAVES_BY_SCHEDULE:
            earlier = os.path.join(os.path.dirname(final), f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
            if state.best_global_step != state.global_step and os.path.exists(earlier):
                state.best_model_checkpoint = earlier
        if state.best_model_checkpoint != best and self.args.should_save:
            state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        """The Trainer's loading as it is, except under FSDP2 inside workers (below)."""
        if checkpoint_dir is None or getattr(self.args, "worker_fsdp", None) is None:
            return super()._load_optimizer_and_scheduler(checkpoint_dir)
        # FSDP2: optimizer.pt holds rank 0's shards only; every rank's own optimizer state comes
        # back from its co2_rank{r}.pt right after (`_restore_co2`). The schedule is shared.
        path = os.path.join(checkpoint_dir, SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _restore_co2(self, directory: str) -> None:
        """This rank's own local parameters, optimizer, scaler and CO2 state (after the Trainer
        restored the anchor into the model and rank 0's optimizer everywhere)."""
        verified = self._co2_verified == directory  # by `_check_resumable`, just before
        sources = self._co2_sources if verified else self._elastic_sources(directory)
        if sources is not None:
            if not verified:
                self._checked_sources(directory, verify=True)
            return self._restore_co2_resharded(directory, sources)
        rank, world = self.args.process_index, self.args.world_size
        state = checkpoint.read_rank_state(directory, rank, world, verify=not verified)
        if self._replica is not None:  # on torchft every replica group resumes from group 0's files
            state = {**state, "co2": self._replica.own_state(state["co2"])}
        checkpoint.apply_rank_state(
            state,
            co2=self.co2,
            model=self.model,
            optimizer=self._inner_optimizer(),
            scaler=getattr(self.accelerator, "scaler", None),
        )

    def _restore_co2_resharded(self, directory: str, sources: list[int]) -> None:
        """After a change of world (``co2_elastic``): CO2's state re-sharded from the old worker this
        rank's worker takes over, the live model restarted from the anchor (``core/reshard.py``)."""
        checkpoint.apply_resharded_state(
            checkpoint.read_states(directory, sources),
            co2=self.co2,
            optimizer=self._inner_optimizer(),
            scaler=getattr(self.accelerator, "scaler", None),
        )
        self._warn_world_changed(directory)

    def _warn_world_changed(self, directory: str) -> None:
        """What a resume on another world carried, reset and does to the data (`checkpoint.warn_world_changed`)."""
        args = self.args
        checkpoint.warn_world_changed(
            directory,
            co2=self.co2,
            world_size=args.world_size,
            samples_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps,
            step=self.state.global_step,
            log=logger.warning if self.is_world_process_zero() else logger.info,
        )

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


def _saved_step(directory: str) -> int | None:
    """The step ``trainer_state.json`` records (verified with its folder before it is read)."""
    path = os.path.join(directory, TRAINER_STATE_NAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            step = json.load(f).get("global_step")
    except (ValueError, AttributeError) as error:
        message = f"checkpoint {directory}: its {TRAINER_STATE_NAME} is not a Trainer state ({error})"
        raise ValueError(message) from None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint {directory}: its {TRAINER_STATE_NAME} records global_step {step!r}")
    return step


@contextlib.contextmanager
def _rng_untouched():
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
