"""scripts/bench_bandwidth.py (the package scripts.bandwidth) and scripts/scaling_model.py: the
namespace plan in a dry run (no root), tear-down on failure, where each rank runs (CPU or one GPU per
rank), the steady-state summary, a loopback smoke run, and the model's formulas."""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed

from scripts import scaling_model as sm
from scripts.bandwidth import analysis, cli, compare, netns, plan, worker
from scripts.bench_overlap import SEQ

pytestmark = pytest.mark.research  # the benchmark code of scripts/
ROOT = Path(__file__).resolve().parents[1]


def _dry_run_commands(capsys, *argv: str) -> list[str]:
    cli.main(["--dry-run", *argv])
    return [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("+ ")]


@pytest.mark.timeout(20)
def test_dry_run_deletes_everything_it_creates_and_shapes_both_directions(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the dry run must not need root
    commands = _dry_run_commands(capsys)
    created, deleted = [], set()
    for i, cmd in enumerate(commands):
        words = cmd.split()
        if words[:3] == ["ip", "netns", "add"]:
            created.append((words[3], i))
        elif "link" in words and "add" in words:
            at = words.index("add")
            created.append((words[at + 1], i))
            if "peer" in words:
                created.append((words[words.index("peer") + 2], i))
        elif words[-2:-1] == ["del"] or words[:3] == ["ip", "netns", "del"]:
            deleted.add((words[-1], i))
    assert created and all(name.startswith("co2b-") for name, _ in created)
    for name, at in created:  # every namespace and link has a delete after its creation
        assert any(d == name and i > at for d, i in deleted), name
    # 4 nodes behind a bridge: 8 shaped ends (each node's upload and its download on the switch side)
    tbf = [c for c in commands if "tbf rate 100mbit" in c and "co2b-sw" in c]
    assert len(tbf) == 4 and any("tbf rate 100mbit" in c and "co2b-n3 " in c for c in commands)
    assert any(c.startswith("tc -n co2b-n0 qdisc del dev co2b-e0 root") for c in commands)  # unshaped
    assert any("GLOO_SOCKET_IFNAME=co2b-e1 ip netns exec co2b-n1" in c for c in commands)


@pytest.mark.timeout(20)
def test_ranks_per_node_share_a_namespace(capsys):
    commands = _dry_run_commands(capsys, "--ranks", "4", "--ranks-per-node", "2", "--no-extras", "--rates", "1gbit")
    launches = [c for c in commands if "--worker" in c]
    assert [c.split("ip netns exec ")[1].split()[0] for c in launches] == ["co2b-n0", "co2b-n0", "co2b-n1", "co2b-n1"]
    assert not any("co2b-sw" in c for c in commands)  # two nodes: one veth pair, no bridge
    assert any("link set co2b-e0 mtu 1500" in c for c in commands)
    with pytest.raises(SystemExit):  # one worker per node needs several ranks per node
        cli.main(["--dry-run", "--methods", "co2_node", "--no-extras"])


@pytest.mark.timeout(20)
def test_refuses_without_root_and_tears_down_after_a_failed_setup(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="root"):
        cli.main(["--rates", "100mbit", "--no-extras"])
    ran = []

    def execute(cmd, *, check):
        ran.append(" ".join(cmd))
        if len(ran) == 6 and check:
            raise RuntimeError("setup failed")

    monkeypatch.setattr(netns, "_execute", execute)
    with pytest.raises(RuntimeError, match="setup failed"):
        with netns.Network(2):
            pass
    _, down = netns.network_commands(2)
    assert ran[-len(down) :] == [" ".join(c) for c in down]
    network = netns.Network(2)
    network.close()
    network.close()  # atexit calls it again: a no-op
    assert ran.count("ip netns del co2b-n0") == 2


def _rank_envs(commands: list[str]) -> list[dict]:
    """The KEY=VALUE words in front of each rank's launch in a dry run."""
    launches = [c.split(" ip netns exec ")[0] for c in commands if "--worker" in c]
    return [dict(word.split("=", 1) for word in launch.split()) for launch in launches]


@pytest.mark.timeout(20)
def test_cuda_gives_each_rank_its_own_gpu_and_nccl_the_shaped_link(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    argv = ["--device", "cuda", "--ranks", "4", "--ranks-per-node", "2", "--no-extras", "--rates", "100mbit"]
    envs = _rank_envs(_dry_run_commands(capsys, *argv))
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]  # the GPU index within its node
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "0,1", "2,3", "2,3"]  # each node its own GPUs
    assert [e["NCCL_HOSTID"] for e in envs] == ["co2b-n0", "co2b-n0", "co2b-n1", "co2b-n1"]  # one host per node
    assert [e["NCCL_SOCKET_IFNAME"] for e in envs] == ["co2b-e0", "co2b-e0", "co2b-e1", "co2b-e1"]
    assert all(e["NCCL_NET"] == "Socket" and e["NCCL_IB_DISABLE"] == "1" for e in envs)  # TCP over the veth
    assert [plan.backend_and_device("cuda", int(e["LOCAL_RANK"])) for e in envs[:2]] == [
        ("nccl", "cuda:0"),
        ("nccl", "cuda:1"),
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the GPUs this job was given, not 0..3
    envs = _rank_envs(_dry_run_commands(capsys, *argv))
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "4,5", "6,7", "6,7"]


