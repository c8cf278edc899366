"""The outer update: the engine's pure functions and penalty rules on hand-computed tensors, and
the worked example through the naive reference (tests/reference.py) in float64.

The engine itself reproduces the same worked example in tests/test_engine_distributed.py and
matches the reference on real training in tests/test_engine_vs_reference.py.
"""

from __future__ import annotations

import pytest
import torch
from reference import ReferenceCO2
from tables import CO2_ROWS, DILOCO_ROWS, OUTER
from torch import nn

from co2_hf import CO2Config
from co2_hf.core import update
from co2_hf.core.layout import FlatLayout
from co2_hf.core.rules import ConstantPenalty, GapAwarePenalty, NoPenalty, make_penalty
from co2_hf.core.schedule import Plan

pytestmark = pytest.mark.timeout(30)
f64 = dict(dtype=torch.float64)


def _penalty(config: CO2Config, layout: FlatLayout):
    """The penalty a run with ``config`` applies to stale updates (its plan decides)."""
    return make_penalty(Plan.resolve(config), config, layout, torch.device("cpu"))


def _mean_outer(t: int) -> torch.Tensor:
    return torch.tensor(OUTER[t], **f64).mean(0)


def _reference(values: dict[str, tuple], **cfg) -> ReferenceCO2:
    """The naive reference over float64 tensors with these initial values, zero momentum."""
    module = nn.Module()
    for name, value in values.items():
        module.register_parameter(name, nn.Parameter(torch.tensor(value, **f64)))
    return ReferenceCO2([module], CO2Config(co2_local_steps=1, **cfg))


def _step(ref: ReferenceCO2, d: dict[str, torch.Tensor], *, stale: bool) -> dict[str, torch.Tensor]:
    """One outer update of the reference; returns the step v (anchor move / -alpha)."""
    before = {n: a.clone() for n, a in ref.anchor.items()}
    ref.apply(d, {}, stale=stale)
    return {n: (before[n] - ref.anchor[n]) / ref.cfg.co2_outer_lr for n in d}


CO2_EXAMPLE = dict(co2_outer_lr=1.0, co2_outer_momentum=0.5, co2_gap_penalty=1.0, co2_clip_threshold=0.25)


def test_worked_example_co2_overlapped():
    ref = _reference({"w": (1.0, -2.0)}, **CO2_EXAMPLE)
    pending = None
    rows = []
    for t in range(4):
        penalty = None
        if pending is not None:  # the all-reduce launched one boundary ago
            ref.apply({"w": pending}, {}, stale=True)
            penalty = ref.penalties[-1]["w"]
        pending = _mean_outer(t)
        rows.append((ref.anchor["w"].clone(), ref.momentum["w"].clone(), penalty))
    ref.apply({"w": pending}, {}, stale=True)  # finalize applies the in-flight average
    rows.append((ref.anchor["w"].clone(), ref.momentum["w"].clone(), ref.penalties[-1]["w"]))
    for (a, mom, p), (want_a, want_m, want_p) in zip(rows, CO2_ROWS):
        torch.testing.assert_close(a, torch.tensor(want_a, **f64), atol=1e-7, rtol=0)
        torch.testing.assert_close(mom, torch.tensor(want_m, **f64), atol=1e-7, rtol=0)
        if want_p is not None:
            torch.testing.assert_close(p, torch.tensor(want_p, **f64), atol=1e-7, rtol=0)


def test_worked_example_penalty_is_the_engines_gap_aware_rule():
    """Boundary 2 of the example (D = (0.1, 0), m = (0.2, -0.1)) through the engine's own rule."""
    d, m = torch.tensor([0.1, 0.0]), torch.tensor([0.2, -0.1])
    penalty = GapAwarePenalty(CO2Config(**CO2_EXAMPLE), FlatLayout(_module(w=2)), torch.device("cpu"))
    total = penalty.scale_(d, m, penalty.partials(d)[:-1])
    torch.testing.assert_close(d, torch.tensor([0.025, 0.0]))  # P = (0.25, 0.5)
    assert float(total) == pytest.approx(0.75)


