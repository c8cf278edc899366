"""`CO2Trainer`'s checkpoints: how it saves, checks and resumes them (a part of `CO2Trainer`).

`CheckpointOverrides` holds the Trainer methods CO2 overrides to save and resume: the anchor as the
saved model, each rank's own state beside it, a checkpoint staged and published whole, and a resume
that checks the checkpoint before reading anything. The files themselves are written and checked by
`co2_hf.checkpoints`, which `CO2Accelerate` uses too; this module holds what is the Trainer's: its
folder names, its rotation and Hub push, its best checkpoint, its optimizer and scheduler files.

It is a mixin of `CO2Trainer` only (it reads ``co2``, ``co2_config``, ``_replica``,
``_inner_optimizer`` and ``_ran_with`` of that class): it is a separate module so that each file
reads as one job, not for use apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, sort_checkpoints

from ..checkpoints import agreement, bounded, config_file, elastic, lease, publish, rank_files
from ..checkpoints.manifest import MANIFEST_FILE, manifest_digest, saved_run

# the save strategies under which the Trainer looks up the best checkpoint at each save
SAVES_BY_SCHEDULE = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)

# CO2Trainer's warnings come from one logger, whichever of its modules says them
logger = logging.getLogger("co2_hf.integrations.trainer")


class CheckpointOverrides:
    """`CO2Trainer`'s saving and resuming (the module docstring): every method calls the Trainer's own."""

    def _check_resumable(self, directory: str) -> None:
        """An incomplete, copied, corrupted, tampered-with or mismatched checkpoint is refused, saying
        why, on every rank at once (`agreement.agree`), before any file is read; the ranks resume from
        one step and, per disk, one manifest (`agreement.agree_on_checkpoint`)."""
        checked = agreement.agree(self._checked_sources, directory, verify=True)
        self._co2_sources, step, digest, self._co2_run = checked  # the resumed run goes on as that run
        leader = self._save_leader()
        agreement.agree_on_checkpoint(directory, step=step, digest=digest, leader=leader)
        self._co2_verified = directory  # `_restore_co2` then checks sizes only: no second hashing

    def _checked_sources(
        self, directory: str, *, verify: bool
    ) -> tuple[list[int] | None, int | None, str, str | None]:
        """The manifest and the shared files first (before anything in the folder is parsed), then the
        rank files this rank reads: its own, or with ``co2_elastic`` after a change of world those of the
        old worker it takes over. Returns those (None: its own), the step, the manifest's digest and the
        run that saved it (None: a co2_hf that did not record runs)."""
        manifest = rank_files.check_shared(directory, verify=verify)
        sources = self._elastic_sources(directory)
        step, rank, world = _saved_step(directory, manifest["step"]), self.args.process_index, self.args.world_size
        rank_files.check_complete(directory, rank, world, step=step, verify=verify, sources=sources, manifest=manifest)
        return sources, step, manifest_digest(directory), manifest.get("run")

    @contextlib.contextmanager
    def _training_alone_in_output_dir(self):
        """Around ``train``: this run holds its output_dir's lease (``checkpoints/lease.py``), so a
        second live run there is refused before either trains on, on every rank; a finished or dead
        run's checkpoints are then this run's to replace, as with the Trainer (one WARNING names them)."""
        args = self.args
        self._co2_run = self._co2_run or agreement.all_gather(publish.new_run_id())[0]  # rank 0's, everywhere
        holder = args.process_index == 0 and (self._replica is None or self._replica.saves)
        held, locked = lease.hold(args.output_dir, run=self._co2_run, holder=holder)
        if holder:
            self._warn_shared_folder(args.output_dir, locked=locked)
        self._co2_sole_run = True
        try:
            yield
        finally:
            self._co2_sole_run = False
            if held is not None:
                held.release()

    def _warn_shared_folder(self, folder: str, *, locked: bool) -> None:
        """One WARNING for what this run will find in its folder: checkpoints of earlier runs (replaced
        where it saves over them, never rotated), folders CO2 did not write, no lock to hold."""
        earlier, foreign = _earlier_checkpoints(folder, run=self._co2_run)
        notes = []
        if not locked:
            notes.append(
                f"the filesystem of {folder} does not lock files, so CO2 cannot tell a live run there from a "
                "finished one: start one run per output_dir"
            )
        if earlier:
            runs = "; ".join(f"run {run}: {', '.join(names)}" for run, names in earlier.items())
            notes.append(
                f"{folder} holds checkpoints of earlier runs ({runs}); this run (run {self._co2_run}) replaces "
                "those it saves over, as the Trainer does, and its rotation (save_total_limit) deletes only its own"
            )
        if foreign:
            notes.append(
                f"{folder} holds checkpoint folders CO2 did not write ({', '.join(foreign)}): a save onto one of "
                "those names is refused, as CO2 never deletes what it did not write"
            )
        if notes:
            logger.warning("CO2: %s.", ". ".join(notes))

    def _save_leader(self) -> int:
        """This rank's `rank_files.save_leader` (``save_on_each_node``: each node publishes its own copy)."""
        args = self.args
        return rank_files.save_leader(args.process_index, args.local_process_index, per_node=args.save_on_each_node)

    def _elastic_sources(self, directory: str) -> list[int] | None:
        if not self.co2_config.co2_elastic:
            return None
        rank, world = self.args.process_index, self.args.world_size
        return elastic.elastic_sources(directory, rank, world, self.co2_config.co2_worker_size)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's ``_save`` (safetensors, config, tokenizer, training args) of the anchor instead of
        this rank's local model, plus ``co2_config.json``."""
        # with co2_worker_size > 1 the anchor is all-gathered inside the worker: every rank joins
        needs_gather = self.co2 is not None and self.co2_config.co2_worker_size > 1
        if self.co2 is not None and state_dict is None and (self.args.should_save or needs_gather):
            state_dict = rank_files.anchor_for_saving(self.co2)
        super()._save(output_dir, state_dict=state_dict)
        if self.co2_config is not None and self.args.should_save:
            directory = output_dir if output_dir is not None else self.args.output_dir
            config_file.write_co2_config(directory, **self._ran_with(), world_size=self.args.world_size)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint plus every rank's ``co2_rank{r}.pt``, published as ``checkpoint-N``
        only when complete.

        The Trainer writes into ``_co2_staging/checkpoint-N.<run>.<token>/checkpoint-N``, a folder of this
        save's own (its run folder for this call: `_get_output_dir`), with its Hub push held;
        `rank_files.saving` then flushes every file, writes the manifest and renames the folder. Only
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
        ran = dict(world_size=args.world_size, step=self.state.global_step, leftovers=f"{PREFIX_CHECKPOINT_DIR}-*")
        ran.update(sole_run=self._co2_sole_run)  # `_training_alone_in_output_dir`
        with rank_files.saving(final, rank=rank, leader=leader, run=run, **ran) as staging:
            with self._saving_into(os.path.dirname(staging)):
                super()._save_checkpoint(model, trial)
            self._save_rank_file(staging)
            self._point_best_checkpoint_at(staging, final)
        self._rotate_and_push(run_dir, final)

    def _save_rank_file(self, staging: str) -> None:
        if self.co2 is not None and not self.args.save_only_model:
            rank_files.save_rank_state(
                staging,
                self.args.process_index,
                co2=self.co2,
                model=self.model,
                optimizer=self._inner_optimizer(),
                scaler=getattr(self.accelerator, "scaler", None),
            )

    def _rotate_and_push(self, run_dir: str, final: str) -> None:
        """What the Trainer's ``_save_checkpoint`` ends with, on the published folder (inside the
        staging area its rotation saw one folder, and its push was held): its push as it is, its
        rotation over this run's own checkpoints only (`rotate_own_checkpoints`)."""
        if self.args.should_save:
            best = self.state.best_model_checkpoint
            rotate_own_checkpoints(run_dir, run=self._co2_run, limit=self.args.save_total_limit, best=best)
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
        restored the anchor into the model and rank 0's optimizer everywhere). A state that passed
        the checks but cannot be applied (a rank file whose ``co2`` state is empty) fails every rank
        at once with the same message, before any trains on (`agreement.agree`)."""
        agreement.agree(self._restore_co2_naming_it, directory)

    def _restore_co2_naming_it(self, directory: str) -> None:
        try:
            self._restore_co2_here(directory)
        except (ValueError, KeyError, TypeError, RuntimeError) as error:
            if directory in str(error):
                raise
            own = rank_files.RANK_FILE.format(rank=self.args.process_index)
            raise ValueError(f"checkpoint {directory}: its {own} cannot be restored ({error})") from error

    def _load_rng_state(self, checkpoint) -> None:
        """The Trainer's, agreed: an RNG file that cannot be restored on one rank fails every rank
        with the same message before any trains on (alone, it left the others to a timeout)."""
        if self.co2_config is None or checkpoint is None:
            return super()._load_rng_state(checkpoint)
        load = super()._load_rng_state

        def restore(folder) -> None:
            try:
                load(folder)
            except Exception as error:  # noqa: BLE001 - a torch.load refusal or a malformed state alike
                raise ValueError(
                    f"checkpoint {folder}: rank {self.args.process_index}'s RNG state (rng_state*.pth) cannot be "
                    f"restored ({type(error).__name__}: {error}); the resume would not be exact"
                ) from None

        agreement.agree(restore, checkpoint)

    def _restore_co2_here(self, directory: str) -> None:
        verified = self._co2_verified == directory  # by `_check_resumable`, just before
        sources = self._co2_sources if verified else self._elastic_sources(directory)
        if sources is not None:
            if not verified:
                self._checked_sources(directory, verify=True)
            return self._restore_co2_resharded(directory, sources)
        rank, world = self.args.process_index, self.args.world_size
        state = rank_files.read_rank_state(directory, rank, world, verify=not verified)
        if self._replica is not None:  # on torchft every replica group resumes from group 0's files
            state = {**state, "co2": self._replica.own_state(state["co2"])}
        rank_files.apply_rank_state(
            state,
            co2=self.co2,
            model=self.model,
            optimizer=self._inner_optimizer(),
            scaler=getattr(self.accelerator, "scaler", None),
        )

    def _restore_co2_resharded(self, directory: str, sources: list[int]) -> None:
        """After a change of world (``co2_elastic``): CO2's state re-sharded from the old worker this
        rank's worker takes over, the live model restarted from the anchor (``core/reshard.py``)."""
        elastic.apply_resharded_state(
            elastic.read_states(directory, sources),
            co2=self.co2,
            optimizer=self._inner_optimizer(),
            scaler=getattr(self.accelerator, "scaler", None),
        )
        self._warn_world_changed(directory)

    def _warn_world_changed(self, directory: str) -> None:
        """What a resume on another world carried, reset and does to the data (`elastic.warn_world_changed`)."""
        args = self.args
        elastic.warn_world_changed(
            directory,
            co2=self.co2,
            world_size=args.world_size,
            samples_per_step=args.per_device_train_batch_size * args.gradient_accumulation_steps,
            step=self.state.global_step,
            log=logger.warning if self.is_world_process_zero() else logger.info,
        )


