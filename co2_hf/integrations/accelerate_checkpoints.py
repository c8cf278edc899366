"""CO2's state inside Accelerate's ``save_state`` / ``load_state``: what `CO2Accelerate.save_state`
and ``load_state`` (``accelerate.py``) hand over to `AccelerateCheckpoints`.

Saving wraps ``accelerator.save_state``: a save hook puts the anchor in the model file and makes every
rank write its own ``co2_rank{r}.pt`` (local parameters, inner optimizer, scaler, CO2 state), and the
folder appears only once complete, with a manifest of sizes and checksums (`rank_files.saving`, as
the Trainer saves); a folder holding other files is refused, never replaced. From its first save into
a folder until the block ends the run holds that folder's lease (``checkpoints/lease.py``): a finished
run's checkpoints there are replaced, a live run's are refused. Loading checks the
folder on every rank before anything is read (refusing a missing, truncated, corrupted or unlisted
file by name), runs ``accelerator.load_state``, checks that it applied this rank's RNG file (it drops
one it cannot apply without a word: `check_random_states_applied`), then restores this rank's own
file, read with ``weights_only=True``. Nothing is registered with ``accelerator.register_for_checkpointing``:
Accelerate unpickles those objects as full pickles (``weights_only`` off), so a checkpoint from
elsewhere could run code; an object the user registered is refused (at construction, ``save_state``
and ``load_state``). A plain ``accelerator.save_state`` inside the block writes the rank files too
(no manifest); a plain ``accelerator.load_state`` of a folder with rank files is refused, naming
``co2.load_state``.
"""

from __future__ import annotations

import glob
import logging
import os
import random
from typing import Any

import torch
from accelerate.utils import RNG_STATE_NAME
from accelerate.utils import load as accelerate_load

from ..checkpoints import agreement, lease, manifest, publish, rank_files
from ..core import CO2

logger = logging.getLogger("co2_hf.integrations.accelerate")


class AccelerateCheckpoints:
    """Accelerate's save and load hooks for one `CO2` (registered here, removed by `close`), and the
    atomic save and checked load around ``accelerator.save_state`` / ``load_state``."""

    def __init__(self, accelerator: Any, module: torch.nn.Module, optimizer: Any, co2: CO2) -> None:
        self.accelerator, self.module, self.optimizer, self.co2 = accelerator, module, optimizer, co2
        self.run: str | None = None  # this run's id (publish.py, "Runs"): `load` takes its folder's
        self._loading: str | None = None  # the folder `load` is loading, checked already
        self._skipped_loads: _SkippedLoads | None = None
        self._leases: dict[str, lease.Lease | None] = {}  # folder saved into -> its lease (`_hold`)
        # No object registered for accelerate's checkpointing: accelerate unpickles those with
        # full pickles (weights_only off). This rank's state comes back in `load`, after theirs.
        self._hooks = [
            accelerator.register_save_state_pre_hook(self._save_hook),
            accelerator.register_load_state_pre_hook(self._load_hook),
        ]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for held in self._leases.values():
            if held is not None:
                held.release()
        self._leases.clear()

    def save(self, output_dir: str, **kwargs: Any) -> None:
        """``accelerator.save_state`` into a staging folder, published as ``output_dir`` once every
        rank's files are there; collective."""
        refuse_custom_objects(self.accelerator, "CO2Accelerate.save_state")
        accelerator, project = self.accelerator, self.accelerator.project_configuration
        if project.automatic_checkpoint_naming:
            raise ValueError(
                "CO2Accelerate.save_state needs the folder's name: with "
                "ProjectConfiguration(automatic_checkpoint_naming=True) call accelerator.save_state() "
                "instead (not atomic)"
            )
        rank = accelerator.process_index
        leader = rank_files.save_leader(rank, accelerator.local_process_index, per_node=project.save_on_each_node)
        self.run = run = self.run or publish.new_run_id()
        self._hold(os.path.dirname(os.path.abspath(output_dir)))
        ran = dict(world_size=accelerator.num_processes, step=self.co2.inner_steps, sole_run=True)
        with rank_files.saving(output_dir, rank=rank, leader=leader, run=run, **ran) as staging:
            accelerator.save_state(staging, **kwargs)

    def _hold(self, parent: str) -> None:
        """The lease on the folder this run saves into (``checkpoints/lease.py``), from its first save
        there until the block ends: another live run saving there is refused, naming it; a finished
        run's folders there are this run's to replace, as ``accelerator.save_state`` replaces them."""
        if parent in self._leases:
            return
        rank = self.accelerator.process_index
        self._leases[parent], locked = lease.hold(parent, run=self.run, holder=rank == 0)
        if not locked and rank == 0:
            logger.warning(
                "CO2Accelerate: the filesystem of %s does not lock files, so CO2 cannot tell a live run saving "
                "there from a finished one: it replaces their folders as accelerator.save_state does. Start one "
                "run per folder",
                parent,
            )

    def load(self, input_dir: str, **kwargs: Any) -> None:
        """The folder checked on every rank, ``accelerator.load_state``, then this rank's own file;
        collective."""
        refuse_custom_objects(self.accelerator, "CO2Accelerate.load_state")
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        # before Accelerate reads anything: sizes and checksums of what this rank reads, every rank
        # refusing when one does; the rank file is then checked by size only
        self.run = agreement.agree(self._check_loadable, input_dir, rank, world) or self.run
        self._loading = input_dir
        try:
            self.accelerator.load_state(input_dir, **kwargs)
        finally:
            self._loading = None
            if self._skipped_loads is not None:
                self._skipped_loads.undo()
                self._skipped_loads = None
        agreement.agree(check_random_states_applied, input_dir, rank)
        saved = rank_files.read_rank_state(input_dir, rank, world, require_manifest=False, verify=False)
        rank_files.apply_rank_state(
            saved, co2=self.co2, model=self.module, optimizer=self.optimizer, scaler=self.accelerator.scaler
        )

    def _check_loadable(self, input_dir: str, rank: int, world: int) -> str | None:
        """Refuse what cannot be loaded; return the run that saved the folder (None: not recorded)."""
        rank_files.check_rank_state(input_dir, rank, world, require_manifest=False)
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
        return manifest.saved_run(input_dir)  # None for a plain accelerator.save_state folder

    def _save_hook(self, models: list, weights: list[dict], output_dir: str) -> None:
        """The model file gets the anchor; every rank writes its own state beside it."""
        for i, model in enumerate(models):
            if self.accelerator.unwrap_model(model) is self.module and i < len(weights):
                weights[i] = rank_files.anchor_under_keys(weights[i], rank_files.anchor_for_saving(self.co2))
        rank_files.save_rank_state(
            output_dir,
            self.accelerator.process_index,
            co2=self.co2,
            model=self.module,
            optimizer=self.optimizer,
            scaler=self.accelerator.scaler,
        )

    def _load_hook(self, models: list, input_dir: str) -> None:
        """Accelerate loads the anchor and rank 0's optimizer next; `load` restores this rank's own
        state after that. A plain ``accelerator.load_state`` of a CO2 folder would resume every rank
        with rank 0's optimizer and the anchor as its local model: refused, saying what to call."""
        if self._loading is None:
            if glob.glob(os.path.join(input_dir, rank_files.RANK_FILE.format(rank="*"))):
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


