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


def fragment_masks(
    model: nn.Module, fragments: int, worker_size: int, *, fsdp: bool = False
) -> list[dict[str, torch.Tensor]]:
    """Per fragment, which elements of each synchronised tensor belong to it (docs/algorithm.md,
    section 7b). Each process of a worker holds a flat shard of ``S`` elements, cut into
    ``fragments`` equal slices (``edges[f] = f * S // F``); fragment f is slice f of every shard.
    The shards: the tensors laid end to end (parameters, then buffers), padded to a multiple of the
    worker size and cut into equal parts; or, under FSDP2 (``fsdp``), each process's dim-0 chunk of
    every tensor, end to end."""
    params, buffers = synchronised(model)
    tensors = {**params, **buffers}
    if fsdp:
        local = {n: _fsdp_positions(t, worker_size) for n, t in tensors.items()}  # (rank, local index)
        sizes = [0] * worker_size
        for rank, index in local.values():
            index += torch.tensor(sizes)[rank]
            for j in range(worker_size):
                sizes[j] += int((rank == j).sum())
        owner = {n: _slice_of(index, torch.tensor(sizes)[rank], fragments) for n, (rank, index) in local.items()}
    else:
        total = sum(t.numel() for t in tensors.values())
        shard = -(-total // worker_size)
        flat = _slice_of(torch.arange(total) % shard, torch.full((total,), shard), fragments)
        owner, offset = {}, 0
        for name, tensor in tensors.items():
            owner[name] = flat[offset : offset + tensor.numel()].view(tensor.shape)
            offset += tensor.numel()
    return [{n: owner[n] == f for n in tensors} for f in range(fragments)]


def _slice_of(position: torch.Tensor, shard_size: torch.Tensor, fragments: int) -> torch.Tensor:
    """The fragment of each element at ``position`` in a shard of ``shard_size`` elements: the
    largest f with ``f * S // F <= position``."""
    f = torch.zeros_like(position)
    for candidate in range(1, fragments):
        f = torch.where(candidate * shard_size // fragments <= position, candidate, f)
    return f


def _fsdp_positions(tensor: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FSDP2's Shard(0): rows ``[j c, (j + 1) c)`` with ``c = ceil(rows / k)`` live on process j.
    Per element: its process, and its index in that process's local chunk."""
    rows = tensor.shape[0]
    c = -(-rows // k)
    per_row = tensor[0].numel() if tensor.dim() else 1
    row = torch.arange(tensor.numel()) // per_row
    rank = row // c
    index = torch.arange(tensor.numel()) - rank * c * per_row
    return rank.view(tensor.shape), index.view(tensor.shape)


class ReferenceCO2:
    def __init__(
        self, models: list[nn.Module], cfg: CO2Config, *, worker_size: int | None = None, fsdp: bool = False
    ) -> None:
        self.models, self.cfg = models, cfg
        params, buffers = synchronised(models[0])
        with torch.no_grad():  # every worker starts from worker 0's synchronised values
            for other in models[1:]:
                for name, tensor in {**synchronised(other)[0], **synchronised(other)[1]}.items():
                    tensor.copy_({**params, **buffers}[name])
        self.anchor = {n: t.detach().double().clone() for n, t in {**params, **buffers}.items()}
        self.momentum = {n: torch.zeros_like(self.anchor[n]) for n in params}
        self.own = [{n: torch.zeros_like(self.anchor[n]) for n in params} for _ in models]
        F = cfg.fragments
        self.masks = fragment_masks(models[0], F, worker_size or cfg.co2_worker_size, fsdp=fsdp)
        total = sum(t.numel() for t in params.values())
        # each fragment's momentum is clipped to phi * sqrt(its share of the parameters)
        self.clip_share = [sum(int(m[n].sum()) for n in params) / total for m in self.masks]
        self.pending = [None] * F  # per fragment: (mean outer gradient, mean buffer values) in flight
        self.since = [0] * F  # inner steps since each fragment's last boundary
        self.steps_in_round = 0
        # where each worker's current round started (the in-round apply shifts from it)
        self.start = [{n: self.anchor[n].clone() for n in params} for _ in models]
        self.penalties: list[dict[str, torch.Tensor]] = []

    def window(self) -> int | None:
        """Steps from a launch to the in-round apply (None: at the next boundary)."""
        c = self.cfg
        return c.co2_local_steps // c.fragments if c.fragments > 1 else c.co2_overlap_steps

    # the outer update, exactly as defined, on fragment f's elements
    def apply(self, d_mean: dict, buf_mean: dict, stale: bool, f: int = 0) -> None:
        c, mask = self.cfg, self.masks[f]
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
            new = beta * self.momentum[name] + penalty[name] * d
            self.momentum[name] = torch.where(mask[name], new, self.momentum[name])
        norm = math.sqrt(sum(float((m[mask[n]] ** 2).sum()) for n, m in self.momentum.items()))
        if c.co2_clip_threshold is not None:
            phi = c.co2_clip_threshold * math.sqrt(self.clip_share[f])
            if norm > phi:
                for name in self.momentum:
                    scaled = self.momentum[name] * (phi / norm)
                    self.momentum[name] = torch.where(mask[name], scaled, self.momentum[name])
        for name, d in d_mean.items():
            if c.co2_nesterov:
                v = beta * self.momentum[name] + penalty[name] * d
            else:
                v = self.momentum[name]
            self.anchor[name] = torch.where(mask[name], self.anchor[name] - alpha * v, self.anchor[name])
        for name, value in buf_mean.items():
            self.anchor[name] = torch.where(mask[name], value, self.anchor[name])

    def after_inner_step(self) -> bool:
        """Count one inner step and run what is due; True when a (fragment's) boundary ran."""
        self.steps_in_round += 1
        self.since = [n + 1 for n in self.since]
        tau, F, k = self.cfg.co2_local_steps, self.cfg.fragments, self.window()
        ran = False
        if F == 1:
            if self.steps_in_round == k and self.pending[0] is not None:
                self.apply_in_round(0)
            if self.steps_in_round == tau:
                self.boundary(0)
                ran = True
        elif self.steps_in_round % k == 0:
            j = self.steps_in_round // k  # fragment j - 1 ends its round; the one before it applies
            if self.pending[(j - 2) % F] is not None:
                self.apply_in_round((j - 2) % F)
            self.boundary(j - 1)
            ran = True
        if self.steps_in_round == tau:
            self.steps_in_round = 0
        return ran

    def apply_in_round(self, f: int) -> None:
        """The average of fragment f's last round arrives k steps after its launch. The anchor has
        not moved since its base, so nothing is stale (P = 1); every local model's fragment is
        moved by (new anchor - where its round started), keeping the k steps it took since."""
        mask = self.masks[f]
        self.apply(*self.pending[f], stale=False, f=f)
        self.pending[f] = None
        with torch.no_grad():
            for i, model in enumerate(self.models):
                params, bufs = synchronised(model)
                for name, p in params.items():
                    moved = p.detach().double() + (self.anchor[name] - self.start[i][name])
                    p.copy_(torch.where(mask[name], moved, p.detach().double()))
                    self.start[i][name] = torch.where(mask[name], self.anchor[name], self.start[i][name])
                    self.own[i][name] = torch.where(mask[name], 0.0, self.own[i][name])
                for name, b in bufs.items():
                    b.copy_(torch.where(mask[name], self.anchor[name], b.double()))

    def boundary(self, f: int = 0) -> None:
        mask = self.masks[f]
        self.since[f] = 0
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
            self.apply(*sent, stale=False, f=f)
            self.reset(f, buffers=True)
            return
        received, self.pending[f] = self.pending[f], sent
        before = {n: t.clone() for n, t in self.anchor.items()}
        if received is not None:  # a fragment's slice has not moved since its base: never stale
            self.apply(*received, stale=self.cfg.fragments == 1, f=f)
        new_own = None
        if eager:  # start at a - gamma d - (1 - gamma) (the anchor's last move)
            gamma = self.cfg.co2_eager_weight
            new_own = [{n: gamma * d[n] + (1 - gamma) * (before[n] - self.anchor[n]) for n in d} for d in outer]
        if lookahead:  # start where the anchor would be if the in-flight average were d
            new_own = [{n: self.predicted_move(n, d[n]) for n in d} for d in outer]
        if new_own is not None:
            self.own = [{n: torch.where(mask[n], new[n], own[n]) for n in own} for own, new in zip(self.own, new_own)]
        self.reset(f, buffers=received is not None)
        if self.window() is not None:  # the next round starts where the reset put it
            for i in range(len(self.models)):
                for n in self.own[i]:
                    self.start[i][n] = torch.where(mask[n], self.anchor[n] - self.own[i][n], self.start[i][n])

    def predicted_move(self, name: str, d: torch.Tensor) -> torch.Tensor:
        """alpha times the step the next boundary applies when its average is d (no penalty, no clip)."""
        beta = self.cfg.co2_outer_momentum
        m = beta * self.momentum[name] + d
        step = beta * m + d if self.cfg.co2_nesterov else m
        return self.cfg.co2_outer_lr * step

    def finalize(self) -> None:
        for f in range(self.cfg.fragments):
            if self.since[f]:
                self.boundary(f)
        for f, pending in enumerate(self.pending):
            if pending is not None:  # with a window, nothing had moved the anchor since: not stale
                self.apply(*pending, stale=self.window() is None, f=f)
                self.pending[f] = None
        self.own = [{n: torch.zeros_like(t) for n, t in own.items()} for own in self.own]
        for f in range(self.cfg.fragments):
            self.reset(f, buffers=True)

    def reset(self, f: int, *, buffers: bool) -> None:
        mask = self.masks[f]
        with torch.no_grad():
            for i, model in enumerate(self.models):
                params, bufs = synchronised(model)
                for name, p in params.items():
                    p.copy_(torch.where(mask[name], self.anchor[name] - self.own[i][name], p.detach().double()))
                if buffers:
                    for name, b in bufs.items():
                        b.copy_(torch.where(mask[name], self.anchor[name], b.double()))


def _mean(dicts: list[dict]) -> dict:
    return {n: sum(d[n] for d in dicts) / len(dicts) for n in dicts[0]}


class ReferenceSecondMoment:
    """``co2_global_second_moment_every`` as defined (docs/algorithm.md, "The inner second moment"),
    naively and in float64, from each worker's gradients: every worker's *own* second moment is kept
    here directly (u <- beta2 u + (1 - beta2) g^2 at each Adam step), never taken from Adam's state,
    so the engine's offset bookkeeping is checked, not repeated.

    Call ``adam_step(grads)`` after each Adam step with every worker's gradients (name -> tensor), and
    ``expected(...)`` at a round end: each worker's Adam second moment after the engine's apply."""

    def __init__(self, workers: int, beta1: float, beta2: float) -> None:
        self.workers, self.beta1, self.beta2 = workers, beta1, beta2
        self.own: list[dict[str, torch.Tensor]] = [{} for _ in range(workers)]
        self.steps = 0
        self.sent = None  # (step, [(m_hat, u_hat, u_own) per worker]) of the exchange in flight

    def adam_step(self, grads: list[dict[str, torch.Tensor]]) -> None:
        self.steps += 1
        for own, worker_grads in zip(self.own, grads):
            for name, g in worker_grads.items():
                g = g.double()
                own[name] = self.beta2 * own.get(name, torch.zeros_like(g)) + (1 - self.beta2) * g * g

    def launch(self, exp_avg: list[dict[str, torch.Tensor]]) -> None:
        """At a launching round end: the workers' first moments (Adam's ``exp_avg``) and their own second."""
        t = self.steps
        c1, c2 = 1 - self.beta1**t, 1 - self.beta2**t
        self.sent = (
            t,
            [
                (
                    {n: m.double() / c1 for n, m in ms.items()},
                    {n: u / c2 for n, u in own.items()},
                    {n: u.clone() for n, u in own.items()},
                )
                for ms, own in zip(exp_avg, self.own)
            ],
        )

    def expected(self) -> list[dict[str, torch.Tensor]]:
        """Each worker's Adam second moment after the apply, one round after `launch`: its own now plus
        beta2^(steps since) * (the averaged gradient's estimate at the launch - its own then)."""
        t0, sent = self.sent
        W, c2 = self.workers, 1 - self.beta2**t0
        decay = self.beta2 ** (self.steps - t0)
        result = []
        for w in range(W):
            moments = {}
            for name in sent[0][0]:
                m = sum(s[0][name] for s in sent) / W
                u = sum(s[1][name] for s in sent) / W
                noise = torch.clamp(u - m * m, min=0)
                estimate = torch.minimum(m * m + noise / W, u) * c2
                moments[name] = self.own[w][name] + decay * (estimate - sent[w][2][name])
            result.append(moments)
        self.sent = None
        return result
