"""scripts/time_to_loss.py: the race's arithmetic by hand, when each method holds a global model, and
a loopback run end to end."""

import datetime
import importlib.util
import json

import pytest
import torch
import torch.distributed as dist

from scripts import time_to_loss as race

pytestmark = pytest.mark.research  # the benchmark code of scripts/


def _line(method, curve, repeat=0, steps=10):
    tau = race.METHODS[method][0]
    return dict(method=method, tau=tau, repeat=repeat, rate="100mbit", budget_s=10.0, steps=steps, curve=curve,
                final_loss=race.loss_at(curve, 10.0), allreduce_alone_s=0.5)  # fmt: skip


@pytest.mark.timeout(10)
def test_loss_at_and_time_to_interpolate_between_snapshots():
    curve = [[0.0, 0, 8.0], [4.0, 10, 6.0], [8.0, 20, 5.0], [12.0, 30, 4.0]]
    assert race.loss_at(curve, 2.0) == 7.0
    assert race.loss_at(curve, 10.0) == 4.5
    assert race.loss_at(curve, 20.0) == 4.0  # past the end: the last snapshot
    assert race.time_to(curve, 5.5) == 6.0
    assert race.time_to(curve, 6.0) == 4.0
    assert race.time_to(curve, 3.0) is None
    # the first crossing counts, not a later one after the curve rose again
    assert race.time_to([[0.0, 0, 8.0], [2.0, 5, 5.0], [4.0, 9, 7.0], [6.0, 14, 4.0]], 5.0) == 2.0


@pytest.mark.timeout(10)
def test_the_target_is_the_best_peers_final_loss_and_co2_is_timed_against_the_fastest_peer():
    lines = [
        _line("ddp", [[0.0, 0, 8.0], [10.0, 20, 6.0]]),
        _line("torchft_streaming", [[0.0, 0, 8.0], [10.0, 60, 5.0]]),  # the best peer: target 5.0 at 10 s
        _line("co2", [[0.0, 0, 8.0], [5.0, 30, 5.0], [10.0, 60, 4.0]], repeat=0),
        _line("co2", [[0.0, 0, 8.0], [10.0, 60, 5.0]], repeat=1),
        _line("co2", [[0.0, 0, 8.0], [8.0, 60, 5.0], [10.0, 70, 4.5]], repeat=2),
    ]
    cells = [row.split("|") for row in race.table(lines).splitlines() if row[:2] == "| "]
    rows = {cell[1].strip(): cell[2:-1] for cell in cells}
    assert race.table(lines).startswith("target 5.0000")
    assert [c.strip() for c in rows["co2"]] == ["12", "10", "4.5000", "5.0, 10.0, 8.0", "8.0", "0.80"]
    assert [c.strip() for c in rows["torchft_streaming"]][-2:] == ["10.0", "1.00"]
    assert [c.strip() for c in rows["ddp"]][-2:] == ["not reached", ""]
    assert race.table([lines[2]]) == "no peer ran: no target"


@pytest.fixture
def one_rank_group(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def _train(loop, model, steps):
    """Whether the loop held a global model after each step."""
    held = []
    for _ in range(steps):
        loop.optimizer.zero_grad()
        loop.backward(loop.module(torch.randn(4, 3)).square().mean())
        loop.step()
        held.append(loop.global_state(model) is not None)
    return held


@pytest.mark.timeout(60)
def test_post_local_sgd_holds_the_global_model_exactly_after_the_steps_its_averager_averaged(
    one_rank_group, monkeypatch
):
    from torch.distributed.algorithms.model_averaging import averagers

    from scripts.bandwidth.peers import PostLocalSGDLoop

    calls = []
    real = averagers.utils.average_parameters_or_parameter_groups
    counted = lambda *a: (calls.append(1), real(*a))  # noqa: E731
    monkeypatch.setattr(averagers.utils, "average_parameters_or_parameter_groups", counted)
    model = torch.nn.Linear(3, 2)
    loop = PostLocalSGDLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), tau=3, device="cpu", ranks_per_node=1)
    averaged, held = [], []
    for step in range(1, 12):
        before = len(calls)
        held += _train(loop, model, 1)
        if len(calls) > before:
            averaged.append(step)
    assert averaged == [2, 5, 8, 11]  # one step after its warm-up, then every period
    assert [s for s, h in zip(range(1, 12), held) if h] == averaged
    # the race checks its stop at exactly those steps for this method
    offset = PostLocalSGDLoop.WARMUP_STEPS + 1
    assert all((s - offset) % race.CHECK_EVERY == 0 for s in (2, 14, 26))


@pytest.mark.timeout(60)
def test_co2_gives_its_anchor_and_data_parallel_its_model(one_rank_group):
    model = torch.nn.Linear(3, 2)
    ddp = race.make_race_loop("ddp", model, torch.optim.SGD(model.parameters(), lr=0.1), rank=0)
    assert all(_train(ddp, model, 3))
    model = torch.nn.Linear(3, 2)
    co2 = race.make_race_loop("co2_tau4", model, torch.optim.AdamW(model.parameters()), rank=0)
    _train(co2, model, 6)
    anchor = co2.co2.anchor_state()
    state = co2.global_state(model)
    assert state.keys() == anchor.keys() and all(torch.equal(state[k], anchor[k]) for k in state)
    assert not torch.equal(state["weight"], model.weight)  # the anchor, not the live model mid-round
    co2.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_loopback_race_end_to_end(tmp_path, monkeypatch, capsys):
    out, png = tmp_path / "race.jsonl", tmp_path / "race.png"
    methods = ["ddp", "co2"] + (["torchft_streaming"] if importlib.util.find_spec("torchft") else [])
    argv = ["--loopback", "--rate", "unshaped", "--budget-s", "3", "--snapshots", "3", "--repeats", "1"]
    argv += ["--methods", *methods, "--out", str(out), "--plot", str(png)]
    monkeypatch.setattr("sys.argv", ["time_to_loss.py", *argv])
    race.main()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["method"] for x in lines] == methods
    for line in lines:
        times = [t for t, _, _ in line["curve"]]
        assert times == sorted(times) and times[-1] >= 3.0 and line["steps"] > 0
        assert all(0 < loss < 10 for _, _, loss in line["curve"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "time to target" in capsys.readouterr().out
