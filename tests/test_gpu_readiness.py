"""The CUDA/NCCL path's decisions, checked on CPU: the backend and timeout of each CO2 group, the
device of the anchor's tensors, CUDA-event timing arithmetic, the host-side bound on CUDA
collectives, and CO2's error when a peer freezes inside a worker (gloo)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
from gpu_readiness_workers import FROZEN_TIMEOUT_S, frozen_peer_inside_a_worker
from tables import SLACK_S
from workers import TinyNet

from co2_hf import CO2, CO2Config
from co2_hf.core import groups, waits
from co2_hf.core.comm import Pending
from co2_hf.core.groups import group_backend, group_timeout
from co2_hf.testing import run_with_faults

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- groups: backend and timeout


def test_host_state_under_nccl_gets_per_device_groups_so_gradients_stay_on_nccl():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert group_backend(cpu, "nccl") == "cpu:gloo,cuda:nccl"
    assert group_backend(cpu, "cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert group_backend(cpu, "gloo") == "gloo"
    assert group_backend(cuda, "nccl") is None  # the default group's backend: NCCL


def test_every_group_co2_makes_has_the_backend_and_a_timeout_above_co2_timeout_s(monkeypatch):
    made = []

    def new_group(ranks=None, **kwargs):
        made.append((ranks, kwargs))
        return f"group{len(made)}"

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4 if group in (None, "group1") else 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    communicator = groups.make_communicator(state_device=torch.device("cpu"), timeout_s=30.0, worker_size=2)
    assert [ranks for ranks, _ in made] == [None, [0, 1], [2, 3], [0, 2], [1, 3]]  # everyone, workers, outers
    for _, kwargs in made:
        assert kwargs["backend"] == "cpu:gloo,cuda:nccl"
        assert kwargs["timeout"] == group_timeout(30.0) > datetime.timedelta(seconds=30.0)
    assert communicator.timeout_s == 30.0  # what bounds each wait


def test_group_timeout_leaves_co2s_wait_room_to_raise_first():
    for timeout_s in (0.5, 30.0, 900.0):
        assert group_timeout(timeout_s).total_seconds() >= max(2 * timeout_s, timeout_s + 60)


def test_the_fsdp2_worker_mesh_is_built_from_groups_with_co2s_timeout(monkeypatch):
    from torch.distributed import device_mesh

    made, meshes = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or tuple(ranks))
    monkeypatch.setattr(
        device_mesh.DeviceMesh, "from_group", staticmethod(lambda group, device_type, **kw: meshes.append(group))
    )
    groups._WORKER_MESHES.clear()
    try:
        groups.worker_mesh(2, "cpu", timeout_s=12.0)
    finally:
        groups._WORKER_MESHES.clear()
    assert [ranks for ranks, _ in made] == [[0, 1], [2, 3]]
    assert all(kw["timeout"] == group_timeout(12.0) for _, kw in made)
    assert meshes == [(2, 3)]  # rank 3's worker


# ---------------------------------------------------------------- the anchor on the model's device


def test_anchor_state_is_on_each_tensors_device_when_the_state_is_in_host_memory():
    # The model moves to the meta device after CO2 was built on the CPU: a stand-in for a CUDA
    # model with co2_state_device=cpu (host anchor, device parameters), which no CPU machine has.
    model = TinyNet(seed=0)
    co2 = CO2(model, CO2Config(co2_local_steps=2, co2_state_device="cpu"))
    assert co2.anchor_state()["hidden.weight"].device.type == "cpu"
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # keep each parameter object: CO2 holds them
    try:
        model.to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    state = co2.anchor_state()
    for name, param in model.named_parameters():
        assert state[name].device == param.device == torch.device("meta"), name


def test_anchor_state_still_copies_nothing_when_the_state_lives_with_the_model():
    model = TinyNet(seed=0)
    co2 = CO2(model, CO2Config(co2_local_steps=2))
    first, second = co2.anchor_state()["hidden.weight"], co2.anchor_state()["hidden.weight"]
    assert first.data_ptr() == second.data_ptr()  # views of the one fp32 anchor


# ---------------------------------------------------------------- timing and bounded waits


class _FakeEvent:
    def __init__(self, at_ms: float) -> None:
        self.at_ms, self.synchronized = at_ms, False

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert end.synchronized, "elapsed_time needs the end event complete"
        return end.at_ms - self.at_ms


def test_cuda_event_timings_are_read_in_seconds_and_preferred_over_the_host_clock():
    pending = Pending(torch.zeros(1))
    pending.launch_events = (_FakeEvent(10.0), _FakeEvent(260.0))
    pending.wait_events = (_FakeEvent(100.0), _FakeEvent(130.0))
    since = time.perf_counter() - 5.0  # the host waited 5 s: the events say the GPU stalled 30 ms
    assert pending.comm_seconds() == pytest.approx(0.25)
    assert pending.wait_seconds(since) == pytest.approx(0.03)


def test_gloo_timings_stay_on_the_host_clock():
    pending = Pending(torch.zeros(1))
    pending.completed_at.append(pending.launched_at + 0.5)
    assert pending.comm_seconds() == pytest.approx(0.5)
    assert pending.wait_seconds(time.perf_counter() - 0.2) == pytest.approx(0.2, abs=0.05)


class _CudaLike:
    is_cuda = True


class _Work:
    def __init__(self, done_after_polls: int | None) -> None:
        self.polls, self.done_after, self.joined = 0, done_after_polls, False

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done_after is not None and self.polls > self.done_after

    def block_current_stream(self) -> None:
        self.joined = True


def test_a_cuda_collective_is_polled_until_done_then_joined_on_the_stream():
    work = _Work(done_after_polls=3)
    waits.bounded_wait(work, _CudaLike(), timeout_s=5.0)
    assert work.polls == 4 and work.joined


def test_a_cuda_collective_that_never_completes_raises_at_the_deadline_not_later():
    work, start = _Work(done_after_polls=None), time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 0.3s"):
        waits.bounded_wait(work, _CudaLike(), timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 2.0 and not work.joined


# ---------------------------------------------------------------- a frozen peer inside a worker


@pytest.fixture(scope="module")
def frozen_runs():
    return {
        where: run_with_faults(frozen_peer_inside_a_worker, 2, where, wait_for=[0], timeout_s=60)[0]
        for where in ("gradient", "boundary")
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("where", "what"),
    [
        ("gradient", "the gradient average over this worker's processes"),
        ("boundary", "the sum of the outer statistics over this worker's processes"),
    ],
)
def test_a_frozen_peer_inside_a_worker_stops_the_other_with_co2s_error_within_the_timeout(frozen_runs, where, what):
    outcome = frozen_runs[where]
    assert outcome is not None and outcome["ok"], outcome
    result = outcome["result"]
    assert result["error"].startswith(f"CO2: {what} failed or did not finish"), result["error"]
    assert f"co2_timeout_s={FROZEN_TIMEOUT_S}s" in result["error"]
    assert FROZEN_TIMEOUT_S - SLACK_S <= result["blocked_s"] <= FROZEN_TIMEOUT_S + SLACK_S, result
