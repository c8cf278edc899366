"""The engine in one process: launch/wait order, round check, equivalence with local training,
finalize, evaluation on the anchor, non-finite workers, wire dtype, memory and checkpoint errors."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from workers import SPEC_DEFAULTS, TinyNet, loss_on, make_optimizer, train_local

from co2_hf import CO2, CO2Config
from co2_hf.core.comm import Pending
from co2_hf.core.wire import header_numel
from co2_hf.testing import FakeCommunicator

pytestmark = pytest.mark.timeout(60)


def _engine(cfg=None, comm=None, **kw):
    model = TinyNet(seed=0)
    optimizer = make_optimizer(model)
    co2 = CO2(model, cfg or CO2Config(**{**SPEC_DEFAULTS, **kw}), optimizer=optimizer, communicator=comm)
    return model, optimizer, co2


def test_overlapped_boundary_launches_without_waiting_and_waits_once_at_the_next():
    fake = FakeCommunicator()
    model, optimizer, co2 = _engine(comm=fake, co2_local_steps=2)
    train_local(model, co2, optimizer, 2)
    assert fake.events == ["launch"]  # round 0: nothing to wait for
    train_local(model, co2, optimizer, 1, start=2)
    assert fake.events == ["launch"]  # mid-round: no communication at all
    train_local(model, co2, optimizer, 1, start=3)
    assert fake.events == ["launch", "wait", "launch"]
    co2.finalize()
    assert fake.events == ["launch", "wait", "launch", "wait"]


def test_synchronous_boundary_waits_right_after_launching():
    fake = FakeCommunicator()
    model, optimizer, co2 = _engine(comm=fake, co2_local_steps=2, co2_overlap=False)
    train_local(model, co2, optimizer, 4)
    assert fake.events == ["launch", "wait", "launch", "wait"]


def test_a_pending_all_reduce_cannot_be_waited_twice():
    pending = Pending(torch.zeros(1))
    pending.mark_waited()
    with pytest.raises(RuntimeError, match="waited twice"):
        pending.mark_waited()


def test_round_index_mismatch_raises():
    def corrupt(buf):  # another rank sent round 1 where this one sent round 0
        buf[-2] += 1.0  # a round bit slot (the last slot is the one worker's wait time)

    fake = FakeCommunicator(on_reduce=corrupt)
    model, optimizer, co2 = _engine(comm=fake, co2_local_steps=1)
    train_local(model, co2, optimizer, 1)
    with pytest.raises(RuntimeError, match="ranks out of step at round 0"):
        train_local(model, co2, optimizer, 1, start=1)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_one_worker_synchronous_plain_average_equals_local_training(opt):
    torch.manual_seed(0)
    plain = TinyNet(seed=0)
    plain_opt = make_optimizer(plain, opt)
    model = TinyNet(seed=0)
    optimizer = make_optimizer(model, opt)
    co2 = CO2(
        model,
        CO2Config(co2_local_steps=3, co2_overlap=False, co2_outer_lr=1.0, co2_outer_momentum=0.0),
        optimizer=optimizer,
    )
    for step in range(10):
        for m, o in ((plain, plain_opt), (model, optimizer)):
            o.zero_grad()
            loss_on(m, 0, step).backward()
            o.step()
        co2.step()
    co2.finalize()
    for (name, want), got in zip(plain.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)


def test_finalize_applies_the_partial_round_and_the_in_flight_average():
    """One worker, alpha 1, beta 0, no penalty: the final anchor is a_0 minus every round's d."""
    fake = FakeCommunicator()
    model, optimizer, co2 = _engine(comm=fake, co2_local_steps=4, co2_outer_momentum=0.0, co2_gap_penalty=0.0)
    expected = co2.anchor_state()["hidden.weight"].clone()
    round_start = None
    for step in range(6):  # a whole round and half of the next
        if co2.round_step == 0:
            round_start = model.hidden.weight.detach().clone()
        optimizer.zero_grad()
        loss_on(model, 0, step).backward()
        optimizer.step()
        if co2.round_step == 3 or step == 5:  # this round's outer gradient d = start - x
            expected -= round_start - model.hidden.weight.detach()
        co2.step()
    assert co2.round_step == 2
    co2.finalize()
    torch.testing.assert_close(co2.anchor_state()["hidden.weight"], expected, rtol=1e-5, atol=1e-6)
    for name, value in co2.anchor_state().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert (co2.round, co2.round_step) == (0, 0)
    events = len(fake.events)
    train_local(model, co2, optimizer, 4, start=6)  # the next boundary has nothing to wait for
    assert fake.events[events:] == ["launch"]


