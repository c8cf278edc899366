"""The outer update of CO2 as pure tensor functions (``docs/algorithm.md``, "One round").

Every function works on a slice of the flat outer state (a chunk of one process's shard) and is
dtype-generic, so the engine runs them in float32 and the tests in float64. Statistics that span
elements (per-tensor means, norms) are *inputs* here: the engine computes their local partials,
combines them through its reduction hook and passes the global values in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

EPS = 1e-12


def gap_aware_penalty(d: Tensor, u: Tensor, mean_abs_d: Tensor, lam: float) -> Tensor:
    """Elementwise ``P = 1 / max(1, lam * |u| / (mean|D| + eps))``.

    ``d`` is the stale averaged outer gradient D, ``u = alpha * m`` the anchor's move since D's base
    was current, ``mean_abs_d`` the mean of ``|D|`` over D's whole tensor, broadcast to ``d``'s
    shape, or a 0-d tensor for one whole tensor (what the engine passes: no per-element copy of the
    mean). Where the anchor already moved further than a typical element of D, that element is damped
    in proportion; ``u = 0`` gives ``P = 1``. ``d`` itself only fixes the dtype.
    """
    gap = u.abs().mul_(lam / (mean_abs_d + EPS))
    return gap.clamp_(min=1.0).reciprocal_().to(d.dtype)


def constant_penalty(lam: float) -> float:
    """``P = 1 / max(1, lam)``: the divisor of the authors' released code."""
    return 1.0 / max(1.0, lam)


def norm_sq(x: Tensor) -> Tensor:
    """``||x||^2`` in float64, as a one-element tensor (a partial statistic to be summed)."""
    return torch.linalg.vector_norm(x).double().square().view(1)


def momentum_(m: Tensor, pd: Tensor, beta: float) -> Tensor:
    """In place ``m <- beta * m + P * D`` (``pd`` already holds ``P * D``)."""
    return m.mul_(beta).add_(pd)


def clip_ratio(norm_sq: float | Tensor, phi: float | None) -> float | Tensor:
    """``min(1, phi / ||m||)``: the factor that clips the outer momentum (1 when ``phi`` is None).
    ``norm_sq`` may be a tensor on the device: the ratio then stays there (no host read)."""
    if phi is None:
        return 1.0 if not isinstance(norm_sq, Tensor) else torch.ones_like(norm_sq)
    if isinstance(norm_sq, Tensor):
        return torch.where(norm_sq <= phi * phi, 1.0, norm_sq.new_full((), phi) / norm_sq.sqrt())
    if norm_sq <= phi * phi:
        return 1.0
    return phi / norm_sq**0.5


def nesterov_direction_(pd: Tensor, m: Tensor, beta: float) -> Tensor:
    """In place ``pd <- beta * m + P * D``: the Nesterov step, using the already clipped ``m``."""
    return pd.add_(m, alpha=beta)


# ------------------------------------------------------------------ the outer step, used everywhere


def outer_step_(
    m: Tensor, pd: Tensor, beta: float, nesterov: bool, *, rescale: Callable[[Tensor], None] | None = None
) -> Tensor:
    """The outer step ``v`` of an averaged outer gradient (``pd``: ``P * D``), in place: ``m <- beta*m + P*D``,
    then ``rescale(m)`` (the engine's clipping, which needs a reduction), then ``v = m``, or with
    Nesterov ``pd <- beta*m + P*D`` and ``v = pd``. Returns ``v`` (a view of ``m`` or ``pd``).

    Elastic re-sharding (``reshard.py``) steps through here; the engine's boundaries write the same
    step in ``fragment.py`` from the same helpers (`momentum_`, `nesterov_direction_`), over the wire buffer."""
    momentum_(m, pd, beta)
    if rescale is not None:
        rescale(m)
    return nesterov_direction_(pd, m, beta) if nesterov else m


def move_anchor_(anchor: Tensor, v: Tensor, mean: Tensor, split: int, lr: float) -> None:
    """``a <- a - lr * v`` on the first ``split`` elements (parameters); ``a <- D`` on the rest (float
    buffers travel as absolute values, so their new value is the received mean ``mean``)."""
    anchor[:split].sub_(v[:split], alpha=lr)
    anchor[split:].copy_(mean[split:])


def move_anchor_where_(anchor: Tensor, v: Tensor, mean: Tensor, split: int, *, neg_lr: Tensor, take: Tensor) -> None:
    """`move_anchor_` decided on the device: ``neg_lr`` is ``-lr`` (``-0.0``: the update is skipped)
    and ``take`` whether the buffers take the mean, both 0-d tensors. One fused multiply-add, which
    rounds as ``sub_(v, alpha=lr)`` does (tests/test_update.py)."""
    anchor[:split].addcmul_(v[:split], neg_lr)
    if anchor.numel() > split:
        torch.where(take, mean[split:], anchor[split:], out=anchor[split:])


def zero_unless_(x: Tensor, keep: Tensor) -> Tensor:
    """In place ``x <- x if keep else 0``, decided on the device (``keep``: a 0-d bool tensor), NaN and
    Inf included. ``keep`` must imply that ``x`` is finite (the engine's finite check): times 1 it is
    then left exactly as it was, and times 0 its NaN and Inf, the only values left, become 0. Two
    vectorized passes: ``masked_fill_`` and ``where`` with a 0-d condition run ~8x slower on the CPU."""
    return x.mul_(keep).nan_to_num_(0.0, 0.0, 0.0)


def lookahead_offset_(out: Tensor, d: Tensor, m: Tensor, beta: float, nesterov: bool, lr: float) -> Tensor:
    """``out <- lr * v'``: the outer step the next boundary would take if the average in flight were
    this worker's own ``d`` (``m' = beta*m + d``, ``v' = m'``, Nesterov ``beta*m' + d``), ``m`` left as
    it is. A prediction: it rounds ``m'`` in one fused operation, not as `outer_step_` does (the
    fragment digests of tests/test_fragments.py pin both), and it does not predict clipping."""
    torch.add(d, m, alpha=beta, out=out)
    if nesterov:
        out.mul_(beta).add_(d)
    return out if lr == 1.0 else out.mul_(lr)  # times 1 changes no bit: the default's pass saved
