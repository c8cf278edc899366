"""CUDA only (skipped without a GPU; never needed by CI): the engine on a GPU with host-memory state,
CUDA-event timing, and a one-rank NCCL group through the whole engine.

    python -m pytest -q tests/test_cuda.py
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from workers import TinyNet, batch, make_optimizer

from co2_hf import CO2, CO2Config
from co2_hf.core.comm import ProcessGroupCommunicator

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    tokens, target = batch(0, step)
    return nn.functional.cross_entropy(model(tokens.cuda()), target.cuda())


def _train(model, co2, optimizer, steps: int) -> None:
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, step).backward()
        co2.average_gradients()
        optimizer.step()
        co2.step()


def _engine(state_device: str, **cfg):
    model = TinyNet(seed=0).cuda()
    optimizer = make_optimizer(model)
    config = CO2Config(**{"co2_local_steps": 2, "co2_state_device": state_device, **cfg})
    return model, optimizer, CO2(model, config, optimizer=optimizer)


@pytest.mark.parametrize("start_rule", ["anchor", "eager"])
def test_host_state_on_a_gpu_model_matches_gpu_state_and_evaluates_on_the_anchor(start_rule):
    runs = {}
    for state_device in ("same", "cpu"):
        model, optimizer, co2 = _engine(state_device, co2_start_rule=start_rule)
        assert co2.device.type == ("cpu" if state_device == "cpu" else "cuda")
        _train(model, co2, optimizer, 7)  # ends mid-round, with an all-reduce in flight
        anchor = co2.anchor_state()
        assert all(t.device.type == "cuda" for t in anchor.values())  # issue 13, item 2
        tokens, _ = batch(0, 99)
        with torch.no_grad():
            functional = torch.func.functional_call(model, anchor, (tokens.cuda(),))
            with co2.anchor_in_place():
                in_place = model(tokens.cuda())
        torch.testing.assert_close(functional, in_place)
        if state_device == "cpu":  # issue 13, item 9: host scratch pinned like the state
            assert co2.live.scratch(8).is_pinned() and co2.live.read(co2.layout.chunks[0]).is_pinned()
        runs[state_device] = {k: v.detach().double().cpu() for k, v in anchor.items()}
    for name, value in runs["same"].items():
        torch.testing.assert_close(runs["cpu"][name], value, atol=1e-5, rtol=1e-5, msg=name)


@pytest.fixture
def one_rank_nccl(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("state_device", ["same", "cpu"])
def test_one_rank_nccl_group_through_the_whole_engine(one_rank_nccl, state_device):
    model, optimizer, co2 = _engine(state_device)
    assert isinstance(co2.comm, ProcessGroupCommunicator)
    backend = str(dist.get_backend(co2.comm.group))  # host state: gloo for host tensors, NCCL for CUDA ones
    assert "nccl" in backend and (("gloo" in backend) == (state_device == "cpu")), backend
    reference = copy.deepcopy(model)
    _train(model, co2, optimizer, 8)
    metrics = co2.pop_metrics()
    assert 0.0 < metrics["co2/comm_s"] < 10.0, metrics
    assert 0.0 <= metrics["co2/comm_wait_s"] < 10.0, metrics
    assert 0.0 <= metrics["co2/hidden_frac"] <= 1.0, metrics
    co2.finalize()
    assert not torch.equal(model.hidden.weight, reference.hidden.weight)  # it trained
    assert torch.isfinite(model.hidden.weight).all()


def test_cuda_all_reduce_is_timed_with_events_on_the_gpu_clock(one_rank_nccl):
    comm = ProcessGroupCommunicator(dist.new_group(), timeout_s=30.0)
    tensor = torch.ones(1 << 20, device="cuda")
    pending = comm.launch(tensor)
    assert pending.launch_events is not None and not pending.completed_at  # no host stamp at enqueue
    torch.cuda._sleep(50_000_000)  # compute still busy when the wait is reached: nothing is exposed
    since = time.perf_counter()
    comm.wait(pending, 30.0)
    assert pending.wait_events is not None
    assert 0.0 < pending.comm_seconds() < 5.0
    assert pending.wait_seconds(since) < 0.01
    torch.testing.assert_close(tensor, torch.ones_like(tensor))  # the sum over one rank


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        dict(co2_fragments=1, co2_start_rule="anchor", co2_gap_penalty=1.0, co2_clip_threshold=1e-3),
        dict(co2_overlap=False, co2_nesterov=True),
        dict(co2_state_device="cpu"),  # host-memory state, staged on the GPU a fragment at a time
    ],
    ids=["streaming", "paper_gap_aware_clip", "synchronous_nesterov", "host_state"],
)
def test_no_host_read_between_logging_steps_on_a_gpu(knobs):
    """On the GPU itself: no step that does not log reads a device value into Python, makes a tensor
    from host data or copies between host and device with a wait (tests/test_host_reads.py checks the
    same on the CPU, at every setting)."""
    from co2_hf.testing import DispatchTrace

    model, optimizer, co2 = _engine("same", co2_local_steps=4, **knobs)
    reads = []
    for step in range(14):
        optimizer.zero_grad()
        _loss(model, step).backward()
        optimizer.step()
        trace = DispatchTrace()
        trace(co2.step)
        reads += trace.reads
        if step == 9:
            co2.pop_metrics()  # a logging step may wait, once
    assert reads == []
    co2.finalize()
    assert torch.isfinite(model.hidden.weight).all()
