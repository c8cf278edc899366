"""CO2Trainer on torchft: ``--co2_fault_tolerance torchft`` (docs/algorithm.md section 19).

Each replica group is its own launch of one process (``REPLICA_GROUP_ID=i python train.py ...``
beside a Lighthouse that ``TORCHFT_LIGHTHOUSE`` names; ``co2-ft-launch`` starts both on one
machine). The Trainer's engine is then built by `co2_hf.torchft.job.TorchFT`, and the Trainer's own
state travels with CO2's to a replica that is behind:

- a replacement (a process that starts while the others train) takes a live peer's model,
  optimizer, scheduler, CO2 state and ``TrainerState`` at its first quorum, before its first step;
  it then skips to the peer's place in its own data shard, exactly as a resume from a checkpoint
  does (`Rejoin`), and reads nothing from disk;
- each replica group reads its own shard of the training set (torchft's ``DistributedSampler``
  over ``NUM_REPLICA_GROUPS`` shards), so a replacement reads what its predecessor would have;
- replica group 0 alone writes checkpoints, models and reports (it is the Trainer's world process
  zero; every group holds the same model);
- ``resume_from_checkpoint`` (one of group 0's, on a disk every group reads) is for a job that lost
  every replica: each group loads it before its first quorum, and a live peer's state, if any peer
  is ahead, replaces it there. A job that starts from step 0 beside a checkpoint of its output
  directory stops instead of training from scratch over it (`Replica.join`).

A survivor healed at a boundary keeps its place (its peers are at its step); one whose Trainer step
differs from the peer's cannot jump in its data mid-epoch, so it stops with an error and rejoins
when its supervisor restarts it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from transformers.trainer_callback import TrainerState

from ..core import CO2
from . import launch

logger = logging.getLogger(__name__)

SAMPLING = ("random", "sequential")  # the train_sampling_strategy values a shard can follow
REJOINED = "<a live peer>"  # `resume_from_checkpoint` while the Trainer skips to a peer's data position


def check_arguments(args) -> None:
    """What ``--co2_fault_tolerance torchft`` needs of the Trainer's settings and of the launch, before
    any process group starts. Its value and what it cannot be combined with among the ``co2_*``
    settings were checked with the others (`CO2Config.validate_co2`, ``allowed.py``)."""
    if args.co2_fault_tolerance == "none":
        return
    flag = "co2_fault_tolerance='torchft'"
    try:
        from ..torchft import job, transport
    except ImportError as error:
        raise ValueError(f"{flag} needs torchft: pip install 'co2_hf[ft]'") from error
    job.check_config(args)
    job.job_from_env()
    transport.job_secret()
    if launch.launched_world_size() != 1:
        raise ValueError(
            f"{flag} with WORLD_SIZE={launch.launched_world_size()}: one process per replica group in this "
            "version. Start each replica group as its own launch of one process (REPLICA_GROUP_ID=i), "
            "e.g. with co2-ft-launch"
        )
    if args.load_best_model_at_end:
        raise ValueError(
            f"load_best_model_at_end=True with {flag}: allowed is False (only replica group 0 writes "
            "checkpoints, so the others could not load the best one)"
        )
    if args.train_sampling_strategy not in SAMPLING:
        raise ValueError(
            f"train_sampling_strategy={args.train_sampling_strategy!r} with {flag}: allowed are "
            f"{', '.join(map(repr, SAMPLING))} (each replica group reads its shard of torchft's DistributedSampler)"
        )


class ReplicaOverrides:
    """The Trainer methods `CO2Trainer` overrides on torchft only (``_replica`` set: a `Replica`);
    without torchft each is the Trainer's own. A mixin of `CO2Trainer`, not for use apart."""

    def _get_train_sampler(self, train_dataset=None):
        """On torchft, this replica group's shard (every group would read the whole set otherwise)."""
        if self._replica is None:
            return super()._get_train_sampler(train_dataset)
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        shuffle = self.args.train_sampling_strategy != "sequential"
        return self._replica.sampler(dataset, seed=seed, drop_last=self.args.dataloader_drop_last, shuffle=shuffle)

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
        kwargs.update(epochs_trained=epoch, steps_trained_in_current_epoch=skip, resume_from_checkpoint=REJOINED)
        return super()._run_epoch(**kwargs)

    def _load_rng_state(self, checkpoint):
        """A replacement keeps its own seeded RNG: the one its predecessor had is gone with it (the data
        order does not depend on it: the shard's sampler follows the seed and the epoch)."""
        if checkpoint is not REJOINED:
            super()._load_rng_state(checkpoint)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model``; on torchft only by replica group 0, which writes the model
        every group holds (the others are told so at start)."""
        if self._replica is not None and not self._replica.saves:
            return
        super().save_model(output_dir, _internal_call)

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


class Replica:
    """One replica group's Trainer on torchft: builds CO2 through `TorchFT`, lends and takes the
    Trainer's state, and says where a replacement resumes in its data."""

    def __init__(self, trainer) -> None:
        from ..torchft import job as ft

        self.trainer = trainer
        _, self.replica_id, self.num_replicas = ft.job_from_env()
        self.ft: ft.TorchFT | None = None
        self.rejoined_at: int | None = None  # the peer's global step a replacement started at
        self.fell_behind: int | None = None  # a peer's step that differs from ours, mid-training
        self._training = False
        self._in_step = False  # inside the Trainer's optimizer step, which it counts only after CO2's
        if not self.saves:
            logger.warning(
                "CO2: replica group %d writes no checkpoints, models or reports: every replica group holds the "
                "same model, and replica group 0 is the job's main process (co2_fault_tolerance='torchft')",
                self.replica_id,
            )

    @property
    def saves(self) -> bool:
        return self.replica_id == 0

    def sampler(self, dataset, *, seed: int, drop_last: bool, shuffle: bool):
        """This replica group's shard of the training set, the same one across its replacements."""
        from torchft.data import DistributedSampler
        from transformers.trainer_utils import has_length

        if not has_length(dataset):
            raise ValueError(
                "co2_fault_tolerance='torchft' needs a training set with a length (map-style): each replica "
                "group reads its shard through torchft's DistributedSampler, and an iterable dataset has none"
            )
        return DistributedSampler(
            dataset,
            replica_rank=self.replica_id,
            num_replica_groups=self.num_replicas,
            group_rank=0,
            num_replicas=1,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )

    def build(self, model, optimizer) -> CO2:
        """CO2 for this replica group, not joined to the job yet (a checkpoint loads first)."""
        from ..torchft.job import TorchFT

        trainer = self.trainer
        self.ft = TorchFT(trainer.co2_config, timeout_s=trainer.args.co2_timeout_s)
        scheduler = trainer.lr_scheduler
        state = {"trainer": (self._take_trainer_state, self._trainer_state)}
        if scheduler is not None:
            state["scheduler"] = (scheduler.load_state_dict, scheduler.state_dict)
        return self.ft.build(model, optimizer, state=state)

    def own_state(self, saved: dict) -> dict:
        """CO2's state from a checkpoint (replica group 0's), as this group's (`torchft.job.own_state`)."""
        from ..torchft.job import own_state

        return own_state(self.trainer.co2, saved)

    def join(self) -> None:
        """The first quorum: a replacement takes a live peer's state (over a checkpoint's, if it
        loaded one). A job that then starts from step 0 while its output directory holds a
        checkpoint stops: every replica was lost at once, and training on would overwrite it."""
        trainer, before = self.trainer, self.trainer.state.global_step
        self.ft.join(trainer.co2)
        if trainer.state.global_step == 0:  # neither a checkpoint nor a peer gave it a step
            self._refuse_a_restart_from_scratch()
        if trainer.state.global_step != before:
            self.rejoined_at = trainer.state.global_step
            logger.warning(
                "CO2: replica group %d rejoined the job at step %d with a live peer's state; it skips to that "
                "step's place in its data shard",
                self.replica_id,
                self.rejoined_at,
            )
        self._training = True

    def _refuse_a_restart_from_scratch(self) -> None:
        from transformers.trainer_utils import get_last_checkpoint

        output_dir = self.trainer.args.output_dir
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            return
        self.shutdown()
        raise ValueError(
            f"CO2: replica group {self.replica_id} starts the torchft job from step 0 (no replica group has trained "
            f"state to give it: every one was lost, or this is a new job), but output_dir holds {last}. Training "
            "on would overwrite it. Pass resume_from_checkpoint (that folder, or True for the last one) to every "
            "replica group to continue from it, or another output_dir to start over."
        )

    def step(self, **kwargs) -> None:
        """``CO2.step`` from the Trainer's optimizer step; then, a heal that moved this replica's
        Trainer step cannot go on in place."""
        self._in_step = True
        try:
            self.trainer.co2.step(**kwargs)
        finally:
            self._in_step = False
        if self.fell_behind is not None:
            raise RuntimeError(
                f"CO2: replica group {self.replica_id} fell behind its peers (its Trainer at step "
                f"{self.trainer.state.global_step + 1}, theirs at {self.fell_behind}: a quorum formed without it, "
                "is the Lighthouse's join_timeout_ms shorter than a round?) and took their state; its data loader "
                "cannot jump there mid-epoch, so it stops: restarted by its supervisor, it rejoins from a live peer"
            )

    def _steps_done(self) -> int:
        """The Trainer's steps, the one it is in counted: a quorum runs inside an optimizer step
        (``CO2.step``) or outside any (the first and the last), and the Trainer counts a step after it."""
        return self.trainer.state.global_step + self._in_step

    def _trainer_state(self) -> str:
        return json.dumps({**dataclasses.asdict(self.trainer.state), "global_step": self._steps_done()})

    def _take_trainer_state(self, saved: str) -> None:
        trainer, peer = self.trainer, TrainerState(**json.loads(saved))
        if self._training:  # a survivor healed at a boundary: its peers' step is its own, or it must stop
            if peer.global_step != self._steps_done():
                self.fell_behind = peer.global_step
            return
        own = trainer.state
        peer.is_local_process_zero, peer.is_world_process_zero = own.is_local_process_zero, own.is_world_process_zero
        trainer.state = peer
        trainer._load_callback_state()  # stateful callbacks (early stopping, ...) as the peer has them

    def epoch_position(self, num_update_steps_per_epoch: int, gradient_accumulation_steps: int) -> tuple[int, int]:
        """A replacement's (epoch, batches into it) at the step it rejoined at, as a resume computes it."""
        step = self.rejoined_at
        return step // num_update_steps_per_epoch, step % num_update_steps_per_epoch * gradient_accumulation_steps

    def shutdown(self) -> None:
        self._training = False
        if self.ft is not None:
            self.ft.shutdown()
            self.ft = None