@pytest.mark.timeout(20)
def test_cpu_ranks_use_gloo_and_no_gpu_settings(capsys):
    argv = ["--ranks", "4", "--ranks-per-node", "2", "--no-extras", "--rates", "1gbit"]
    envs = _rank_envs(_dry_run_commands(capsys, *argv))
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert not any(key.startswith(("CUDA", "NCCL")) for e in envs for key in e)
    assert plan.backend_and_device("cpu", 1) == ("gloo", "cpu")


@pytest.mark.timeout(20)
def test_cuda_refuses_fewer_gpus_than_ranks_before_any_rank_starts(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a rank started"))
    argv = ["--device", "cuda", "--loopback", "--rates", "unshaped", "--no-extras"]
    with pytest.raises(SystemExit, match=r"--device cuda runs one rank per GPU.* 2 ranks .* 1 GPU"):
        cli.main(argv)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit, match=r"a block of 4 ranks .*--no-extras"):  # the extras double the ranks
        cli.main(["--device", "cuda", "--rates", "100mbit"])
    with pytest.raises(SystemExit):
        cli.main(["--device", "tpu", "--dry-run"])
    assert "argument --device: invalid choice: 'tpu' (choose from 'cpu', 'cuda')" in capsys.readouterr().err


@pytest.mark.timeout(20)
def test_a_cuda_rank_binds_its_local_gpu_before_nccl_starts(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))

    def init_process_group(backend, **kwargs):
        calls.append(("init", backend, kwargs.get("device_id")))
        raise InterruptedError  # far enough: what follows needs a GPU

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    spec = {"model": "tiny", "batch": 1, "device": "cuda", "out_dir": str(tmp_path), "timeout_s": 9}
    (tmp_path / "spec.json").write_text(json.dumps({**spec, "ranks_per_node": 2, "runs": []}))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(InterruptedError):
        worker.worker(str(tmp_path / "spec.json"))
    assert calls == [("set_device", "cuda:1"), ("init", "nccl", torch.device("cuda", 1))]


@pytest.mark.timeout(10)
def test_steady_state_summary_by_hand():
    run = plan.Run("co2", tau=2, rounds=4)
    rank = {"times": [9, 9, 1, 2, 1, 4, 9, 9], "waits": [0, 0.5, 1.5, 7], "comms": [0, 2, 2, 7], "load_1m": 2.0}
    rank["engine"] = [9, 0.75, 2.0, 9]  # host seconds in co2.step() per round, its waits included
    block = plan.Block(2, 1, "100mbit", "tiny", [run], batch=3)
    line = analysis.run_line(block, run, [rank, {**rank, "waits": [0, 0.25, 2.5, 0]}], alone=1.0, limit=1.0)
    assert line["step_time_s"] == 1.5  # median of the steady steps 1, 2, 1, 4
    assert line["time_per_step_s"] == 2.0  # steady rounds take 3 and 5 s: median 4, over tau 2
    assert line["exposed_comm_per_round_s"] == 1.5  # max over ranks per round: 0.5 and 2.5
    assert line["exposed_frac_of_round"] == 0.75 and line["comm_over_compute"] == 0.5
    assert line["hidden_frac"] == 0.25  # 1 - (0.5 + 2.5) / (2 + 2)
    assert line["engine_per_round_s"] == 0.5  # less the waits, max over ranks: (0.25, 0.5) and (0.5, 0)
    assert line["rel_to_limit"] == 0.5 and line["tokens_per_s"] == 2 * 3 * SEQ / 2.0
    assert "link_tx_bytes_per_round" not in line  # loopback: no link counter


