"""`CO2TrainingArguments`: ``TrainingArguments`` plus every ``--co2_*`` flag of `CO2Config`.

Everything CO2 cannot work with is refused in ``__post_init__``, before ``TrainingArguments`` sets
up the device and with it the default process group, so a bad launch fails at once and the same on
every rank: a bad ``co2_*`` value, DeepSpeed, FSDP1 and FSDP across workers, ``parallelism_config``,
a per-step token count gather, a ``co2_worker_size`` that does not divide ``WORLD_SIZE``, a
bfloat16 wire over more than 256 workers, a ``ddp_timeout`` below ``co2_timeout_s`` (a
``max_steps`` in which no round completes is warned, not refused). ``ddp_timeout`` defaults to
``co2_timeout_s`` (`_follow_ddp_timeout` applies it to the default group).

FSDP2 (``--fsdp`` with ``fsdp_config`` version 2, the default) together with ``co2_worker_size = k
> 1`` shards the model inside each worker: the Trainer's own FSDP, which would shard across every
process, is turned off here, its settings move to the public field ``worker_fsdp`` and `CO2Trainer`
applies ``fully_shard`` over the worker's k processes itself (`_take_over_fsdp2`).

What CO2 changes in the user's settings is logged at WARNING once, with why:
``average_tokens_across_devices`` is turned off, ``ddp_timeout`` follows ``co2_timeout_s``, the
``ddp_*`` flags of DDP have no effect (CO2 does not use DDP), ``dispatch_batches=True`` applies to
evaluation and prediction only, and a run with a single worker has nobody to average with.

``__post_init__`` calls ``super().__post_init__()``, so the class mixes with other
``TrainingArguments`` subclasses (TRL's ``SFTConfig``) in either base-class order::

    @dataclass
    class CO2SFTConfig(CO2TrainingArguments, SFTConfig):  # or (SFTConfig, CO2TrainingArguments)
        pass
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import TrainingArguments
from transformers.trainer_pt_utils import AcceleratorConfig
from transformers.training_args import _convert_str_dict  # how TrainingArguments reads JSON flags

from ..allowed import check_ddp_timeout, run_length_warning
from ..config import CO2Config
from . import fault_tolerance, launch

logger = logging.getLogger(__name__)

TRAINER_DDP_TIMEOUT = TrainingArguments.__dataclass_fields__["ddp_timeout"].default


@dataclass
class CO2TrainingArguments(TrainingArguments, CO2Config):
    """``TrainingArguments`` plus every field of `CO2Config` (declared there, once: also
    ``co2_elastic`` and ``co2_fault_tolerance``, which Accelerate and the engine read too)."""

    # None = not set: CO2 then bounds the default group's collectives (the loss gather at logging
    # steps, save barriers) by co2_timeout_s too, so a dead peer cannot leave a rank blocked there
    ddp_timeout: int | None = field(
        default=None,
        metadata={
            "help": "Timeout (s) of the default process group's collectives. Default: co2_timeout_s "
            f"(rounded up) with CO2, {TRAINER_DDP_TIMEOUT} without."
        },
    )

    # Set by __post_init__, not a flag: with --fsdp (FSDP2) and co2_worker_size = k > 1, what CO2Trainer
    # needs to shard the model over the k processes of each worker (the Trainer's own fsdp and
    # fsdp_config are cleared, as they would shard across workers)
    worker_fsdp: dict | None = field(
        default=None,
        init=False,
        metadata={
            "help": "Set by CO2 from --fsdp/--fsdp_config when co2_worker_size > 1: {'layer_classes': [...], "
            "'reshard_after_forward': bool}, the FSDP2 sharding CO2Trainer applies inside each worker."
        },
    )

    def __post_init__(self) -> None:
        # CO2's own checks first: they need no device and no process group (TrainingArguments'
        # __post_init__ sets up the device, which creates the default group)
        self.validate_co2()
        fault_tolerance.check_arguments(self)
        _use_cpu_without_accelerator(self)
        if self.co2_enabled:
            workers = self.check_world(_workers_launched(self))
            self.worker_fsdp = _take_over_fsdp2(self)
            _refuse_unsupported(self)
            dispatch = _dispatch_batches_given(self)
            if _ddp_timeout_given(self):
                check_ddp_timeout(self, self.ddp_timeout)
        follows = self.co2_enabled and not _ddp_timeout_given(self)
        if follows:
            self.ddp_timeout = math.ceil(self.co2_timeout_s)
        elif self.ddp_timeout is None:
            self.ddp_timeout = TRAINER_DDP_TIMEOUT
        super().__post_init__()  # cooperative: an SFTConfig (or other) base runs its own checks too
        if not self.co2_enabled:
            return
        refuse_data_parallel(self)
        off = _turn_off_per_step_collectives(self)
        _warn_changed_settings(
            self,
            ddp_timeout_followed=follows,
            token_average_off=off,
            workers=workers,
            dispatch=dispatch,
            run_length=run_length_warning(self, self.max_steps),
        )


def _workers_launched(args: CO2TrainingArguments) -> int:
    """The processes CO2's workers span: this launch's, or on torchft every replica group's."""
    if args.co2_fault_tolerance == "torchft":
        from ..torchft.job import job_from_env

        return job_from_env()[2]
    return launch.launched_world_size()


