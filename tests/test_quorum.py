"""CO2 on a transport whose workers may change between rounds (torchft, ``co2_hf/torchft/``),
through the one-worker fake `QuorumCommunicator`: a quorum with nothing in flight before every
launch, one commit per all-reduce, a dropped round applies nothing, and a replica that loads a live
peer's state inside the quorum (as torchft heals one) continues exactly as that peer does. The real
thing, torchft's Lighthouse and replica groups killed and restarted: tests/test_ft.py."""

from __future__ import annotations

import copy

import pytest
import torch
from workers import SPEC_DEFAULTS, TinyNet, loss_on, make_optimizer

from co2_hf import CO2, CO2Config
from co2_hf.testing import FakeCommunicator, QuorumCommunicator

pytestmark = pytest.mark.timeout(60)


def _engine(comm, seed=0, **kw):
    model = TinyNet(seed=seed)
    optimizer = make_optimizer(model)
    co2 = CO2(model, CO2Config(**{**SPEC_DEFAULTS, **kw}), optimizer=optimizer, communicator=comm)
    return model, optimizer, co2


def _train(model, co2, optimizer, until, anchors=None):
    """Inner steps until ``co2.inner_steps == until`` (the data follows the step, so a replica that
    rejoined at step s reads what its peer reads); ``anchors[step]``: the anchor after each step."""
    while co2.inner_steps < until:
        optimizer.zero_grad()
        loss_on(model, 0, co2.inner_steps).backward()
        optimizer.step()
        co2.step()
        if anchors is not None:
            anchors[co2.inner_steps] = {k: v.clone() for k, v in co2.anchor_state().items()}


@pytest.mark.parametrize("fragments", [1, 2])
def test_every_launch_follows_a_quorum_with_nothing_in_flight_and_every_wait_one_commit(fragments):
    comm = QuorumCommunicator()
    model, optimizer, co2 = _engine(comm, co2_local_steps=4, co2_fragments=fragments)
    _train(model, co2, optimizer, 16)
    events = comm.events
    launches = [i for i, e in enumerate(events) if e == "launch"]
    assert len(launches) == 4 * fragments
    assert all(events[i - 1] == "quorum:0" for i in launches)  # nothing in flight at any quorum
    assert not [e for e in events if e.startswith("quorum:") and e != "quorum:0"]
    assert events.count("wait") == events.count("commit") == len(launches) - 1  # the last still in flight


def test_a_dropped_round_applies_nothing_and_the_rounds_after_it_run():
    kept, dropped = QuorumCommunicator(), QuorumCommunicator(drop={1})
    runs = {}
    for name, comm in (("kept", kept), ("dropped", dropped)):
        model, optimizer, co2 = _engine(comm, co2_local_steps=2)
        runs[name] = {}
        _train(model, co2, optimizer, 10, runs[name])
    kept, dropped = runs["kept"], runs["dropped"]
    floats = [n for n, v in kept[4].items() if v.is_floating_point()]  # integer buffers are not averaged
    # launch 1 (step 4) is received at step 6: kept applies it there, dropped does not move
    for name in floats:
        assert torch.equal(dropped[4][name], kept[4][name])
        assert torch.equal(dropped[6][name], dropped[4][name]), name
    assert any(not torch.equal(kept[6][n], kept[4][n]) for n in floats)
    assert any(not torch.equal(dropped[8][n], dropped[6][n]) for n in floats)  # later rounds apply


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_replica_that_loads_a_live_peer_s_state_in_the_quorum_continues_as_that_peer(fragments):
    snapshot = {}
    peer_model = peer_opt = peer = None

    def take_snapshot():  # what torchft sends a replica that is behind, at the quorum of step 12
        if peer.inner_steps == 12:
            snapshot.update(
                copy.deepcopy(
                    {"co2": peer.state_dict(), "model": peer_model.state_dict(), "optimizer": peer_opt.state_dict()}
                )
            )

    kw = dict(co2_local_steps=4, co2_fragments=fragments)
    peer_model, peer_opt, peer = _engine(QuorumCommunicator(on_quorum=take_snapshot), **kw)
    peer_anchors = {}
    _train(peer_model, peer, peer_opt, 20, peer_anchors)
    assert snapshot, "no quorum at step 12"

    def heal():  # True: the state loaded was taken at the peer's boundary
        if "co2" in snapshot:
            model.load_state_dict(snapshot["model"])
            optimizer.load_state_dict(snapshot["optimizer"])
            co2.load_state_dict(snapshot.pop("co2"))
            return True
        return False

    model, optimizer, co2 = _engine(QuorumCommunicator(on_quorum=heal), seed=1, **kw)  # another init
    assert co2.rejoin()  # the boundary the peer was running when it sent its state
    assert co2.inner_steps == 12
    anchors = {}
    _train(model, co2, optimizer, 20, anchors)
    for step in range(13, 21):
        for name, value in peer_anchors[step].items():
            assert torch.equal(anchors[step][name], value), (step, name)
    for name, value in peer_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_replica_resumed_from_a_mid_round_checkpoint_rejoins_without_running_its_boundary_again(fragments):
    """Every replica restarted from one checkpoint (torchft: all of them were lost): the state was
    saved after the boundaries at its clock ran (step 10 of rounds of 4: with 2 fragments, fragment
    0's boundary), so the first quorum launches nothing and the run goes on exactly as the one that
    saved it."""
    kw = dict(co2_local_steps=4, co2_fragments=fragments)
    model, optimizer, co2 = _engine(QuorumCommunicator(), **kw)
    _train(model, co2, optimizer, 10)
    saved = copy.deepcopy({"co2": co2.state_dict(), "model": model.state_dict(), "optimizer": optimizer.state_dict()})
    anchors = {}
    _train(model, co2, optimizer, 20, anchors)

    comm = QuorumCommunicator()
    resumed_model, resumed_optimizer, resumed = _engine(comm, seed=1, **kw)
    resumed_model.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    resumed.load_state_dict(saved["co2"])
    assert not resumed.rejoin()
    assert comm.events == ["quorum:0"]  # nothing launched: the checkpoint's boundary ran before it
    resumed_anchors = {}
    _train(resumed_model, resumed, resumed_optimizer, 20, resumed_anchors)
    for step in range(11, 21):
        for name, value in anchors[step].items():
            assert torch.equal(resumed_anchors[step][name], value), (step, name)


def test_rejoin_needs_a_transport_that_reconfigures():
    _, _, co2 = _engine(FakeCommunicator())
    with pytest.raises(RuntimeError, match="fault-tolerant communicator"):
        co2.rejoin()
