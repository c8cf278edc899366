"""``co2_global_second_moment_every`` (core/moments.py): the engine's exchange against the naive
reference (tests/reference.py) at every apply, resume bit for bit with the exchange in flight, a
cleared optimizer, and what it refuses, by name, before anything starts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from reference import ReferenceSecondMoment
from simulated import Workers, clone
from workers import SPEC_DEFAULTS, TinyNet, loss_on

from co2_hf import CO2Config
from co2_hf.core import CO2
from co2_hf.core.moments import GlobalSecondMoment
from co2_hf.testing import SimulatedNetwork

pytestmark = pytest.mark.timeout(60)

TAU, WORKERS = 3, 3


def _config(**knobs) -> CO2Config:
    return CO2Config(**{**SPEC_DEFAULTS, "co2_local_steps": TAU, "co2_global_second_moment_every": 1, **knobs})


def _named(model: torch.nn.Module) -> dict[torch.Tensor, str]:
    return {p: name for name, p in model.named_parameters() if p.requires_grad}


def _train_with_reference(workers: Workers, steps: int, every: int, rtol: float = 1e-4) -> int:
    """Train ``steps`` steps; at every apply, compare each worker's Adam second moment with the
    reference's. Returns how many applies were compared."""
    beta1, beta2 = workers.optimizers[0].param_groups[0]["betas"]
    reference = ReferenceSecondMoment(WORKERS, beta1, beta2)
    names = [_named(m) for m in workers.models]
    compared = 0
    for step in range(steps):
        grads = []
        for i, (model, optimizer) in enumerate(zip(workers.models, workers.optimizers)):
            optimizer.zero_grad()
            loss_on(model, i, step).backward()
            grads.append({names[i][p]: p.grad.clone() for p in names[i]})
            optimizer.step()
        reference.adam_step(grads)
        workers._each(lambda i: workers.engines[i].step())
        if (step + 1) % TAU:
            continue
        rounds = (step + 1) // TAU
        if reference.sent is not None:
            for i, expected in enumerate(reference.expected()):
                state = workers.optimizers[i].state
                for p, name in names[i].items():
                    torch.testing.assert_close(state[p]["exp_avg_sq"].double(), expected[name], rtol=rtol, atol=1e-9)
            compared += 1
        if rounds % every == 0:
            optimizers = enumerate(workers.optimizers)
            reference.launch([{names[i][p]: o.state[p]["exp_avg"] for p in names[i]} for i, o in optimizers])
    return compared


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("fragments", [1, TAU], ids=["whole", "streaming"])
def test_engine_matches_the_reference(every: int, fragments: int) -> None:
    workers = Workers(_config(co2_global_second_moment_every=every, co2_fragments=fragments), WORKERS)
    # 8 rounds: launches after rounds every, 2 every, ...; each applied one round later
    assert _train_with_reference(workers, 8 * TAU, every) == (7 if every == 1 else 3)


def test_its_wait_is_reported_at_logging_steps() -> None:
    """co2/second_moment_wait_s: how long the applies since the last log waited for the exchange."""
    workers = Workers(_config(), WORKERS)
    workers.train(0, 3 * TAU)  # two applies
    first = workers.engines[0].pop_metrics()
    assert first["co2/second_moment_wait_s"] >= 0
    assert "co2/second_moment_wait_s" not in workers.engines[0].pop_metrics()  # none since


def test_a_bfloat16_wire_sends_the_moments_in_bfloat16() -> None:
    """With co2_comm_dtype='bfloat16' the exchange travels as bf16 (half the bytes): the reference
    holds to bf16's precision (8 bits: 2^-8 relative, summed over three workers)."""
    workers = Workers(_config(co2_comm_dtype="bfloat16"), WORKERS)
    workers.train(0, TAU)
    assert workers.engines[0]._moments.pending.tensor.dtype == torch.bfloat16
    workers = Workers(_config(co2_comm_dtype="bfloat16"), WORKERS)
    assert _train_with_reference(workers, 4 * TAU, 1, rtol=2e-2) == 3