def test_worked_example_diloco_synchronous():
    ref = _reference(
        {"w": (1.0, -2.0)}, co2_outer_lr=0.7, co2_outer_momentum=0.9, co2_nesterov=True, co2_gap_penalty=1.0
    )
    for t, (want_a, want_m) in enumerate(DILOCO_ROWS):
        ref.apply({"w": _mean_outer(t)}, {}, stale=False)
        assert torch.equal(ref.penalties[-1]["w"], torch.ones(2, **f64))  # nothing is stale without overlap
        torch.testing.assert_close(ref.anchor["w"], torch.tensor(want_a, **f64), atol=1e-7, rtol=0)
        torch.testing.assert_close(ref.momentum["w"], torch.tensor(want_m, **f64), atol=1e-7, rtol=0)


def _module(**sizes: int) -> nn.Module:
    module = nn.Module()
    for name, size in sizes.items():
        module.register_parameter(name, nn.Parameter(torch.zeros(size)))
    return module


def test_gap_aware_penalty_hand_computed():
    d = torch.tensor([0.2, -0.2, 0.4, 0.0], **f64)  # mean |D| = 0.2
    u = torch.tensor([0.1, 0.6, -1.0, 0.0], **f64)  # |u| / 0.2 = 0.5, 3, 5, 0
    mean = d.abs().mean().expand_as(d)
    torch.testing.assert_close(
        update.gap_aware_penalty(d, u, mean, lam=1.0), torch.tensor([1.0, 1 / 3, 0.2, 1.0], **f64)
    )
    # lam scales the gap: 2 * (0.5, 3, 5, 0) = (1, 6, 10, 0)
    torch.testing.assert_close(
        update.gap_aware_penalty(d, u, mean, lam=2.0), torch.tensor([1.0, 1 / 6, 0.1, 1.0], **f64)
    )


def test_penalty_is_one_when_the_anchor_has_not_moved():
    d = torch.randn(10, **f64)
    p = update.gap_aware_penalty(d, torch.zeros_like(d), d.abs().mean().expand_as(d), lam=5.0)
    assert torch.equal(p, torch.ones_like(d))


@pytest.mark.parametrize("chunk_numel", [4, 3, 1])  # one chunk, a tensor split over chunks, one per element
def test_penalty_takes_the_mean_over_each_tensor_separately(chunk_numel):
    m = torch.tensor([1.0, 1.0, 1.0, 1.0])
    d = torch.tensor([1.0, 1.0, 0.1, 0.1])  # tensor A: mean 1; tensor B: mean 0.1
    layout = FlatLayout(_module(a=2, b=2), chunk_numel=chunk_numel)
    penalty = GapAwarePenalty(CO2Config(co2_gap_penalty=1.0), layout, torch.device("cpu"))
    total = penalty.scale_(d, m, penalty.partials(d)[:-1])
    # P = (1, 1) on A (gap 1) and (0.1, 0.1) on B (gap 10): mean 0.55
    assert float(total) / 4 == pytest.approx(0.55)
    torch.testing.assert_close(d, torch.tensor([1.0, 1.0, 0.01, 0.01]))
    # the reference agrees
    ref = _reference({"a": (0.0, 0.0), "b": (0.0, 0.0)}, co2_outer_momentum=0.0, co2_gap_penalty=1.0)
    ref.momentum = {"a": torch.ones(2, **f64), "b": torch.ones(2, **f64)}
    ref.apply({"a": torch.ones(2, **f64), "b": torch.full((2,), 0.1, **f64)}, {}, stale=True)
    assert float(torch.cat(list(ref.penalties[-1].values())).mean()) == pytest.approx(0.55)


def test_constant_penalty():
    assert update.constant_penalty(4.0) == 0.25
    assert update.constant_penalty(0.5) == 1.0
    cfg = dict(co2_gap_penalty=4.0, co2_gap_penalty_mode="constant", co2_fragments=1)
    penalty = _penalty(CO2Config(**cfg), FlatLayout(_module(w=3)))
    assert isinstance(penalty, ConstantPenalty)
    d = torch.ones(3)
    assert float(penalty.scale_(d, torch.zeros(3), penalty.partials(d)[:-1])) == pytest.approx(0.75)
    torch.testing.assert_close(d, torch.full((3,), 0.25))
    ref = _reference({"w": (0.0, 0.0, 0.0)}, co2_outer_momentum=0.0, **cfg)
    v = _step(ref, {"w": torch.ones(3, **f64)}, stale=True)
    torch.testing.assert_close(v["w"], torch.full((3,), 0.25, **f64))