def rotate_own_checkpoints(run_dir: str, *, run: str, limit: int | None, best: str | None) -> None:
    """The Trainer's rotation (``transformers.trainer_utils.rotate_checkpoints``: oldest first by
    modification time, the newest and the best kept) over the checkpoints of run ``run`` only: another
    run's, live or finished, and folders CO2 did not write are never deleted (``publish.py``, "Runs")."""
    if limit is None or limit <= 0:
        return
    ours = [path for path in sort_checkpoints(run_dir, use_mtime=True) if _run_of(path) == run]
    if len(ours) <= limit:
        return
    protected = {ours[-1]} | ({str(Path(best))} if best is not None else set())
    excess = len(ours) - max(limit, len(protected))
    for path in [path for path in ours if path not in protected][: max(excess, 0)]:
        shutil.rmtree(path, ignore_errors=True)


def _run_of(path: str) -> str | None:
    try:
        return saved_run(path)
    except ValueError:  # a damaged manifest: not known to be this run's, so never deleted
        return None


def _earlier_checkpoints(folder: str, *, run: str) -> tuple[dict[str, list[str]], list[str]]:
    """The ``checkpoint-*`` folders in ``folder`` another run saved (by run), and those CO2 did not write."""
    earlier: dict[str, list[str]] = {}
    foreign: list[str] = []
    for path in sort_checkpoints(folder) if os.path.isdir(folder) else []:
        owner, name = _run_of(path), os.path.basename(path)
        if not os.path.lexists(os.path.join(path, MANIFEST_FILE)):
            foreign.append(name)
        elif owner != run:
            earlier.setdefault(owner or "not recorded", []).append(name)
    return earlier, foreign