def test_the_estimate_is_below_the_own_moment_and_changes_training() -> None:
    """Averaging W workers divides the noise: the estimate is at most the workers' mean own moment, and
    smaller somewhere (their gradients differ), so the run differs from the one without it."""
    on, off = Workers(_config(), WORKERS), Workers(_config(co2_global_second_moment_every=0), WORKERS)
    on.train(0, 4 * TAU)
    off.train(0, 4 * TAU)
    # each worker's offset (Adam's moment minus its own) is decay * (estimate - own at the launch): their
    # mean over the workers, set at the same step, is decay * (estimate - mean own) <= 0
    mean_offset = torch.stack([e._moments.offset for e in on.engines]).mean(0)
    assert float(mean_offset.max()) <= 1e-9 and float(mean_offset.min()) < 0
    assert not torch.equal(on.finish()[0]["hidden.weight"], off.finish()[0]["hidden.weight"])


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
@pytest.mark.parametrize("stop", [TAU, 2 * TAU + 1], ids=["in_flight", "mid_round"])
def test_resume_is_bit_for_bit(stop: int, wire: str) -> None:
    """Saved with the exchange in flight (at a round's end) or a step into the next round, rebuilt,
    and trained on: the same bits as the run that never stopped, Adam's state included."""
    config = _config(co2_fragments=TAU, co2_comm_dtype=wire)
    straight = Workers(config, WORKERS)
    straight.train(0, 5 * TAU)
    first = Workers(config, WORKERS)
    first.train(0, stop)
    saved = first.save()
    assert saved[0]["co2"]["second_moment"]["in_flight"] is not None
    again = Workers(config, WORKERS, saved=saved)
    again.train(stop, 5 * TAU)
    for a, b in zip(straight.optimizers, again.optimizers):
        for pa, pb in zip(a.state.values(), b.state.values()):
            assert torch.equal(pa["exp_avg_sq"], pb["exp_avg_sq"])
    for a, b in zip(straight.finish(), again.finish()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_quarantined_worker_sends_nothing_and_starts_its_own_moment_again(caplog) -> None:
    """A worker turned NaN sends no moments (the others' stay finite), is quarantined (its Adam state
    cleared), skips the apply of the exchange in flight and starts its offset at 0: its moment is
    its own until the next exchange."""
    workers = Workers(_config(), WORKERS)
    workers.train(0, 2 * TAU, poison=(1, TAU + 1))  # round 2's boundary finds worker 1 non-finite
    assert "worker 1 has a non-finite outer gradient" in caplog.text
    assert not workers.optimizers[1].state
    moments = [e._moments for e in workers.engines]
    assert torch.equal(moments[1].offset, torch.zeros_like(moments[1].offset))
    assert torch.isfinite(moments[0].pending.tensor).all()  # launched at round 2's end without worker 1
    workers.train(2 * TAU, 5 * TAU)
    assert all(torch.isfinite(s["exp_avg_sq"]).all() for o in workers.optimizers for s in o.state.values())
    assert all(torch.isfinite(m["hidden.weight"]).all() for m in workers.finish())


@pytest.mark.parametrize(
    "knobs, named",
    [
        (dict(co2_comm_dtype="int8"), "co2_comm_dtype"),
        (dict(co2_comm_dtype="sparse"), "co2_comm_dtype"),
        (dict(co2_worker_size=2), "co2_worker_size"),
        (dict(co2_fault_tolerance="torchft"), "co2_fault_tolerance"),
        (dict(co2_global_second_moment_every=-1), "an integer >= 0"),
        (dict(co2_global_second_moment_every=True), "an integer >= 0"),
        (dict(co2_global_second_moment_every=10**5), "<= 10000"),
    ],
)
def test_refused_combinations_name_the_flags(knobs: dict, named: str) -> None:
    with pytest.raises(ValueError, match="co2_global_second_moment_every") as error:
        CO2Config(**{"co2_global_second_moment_every": 2, **knobs})
    assert named in str(error.value)


def test_bfloat16_wire_and_elastic_resume_are_allowed() -> None:
    """Elastic: on another world re-sharding starts the exchange's state afresh (test_reshard.py)."""
    assert CO2Config(co2_global_second_moment_every=2, co2_comm_dtype="bfloat16").co2_global_second_moment_every == 2
    assert CO2Config(co2_global_second_moment_every=2, co2_elastic=True).co2_global_second_moment_every == 2


# ---------------------------------------------------------------- the default: K = 4 where it applies


def _default(**knobs) -> CO2Config:
    """The library's defaults at TAU, the setting left unset."""
    return CO2Config(co2_local_steps=TAU, **knobs)


def test_unset_is_every_4_rounds_with_adamw_and_says_nothing(caplog) -> None:
    """Unset with AdamW on several workers: K = 4, recorded as 4 (what checkpoints and
    co2_config.json say), the same bits as K = 4 set by hand; no WARNING."""
    with caplog.at_level("WARNING", logger="co2_hf"):
        unset = Workers(_default(), WORKERS)
    assert not caplog.records
    assert all(e.config.co2_global_second_moment_every == 4 for e in unset.engines)
    assert unset.engines[0].state_dict()["config"]["co2_global_second_moment_every"] == 4
    by_hand = Workers(_default(co2_global_second_moment_every=4), WORKERS)
    unset.train(0, 6 * TAU)
    by_hand.train(0, 6 * TAU)
    off = Workers(_default(co2_global_second_moment_every=0), WORKERS)
    off.train(0, 6 * TAU)
    first, again, without = unset.finish(), by_hand.finish(), off.finish()
    assert all(torch.equal(first[0][k], again[0][k]) for k in first[0])
    assert not all(torch.equal(first[0][k], without[0][k]) for k in first[0])


def _engines(config: CO2Config, make, workers: int = 2) -> list[CO2]:
    """One engine per simulated worker, built together (construction is collective), each around its
    own model and ``make(model)``'s optimizer."""
    network = SimulatedNetwork(workers)
    models = [TinyNet(seed=0) for _ in range(workers)]
    with ThreadPoolExecutor(workers) as pool:
        build = pool.map(
            lambda i: CO2(models[i], config, optimizer=make(models[i]), communicator=network.communicator(i)),
            range(workers),
        )
        return list(build)


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)