def test_one_worker_eager_rule_equals_local_training():
    """Under the eager rule a lone worker keeps its own progress: it is plain local training."""
    plain = TinyNet(seed=0)
    plain_opt = make_optimizer(plain)
    model, optimizer, co2 = _engine(
        co2_local_steps=3, co2_start_rule="eager", co2_outer_momentum=0.0, co2_gap_penalty=0.0
    )
    for step in range(11):
        for m, o in ((plain, plain_opt), (model, optimizer)):
            o.zero_grad()
            loss_on(m, 0, step).backward()
            o.step()
        co2.step()
        torch.testing.assert_close(model.hidden.weight, plain.hidden.weight, rtol=1e-5, atol=1e-6)
    co2.finalize()
    # parameters only: buffers are set to the previous boundary's mean, so they lag one round
    for (name, want), got in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_evaluation_on_the_anchor_copies_nothing_and_consumes_no_random_numbers():
    model, optimizer, co2 = _engine(co2_local_steps=3)
    train_local(model, co2, optimizer, 4)
    live = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    anchor = co2.anchor_state()
    assert anchor["emb.weight"].data_ptr() == co2._anchor.data_ptr()  # a view, not a copy
    assert anchor["out.weight"] is anchor["emb.weight"]  # tied names share one tensor
    with torch.no_grad():
        out = torch.func.functional_call(model.eval(), anchor, (torch.zeros(2, 4, dtype=torch.long),))
    model.train()
    assert out.shape == (2, 16)
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in model.state_dict().items():
        assert torch.equal(value, live[name]), name
    assert not torch.equal(anchor["hidden.weight"], live["hidden.weight"])


def test_non_finite_worker_is_quarantined_and_repeated_failure_stops_training():
    model, optimizer, co2 = _engine(co2_local_steps=2, co2_max_skipped_rounds=2)
    train_local(model, co2, optimizer, 2)
    anchor = co2.anchor_state()["hidden.weight"].clone()
    with torch.no_grad():
        model.hidden.weight[0, 0] = float("nan")
    train_local(model, co2, optimizer, 2, start=2)  # boundary 1: this worker sends nothing
    assert torch.isfinite(model.hidden.weight).all()
    assert len(optimizer.state) == 0  # Adam moments were cleared
    with torch.no_grad():
        model.hidden.weight[0, 0] = float("inf")
    train_local(model, co2, optimizer, 2, start=4)  # boundary 2 receives round 1: no finite worker
    assert co2.skipped_rounds == 1
    assert co2.pop_metrics()["co2/skipped_rounds"] == 1.0
    assert torch.isfinite(co2.anchor_state()["hidden.weight"]).all()
    del anchor
    with pytest.raises(RuntimeError, match="co2_max_skipped_rounds=2"):
        train_local(model, co2, optimizer, 2, start=6)


def test_amp_skipped_steps_count_as_inner_steps():
    model, optimizer, co2 = _engine(co2_local_steps=3)
    co2.step(skipped=True)
    co2.step()
    assert co2.step(skipped=True)  # the third call is the boundary
    assert co2.pop_metrics()["co2/amp_skipped_steps"] == 2.0


def test_metrics_after_rounds():
    slow = FakeCommunicator(delay_s=0.005)
    model, optimizer, co2 = _engine(comm=slow, co2_local_steps=2, co2_clip_threshold=1e-3)
    train_local(model, co2, optimizer, 6)
    metrics = co2.pop_metrics()
    for key in (
        "comm_wait_s",
        "comm_s",
        "hidden_frac",
        "outer_grad_norm",
        "momentum_norm",
        "clip_ratio",
        "penalty_mean",
        "amp_skipped_steps",
        "skipped_rounds",
    ):
        assert f"co2/{key}" in metrics, key
    assert metrics["co2/clip_ratio"] < 1.0
    assert metrics["co2/momentum_norm"] == pytest.approx(1e-3, rel=1e-4)
    assert set(co2.pop_metrics()) == {"co2/amp_skipped_steps", "co2/skipped_rounds"}