def test_penalty_off_is_no_penalty():
    layout = FlatLayout(_module(w=3))
    assert type(_penalty(CO2Config(co2_gap_penalty=0.0), layout)) is NoPenalty
    d = torch.full((3,), 0.01)
    assert float(NoPenalty().scale_(d, torch.ones(3), NoPenalty().partials(d)[:-1])) == 3.0
    assert torch.equal(d, torch.full((3,), 0.01))


@pytest.mark.parametrize("mode", ["gap_aware", "constant"])
def test_no_penalty_when_not_stale(mode):
    ref = _reference({"w": (0.0, 0.0, 0.0)}, co2_outer_momentum=0.5, co2_gap_penalty=100.0, co2_gap_penalty_mode=mode)
    ref.momentum = {"w": torch.ones(3, **f64)}
    v = _step(ref, {"w": torch.full((3,), 0.01, **f64)}, stale=False)
    torch.testing.assert_close(v["w"], torch.full((3,), 0.51, **f64))
    assert torch.equal(ref.penalties[-1]["w"], torch.ones(3, **f64))


def test_clipping_clips_and_leaves_small_momentum_alone():
    assert update.clip_ratio(25.0, 2.5) == pytest.approx(0.5)  # ||m|| = 5 -> 2.5
    assert update.clip_ratio(4.0, 2.5) == 1.0
    assert update.clip_ratio(1e9, None) == 1.0
    assert update.clip_ratio(25.0, 1.0) == pytest.approx(0.2)
    cfg = dict(co2_outer_momentum=0.0, co2_gap_penalty=0.0, co2_clip_threshold=1.0)
    ref = _reference({"w": (0.0, 0.0)}, **cfg)
    ref.apply({"w": torch.tensor([3.0, 4.0], **f64)}, {}, stale=True)
    torch.testing.assert_close(ref.momentum["w"], torch.tensor([0.6, 0.8], **f64))
    assert float(ref.momentum["w"].norm()) == pytest.approx(1.0)
    small = _reference({"w": (0.0, 0.0)}, **cfg)
    small.apply({"w": torch.tensor([0.3, 0.4], **f64)}, {}, stale=True)
    torch.testing.assert_close(small.momentum["w"], torch.tensor([0.3, 0.4], **f64))


def test_nesterov_versus_heavy_ball():
    d = {"w": torch.tensor([1.0, -2.0], **f64)}
    common = dict(co2_outer_lr=1.0, co2_outer_momentum=0.5, co2_gap_penalty=0.0)
    hb = _reference({"w": (0.0, 0.0)}, **common)
    hb.momentum = {"w": torch.tensor([2.0, 2.0], **f64)}
    torch.testing.assert_close(_step(hb, d, stale=False)["w"], torch.tensor([2.0, -1.0], **f64))  # v = m = 0.5 m + D
    nesterov = _reference({"w": (0.0, 0.0)}, co2_nesterov=True, **common)
    nesterov.momentum = {"w": torch.tensor([2.0, 2.0], **f64)}
    v = _step(nesterov, d, stale=False)["w"]
    torch.testing.assert_close(v, torch.tensor([2.0, -2.5], **f64))  # v = 0.5 m_new + D
    # the engine's pure functions compose to the same step
    m, pd = torch.tensor([2.0, 2.0], **f64), d["w"].clone()
    update.momentum_(m, pd, 0.5)
    torch.testing.assert_close(update.nesterov_direction_(pd, m, 0.5), v)


def test_nesterov_clip_bounds_momentum_not_the_gradient_term():
    ref = _reference(
        {"w": (0.0, 0.0)}, co2_outer_momentum=0.5, co2_nesterov=True, co2_gap_penalty=0.0, co2_clip_threshold=1.0
    )
    d = torch.tensor([3.0, 4.0], **f64)
    v = _step(ref, {"w": d}, stale=False)["w"]
    torch.testing.assert_close(ref.momentum["w"], torch.tensor([0.6, 0.8], **f64))
    torch.testing.assert_close(v, 0.5 * ref.momentum["w"] + d)