def _adamw(model: torch.nn.Module, **kwargs) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **kwargs)


@pytest.mark.parametrize(
    "knobs, make, named",
    [
        (dict(), _sgd, "torch.optim.Adam or AdamW"),
        (dict(), lambda m: _adamw(m, amsgrad=True), "amsgrad"),
        (dict(), lambda m: None, "optimizer="),
        (dict(co2_comm_dtype="int8"), _adamw, "co2_comm_dtype='int8'"),
        (dict(co2_comm_dtype="sparse"), _adamw, "co2_comm_dtype='sparse'"),
        (dict(co2_state_device="cpu"), _adamw, "co2_state_device='cpu'"),
        (dict(co2_sync_warmup_steps=2), _adamw, "co2_sync_warmup_steps=2"),
    ],
    ids=["sgd", "amsgrad", "no_optimizer", "int8", "sparse", "host_state", "sync_warmup"],
)
def test_unset_where_it_does_not_apply_is_off_with_one_warning_saying_why(knobs, make, named, caplog) -> None:
    with caplog.at_level("WARNING", logger="co2_hf"):
        engines = _engines(_default(**knobs), make)
    assert all(co2.config.co2_global_second_moment_every == 0 for co2 in engines)
    said = [r.getMessage() for r in caplog.records if "co2_global_second_moment_every" in r.getMessage()]
    assert len(said) == 2 and named in said[0] and "=0 to say so" in said[0]  # once per worker


