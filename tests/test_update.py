"""The outer update's pure functions on hand-computed tensors, and the worked example in float64."""

from __future__ import annotations

import pytest
import torch

from co2_hf.core import update

pytestmark = pytest.mark.timeout(30)
f64 = dict(dtype=torch.float64)

# Outer gradients d^i_t of the worked example: OUTER[t] = (worker 0, worker 1)
OUTER = [
    ((0.10, -0.20), (0.30, 0.00)),
    ((0.05, 0.10), (0.15, -0.10)),
    ((-0.20, 0.40), (0.00, 0.20)),
    ((0.10, 0.10), (0.10, 0.30)),
]
CO2_ROWS = [  # anchor, momentum, penalty after each boundary, then after finalize
    ((1.0, -2.0), (0.0, 0.0), None),
    ((0.8, -1.9), (0.2, -0.1), (1.0, 1.0)),
    ((0.675, -1.85), (0.125, -0.05), (0.25, 0.5)),
    ((0.7087783, -2.0977075), (-0.0337783, 0.2477075), (1.0, 1.0)),
    ((0.6284560, -2.3344528), (0.0803223, 0.2367453), (1.0, 0.6055528)),
]
DILOCO_ROWS = [
    ((0.7340000, -1.8670000), (0.2000000, -0.1000000)),
    ((0.4876000, -1.8103000), (0.2800000, -0.0900000)),
    ((0.4618400, -2.1582700), (0.1520000, 0.2190000)),
    ((0.2426560, -2.5484430), (0.2368000, 0.3971000)),
]


def _mean_outer(t: int) -> torch.Tensor:
    return torch.tensor(OUTER[t], **f64).mean(0)