@pytest.mark.parametrize(
    ("settings", "rule"),
    [
        (dict(co2_start_rule="anchor"), "AnchorStart"),
        (dict(co2_start_rule="eager"), "EagerStart"),
        (dict(), "LookaheadStart"),  # the default
        (dict(co2_start_rule="lookahead"), "LookaheadStart"),
        (dict(co2_overlap=False), "AnchorStart"),  # the default lookahead, no overlap: nothing to anticipate
    ],
)
def test_the_start_rule_is_picked_once_from_its_table(settings, rule):
    from co2_hf.core.rules import make_start_rule

    config = CO2Config(**settings)
    start = make_start_rule(Plan.resolve(config), config, torch.zeros(3), 3, dtype=torch.float32)
    assert type(start).__name__ == rule
    assert (start.offset is None) == (rule == "AnchorStart")  # the anchor rule holds no memory


def test_the_round_schedule_says_what_is_due_after_each_step():
    from co2_hf.core.schedule import Event

    apply, boundary = Event.APPLY_IN_ROUND, Event.BOUNDARY
    full = Plan.resolve(CO2Config(co2_local_steps=3, co2_fragments=1))
    assert [full.due(s) for s in (1, 2, 3)] == [(), (), ((boundary, 0),)]
    window = Plan.resolve(CO2Config(co2_local_steps=3, co2_overlap_steps=1))
    assert [window.due(s) for s in (1, 2, 3)] == [((apply, 0),), (), ((boundary, 0),)]
    # three fragments, tau 6: every 2 steps the previous fragment applies, then the next one launches
    streaming = Plan.resolve(CO2Config(co2_local_steps=6, co2_fragments=3))
    assert [streaming.due(s) for s in range(1, 7)] == [
        (),
        ((apply, 2), (boundary, 0)),
        (),
        ((apply, 0), (boundary, 1)),
        (),
        ((apply, 1), (boundary, 2)),
    ]
    # steps since each fragment's boundary, in the first round (none yet) and later ones
    assert [streaming.steps_since_boundary(f, 0, 3) for f in range(3)] == [1, 3, 3]
    assert [streaming.steps_since_boundary(f, 1, 3) for f in range(3)] == [1, 5, 3]
    assert [full.steps_since_boundary(0, 4, s) for s in (0, 2)] == [0, 2]


def test_fragments_have_no_penalty_since_no_fragment_update_is_stale():
    layout = FlatLayout(_module(w=3))
    assert type(_penalty(CO2Config(co2_gap_penalty=1.0), layout)) is NoPenalty
    one = CO2Config(co2_gap_penalty=1.0, co2_fragments=1)
    assert type(_penalty(one, layout)) is GapAwarePenalty


@pytest.mark.parametrize("lr", [1.0, 0.7, 0.8, 0.35])
def test_the_anchor_step_decided_on_the_device_rounds_as_the_host_s_and_a_skip_moves_nothing(lr):
    """`move_anchor_where_` takes ``-lr`` as a 0-d tensor (``-0.0`` for a skipped D) and whether the
    buffers take the mean: its fused multiply-add gives the bits of ``sub_(v, alpha=lr)``, so the
    golden digests of tests/test_fragments.py hold."""
    g = torch.Generator().manual_seed(0)
    anchor, v, mean = (torch.randn(100_003, generator=g) for _ in range(3))
    split = 100_000
    want = anchor.clone()
    update.move_anchor_(want, v, mean, split, lr)
    got = anchor.clone()
    update.move_anchor_where_(got, v, mean, split, neg_lr=torch.tensor(-lr), take=torch.tensor(True))
    assert torch.equal(got, want)
    skipped = anchor.clone()
    update.move_anchor_where_(skipped, v, mean, split, neg_lr=torch.tensor(0.0) * -lr, take=torch.tensor(False))
    assert torch.equal(skipped, anchor)


def test_the_clip_ratio_on_the_device_equals_the_host_s():
    for norm_sq, phi in [(25.0, 2.5), (4.0, 2.5), (1e-9, 1e-3), (7.3, 1.1)]:
        on_device = update.clip_ratio(torch.tensor(norm_sq, dtype=torch.float64), phi)
        assert float(on_device) == update.clip_ratio(norm_sq, phi)
    assert float(update.clip_ratio(torch.tensor(9.0, dtype=torch.float64), None)) == 1.0
