"""Models, data and per-rank training loops shared by the engine tests and the reference."""

from __future__ import annotations

import torch
from torch import nn

from co2_hf import CO2, CO2Config

VOCAB, DIM = 16, 8


class TinyNet(nn.Module):
    """Tied embedding/output, a frozen layer and BatchNorm: every kind of tensor CO2 handles."""

    def __init__(self, seed: int, batchnorm: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(DIM, DIM, bias=not batchnorm)  # a bias before BN has ~0 gradient
        self.norm = nn.BatchNorm1d(DIM) if batchnorm else nn.Identity()
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.emb(tokens).mean(1))
        return self.out(self.norm(torch.relu(self.hidden(h))))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (16, 4), generator=g)
    return tokens, (tokens.sum(1) % VOCAB)


def loss_on(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    tokens, target = batch(rank, step)
    return nn.functional.cross_entropy(model(tokens), target)


def make_optimizer(model: nn.Module, kind: str = "adam") -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.Adam(params, lr=0.02)


def snapshot(co2: CO2, names: list[str]) -> dict[str, torch.Tensor]:
    state = co2.anchor_state()
    return {n: state[n].detach().double().clone() for n in names}


def train_engine(rank: int, world: int, cfg_kwargs: dict, steps: int, opt: str = "adam") -> dict:
    """Train TinyNet with the real engine; return the anchor after every boundary and at the end."""
    model = TinyNet(seed=rank)
    # the synchronised entries; the frozen layer and the integer BN counter stay per rank
    names = [n for n in model.state_dict() if not n.startswith("frozen.") and "num_batches" not in n]
    optimizer = make_optimizer(model, opt)
    co2 = CO2(model, CO2Config(**cfg_kwargs), optimizer=optimizer)
    anchors = []
    for step in range(steps):
        optimizer.zero_grad()
        loss_on(model, rank, step).backward()
        co2.average_gradients()
        optimizer.step()
        if co2.step():
            anchors.append(snapshot(co2, names))
    co2.finalize()
    anchors.append(snapshot(co2, names))
    live = {n: t.detach().double().clone() for n, t in model.state_dict().items()}
    return {"anchors": anchors, "live": live, "metrics": co2.pop_metrics()}


def train_reference(world: int, cfg_kwargs: dict, steps: int, opt: str = "adam") -> dict:
    """The same training, G workers in this process, through tests/reference.py."""
    from reference import ReferenceCO2

    cfg = CO2Config(**cfg_kwargs)
    models = [TinyNet(seed=r) for r in range(world)]
    ref = ReferenceCO2(models, cfg)
    optimizers = [make_optimizer(m, opt) for m in models]
    warmup = cfg.co2_sync_warmup_steps
    anchors = []
    for step in range(steps):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            optimizer.zero_grad()
            loss_on(model, rank, step).backward()
        if step < warmup:  # data parallel: every worker applies the mean gradient
            _average_grads(models)
        for optimizer in optimizers:
            optimizer.step()
        if step < warmup:
            if step == warmup - 1:
                ref = ReferenceCO2(models, cfg)  # the anchor is taken now, from worker 0
            continue
        ref.after_inner_step()
        if ref.steps_in_round == 0:  # a boundary just ran
            anchors.append({n: t.clone() for n, t in ref.anchor.items()})
    ref.finalize()
    anchors.append({n: t.clone() for n, t in ref.anchor.items()})
    return {"anchors": anchors}


def _average_grads(models: list[nn.Module]) -> None:
    params = [[p for p in m.parameters() if p.requires_grad] for m in models]
    for group in zip(*params):
        mean = sum(p.grad for p in group) / len(group)
        for p in group:
            p.grad.copy_(mean)