@pytest.mark.parametrize("knobs, workers", [(dict(co2_global_second_moment_every=0), 2), (dict(), 1)])
def test_off_by_hand_or_with_one_worker_says_nothing(knobs, workers, caplog) -> None:
    """One worker: the workers' average is its own moment, so the exchange would change nothing."""
    with caplog.at_level("WARNING", logger="co2_hf"):
        engines = _engines(_default(**knobs), _adamw, workers)
    assert all(co2.config.co2_global_second_moment_every == 0 for co2 in engines) and not caplog.records


@pytest.mark.parametrize("older", [False, True], ids=["saved_0", "saved_before_the_setting"])
def test_a_checkpoint_trained_without_it_resumes_without_it_bit_for_bit(older: bool, caplog) -> None:
    """A checkpoint trained with 0 (or from before the setting existed: read as 0) resumes under the
    default with 0, said once at WARNING, and trains on as the run saved with 0 does."""
    off = _default(co2_global_second_moment_every=0)
    straight = Workers(off, WORKERS)
    straight.train(0, 5 * TAU)
    first = Workers(off, WORKERS)
    first.train(0, 2 * TAU + 1)
    saved = first.save()
    if older:
        for state in saved:
            del state["co2"]["config"]["co2_global_second_moment_every"], state["co2"]["second_moment"]
    with caplog.at_level("WARNING", logger="co2_hf"):
        again = Workers(_default(), WORKERS, saved=saved)
    said = [r.getMessage() for r in caplog.records if "resuming a checkpoint trained with" in r.getMessage()]
    assert len(said) == WORKERS  # once per worker (each its own process in a real run)
    assert all(e.config.co2_global_second_moment_every == 0 for e in again.engines)
    again.train(2 * TAU + 1, 5 * TAU)
    for a, b in zip(straight.finish(), again.finish()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_trained_with_it_is_refused_where_it_cannot_run() -> None:
    """Saved by the default (4), resumed where the default resolves to 0 (here: an optimizer that is not
    Adam's): refused, naming the setting, never trained on silently without it."""
    first = Workers(_default(), 2)
    first.train(0, TAU)
    saved = first.save()
    co2 = _engines(_default(), _sgd)[0]
    with pytest.raises(ValueError, match="co2_global_second_moment_every: checkpoint 4, now 0"):
        co2.load_state_dict(saved[0]["co2"])


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "torch.optim.Adam or AdamW"),
        (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad"),
        (lambda m: None, "optimizer="),
    ],
)
def test_refused_optimizers(make, named: str) -> None:
    model = TinyNet(seed=0)
    network = SimulatedNetwork(1)
    with pytest.raises(ValueError, match=named):
        CO2(model, _config(), optimizer=make(model), communicator=network.communicator(0))


def test_wrapped_optimizers_are_unwrapped() -> None:
    """Accelerate's and the Trainer's optimizer wrappers hold the torch optimizer as ``.optimizer``."""

    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    model = TinyNet(seed=0)
    adam = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    comm = SimulatedNetwork(1).communicator(0)
    moments = GlobalSecondMoment(Wrapper(Wrapper(adam)), comm, every=1, timeout_s=60, wire_dtype=torch.float32)
    assert moments.adam is adam


def test_checkpoint_state_loads_without_running_code(tmp_path) -> None:
    """The saved state is plain tensors and None: it loads with weights_only=True."""
    workers = Workers(_config(), WORKERS)
    workers.train(0, TAU)
    torch.save(clone(workers.engines[0].state_dict()), tmp_path / "co2.pt")
    state = torch.load(tmp_path / "co2.pt", weights_only=True)["second_moment"]
    assert set(state) == {"offset", "offset_step", "in_flight"}
    assert set(state["in_flight"]) == {"sum", "own", "launch_step"}
