"""One torchft replica group running CO2Trainer with ``co2_fault_tolerance='torchft'``, for tests/test_ft.py.

    python tests/ft_trainer_workers.py --out FILE [--steps 48] [--tau 4] [--die_at STEP] [--step_s 0.3]
        [--save_steps N] [--output_dir DIR] [--resume CHECKPOINT]

torchft's environment (TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS) says which replica
group this is. After each optimizer step one JSON line is appended to ``--out`` (a replacement
appends to its predecessor's file): the process id, the Trainer's global step and CO2's, the dataset indices
of the step's batch and a digest of CO2's anchor. ``--die_at K``: the first process of the replica
(its file does not exist yet) SIGKILLs itself at the end of step K. At the end the model is saved
into the output directory, ``out<replica>`` beside ``--out`` unless ``--output_dir`` names one for
every group (replica group 0 alone writes it, and the checkpoints every ``--save_steps``).
``--resume``: ``resume_from_checkpoint``, a folder or ``true``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time

import torch
from ft_workers import anchor_digest  # the same digest the engine's test records
from torch import nn
from transformers import TrainerCallback

from co2_hf import CO2Trainer, CO2TrainingArguments

SAMPLES, FEATURES = 96, 8


class Indexed(torch.utils.data.Dataset):
    """A fixed regression set whose items say their index, so a test can check who read what."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i], "index": torch.tensor(i)}


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.seen: list[int] = []

    def forward(self, x, labels, index):
        self.seen = index.tolist()
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


class Record(TrainerCallback):
    def __init__(self, trainer: CO2Trainer, out: str, die_at: int | None, step_s: float) -> None:
        self.trainer, self.out, self.die_at, self.step_s = trainer, out, die_at, step_s

    def on_step_end(self, args, state, control, **kwargs):
        line = dict(
            inner=self.trainer.co2.inner_steps,
            pid=os.getpid(),
            step=state.global_step,
            seen=self.trainer.model.seen,
            anchor=anchor_digest(self.trainer.co2),
        )
        with open(self.out, "a") as f:
            f.write(json.dumps(line) + "\n")
        if state.global_step == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.step_s)  # steps long enough for a replacement to start while the others train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--tau", type=int, default=4)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--die_at", type=int, default=None)
    parser.add_argument("--step_s", type=float, default=0.3)
    parser.add_argument("--save_steps", type=int, default=None)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--resume", default=None)
    a = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.environ.get("CO2_FT_DEBUG"):  # torchft's quorum, heal and commit lines, for a failing test
        logging.getLogger("torchft").setLevel(logging.INFO)
    replica = int(os.environ["REPLICA_GROUP_ID"])
    die_at = a.die_at if not os.path.exists(a.out) else None  # a replacement lives
    torch.manual_seed(replica)  # each replica its own init: the first quorum must make them agree
    args = CO2TrainingArguments(
        a.output_dir or os.path.join(os.path.dirname(os.path.abspath(a.out)), f"out{replica}"),
        use_cpu=True,
        max_steps=a.steps,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="linear",
        save_strategy="no" if a.save_steps is None else "steps",
        save_steps=a.save_steps or 500,
        report_to=[],
        disable_tqdm=True,
        logging_steps=1000,
        seed=7,
        co2_local_steps=a.tau,
        co2_fragments=a.fragments,
        co2_timeout_s=5.0,
        co2_fault_tolerance="torchft",
    )
    trainer = CO2Trainer(model=Regression(), args=args, train_dataset=Indexed())
    trainer.add_callback(Record(trainer, a.out, die_at, a.step_s))
    trainer.train(resume_from_checkpoint={"true": True}.get(a.resume, a.resume))
    trainer.save_model()


if __name__ == "__main__":
    main()
