"""A naive CO2: G workers simulated in one process with plain per-tensor math.

Written from the algorithm's definition (docs/algorithm.md), independently of the engine: no flat
buffers, no chunks, no one-buffer ordering, just dicts of tensors named like ``state_dict`` keys.
Tests run the real multi-process engine and this reference on the same models and data and compare.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from co2_hf.config import CO2Config


def synchronised(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trainable parameters, persistent float buffers), one name per tensor."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    keys = model.state_dict(keep_vars=True).keys()
    buffers = {n: b for n, b in model.named_buffers() if b.is_floating_point() and n in keys}
    return params, buffers


class ReferenceCO2:
    def __init__(self, models: list[nn.Module], cfg: CO2Config) -> None:
        self.models, self.cfg = models, cfg
        params, buffers = synchronised(models[0])
        with torch.no_grad():  # every worker starts from worker 0's synchronised values
            for other in models[1:]:
                for name, tensor in {**synchronised(other)[0], **synchronised(other)[1]}.items():
                    tensor.copy_({**params, **buffers}[name])
        self.anchor = {n: t.detach().double().clone() for n, t in {**params, **buffers}.items()}
        self.momentum = {n: torch.zeros_like(self.anchor[n]) for n in params}
        self.own = [{n: torch.zeros_like(self.anchor[n]) for n in params} for _ in models]
        self.pending = None  # (mean outer gradient, mean buffer values) sent one boundary ago
        self.steps_in_round = 0
        # where each worker's current round started (the partial-overlap window shifts from it)
        self.start = [{n: self.anchor[n].clone() for n in params} for _ in models]
        self.penalties: list[dict[str, torch.Tensor]] = []

    # the outer update, exactly as defined
    def apply(self, d_mean: dict, buf_mean: dict, stale: bool) -> None:
        c = self.cfg
        alpha, beta, lam = c.co2_outer_lr, c.co2_outer_momentum, c.co2_gap_penalty
        penalty = {}
        for name, d in d_mean.items():
            if stale and lam > 0 and c.co2_gap_penalty_mode == "gap_aware":
                u = alpha * self.momentum[name]
                g = u.abs() / (d.abs().mean() + 1e-12)
                penalty[name] = 1.0 / torch.clamp(lam * g, min=1.0)
            elif stale and lam > 0:
                penalty[name] = torch.full_like(d, 1.0 / max(1.0, lam))
            else:
                penalty[name] = torch.ones_like(d)
        self.penalties.append(penalty)
        for name, d in d_mean.items():
            self.momentum[name] = beta * self.momentum[name] + penalty[name] * d
        norm = math.sqrt(sum(float((m**2).sum()) for m in self.momentum.values()))
        if c.co2_clip_threshold is not None and norm > c.co2_clip_threshold:
            for name in self.momentum:
                self.momentum[name] = self.momentum[name] * (c.co2_clip_threshold / norm)
        for name, d in d_mean.items():
            if c.co2_nesterov:
                v = beta * self.momentum[name] + penalty[name] * d
            else:
                v = self.momentum[name]
            self.anchor[name] = self.anchor[name] - alpha * v
        for name, value in buf_mean.items():
            self.anchor[name] = value.clone()

    def after_inner_step(self) -> None:
        self.steps_in_round += 1
        if self.steps_in_round == self.cfg.co2_local_steps:
            self.boundary()
        elif self.steps_in_round == self.cfg.co2_overlap_steps and self.pending is not None:
            self.apply_in_round()

    def apply_in_round(self) -> None:
        """Partial overlap: the average of the last round arrives k steps into this one. The anchor
        has not moved since its base, so nothing is stale (P = 1); every local model is moved by
        (new anchor - where its round started), keeping the k steps it took since."""
        self.apply(*self.pending, stale=False)
        self.pending = None
        with torch.no_grad():
            for i, model in enumerate(self.models):
                params, bufs = synchronised(model)
                for name, p in params.items():
                    p.add_(self.anchor[name] - self.start[i][name])
                    self.start[i][name] = self.anchor[name].clone()
                for name, b in bufs.items():
                    b.copy_(self.anchor[name])
            self.own = [{n: torch.zeros_like(t) for n, t in own.items()} for own in self.own]

    def boundary(self) -> None:
        self.steps_in_round = 0
        eager = self.cfg.co2_overlap and self.cfg.co2_start_rule == "eager"
        lookahead = self.cfg.co2_overlap and self.cfg.co2_start_rule == "lookahead"
        outer = []
        for i, model in enumerate(self.models):
            params, _ = synchronised(model)
            outer.append({n: self.anchor[n] - self.own[i][n] - p.detach().double() for n, p in params.items()})
        sent = (
            _mean(outer),
            _mean([{n: b.detach().double() for n, b in synchronised(m)[1].items()} for m in self.models]),
        )
        if not self.cfg.co2_overlap:
            self.apply(*sent, stale=False)
            self.reset(buffers=True)
            return
        received, self.pending = self.pending, sent
        before = {n: t.clone() for n, t in self.anchor.items()}
        if received is not None:
            self.apply(*received, stale=True)
        if eager:  # start at a - gamma d - (1 - gamma) (the anchor's last move)
            gamma = self.cfg.co2_eager_weight
            self.own = [{n: gamma * d[n] + (1 - gamma) * (before[n] - self.anchor[n]) for n in d} for d in outer]
        if lookahead:  # start where the anchor would be if the in-flight average were d
            self.own = [{n: self.predicted_move(n, d[n]) for n in d} for d in outer]
        self.reset(buffers=received is not None)
        if self.cfg.co2_overlap_steps is not None:  # the next round starts where the reset put it
            self.start = [
                {n: (self.anchor[n] - self.own[i][n]).clone() for n in self.anchor if n in self.own[i]}
                for i in range(len(self.models))
            ]

    def predicted_move(self, name: str, d: torch.Tensor) -> torch.Tensor:
        """alpha times the step the next boundary applies when its average is d (no penalty, no clip)."""
        beta = self.cfg.co2_outer_momentum
        m = beta * self.momentum[name] + d
        step = beta * m + d if self.cfg.co2_nesterov else m
        return self.cfg.co2_outer_lr * step

    def finalize(self) -> None:
        if self.steps_in_round:
            self.boundary()
        if self.pending is not None:  # with a window, nothing had moved the anchor since: not stale
            self.apply(*self.pending, stale=self.cfg.co2_overlap_steps is None)
            self.pending = None
        self.own = [{n: torch.zeros_like(t) for n, t in own.items()} for own in self.own]
        self.reset(buffers=True)

    def reset(self, *, buffers: bool) -> None:
        with torch.no_grad():
            for i, model in enumerate(self.models):
                params, bufs = synchronised(model)
                for name, p in params.items():
                    p.copy_(self.anchor[name] - self.own[i][name])
                if buffers:
                    for name, b in bufs.items():
                        b.copy_(self.anchor[name])


def _mean(dicts: list[dict]) -> dict:
    return {n: sum(d[n] for d in dicts) / len(dicts) for n in dicts[0]}
