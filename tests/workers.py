"""Models, data and per-rank training loops shared by the engine tests and the reference."""

from __future__ import annotations

import torch
from tables import OUTER
from torch import nn

from co2_hf import CO2, CO2Config
from co2_hf.core.wire import header_numel

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


def train_local(model: nn.Module, co2: CO2, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    """``steps`` inner steps of rank 0's batches from step ``start``, each with CO2's gradient average
    and step (the loop of a single-process engine test)."""
    for step in range(start, start + steps):
        optimizer.zero_grad()
        loss_on(model, 0, step).backward()
        co2.average_gradients()
        optimizer.step()
        co2.step()


def make_optimizer(model: nn.Module, kind: str = "adam") -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.Adam(params, lr=0.02)


def snapshot(co2: CO2, names: list[str]) -> dict[str, torch.Tensor]:
    state = co2.anchor_state()
    return {n: state[n].detach().double().clone() for n in names}


# CO2Config()'s defaults before streaming fragments (the SPEC's): tests of the one-fragment engine's
# full-overlap mechanics pin them, so that they keep testing what their names say.
SPEC_DEFAULTS = dict(
    co2_fragments=1,
    co2_start_rule="anchor",
    co2_outer_momentum=0.2,
    co2_gap_penalty=1.0,
    co2_global_second_moment_every=0,
)


def _train_rounds(model, optimizer, co2: CO2, rank: int, steps: int, names: list[str]) -> list[dict]:
    """The engine's training loop on rank ``rank``'s batches: the anchor after every boundary and
    after ``finalize``."""
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
    return anchors


def train_engine(rank: int, world: int, cfg_kwargs: dict, steps: int, opt: str = "adam") -> dict:
    """Train TinyNet with the real engine; return the anchor after every boundary and at the end."""
    model = TinyNet(seed=rank)
    # the synchronised entries; the frozen layer and the integer BN counter stay per rank
    names = [n for n in model.state_dict() if not n.startswith("frozen.") and "num_batches" not in n]
    optimizer = make_optimizer(model, opt)
    co2 = CO2(model, CO2Config(**cfg_kwargs), optimizer=optimizer)
    anchors = _train_rounds(model, optimizer, co2, rank, steps, names)
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
        if ref.after_inner_step():  # a boundary just ran
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


# ---------------------------------------------------------------- worked example through the engine


class Pair(nn.Module):
    def __init__(self, init: tuple[float, float]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(init))


def worked_example(rank: int, world: int, cfg_kwargs: dict) -> list[tuple[list, list]]:
    """Feed the example's outer gradients to the engine (tau 1); anchor and m after each boundary."""
    model = Pair((1.0, -2.0) if rank == 0 else (7.0, 7.0))  # the broadcast from rank 0 fixes this
    co2 = CO2(model, CO2Config(co2_local_steps=1, **cfg_kwargs))
    rows = []
    for outer in OUTER:
        with torch.no_grad():
            model.w.sub_(torch.tensor(outer[rank]))  # as if local steps had moved it by d
        co2.step()
        rows.append((co2.anchor_state()["w"].tolist(), co2._momentum[:2].tolist()))
    co2.finalize()
    rows.append((co2.anchor_state()["w"].tolist(), co2._momentum[:2].tolist()))
    return rows


def ddp_versus_co2(rank: int, world: int, steps: int = 6) -> dict:
    """tau 1, no overlap, alpha 1, beta 0, SGD: CO2 should be DDP with SGD."""
    ddp_model = TinyNet(seed=0, batchnorm=False)
    ddp = nn.parallel.DistributedDataParallel(ddp_model)
    ddp_opt = make_optimizer(ddp_model, "sgd")
    model = TinyNet(seed=0, batchnorm=False)
    opt = make_optimizer(model, "sgd")
    co2 = CO2(model, CO2Config(co2_local_steps=1, co2_overlap=False, co2_outer_momentum=0.0))
    for step in range(steps):
        for m, o in ((ddp, ddp_opt), (model, opt)):
            o.zero_grad()
            loss_on(m, rank, step).backward()
            o.step()
        co2.step()
    return {"ddp": dict(ddp_model.named_parameters()), "co2": dict(model.named_parameters())}


def wire_dtypes(rank: int, world: int) -> dict:
    """The same short run with fp32 and bf16 on the (real gloo) wire."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = train_engine(rank, world, dict(co2_local_steps=2, co2_comm_dtype=dtype), 7)
    return out


# ---------------------------------------------------------------- stop and resume in fresh processes

RESUME_CFG = dict(co2_local_steps=4, co2_outer_momentum=0.5, co2_clip_threshold=1.0)
RESUME_STEPS, STOP_AT = 20, 10  # boundaries after steps 4 and 8: step 10 is mid-round, in flight


def _step(model, optimizer, co2, rank, step):
    optimizer.zero_grad()
    loss_on(model, rank, step).backward()
    optimizer.step()
    co2.step()


def _final(model: nn.Module, co2: CO2) -> dict:
    co2.finalize()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_then_stop(rank: int, world: int, save_path: str) -> dict:
    """An uninterrupted run, then a run stopped mid-round whose state is saved per rank."""
    model = TinyNet(seed=rank)
    optimizer = make_optimizer(model)
    co2 = CO2(model, CO2Config(**RESUME_CFG), optimizer=optimizer)
    for step in range(RESUME_STEPS):
        _step(model, optimizer, co2, rank, step)
        if step == 6 and rank == 0:
            co2.state_dict()  # one rank alone: state_dict issues no collective
    uninterrupted = _final(model, co2)

    model = TinyNet(seed=rank)
    optimizer = make_optimizer(model)
    co2 = CO2(model, CO2Config(**RESUME_CFG), optimizer=optimizer)
    for step in range(STOP_AT):
        _step(model, optimizer, co2, rank, step)
    assert co2._pending is not None, "the test must stop with an all-reduce in flight"
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "co2": co2.state_dict()},
        f"{save_path}.rank{rank}",
    )
    return uninterrupted


def resume(rank: int, world: int, save_path: str) -> dict:
    """Fresh processes: build everything anew (other init), load the rank's state, finish."""
    model = TinyNet(seed=100 + rank)
    optimizer = make_optimizer(model)
    co2 = CO2(model, CO2Config(**RESUME_CFG), optimizer=optimizer)
    saved = torch.load(f"{save_path}.rank{rank}", weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    co2.load_state_dict(saved["co2"])
    for step in range(STOP_AT, RESUME_STEPS):
        _step(model, optimizer, co2, rank, step)
    return _final(model, co2)


# ---------------------------------------------------------------- hierarchical workers (k processes each)


def assert_same_anchors(engine: list[dict], reference: list[dict], who: str, *, tol: float = 1e-5) -> None:
    """The engine's anchor after every boundary (and finalize) equals the reference's."""
    assert len(engine) == len(reference), who
    for boundary, (got, want) in enumerate(zip(engine, reference)):
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=tol, atol=tol, msg=f"{who} {boundary} {key}")


def union_loss(model: nn.Module, worker: int, step: int, k: int) -> torch.Tensor:
    """The loss of worker ``worker`` in the reference: the mean over its k processes' batches."""
    return sum(loss_on(model, worker * k + j, step) for j in range(k)) / k


def train_hierarchical(rank: int, world: int, cfg_kwargs: dict, steps: int) -> dict:
    """Every process trains on its own batch; gradients are averaged inside the worker."""
    model = TinyNet(seed=0, batchnorm=False)  # same frozen layer in every process of a worker
    names = [n for n in model.state_dict() if not n.startswith("frozen.")]
    optimizer = make_optimizer(model, "sgd")
    co2 = CO2(model, CO2Config(**cfg_kwargs), optimizer=optimizer)
    launched = []
    launch = co2.comm.launch
    co2.comm.launch = lambda t: launched.append(t.numel() * t.element_size()) or launch(t)
    anchors = _train_rounds(model, optimizer, co2, rank, steps, names)
    return {
        "anchors": anchors,
        "launched_bytes": launched,
        "shard_numel": co2.layout.shard_numel,
        "padded_numel": co2.layout.padded_numel,
        "header_slots": header_numel(co2.num_workers),
    }


def reference_hierarchical(
    workers: int, k: int, cfg_kwargs: dict, steps: int, warmup: int = 0, *, fsdp: bool = False
) -> list[dict]:
    """G workers of k processes in this process: each worker's loss is the mean over its
    processes' batches; the first ``warmup`` steps are data parallel over every batch. ``fsdp``:
    the processes shard like FSDP2 (which only matters for where fragments are cut)."""
    from reference import ReferenceCO2

    cfg = CO2Config(**{**cfg_kwargs, "co2_worker_size": 1})
    models = [TinyNet(seed=0, batchnorm=False) for _ in range(workers)]
    ref = ReferenceCO2(models, cfg, worker_size=k, fsdp=fsdp) if warmup == 0 else None
    optimizers = [make_optimizer(m, "sgd") for m in models]
    anchors = []
    for step in range(steps):
        for w, (model, optimizer) in enumerate(zip(models, optimizers)):
            optimizer.zero_grad()
            union_loss(model, w, step, k).backward()
        if step < warmup:
            _average_grads(models)
        for optimizer in optimizers:
            optimizer.step()
        if step < warmup:
            if step == warmup - 1:
                ref = ReferenceCO2(models, cfg, worker_size=k, fsdp=fsdp)  # the anchor is taken now
            continue
        if ref.after_inner_step():
            anchors.append({n: t.clone() for n, t in ref.anchor.items()})
    ref.finalize()
    anchors.append({n: t.clone() for n, t in ref.anchor.items()})
    return anchors


def outer_state_of_a_wide_model(rank: int, world: int) -> dict:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 255))
    co2 = CO2(model, CO2Config(**SPEC_DEFAULTS, co2_worker_size=2))
    params = sum(p.numel() for p in model.parameters())
    return {"nbytes": co2.outer_state_nbytes(), "params": params}


