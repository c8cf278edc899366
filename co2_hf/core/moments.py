"""`GlobalSecondMoment`: ``co2_global_second_moment_every`` (``docs/algorithm.md``, "The inner
second moment").

Each worker's Adam(W) divides its step by a second moment of its *own* small batch's gradients,
which holds W times the gradient noise that data parallel's (of the averaged gradient) holds, so
the local methods take smaller steps where the gradient is noisy. Every K rounds the workers
all-reduce their bias-corrected moments (first m, and each worker's own second u), and each worker
replaces its Adam second moment by the averaged gradient's estimate ``m^2 + (u - m^2) / W``.

The all-reduce is launched at a round's end and applied at the next one, tau steps later (it
overlaps a round of compute); the estimate, taken at the launch, enters decayed by beta2 for the
steps between, beside what Adam added meanwhile from the worker's own gradients. Each worker keeps
``offset``, Adam's second moment minus its own (that decays by beta2 per step), so that an estimate
is never taken for a worker's own moment and divided by W a second time.

Pure tensor work on the parameters' device: no host read. One flat buffer of ``2n + P`` values in the
outer wire's dtype (fp32, or bf16 with ``co2_comm_dtype='bfloat16'``; n optimizer elements, P
parameters: a worker without state for a parameter says so in its slot),
a copy of the own moment (n) while the exchange is in flight, and the offset (n).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..allowed import second_moment_conflicts
from .comm import Communicator, Pending
from .tally import Seconds

logger = logging.getLogger("co2_hf.core.co2")


DEFAULT_EVERY = 4  # co2_global_second_moment_every unset, where it applies (docs/choosing_settings.md, "Workers")
FLAG = "co2_global_second_moment_every"


def adam_of(optimizer: Any) -> torch.optim.Optimizer:
    """The torch Adam or AdamW inside ``optimizer`` (through wrappers' ``.optimizer``, as Accelerate's
    and the Trainer's), or ``ValueError`` naming the setting and what it needs."""
    inner, why_not = _unwrap(optimizer), _why_not_adam(optimizer)
    if why_not is not None:
        raise ValueError(f"{FLAG} > 0 {why_not}; set {FLAG}=0")
    return inner


def fit_default_every(config: Any, optimizer: Any, num_workers: int) -> Any:
    """``co2_global_second_moment_every`` unset: `DEFAULT_EVERY` where it applies, else 0, with a
    WARNING saying why (none with one worker, where the exchange changes nothing: the workers' average
    is the worker's own). A value the user set is never changed. Returns the config with the value
    set: what checkpoints, ``co2_config.json`` and model cards record."""
    if config.co2_global_second_moment_every is not None:
        return config
    if num_workers == 1:  # the workers' average is the worker's own moment: nothing to exchange
        return dataclasses.replace(config, co2_global_second_moment_every=0)
    why_not = _why_default_off(config, optimizer)
    if why_not is not None:
        logger.warning(
            "CO2: %s is not set, and its default (%d: every %d rounds the workers' Adam second moments are "
            "averaged, docs/algorithm.md 'The inner second moment') does not apply here: it %s. Training "
            "without it (0); set %s=0 to say so.",
            FLAG,
            DEFAULT_EVERY,
            DEFAULT_EVERY,
            why_not,
            FLAG,
        )
    return dataclasses.replace(config, co2_global_second_moment_every=DEFAULT_EVERY if why_not is None else 0)


def _why_default_off(config: Any, optimizer: Any) -> str | None:
    """Why the default cannot run under ``config`` with ``optimizer`` (None: it can)."""
    conflicts = [f"{name}={getattr(config, name)!r}" for name, _ in second_moment_conflicts(config)]
    if config.co2_state_device == "cpu":  # its buffers would fill the device memory the user is saving
        conflicts.append("co2_state_device='cpu' (its buffers live on the parameters' device)")
    if config.co2_sync_warmup_steps > 0:  # docs/algorithm.md section 20, "Where it stops"
        conflicts.append(
            f"co2_sync_warmup_steps={config.co2_sync_warmup_steps} (after it each worker's moment is the "
            "averaged gradient's already, and a first exchange would divide its noise by the workers again)"
        )
    return f"is not built for {conflicts[0]}" if conflicts else _why_not_adam(optimizer)


def _unwrap(optimizer: Any) -> Any:
    """The optimizer inside wrappers' ``.optimizer`` (Accelerate's, the Trainer's)."""
    inner = optimizer
    while inner is not None and not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


def _why_not_adam(optimizer: Any) -> str | None:
    """Why the exchange cannot rescale ``optimizer``'s second moment (None: it can)."""
    inner = _unwrap(optimizer)
    if optimizer is None:
        return "needs the inner optimizer (CO2(..., optimizer=), torch.optim.Adam or AdamW)"
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return (
            "needs the inner optimizer to be torch.optim.Adam or AdamW (it rescales their exp_avg_sq), "
            f"got {type(optimizer).__name__}"
        )
    if any(group.get("amsgrad") for group in inner.param_groups):
        return "with amsgrad=True: allowed is amsgrad=False (max_exp_avg_sq is not rescaled)"
    if any(isinstance(p, DTensor) for p in _params(inner)):
        return "with DTensor parameters (FSDP2, tensor parallel): allowed is plain tensors"
    return None


def _params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class GlobalSecondMoment:
    """Every ``every`` rounds, this worker's Adam second moment becomes the averaged gradient's
    estimate (module docstring); ``round_ended`` after each round, ``finish`` at the end."""

    def __init__(
        self, optimizer: Any, comm: Communicator, *, every: int, timeout_s: float, wire_dtype: torch.dtype
    ) -> None:
        """``wire_dtype``: what the exchange travels as, the outer wire's (float32 or bfloat16)."""
        self.adam, self.comm, self.every, self.timeout_s = adam_of(optimizer), comm, every, timeout_s
        self.wire_dtype = wire_dtype
        self.params = _params(self.adam)
        self.edges = [0]
        for p in self.params:
            self.edges.append(self.edges[-1] + p.numel())
        device = self.params[0].device if self.params else torch.device("cpu")
        n, count = self.edges[-1], len(self.params)
        self.offset = torch.zeros(n, dtype=torch.float32, device=device)  # Adam's moment minus the own
        # Adam's step counts where Adam keeps them: on the host unless fused or capturable, so that
        # reading them is never a device read (they only scale tensors on the device)
        on_device = any(group.get("fused") or group.get("capturable") for group in self.adam.param_groups)
        self.step_device = device if on_device else torch.device("cpu")
        self.offset_step = torch.zeros(count, dtype=torch.float32, device=self.step_device)  # the offset's step
        self.pending: Pending | None = None
        self.received = False  # the pending sum has arrived (waited for at a checkpoint)
        self.own = torch.zeros(0, device=device)  # the own moment at the launch, while in flight
        self._waits: list[Seconds] = []  # how long each apply's wait held compute up, since the last pop
        self.launch_step = torch.zeros(0, device=self.step_device)

    # ------------------------------------------------------------------ the verbs

    @torch.no_grad()
    def round_ended(self, rounds: int) -> None:
        """After round ``rounds`` (1, 2, ...): apply the exchange launched a round ago, launch the next when due."""
        if self.pending is not None:
            self._apply()
        if rounds % self.every == 0:
            self._launch()

    @torch.no_grad()
    def finish(self) -> None:
        """The end of training: the exchange in flight applied now."""
        if self.pending is not None:
            self._apply()

    def restart(self) -> None:
        """This worker's Adam state was cleared (a quarantine: ``watch.py``): all of its moment is its
        own again, and the exchange in flight, still waited for, is not applied here."""
        self.offset.zero_()
        self.offset_step.zero_()
        self.launch_step.zero_()

    def drain(self) -> None:
        """Wait for the exchange in flight (a checkpoint keeps the sum, applied on schedule)."""
        if self.pending is not None and not self.received:
            self.comm.wait(self.pending, self.timeout_s)
            self.received = True

    def pop_wait_s(self) -> float | None:
        """Seconds the applies since the last call waited for their exchange (None: no apply waited);
        on CUDA tensors this waits for the device's events (logging steps only)."""
        waits, self._waits = self._waits, []
        return sum(w.get() for w in waits) if waits else None

    def nbytes(self) -> int:
        """Persistent bytes: the offset and its steps (an exchange in flight holds 3n + P more)."""
        return self.offset.numel() * 4 + self.offset_step.numel() * 4

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        self.drain()
        flight = None
        if self.pending is not None:
            flight = {"sum": self.pending.tensor, "own": self.own, "launch_step": self.launch_step}
        return {"offset": self.offset, "offset_step": self.offset_step, "in_flight": flight}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved["offset"].shape != self.offset.shape:
            raise ValueError(
                "the CO2 checkpoint's second-moment state does not match this optimizer "
                f"({saved['offset'].numel()} elements saved, {self.offset.numel()} now)"
            )
        self.offset.copy_(saved["offset"])
        self.offset_step.copy_(saved["offset_step"])
        flight = saved["in_flight"]
        self.pending, self.received = None, False
        if flight is not None:
            self.pending = Pending(flight["sum"].to(self.offset.device, copy=True))
            self.pending.mark_waited()
            self.received = True
            self.own = flight["own"].to(self.offset.device, copy=True)
            self.launch_step = flight["launch_step"].to(self.step_device, copy=True)

    # ------------------------------------------------------------------ the exchange

    def _launch(self) -> None:
        """Send [m / c1, u / c2, present] of every parameter (zeros where this worker has no state);
        the offset is brought to this step and the own moment kept for the apply."""
        n, count = self.edges[-1], len(self.params)
        buffer = torch.zeros(2 * n + count, dtype=torch.float32, device=self.offset.device)
        self.own = torch.zeros(n, dtype=torch.float32, device=self.offset.device)
        self.launch_step = torch.zeros(count, dtype=torch.float32, device=self.step_device)
        for i, (p, beta1, beta2) in enumerate(self._each()):
            state = self.adam.state.get(p, {})
            if "exp_avg_sq" not in state:
                continue
            lo, hi = self.edges[i], self.edges[i + 1]
            step = _step(state)
            offset = self._offset_now(i, step, beta2)
            own = (state["exp_avg_sq"].reshape(-1).float() - offset).clamp_(min=0)
            self.offset[lo:hi] = offset
            self.offset_step[i] = step
            self.own[lo:hi] = own
            self.launch_step[i] = step
            m, u = state["exp_avg"].reshape(-1).float() / (1 - beta1**step), own / (1 - beta2**step)
            # a non-finite worker (quarantined at this boundary) sends nothing for the parameter
            finite = torch.isfinite(m).all() & torch.isfinite(u).all()
            buffer[lo:hi] = torch.where(finite, m, 0.0)
            buffer[n + lo : n + hi] = torch.where(finite, u, 0.0)
            buffer[2 * n + i] = finite
        self.pending, self.received = self.comm.launch(buffer.to(self.wire_dtype)), False

    def _apply(self) -> None:
        """Adam's second moment <- the own one now + beta2^(steps since the launch) * (E - own at the
        launch), E the averaged gradient's estimate at the launch (module docstring)."""
        if not self.received:
            since = time.perf_counter()
            self.comm.wait(self.pending, self.timeout_s)
            self._waits.append(self.pending.wait_time(since))
        total, n = self.pending.tensor.float(), self.edges[-1]
        for i, (p, _, beta2) in enumerate(self._each()):
            state = self.adam.state.get(p, {})
            if "exp_avg_sq" not in state:  # no state (not trained yet, or cleared): nothing to rescale
                continue
            lo, hi, workers = self.edges[i], self.edges[i + 1], total[2 * n + i]
            step, launched = _step(state), self.launch_step[i]
            # some worker sent it, and this one did, with the state it has now (not cleared since)
            applies = (workers > 0) & (launched > 0)
            many = workers.clamp(min=1)
            m = total[lo:hi] / many
            u = total[n + lo : n + hi] / many
            noise = (u - m * m).clamp_(min=0)
            estimate = torch.minimum(m * m + noise / many, u) * (1 - beta2**launched)
            decay = beta2 ** (step - launched)
            offset_now = self._offset_now(i, step, beta2)
            exp_avg_sq = state["exp_avg_sq"]
            own_now = exp_avg_sq.reshape(-1).float() - offset_now
            new_offset = decay * (estimate - self.own[lo:hi])
            new = torch.where(applies, (own_now + new_offset).clamp_(min=0), exp_avg_sq.reshape(-1).float())
            exp_avg_sq.copy_(new.view_as(exp_avg_sq).to(exp_avg_sq.dtype))
            self.offset[lo:hi] = torch.where(applies, new_offset, offset_now)
            self.offset_step[i] = step
        self.pending, self.received = None, False
        self.own = self.own.new_zeros(0)  # held only while an exchange is in flight (the module docstring's memory)

    def _offset_now(self, i: int, step: Tensor, beta2: float) -> Tensor:
        """The offset brought from its step to ``step``: Adam's update only decays it, by beta2 per step."""
        lo, hi = self.edges[i], self.edges[i + 1]
        return beta2 ** (step - self.offset_step[i]) * self.offset[lo:hi]

    def _each(self):
        """(parameter, beta1, beta2) in the optimizer's order."""
        for group in self.adam.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                yield p, float(beta1), float(beta2)


def _step(state: dict[str, Any]) -> Tensor:
    """Adam's step count of one parameter, a float tensor where Adam keeps it (module docstring:
    never read on the host)."""
    step = state["step"]
    return step.float() if isinstance(step, Tensor) else torch.tensor(float(step))
