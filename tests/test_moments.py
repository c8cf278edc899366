"""``co2_global_second_moment_every`` (core/moments.py): the engine's exchange against the naive
reference (tests/reference.py) at every apply, resume bit for bit with the exchange in flight, a
cleared optimizer, and what it refuses, by name, before anything starts."""

from __future__ import annotations

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
        (dict(co2_elastic=True), "co2_elastic"),
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


def test_bfloat16_wire_is_allowed() -> None:
    assert CO2Config(co2_global_second_moment_every=2, co2_comm_dtype="bfloat16").co2_global_second_moment_every == 2


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