def train_steps(model, optimizer, co2: CO2, rank: int, start: int, stop: int) -> None:
    """Steps ``start .. stop - 1`` on rank ``rank``'s batches, gradients averaged inside a worker."""
    for step in range(start, stop):
        optimizer.zero_grad()
        loss_on(model, rank, step).backward()
        co2.average_gradients()
        optimizer.step()
        co2.step()


def hierarchical_stop(rank: int, world: int, cfg_kwargs: dict, path: str) -> dict:
    """Uninterrupted 14 steps; then a run stopped at step 6 (mid-round, in flight), saved per rank."""

    def fresh(seed):
        model = TinyNet(seed=seed, batchnorm=False)
        optimizer = make_optimizer(model)
        return model, optimizer, CO2(model, CO2Config(**cfg_kwargs), optimizer=optimizer)

    def train(model, optimizer, co2, start, stop):
        train_steps(model, optimizer, co2, rank, start, stop)

    model, optimizer, co2 = fresh(0)
    train(model, optimizer, co2, 0, 14)
    co2.finalize()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer, co2 = fresh(0)
    train(model, optimizer, co2, 0, 6)
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "co2": co2.state_dict()},
        f"{path}.rank{rank}",
    )
    return full


def hierarchical_resume(rank: int, world: int, cfg_kwargs: dict, path: str) -> dict:
    model = TinyNet(seed=0, batchnorm=False)
    optimizer = make_optimizer(model)
    co2 = CO2(model, CO2Config(**cfg_kwargs), optimizer=optimizer)
    saved = torch.load(f"{path}.rank{rank}", weights_only=False)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    co2.load_state_dict(saved["co2"])
    train_steps(model, optimizer, co2, rank, 6, 14)
    co2.finalize()
    return {k: v.clone() for k, v in model.state_dict().items()}


def sim_task(evaluate=lambda model, params: 0.0):
    """TinyNet on worker w's batch of step s, as a task of the simulation harness (scripts/sim.py)."""
    from scripts.sim import Task

    return Task(
        build_model=lambda seed: TinyNet(seed=seed),
        build_optimizer=make_optimizer,
        batch=lambda worker, step: (worker, step),
        loss=lambda model, ws: loss_on(model, *ws),
        evaluate=evaluate,
    )