# trainer_state.json holds a few fields and the log history: at most a training log and an
# evaluation's per step (each a few hundred bytes with CO2's metrics, 4 KiB allows many more metrics)
TRAINER_STATE_BASE_BYTES = 1 << 20
TRAINER_STATE_BYTES_PER_STEP = 4 << 10
TRAINER_STATE_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainerState))


def _saved_step(directory: str, manifest_step: int) -> int | None:
    """The step ``trainer_state.json`` records, read (verified with its folder first) no larger than
    ``manifest_step`` steps of logs need and with only `TrainerState`'s fields, before the Trainer
    builds its `TrainerState` from it."""
    if not os.path.lexists(os.path.join(directory, TRAINER_STATE_NAME)):
        return None
    cap = TRAINER_STATE_BASE_BYTES + TRAINER_STATE_BYTES_PER_STEP * max(manifest_step, 0)
    needs = f"1 MiB and 4 KiB of logs per step, {manifest_step} steps saved"
    state = bounded.read_json(directory, TRAINER_STATE_NAME, max_bytes=cap, why=needs)
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {directory}: its {TRAINER_STATE_NAME} is not a Trainer state (not an object)")
    unknown = sorted(set(state) - TRAINER_STATE_FIELDS)
    if unknown:
        raise ValueError(
            f"checkpoint {directory}: its {TRAINER_STATE_NAME} holds {', '.join(map(repr, unknown[:5]))}, not "
            f"fields of this transformers' TrainerState, so it is not loaded"
        )
    step = state.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint {directory}: its {TRAINER_STATE_NAME} records global_step {step!r}")
    return step