def _warn_changed_settings(
    args: CO2TrainingArguments,
    *,
    ddp_timeout_followed: bool,
    token_average_off: bool,
    workers: int,
    dispatch: bool,
    run_length: str | None,
) -> None:
    """What CO2 changed or made useless, at WARNING once (rank 0; the other ranks at INFO), with why."""
    warn = logger.warning if args.process_index == 0 else logger.info
    if ddp_timeout_followed:
        warn(
            f"CO2: ddp_timeout not set, so it follows co2_timeout_s: {args.ddp_timeout} s instead of the "
            f"Trainer's {TRAINER_DDP_TIMEOUT} s, so that a rank blocked behind a dead peer in the default "
            "group (the loss gather at logging steps, save barriers) stops as soon as CO2's own wait does. "
            "Pass --ddp_timeout to choose."
        )
    if token_average_off:
        warn(
            "CO2: average_tokens_across_devices turned off: it all-gathers the token count across every "
            "process at every step, a collective over the slow link that CO2 exists to avoid; each "
            "process normalises its loss by its own token count"
        )
    if dispatch:
        warn(
            "CO2: accelerator_config.dispatch_batches=True applies to evaluation and prediction only: each "
            "worker reads its own training batches (dispatching broadcasts every batch from rank 0 at every "
            "step, a collective over the slow link CO2 exists to avoid)"
        )
    given = {name: getattr(args, name) for name in DDP_FLAGS if getattr(args, name, None) is not None}
    if given:
        warn(
            f"CO2: {', '.join(f'{k}={v!r}' for k, v in given.items())} ha{'s' if len(given) == 1 else 've'} no "
            "effect: CO2 does not wrap the model in DistributedDataParallel (workers train alone between "
            "round boundaries, and CO2 averages the gradients itself during co2_sync_warmup_steps)"
        )
    if workers == 1:
        warn(
            f"CO2 with a single worker ({args.world_size} process(es), co2_worker_size={args.co2_worker_size}): "
            "there is nobody to average with, so the outer step only replays this worker's own progress. "
            f"{_launch_hint()}, or pass --co2_enabled false."
        )
    if run_length:
        warn(run_length)
    if args.hub_strategy == "checkpoint":
        warnings.warn(
            "hub_strategy='checkpoint' uploads the last checkpoint folder, which with CO2 "
            "holds every rank's local parameters and optimizer state (co2_rank*.pt)",
            stacklevel=4,
        )


def _launch_hint() -> str:
    """How to start N processes here. Without GPUs, ``accelerate launch --num_processes N`` and no
    config file still starts one process (it needs --multi_cpu or a config that says so)."""
    if torch.accelerator.is_available():
        return "Launch several processes (accelerate launch --num_processes N, or torchrun --nproc_per_node N)"
    return (
        "Launch several processes: on CPUs torchrun --nproc_per_node N, or accelerate launch --config_file "
        "with a multi-CPU config (recipes/accelerate_configs/cpu_2proc.yaml in the co2_hf repository; "
        "accelerate launch --num_processes N alone starts one process on a machine without GPUs)"
    )


def _ddp_timeout_given(args: CO2TrainingArguments) -> bool:
    """Whether the user set ``ddp_timeout``. Mixed in after another TrainingArguments subclass
    (``class C(SFTConfig, CO2TrainingArguments)``), that class's copy of the field, default 1800,
    wins over ours (None): there the Trainer's default value counts as not set."""
    if args.ddp_timeout is None:
        return False
    shadowed = type(args).__dataclass_fields__["ddp_timeout"].default == TRAINER_DDP_TIMEOUT
    return not (shadowed and args.ddp_timeout == TRAINER_DDP_TIMEOUT)


def _use_cpu_without_accelerator(args: CO2TrainingArguments) -> None:
    """Launched as several processes on a machine without GPUs, TrainingArguments would otherwise
    set up one independent process each (world size 1): every replica would train alone."""
    launched = launch.launched_world_size() > 1
    if launched and not args.use_cpu and not torch.accelerator.is_available():
        if os.environ.get("RANK", "0") == "0":  # the same on every rank: said once
            logger.warning(
                "CO2: no GPU or other accelerator found: use_cpu set to True, else TrainingArguments would "
                "set up each launched process as an independent run of its own (world size 1)"
            )
        args.use_cpu = True