@pytest.mark.timeout(10)
def test_link_bytes_per_round_and_their_prediction_by_hand():
    run = plan.Run("co2_node", tau=2, rounds=4)
    block = plan.Block(4, 2, "100mbit", "tiny", [run], batch=3)
    ranks = [{"times": [1.0] * 8, "waits": [0] * 4, "comms": [1] * 4, "load_1m": 1.0} for _ in range(4)]
    for rank, tx in zip(ranks, [400, 400, 800, 800]):  # the two ranks of a node read one counter
        rank["link_tx_bytes"] = tx
    line = analysis.run_line(block, run, ranks, alone=1.0, limit=1.0)
    assert line["link_tx_bytes_per_round"] == 150  # (400 + 800) / 2 nodes / 4 rounds
    size = 4 * sm.gpt2_params(plan.MODELS["tiny"])
    assert line["link_tx_predicted_bytes_per_round"] == round(size)  # 2 (2-1)/2 x S: k rings of S/k
    assert analysis.predicted_link_bytes("co2", block) == pytest.approx(1.5 * size)  # one ring of 4 ranks
    # streaming: S per round, plus finalize's boundaries of tau - 1 fragments spread over the rounds
    stream = plan.Run("co2_stream", tau=12, rounds=5)
    assert analysis.predicted_link_bytes("co2_stream", block, stream) == pytest.approx(1.5 * size * (1 + 11 / 60))
    # codes: one byte (int8) or half of one (int4) per value, plus a 4-byte scale per 128 values
    for wire, per_value in (("int8", 1 + 4 / 128), ("int4", 0.5 + 4 / 128), ("bfloat16", 2.0)):
        coded = plan.Run("co2", tau=12, rounds=5, wire=wire)
        assert analysis.predicted_link_bytes("co2", block, coded) == pytest.approx(1.5 * size * per_value / 4)


@pytest.mark.timeout(10)
def test_the_table_gives_each_wire_type_a_row_and_its_bytes_against_float32():
    common = {"rate": "100mbit", "ranks": 2, "model": "small", "allreduce_alone_s": 3.5, "load_1m": 1.0}
    run = {"time_per_step_s": 0.5, "tokens_per_s": 970.0, "rel_to_limit": 0.9, "exposed_comm_per_round_s": 0.0}
    lines = [
        {**common, **run, "method": "co2", "tau": 4, "wire": wire, "hidden_frac": 1.0, "link_tx_bytes_per_round": b}
        for wire, b in (("float32", 4000), ("int8", 1032))
    ]
    rows = analysis.markdown_table(lines).splitlines()
    assert "| co2 | float32 | 4 |" in rows[2] and "| 1.000 |" in rows[2]
    assert "| co2 | int8 | 4 |" in rows[3] and "| 0.258 |" in rows[3]