def test_outer_state_is_twelve_bytes_per_parameter_plus_two_for_bfloat16():
    _, _, fp32 = _engine()
    n = fp32.layout.padded_numel
    header = header_numel(fp32.num_workers)
    assert fp32.outer_state_nbytes() == 12 * n + 4 * header
    _, _, bf16 = _engine(co2_comm_dtype="bfloat16")
    assert bf16.outer_state_nbytes() == 12 * n + 4 * header + 2 * (n + header)
    _, _, eager = _engine(co2_start_rule="eager")
    assert eager.outer_state_nbytes() == 12 * n + 4 * header + 4 * eager.layout.param_numel


def test_bfloat16_on_the_wire_keeps_fp32_state_and_stays_close():
    results = {}
    for dtype in ("float32", "bfloat16"):
        model, optimizer, co2 = _engine(co2_local_steps=2, co2_comm_dtype=dtype)
        train_local(model, co2, optimizer, 8)
        co2.finalize()
        assert co2._anchor.dtype == torch.float32
        results[dtype] = co2.anchor_state()["hidden.weight"].clone()
    torch.testing.assert_close(results["bfloat16"], results["float32"], rtol=2e-2, atol=2e-2)
    assert not torch.equal(results["bfloat16"], results["float32"])


def test_state_device_cpu_places_the_outer_state_in_host_memory():
    _, _, co2 = _engine(co2_state_device="cpu")
    assert {t.device.type for t in (co2._anchor, co2._momentum, co2.fragments[0].wire.fp32)} == {"cpu"}
    assert not co2._anchor.is_pinned()  # nothing to pin for a model on the CPU


def test_host_state_is_pinned_exactly_when_the_model_is_on_a_gpu():
    from types import SimpleNamespace

    from co2_hf.core.live import pin_state as _pin_state

    def model_on(device):
        return SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device(device))]))

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert _pin_state(model_on("cuda"), cpu) and not _pin_state(model_on("cpu"), cpu)
    assert not _pin_state(model_on("cuda"), cuda)  # state on the GPU itself


def test_engine_refuses_disabled_config_and_unsupported_worker_size():
    with pytest.raises(ValueError, match="co2_enabled=False"):
        CO2(nn.Linear(2, 2), CO2Config(co2_enabled=False))
    with pytest.raises(ValueError, match="co2_worker_size=2"):
        CO2(nn.Linear(2, 2), CO2Config(co2_worker_size=2))


def test_load_state_dict_refuses_other_settings_or_another_model():
    _, _, co2 = _engine(co2_local_steps=3)
    state = co2.state_dict()
    _, _, other = _engine(co2_local_steps=4)
    with pytest.raises(ValueError, match="co2_local_steps: checkpoint 3, now 4"):
        other.load_state_dict(state)
    different = CO2(nn.Linear(2, 2), CO2Config(**{**SPEC_DEFAULTS, "co2_local_steps": 3}))
    with pytest.raises(ValueError, match="layout"):
        different.load_state_dict(state)
    _, _, patient = _engine(co2_local_steps=3, co2_timeout_s=60.0)
    patient.load_state_dict(state)  # a different timeout does not change the trajectory


def test_frozen_parameters_and_integer_buffers_are_not_synchronised():
    _, _, co2 = _engine()
    names = {n for segment in co2.layout.segments for n in segment.names}
    assert "frozen.weight" not in names and "norm.num_batches_tracked" not in names
    assert {"emb.weight", "out.weight", "norm.running_mean"} <= names
    emb = next(s for s in co2.layout.segments if "emb.weight" in s.names)
    assert emb.names == ["emb.weight", "out.weight"]  # tied: one segment


@pytest.mark.parametrize("window", [None, 2])
def test_state_dict_inside_the_overlap_window_resumes_bit_for_bit(window):
    """Saved one step into round 1, before the window applies round 0's average at step 2."""
    cfg = dict(co2_local_steps=4, co2_overlap_steps=window, co2_start_rule="eager", co2_outer_momentum=0.5)
    model, optimizer, co2 = _engine(**cfg)
    train_local(model, co2, optimizer, 12)
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    model, optimizer, co2 = _engine(**cfg)
    train_local(model, co2, optimizer, 5)
    saved = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "co2": copy.deepcopy(co2.state_dict()),
    }
    model, optimizer, co2 = _engine(**cfg)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    co2.load_state_dict(saved["co2"])
    train_local(model, co2, optimizer, 7, start=5)
    for name, value in uninterrupted.items():
        assert torch.equal(model.state_dict()[name], value), name