def refuse_custom_objects(accelerator: Any, what: str) -> None:
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


def check_random_states_applied(input_dir: str, rank: int) -> None:
    """Right after ``accelerator.load_state``: this rank's RNGs are those its ``random_states_<rank>.pkl``
    holds. Accelerate drops a file it cannot apply (a missing key, a foreign object) with an INFO line
    on the main process only, and the resume goes on, no longer bit for bit; refused here, naming the
    file and the checkpoint (as CO2Trainer refuses the Trainer's ``rng_state*.pth``)."""
    name = f"{RNG_STATE_NAME}_{rank}.pkl"
    path = os.path.join(input_dir, name)
    try:
        states = accelerate_load(path)  # as Accelerate read it: weights_only, its allowlist
        applied = _rng_matches(states)
    except Exception as error:  # noqa: BLE001 - any failure to read it back means it was not applied
        applied, why = False, f"{type(error).__name__}: {error}"
    else:
        why = "the RNGs after load_state differ from what it holds"
    if not applied:
        raise ValueError(
            f"checkpoint {input_dir}: {name} was not applied by accelerator.load_state ({why}), so the "
            "resume would not be bit for bit (Accelerate goes on silently). Resume from a checkpoint as it was "
            "saved, or start from its model"
        )


def _rng_matches(states: dict) -> bool:
    """Python's, torch's CPU and (where present) CUDA generators are at ``states``. Accelerate sets
    Python's, numpy's, torch's, then the device's, and stops at the first that fails: numpy's failing
    leaves torch's unset, so torch's says it (numpy itself is not a dependency of co2_hf)."""
    same = random.getstate() == states["random_state"]
    same = same and torch.equal(torch.get_rng_state(), states["torch_manual_seed"])
    saved = states.get("torch_cuda_manual_seed")
    if saved is not None and torch.cuda.is_available():
        # every device's state (get_rng_state_all) or, saved through torch.accelerator, the current one's
        many = isinstance(saved, (list, tuple))
        cuda, saved = (
            (torch.cuda.get_rng_state_all(), list(saved)) if many else ([torch.cuda.get_rng_state()], [saved])
        )
        same = same and len(cuda) == len(saved) and all(torch.equal(a, b) for a, b in zip(cuda, saved))
    return bool(same)