def _refuse_unsupported(args: CO2TrainingArguments) -> None:
    env_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if args.deepspeed or env_deepspeed:
        raise ValueError(
            "CO2 does not support DeepSpeed: ZeRO would shard the model and its optimizer across CO2 "
            "workers. Drop --deepspeed; to shard the model states inside a worker use FSDP2 "
            f"({FSDP2_HINT}), or pass --co2_enabled false."
        )
    if getattr(args, "parallelism_config", None) is not None:
        raise ValueError(
            f"parallelism_config={args.parallelism_config!r} splits one model across processes; CO2 "
            "needs every process to be its own worker: allowed value with CO2 is None"
        )
    if args.include_num_input_tokens_seen not in ("no", False, None):
        raise ValueError(
            f"include_num_input_tokens_seen={args.include_num_input_tokens_seen!r} gathers a token "
            "count across workers at every step, which CO2 exists to avoid: allowed value with CO2 "
            "is 'no'"
        )


FSDP2_HINT = "--fsdp full_shard --fsdp_config '{\"version\": 2}' with --co2_worker_size k > 1"


def _take_over_fsdp2(args: CO2TrainingArguments) -> dict | None:
    """FSDP asked for (``--fsdp`` or ``ACCELERATE_USE_FSDP``): with FSDP2 and ``co2_worker_size = k
    > 1``, return what CO2Trainer needs to shard inside each worker (layer classes to wrap,
    reshard_after_forward) and turn the Trainer's FSDP off; refuse FSDP1 and FSDP without workers
    of several processes, which would shard across CO2 workers."""
    env_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not (args.fsdp or env_fsdp):
        return None
    config = _fsdp_config(args.fsdp_config)
    version = int(config.get("version", os.environ.get("FSDP_VERSION", 2)))
    options = _fsdp_options(args.fsdp)
    if version != 2:
        raise ValueError(
            f"FSDP version {version} is not supported with CO2: use FSDP2 inside each worker ({FSDP2_HINT}), "
            "or pass --co2_enabled false"
        )
    if args.co2_worker_size == 1:
        raise ValueError(
            "FSDP with co2_worker_size=1 would shard the model across CO2 workers (every process is one). "
            f"Set --co2_worker_size to the processes of one worker (e.g. the GPUs of a node): {FSDP2_HINT}"
        )
    unsupported = [o for o in options if o not in ("full_shard", "shard_grad_op", "auto_wrap")]
    if unsupported or config.get("cpu_offload") or config.get("offload_params"):
        raise ValueError(
            f"fsdp options {unsupported or ['cpu_offload']} are not supported inside a CO2 worker: allowed are "
            "full_shard, shard_grad_op and auto_wrap (use --co2_state_device cpu to keep CO2's state in host memory)"
        )
    layers = config.get("transformer_layer_cls_to_wrap")
    take = {
        "layer_classes": [layers] if isinstance(layers, str) else list(layers or []),
        "reshard_after_forward": bool(config.get("reshard_after_forward", "shard_grad_op" not in options)),
    }
    args.fsdp, args.fsdp_config = None, None  # the Trainer's FSDP would shard across every process
    if env_fsdp:
        # No other way: `accelerate launch --use_fsdp` asks for FSDP through this variable only, and
        # Accelerate's state, created by TrainingArguments.__post_init__ right after this, reads it
        # (no argument overrides it); left "true", Accelerate would shard across every process.
        os.environ["ACCELERATE_USE_FSDP"] = "false"
    return take


def _fsdp_options(fsdp: bool | str | list | None) -> list[str]:
    """``--fsdp``'s option words ('full_shard offload', or a list); none for a plain ``--fsdp``."""
    if isinstance(fsdp, str):
        return fsdp.split()
    return [getattr(o, "value", o) for o in fsdp] if isinstance(fsdp, (list, tuple)) else []  # enum members too