def _co2_update(m: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One overlapped CO2 update of the example; returns (step v, penalty P)."""
    p = update.gap_aware_penalty(d, 1.0 * m, d.abs().mean().expand_as(d), lam=1.0)
    v, _ = update.outer_update(
        m, d, alpha=1.0, beta=0.5, nesterov=False, lam=1.0, mode="gap_aware", phi=0.25, stale=True
    )
    return v, p


def test_worked_example_co2_overlapped():
    anchor, m = torch.tensor([1.0, -2.0], **f64), torch.zeros(2, **f64)
    pending = None
    rows = []
    for t in range(4):
        penalty = None
        if pending is not None:  # the all-reduce launched one boundary ago
            v, penalty = _co2_update(m, pending)
            anchor = anchor - 1.0 * v
        pending = _mean_outer(t)
        rows.append((anchor.clone(), m.clone(), penalty))
    v, penalty = _co2_update(m, pending)  # finalize applies the in-flight average
    rows.append((anchor - v, m.clone(), penalty))
    for (a, mom, p), (want_a, want_m, want_p) in zip(rows, CO2_ROWS):
        torch.testing.assert_close(a, torch.tensor(want_a, **f64), atol=1e-7, rtol=0)
        torch.testing.assert_close(mom, torch.tensor(want_m, **f64), atol=1e-7, rtol=0)
        if want_p is not None:
            torch.testing.assert_close(p, torch.tensor(want_p, **f64), atol=1e-7, rtol=0)


def test_worked_example_diloco_synchronous():
    anchor, m = torch.tensor([1.0, -2.0], **f64), torch.zeros(2, **f64)
    for t, (want_a, want_m) in enumerate(DILOCO_ROWS):
        v, stats = update.outer_update(
            m,
            _mean_outer(t),
            alpha=0.7,
            beta=0.9,
            nesterov=True,
            lam=1.0,
            mode="gap_aware",
            phi=None,
            stale=False,
        )
        anchor = anchor - 0.7 * v
        assert stats["penalty_mean"] == 1.0  # nothing is stale without overlap
        torch.testing.assert_close(anchor, torch.tensor(want_a, **f64), atol=1e-7, rtol=0)
        torch.testing.assert_close(m, torch.tensor(want_m, **f64), atol=1e-7, rtol=0)


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


def test_penalty_takes_the_mean_over_each_tensor_separately():
    m = torch.tensor([1.0, 1.0, 1.0, 1.0], **f64)
    d = torch.tensor([1.0, 1.0, 0.1, 0.1], **f64)  # tensor A: mean 1; tensor B: mean 0.1
    _, stats = update.outer_update(
        m.clone(),
        d,
        alpha=1.0,
        beta=0.0,
        nesterov=False,
        lam=1.0,
        mode="gap_aware",
        phi=None,
        stale=True,
        segment_lengths=[2, 2],
    )
    # P = (1, 1) on A (gap 1) and (0.1, 0.1) on B (gap 10): mean 0.55
    assert stats["penalty_mean"] == pytest.approx(0.55)


def test_constant_penalty():
    assert update.constant_penalty(4.0) == 0.25
    assert update.constant_penalty(0.5) == 1.0
    m, d = torch.zeros(3, **f64), torch.ones(3, **f64)
    v, stats = update.outer_update(
        m, d, alpha=1.0, beta=0.0, nesterov=False, lam=4.0, mode="constant", phi=None, stale=True
    )
    torch.testing.assert_close(v, torch.full((3,), 0.25, **f64))
    assert stats["penalty_mean"] == 0.25


@pytest.mark.parametrize("mode", ["gap_aware", "constant"])
def test_no_penalty_when_not_stale(mode):
    m, d = torch.ones(3, **f64), torch.full((3,), 0.01, **f64)
    v, stats = update.outer_update(
        m, d, alpha=1.0, beta=0.5, nesterov=False, lam=100.0, mode=mode, phi=None, stale=False
    )
    torch.testing.assert_close(v, torch.full((3,), 0.51, **f64))
    assert stats["penalty_mean"] == 1.0


def test_clipping_clips_and_leaves_small_momentum_alone():
    assert update.clip_ratio(25.0, 2.5) == pytest.approx(0.5)  # ||m|| = 5 -> 2.5
    assert update.clip_ratio(4.0, 2.5) == 1.0
    assert update.clip_ratio(1e9, None) == 1.0
    m = torch.zeros(2, **f64)
    v, stats = update.outer_update(
        m,
        torch.tensor([3.0, 4.0], **f64),
        alpha=1.0,
        beta=0.0,
        nesterov=False,
        lam=0.0,
        mode="gap_aware",
        phi=1.0,
        stale=True,
    )
    torch.testing.assert_close(m, torch.tensor([0.6, 0.8], **f64))
    assert stats["clip_ratio"] == pytest.approx(0.2) and stats["momentum_norm"] == pytest.approx(1.0)
    small = torch.zeros(2, **f64)
    update.outer_update(
        small,
        torch.tensor([0.3, 0.4], **f64),
        alpha=1.0,
        beta=0.0,
        nesterov=False,
        lam=0.0,
        mode="gap_aware",
        phi=1.0,
        stale=True,
    )
    torch.testing.assert_close(small, torch.tensor([0.3, 0.4], **f64))


def test_nesterov_versus_heavy_ball():
    d = torch.tensor([1.0, -2.0], **f64)
    common = dict(alpha=1.0, beta=0.5, lam=0.0, mode="gap_aware", phi=None, stale=False)
    m_hb = torch.tensor([2.0, 2.0], **f64)
    v_hb, _ = update.outer_update(m_hb, d, nesterov=False, **common)
    torch.testing.assert_close(v_hb, torch.tensor([2.0, -1.0], **f64))  # v = m = 0.5 m + D
    m_n = torch.tensor([2.0, 2.0], **f64)
    v_n, _ = update.outer_update(m_n, d, nesterov=True, **common)
    torch.testing.assert_close(v_n, torch.tensor([2.0, -2.5], **f64))  # v = 0.5 m_new + D


def test_nesterov_clip_bounds_momentum_not_the_gradient_term():
    m = torch.zeros(2, **f64)
    d = torch.tensor([3.0, 4.0], **f64)
    v, _ = update.outer_update(
        m, d, alpha=1.0, beta=0.5, nesterov=True, lam=0.0, mode="gap_aware", phi=1.0, stale=False
    )
    torch.testing.assert_close(m, torch.tensor([0.6, 0.8], **f64))
    torch.testing.assert_close(v, 0.5 * m + d)