def test_wires_make_one_run_per_wire_type_and_bad_ones_are_refused(capsys):
    args = cli.parse_args(["--rates", "100mbit", "--taus", "4", "--methods", "no_comm,co2", "--wires", "float32,int8"])
    (block,) = plan.build_plan(argparse.Namespace(**{**vars(args), "extras": False}))
    assert [(r.method, r.wire) for r in block.runs if r.method != "no_comm"] == [("co2", "float32"), ("co2", "int8")]
    with pytest.raises(SystemExit):
        cli.parse_args(["--wires", "int3"])
    assert "--wires must be among float32, bfloat16, int8, int4" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_loopback_smoke_run(tmp_path, capsys):
    out, png = tmp_path / "out.jsonl", tmp_path / "plot.png"
    argv = ["--loopback", "--rates", "unshaped", "--no-extras", "--model", "tiny", "--taus", "2"]
    peers = [m for m, package in plan.PEERS.items() if importlib.util.find_spec(package)]  # the installed ones
    methods = ["no_comm", "ddp", "local_sgd", "diloco", "co2", "co2_stream", *peers]
    argv += ["--methods", ",".join(methods), "--torchft-fragments", "2", "--min-steps", "8", "--ddp-steps", "4"]
    cli.main([*argv, "--out", str(out), "--plot", str(png)])
    assert capsys.readouterr().out.startswith("# plan:")  # the estimate comes first
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["method"] for x in lines] == ["probe", *methods, "no_comm"]  # no_comm runs around the pass
    for line in lines[1:]:
        assert line["tokens_per_s"] > 0 and line["rel_to_limit"] > 0 and "error" not in line
    engine = [x for x in lines if x["method"] in plan.CO2_SETTINGS]
    assert all(0 <= line["hidden_frac"] <= 1 for line in engine)
    assert engine[-1]["tau"] == 2 and engine[-1]["comm_s"] > 0
    # each peer ran through its own library, and says which
    assert [x["library"].split()[0] for x in lines if x["method"] in peers] == [plan.PEERS[m] for m in peers]
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(10)
def test_scaling_model_formulas_by_hand():
    assert sm.ring_allreduce_s(1e6, 2, 8e6) == pytest.approx(1.0)  # each node sends the payload once
    assert sm.ring_allreduce_s(1e6, 4, 8e6) == pytest.approx(1.5)  # 2 (G-1)/G
    assert sm.ring_allreduce_s(1e6, 1, 8e6) == 0.0
    # 1e6 fp32 parameters, 2 workers at 32 Mbit/s: one all-reduce takes 1 s
    args = (0.5, 1e6, 32e6, 2)
    assert sm.step_time_s("data_parallel", *args) == pytest.approx(1.5)
    assert sm.step_time_s("local_sgd", *args, tau=4) == pytest.approx(0.75)
    assert sm.step_time_s("co2", *args, tau=4) == pytest.approx(0.5)  # 1 s hides behind 2 s of compute
    assert sm.step_time_s("co2", *args, tau=1) == pytest.approx(1.0)  # 0.5 s of the 1 s exposed
    assert sm.step_time_s("no_comm", *args) == 0.5
    # 2 -> 4 workers: the all-reduce grows from 1 to 1.5 s; data parallel keeps 1.5 / 2 of linear scaling
    assert sm.scalability("data_parallel", *args[:3], 2, 4) == pytest.approx(0.75)
    assert sm.scalability("co2", *args[:3], 2, 4, tau=4) == pytest.approx(1.0)
    assert sm.gpt2_params(plan.MODELS["small"]) == 10_293_504  # counted by torch on the real model
    assert sm.gpt2_params(sm.GPT2_SMALL) == 124_439_808  # GPT-2 small as published by OpenAI/HF