def _inline_json(flag: str, text: str) -> dict:
    """A dict flag given as JSON on the command line, read as ``TrainingArguments.__post_init__``
    reads it (which runs after CO2's checks): ``json.loads``, then its conversion of "true"-like strings."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{flag}={text!r} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{flag}={text!r} must be a JSON object")
    return _convert_str_dict(value)


def _fsdp_config(config: dict | str | None) -> dict:
    """``fsdp_config`` as TrainingArguments reads it: a dict, a JSON string or a JSON file."""
    if isinstance(config, str) and config.startswith("{"):
        config = _inline_json("fsdp_config", config)
    elif isinstance(config, str):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    return {(k[5:] if k.startswith("fsdp_") else k): v for k, v in (config or {}).items()}


def _dispatch_batches_given(args: CO2TrainingArguments) -> bool:
    """Whether ``accelerator_config`` asks for ``dispatch_batches=True``, read as TrainingArguments
    reads it (a dict, inline JSON, an AcceleratorConfig, or any path of a JSON file), here, before it
    builds the config (a bad one fails now, before any process group). The config is left as given:
    `CO2Trainer.get_train_dataloader` keeps the training batches local, and evaluation and prediction
    loaders are dispatched or not as without CO2."""
    config = args.accelerator_config
    if config is None or isinstance(config, type):  # a class: TrainingArguments refuses it itself
        return False
    if isinstance(config, str) and config.startswith("{"):  # inline JSON, as TrainingArguments reads it
        config = _inline_json("accelerator_config", config)
    if isinstance(config, dict):
        return bool(config.get("dispatch_batches"))
    if isinstance(config, AcceleratorConfig):
        return bool(config.dispatch_batches)
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise ValueError(
            f"accelerator_config={config!r} is neither inline JSON (starting with '{{') nor an existing JSON file"
        )
    return bool(AcceleratorConfig.from_json_file(path).dispatch_batches)


def _turn_off_per_step_collectives(args: CO2TrainingArguments) -> bool:
    """``average_tokens_across_devices`` gathers at every step: off. Whether it was on."""
    was_on = bool(args.average_tokens_across_devices)
    args.average_tokens_across_devices = False
    return was_on


DDP_FLAGS = ("ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph")


def refuse_data_parallel(args) -> None:
    """One process driving several GPUs: the Trainer would wrap the model in ``nn.DataParallel``
    (``n_gpu > 1``), WORLD_SIZE is 1, and CO2 would run one worker with nobody to average with."""
    if args.n_gpu > 1:
        raise ValueError(
            f"CO2 needs one process per GPU, but this single process sees n_gpu={args.n_gpu} and the Trainer "
            "would wrap the model in nn.DataParallel (one CO2 worker, nobody to average with). Launch one "
            f"process per GPU: accelerate launch --num_processes {args.n_gpu} train.py ..., or torchrun "
            f"--nproc_per_node {args.n_gpu} train.py ... (or pass --co2_enabled false)."
        )


def _follow_ddp_timeout(args: CO2TrainingArguments) -> None:
    """Give the default group ``args.ddp_timeout``. Accelerate does not pass ddp_timeout on when
    training on CPUs, nor to a group the script created itself; without this, a rank blocked in the
    Trainer's loss gather behind a dead peer would wait 30 minutes instead of co2_timeout_s."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # older torch: Accelerate's own setting is all there is
        logger.warning("CO2: this torch cannot change the default group's timeout (ddp_timeout)")
        return
    set_timeout(datetime.timedelta(seconds=args.ddp_timeout))


def resolve_resume_from_checkpoint(resume, output_dir: str | None) -> str | None:
    """What ``--resume_from_checkpoint`` (or ``Trainer.train(resume_from_checkpoint=...)``) names: a
    checkpoint folder; ``True`` or the word ``true`` (any case; a folder of that name is a folder) for
    the last ``checkpoint-N`` of ``output_dir`` (transformers' ``get_last_checkpoint``); ``None``,
    ``False`` or ``false``: start afresh. ``CO2Trainer.train`` and the recipes both resolve it here."""
    from transformers.trainer_utils import get_last_checkpoint

    word = resume.lower() if isinstance(resume, str) and not os.path.isdir(resume) else None
    if resume is None or resume is False or word == "false":
        return None
    if resume is True or word == "true":
        last = get_last_checkpoint(output_dir) if output_dir and os.path.isdir(output_dir) else None
        if last is None:
            raise ValueError(
                f"--resume_from_checkpoint true: --output_dir {output_dir} holds no checkpoint-N folder; "
                "allowed values are a checkpoint folder, or true once output_dir holds one"
            )
        return last
    if not isinstance(resume, (str, os.PathLike)):
        raise ValueError(f"--resume_from_checkpoint={resume!r}: allowed values are a checkpoint folder or true")
    return os.fspath(resume)


def parse_or_exit(parse, *args, **kwargs):
    """``parse(*args, **kwargs)``; a refused setting (the ``ValueError`` that validation raises, naming
    the flag and the allowed values) prints ``error: <message>`` once, on rank 0 only, and exits with
    status 1, with no traceback: the recipes parse their flags through it."""
    import sys

    try:
        return parse(*args, **kwargs)
    except ValueError as error:
        if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