def test_the_communicator_is_fixed_at_construction_and_a_wrapper_forwards_every_verb():
    from co2_hf.core.comm import Communicator
    from co2_hf.testing import DelayedCommunicator, ForwardingCommunicator, RecordingCommunicator

    _, _, co2 = _engine()
    with pytest.raises(AttributeError):
        co2.comm = FakeCommunicator()  # fragments keep theirs: inject through communicator= instead
    verbs = [name for name, value in vars(Communicator).items() if callable(value) and not name.startswith("_")]
    assert len(verbs) == 11  # the eight of the docstring, worker_ranks, start_quorum and commit
    for wrapper in (ForwardingCommunicator, RecordingCommunicator, DelayedCommunicator):
        missing = [name for name in verbs if getattr(wrapper, name) is getattr(Communicator, name)]
        assert missing == [], wrapper
    delayed = DelayedCommunicator(FakeCommunicator(), delay_s=0.05)
    model, optimizer, co2 = _engine(comm=delayed, co2_local_steps=1, co2_overlap=False)
    train_local(model, co2, optimizer, 2)
    assert co2.last_comm_s >= 0.05 - 1e-9  # the fragments' all-reduces went through the delay


def test_the_plan_resolves_the_knobs_once_and_the_saved_settings_show_it(tmp_path):
    import json

    from co2_hf.checkpoints import config_file
    from co2_hf.core.schedule import Plan
    from co2_hf.integrations import model_card

    plan = CO2(TinyNet(seed=0), CO2Config()).plan
    assert plan.describe() == {
        "local_steps": 12,
        "fragments": 12,
        "window_steps": 1,
        "overlapped": True,
        "start_rule": "lookahead",
        "stale": False,
        "penalty": "none",
    }
    sync = CO2(TinyNet(seed=0), CO2Config(co2_overlap=False, co2_gap_penalty=1.0)).plan
    assert (sync.fragments, sync.start_rule, sync.stale, sync.penalty) == (1, "anchor", False, "none")
    full = CO2(TinyNet(seed=0), CO2Config(co2_fragments=1, co2_gap_penalty=1.0)).plan
    assert (full.window_steps, full.stale, full.penalty) == (None, True, "gap_aware")
    config_file.write_co2_config(str(tmp_path), CO2Config(), world_size=2, plan=plan)
    saved = json.loads((tmp_path / "co2_config.json").read_text())
    assert saved["co2_fragments"] == 12 and saved["co2_plan"]["fragments"] == 12 and saved["num_workers"] == 2
    (tmp_path / "README.md").write_text("# model\n")
    model_card.add_co2_section(str(tmp_path / "README.md"), CO2Config(), plan=Plan.resolve(CO2Config()), world_size=2)
    card = (tmp_path / "README.md").read_text()
    assert "| `co2_fragments` | `12` |" in card and "| resolved: `start_rule` | `lookahead` |" in card
    # the Trainer's hyperparameter list names every multi-process run "multi-GPU"
    for device, expected in (("cpu", "multi-CPU"), ("cuda", "multi-GPU")):
        (tmp_path / "README.md").write_text("# model\n\n- distributed_type: multi-GPU\n- num_devices: 2\n")
        model_card.add_co2_section(
            str(tmp_path / "README.md"), CO2Config(), plan=plan, world_size=2, device_type=device
        )
        assert f"- distributed_type: {expected}\n" in (tmp_path / "README.md").read_text()


@pytest.mark.timeout(30)
def test_the_coded_all_reduce_thread_keeps_the_callers_torch_thread_count():
    """A new thread's OpenMP team is as wide as the machine whatever torch.set_num_threads said: the
    codec's ops in the background thread spilled onto the other ranks' cores (issue 44: each rank of
    the 2-core benchmark had its one core, and every codec op ran on both)."""
    import ctypes
    import glob

    from co2_hf.core.waits import BackgroundWork

    libraries = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))
    if not libraries:
        pytest.skip("this torch build does not ship GNU OpenMP, whose per-thread width the test reads")
    omp_max_threads = ctypes.CDLL(libraries[0]).omp_get_max_threads
    width = []
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        work = BackgroundWork()
        work.start(lambda: width.append(omp_max_threads()))
        work.join()
    finally:
        torch.set_num_threads(before)
    assert width == [1]