@pytest.mark.timeout(60)
def test_scaling_model_cli_prints_the_smallest_tau_per_wire():
    flags = ["--params", "124e6", "--bandwidth-gbps", "1", "--step-time-s", "0.3"]
    done = subprocess.run(
        [sys.executable, "-m", "scripts.scaling_model", *flags], cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    rows = dict(re.findall(r"^\| (fp32|bf16|int8|int4) \| \w+ \| (\d+) \|$", done.stdout, re.M))
    # fp32 over 2 workers at 1 Gbit/s: 2 (1/2) 124e6 * 32 bit / 1e9 = 3.97 s, over 0.3 s steps: 13.2 -> 14
    assert rows == {"fp32": "14", "bf16": "7", "int8": "4", "int4": "2"}
    for tau, wire in ((14, "fp32"), (4, "int8")):  # the smallest: one step less does not hide it
        bytes_ = sm.WIRE_BYTES[wire]
        fits = [
            sm.fragment_fits(0.3, 124e6, 1e9, 2, tau=t, fragments=t, bytes_per_element=bytes_) for t in (tau - 1, tau)
        ]
        assert fits == [False, True]
    done = subprocess.run(
        [sys.executable, "-m", "scripts.scaling_model", *flags, "--workers", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 2 and "--workers=0: allowed values are integers >= 1" in done.stderr


@pytest.mark.timeout(10)
def test_markdown_table_lists_the_methods_only():
    common = {"rate": "100mbit", "ranks": 2, "model": "small", "allreduce_alone_s": 3.5, "load_1m": 1.0}
    run = {"time_per_step_s": 0.5, "tokens_per_s": 970.0, "rel_to_limit": 0.78, "exposed_comm_per_round_s": 0.0}
    lines = [
        {**common, "method": "probe"},
        {**common, **run, "method": "no_comm", "tau": None, "hidden_frac": None},
        {**common, **run, "method": "co2", "tau": 12, "hidden_frac": 1.0},
    ]
    rows = analysis.markdown_table(lines).splitlines()
    assert len(rows) == 3 and rows[2].startswith("| 100mbit | 2 | small | co2 | - | 12 | 0.500 | 970 | **0.78** |")
    assert rows[2].endswith("| 1 |")
    repeated = [*lines, {**lines[2], "rel_to_limit": 0.90}, {**lines[2], "rel_to_limit": 0.95}]
    rows = analysis.markdown_table(repeated).splitlines()  # repeats of a cell: one row, the median
    assert len(rows) == 3 and "| **0.90** |" in rows[2] and rows[2].endswith("| 3 |")


def _plan(*argv: str) -> plan.Block:
    args = cli.parse_args(["--rates", "100mbit", "--no-extras", *argv])
    (block,) = plan.build_plan(args)
    return block


@pytest.mark.timeout(10)
def test_repeats_interleave_the_methods_each_pass_led_by_its_own_no_comm_run(tmp_path):
    (tmp_path / "co2_hf").mkdir()
    (tmp_path / "co2_hf" / "__init__.py").write_text("")  # a checkout to run --against (not a git one)
    block = _plan("--taus", "16", "--methods", "no_comm,co2_stream,torchft_diloco", "--repeats", "3")
    against = _plan("--taus", "16", "--methods", "no_comm,co2_stream", "--repeats", "2", "--against", str(tmp_path))
    order = [(r.method, r.repeat) for r in block.runs]
    passes = [(m, k) for k in range(3) for m in ("no_comm", "co2_stream", "torchft_diloco")]  # A B C A B C
    assert order == [*passes, ("no_comm", 3)]  # and a no_comm run after the last pass
    assert all(r.tau == 16 and r.rounds == 4 for r in block.runs)  # no_comm in rounds of tau too: the same statistic
    assert [(r.method, r.code) for r in against.runs[:3]] == [
        ("no_comm", ""),
        ("co2_stream", ""),
        ("co2_stream", tmp_path.name),
    ]
    assert against.options["trees"] == {tmp_path.name: str(tmp_path)}  # what the ranks import the other engine from


def _result(seconds_per_step: float, steps: int = 12) -> dict:
    return {"times": [seconds_per_step] * steps, "waits": [0.0] * 3, "comms": [1.0] * 3, "load_1m": 2.0}


@pytest.mark.timeout(10)
def test_each_run_is_compared_with_the_no_comm_time_interpolated_at_its_place_in_the_pass():
    runs = [plan.Run(m, 4, 3, repeat=k) for k in range(2) for m in ("no_comm", "co2", "torchft_diloco")]
    runs.append(plan.Run("no_comm", 4, 3, repeat=2))
    block = plan.Block(2, 1, "100mbit", "tiny", runs, batch=3, options={"torchft_fragments": 1})
    # the machine slows from 1.0 to 1.3 s per step over the first pass, then holds
    seconds = [1.0, 1.1, 2.4, 1.3, 1.3, 2.6, 1.3]
    lines = analysis.block_lines(block, [{"allreduce_alone_s": 1.0}] * 2, [[_result(t)] * 2 for t in seconds])
    rel = [(x["method"], x["repeat"], x["rel_to_limit"]) for x in lines[1:]]
    # limits 1.1 and 1.2 a third and two thirds of the way from 1.0 to 1.3 (not 1.0: the pass's first)
    assert rel[1:3] == [("co2", 0, 1.0), ("torchft_diloco", 0, 0.5)]
    assert rel[4:6] == [("co2", 1, 1.0), ("torchft_diloco", 1, 0.5)]
    assert lines[3]["exposed_comm_per_round_s"] == 4.8  # a peer: its time over the limit, per round of 4 steps
    assert lines[3]["tau"] == 4 and lines[1]["tau"] is None  # a peer's tau is its sync period


def _cell(method: str, repeat: int, rel: float, **extra) -> dict:
    common = {"rate": "100mbit", "ranks": 2, "model": "small", "tau": 16, "load_1m": 2.1, "invocation": "i"}
    speed = {"tokens_per_s": 1000.0 * rel, "rel_to_limit": rel, "time_per_step_s": 1 / rel, "date": "2026-12-04"}
    return {**common, **speed, "method": method, "repeat": repeat, "wire": None, **extra}


@pytest.mark.timeout(10)
def test_the_comparison_gives_medians_ranges_and_ratios_within_each_repeat(tmp_path):
    defaults = dict(wire="float32", exposed_comm_per_round_s=0.5, engine_per_round_s=0.25)
    lines = [_cell("no_comm", 0, 1.0)]
    for repeat, (co2, old, peer) in enumerate([(0.95, 0.90, 0.80), (0.90, 0.90, 0.90), (0.99, 0.85, 0.60)]):
        lines += [
            _cell("co2_stream", repeat, co2, **defaults),
            _cell("co2_stream", repeat, old, code="1a35d5a", **defaults),
        ]
        lines.append(_cell("torchft_diloco", repeat, peer, library="torchft 0.2.0"))
    rows = compare.comparison_table(lines).splitlines()
    assert len(rows) == 5  # the head, its rule, and one row per cell: no_comm left out
    assert "| CO2, the defaults (streaming, F = tau) | **0.95 (0.90-0.99)** | reference |" in rows[2]
    # lost per round against the limit, 16 (1/rel - 1) s: waits 0.5, engine 0.25, the rest
    assert "| reference | 0.50 / 0.25 / 0.09 |" in rows[2]  # the rest: median of 0.09, 1.03 and -0.59
    # the other checkout's engine against this one's, repeat by repeat: 0.95/0.90, 0.90/0.90, 0.99/0.85
    assert "at 1a35d5a | **0.90 (0.85-0.90)** | 1.06 (1.00-1.16) |" in rows[3]
    # the peer against the defaults of the same repeat: 0.95/0.80, 0.90/0.90, 0.99/0.60
    assert "| torchft 0.2.0 DiLoCo | **0.80 (0.60-0.90)** | 1.19 (1.00-1.65) | - / - / 4.00 |" in rows[4]
    doc = tmp_path / "performance.md"
    doc.write_text(f"before\n{compare.BEGIN}\nstale\n{compare.END}\nafter\n")
    compare.write_doc(str(doc), lines, "results/x.jsonl")
    text = doc.read_text()
    assert "stale" not in text and text.startswith("before\n") and text.endswith("after\n")
    assert "Measured 2026-12-04" in text and "--table results/x.jsonl --doc" in text and rows[4] in text
    doc.write_text("no markers")
    with pytest.raises(SystemExit, match="--doc .* no .* markers"):
        compare.write_doc(str(doc), lines, "results/x.jsonl")


@pytest.mark.timeout(20)
def test_a_peer_without_its_library_is_skipped_with_a_message_and_the_rest_runs(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    methods = "no_comm,co2_stream,torchft_diloco,torchft_streaming,accelerate_local_sgd"
    cli.main(["--dry-run", "--rates", "100mbit", "--no-extras", "--taus", "16", "--methods", methods])
    out = capsys.readouterr().out
    assert "# skipping torchft_diloco: torchft is not installed (pip install 'co2_hf[ft]')" in out
    assert "# skipping torchft_streaming" in out and "accelerate_local_sgd" not in out
    assert "# plan: 1 blocks, 4 runs" in out  # no_comm, co2_stream, accelerate_local_sgd, the closing no_comm


@pytest.mark.timeout(10)
def test_bad_peer_settings_are_refused_naming_the_flag(capsys, tmp_path):
    for argv, message in (
        (["--torchft-fragments", "3"], "--torchft-fragments=3 must be >= 1 and divide every --taus"),
        (["--torchft-delay", "4"], "--torchft-delay=4: allowed are 0 .. tau / --torchft-fragments - 1 = 3"),
        (["--against", str(tmp_path)], "not a checkout of this project"),
        (["--torchft-fragments", "8"], "--torchft-fragments=8: the model has only 7 modules to cut between"),
    ):
        with pytest.raises(SystemExit):
            cli.parse_args(["--taus", "16", "--methods", "no_comm,torchft_streaming", *argv])
        assert message in capsys.readouterr().err


@pytest.mark.timeout(20)
def test_torchft_streaming_fragments_are_runs_of_whole_modules_holding_each_parameter_once():
    from scripts.bandwidth import peers

    model = worker.build_model(plan.MODELS["small"], seed=0)
    parts = peers.split_modules(model, 4)
    held = [p for part in parts for p in part.parameters()]
    assert len(held) == len({id(p) for p in held}) == len(list(model.parameters()))  # the tied head once
    sizes = [sum(p.numel() for p in part.parameters()) / 1e6 for part in parts]
    assert [round(x, 2) for x in sizes] == [3.15, 1.82, 3.55, 1.78]  # cut at the block nearest each quarter
    with pytest.raises(ValueError, match="--torchft-fragments=8: the model has only 7 modules"):
        peers.split_modules(model, 8)
