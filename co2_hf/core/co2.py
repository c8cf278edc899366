"""`CO2`: the engine's state and the phases of one round (``docs/algorithm.md``).

A round boundary with overlap runs, on every rank and in this order:

1. ``_receive``  -- wait for the all-reduce launched one boundary ago; it holds ``D_{t-1}``;
2. ``_direction`` -- staleness penalty ``P``, ``m <- beta*m + P*D``, clip ``m``, step ``v``;
3. ``_exchange``  -- chunk by chunk: ``d = a - x``, ``a <- a - alpha*v``, buffer <- ``d``;
4. ``_launch``    -- start the all-reduce of this round's ``d`` (never of live parameters);
5. ``_reset_live`` -- ``x <- a``, written in place into the existing parameter tensors.

With overlap off the same phases run as exchange, launch, receive, direction, move anchor, reset.
One fp32 communication buffer carries ``D`` in and ``d`` out; scratch memory is one chunk.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from ..config import CO2Config
from . import update
from .comm import Communicator, Pending, make_communicator
from .layout import DEFAULT_CHUNK_NUMEL, FlatLayout
from .state import CheckpointMixin

logger = logging.getLogger(__name__)

ROUND_BITS = 32  # the round index travels as bits: any disagreement gives a bit sum in (0, G)
TIMEOUT_CHECK_BOUNDARY = 3  # co2_timeout_s is compared with the round timed between boundaries 2 and 3


class CO2(CheckpointMixin):
    """CO2 data-parallel training around an ``nn.Module``; call ``step()`` after each optimizer step.

    Args:
        model: the module to train; construct CO2 after moving it to its device.
        config: the ``co2_*`` settings (``CO2Config()`` when None).
        optimizer: the inner optimizer; when given, a worker found non-finite has its state cleared.
        process_group: the group of workers; None makes a dedicated group over all ranks of the
            default group (collective: every rank constructs CO2 at the same point), or runs a
            single worker when torch.distributed is not initialised.
        communicator: overrides ``process_group`` with an injected communicator (tests).
    """

    def __init__(
        self,
        model: nn.Module,
        config: CO2Config | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        process_group: Any = None,
        communicator: Communicator | None = None,
        *,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
    ) -> None:
        self.config = cfg = config if config is not None else CO2Config()
        if not cfg.co2_enabled:
            raise ValueError("co2_enabled=False: train without CO2 (plain data parallel) instead")
        if cfg.co2_overlap_steps is not None and cfg.co2_start_rule == "anchor":
            logger.warning(
                "CO2: co2_overlap_steps=%d with co2_start_rule='anchor' makes every worker redo the "
                "first %d steps of its last round and count them twice (docs/algorithm.md, 7a); "
                "co2_start_rule='eager' avoids it",
                cfg.co2_overlap_steps,
                cfg.co2_overlap_steps,
            )
        self.model, self.optimizer = model, optimizer
        self.device = _state_device(model, cfg)
        self.comm = communicator or make_communicator(
            process_group=process_group,
            state_device=self.device,
            timeout_s=cfg.co2_timeout_s,
            worker_size=cfg.co2_worker_size,
            sharded_params=_has_dtensors(model),
        )
        if self.comm.worker_size != cfg.co2_worker_size:
            raise ValueError(
                f"co2_worker_size={cfg.co2_worker_size} but the communicator has {self.comm.worker_size} "
                "process(es) per worker"
            )
        self.num_workers = cfg.check_world(self.comm.num_workers * self.comm.worker_size)
        self.layout = FlatLayout(
            model,
            worker_size=self.comm.worker_size,
            shard_index=self.comm.shard_index,
            chunk_numel=chunk_numel,
        )
        if self.layout.presharded:  # FSDP2 inside the worker, never across workers
            self.layout.check_sharded_over(self.comm.worker_ranks())
        n = self.layout.shard_numel
        self._header = n  # buffer slots: [payload n | weight | round bits | one wait time per worker]
        zeros = dict(dtype=torch.float32, device=self.device, pin_memory=_pin_state(model, self.device))
        self._anchor = torch.zeros(n, **zeros)
        self._momentum = torch.zeros(n, **zeros)
        self._buf = torch.zeros(n + 1 + ROUND_BITS + self.num_workers, **zeros)
        wire_dtype = torch.bfloat16 if cfg.co2_comm_dtype == "bfloat16" else torch.float32
        self._wire = self._buf if wire_dtype == torch.float32 else self._buf.to(wire_dtype)
        eager = cfg.co2_overlap and cfg.co2_start_rule in ("eager", "lookahead")
        self._own = torch.zeros(self.layout.param_local, **zeros) if eager else None
        self._pending: Pending | None = None
        self._sent_round = 0  # the round whose outer gradients the pending all-reduce carries
        self._have_d = False  # the buffer holds a received D, not yet applied
        self.inner_steps = 0  # inner steps since construction (all of them, AMP-skipped included)
        self.round = 0  # index t of the current round
        self.round_step = 0  # inner steps taken in the current round
        self.warmup_done = cfg.co2_sync_warmup_steps == 0
        self.amp_skipped_steps = 0
        self.skipped_rounds = 0
        self._consecutive_skipped = 0
        self._last_wait_s = 0.0
        self.last_comm_s = 0.0  # launch-to-completion of the last all-reduce received (this rank)
        self._boundaries_run = 0  # by this instance (not saved): the timeout check runs at the third
        self._round_started: float | None = None
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._param_pieces = self._index_param_pieces()
        self._piece_segment_ids = torch.tensor([sid for sid, _, _ in self._param_pieces], device=self.device)
        # chunk c of every shard of this worker, in shard order: what an all-gather of chunk c fills
        # (pre-sharded by FSDP2: this process's own chunks only, nothing is gathered)
        shards = [self.layout.chunks]
        if self.layout.gathers:
            shards = [
                self.layout.chunks if j == self.layout.shard_index else self.layout.shard_chunks(j)
                for j in range(self.layout.worker_size)
            ]
        self._chunks_of_every_shard = list(zip(*shards))
        self._take_anchor()

    # ------------------------------------------------------------------ public API

    def step(self, *, skipped: bool = False) -> bool:
        """Count one inner step (``skipped``: AMP skipped it); run a boundary after ``tau`` of them.

        Returns True when a round boundary ran.
        """
        self.inner_steps += 1
        self.amp_skipped_steps += int(skipped)
        if not self.warmup_done:
            if self.inner_steps >= self.config.co2_sync_warmup_steps:
                self._take_anchor()
                self.warmup_done = True
            return False
        self.round_step += 1
        if self.round_step == self.config.co2_overlap_steps:
            self._apply_in_round()
        if self.round_step < self.config.co2_local_steps:
            return False
        self._boundary()
        return True

    @property
    def last_wait_s(self) -> float:
        """Seconds this rank was blocked waiting at the last boundary (exposed communication)."""
        return self._last_wait_s

    @property
    def in_warmup(self) -> bool:
        """True during ``co2_sync_warmup_steps``, while training is ordinary data parallel."""
        return not self.warmup_done

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Average gradients: over every process during the warm-up (plain data parallel), then
        over the processes of this worker when ``co2_worker_size > 1``; else nothing.

        Call it after ``backward()`` and before the optimizer step (before unscaling, with AMP).
        """
        k = self.comm.worker_size
        # under FSDP2 the worker's gradients are already averaged (reduce-scattered) by FSDP
        if self.warmup_done and (k == 1 or self.layout.presharded):
            return
        grads = self._local_grads()
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        if not self.warmup_done:
            self.comm.all_reduce_(flat)  # every process; under FSDP2 the copies of this shard
            flat.div_(self.num_workers if self.layout.presharded else self.num_workers * k)
        else:
            self.comm.worker_all_reduce_(flat)
            flat.div_(k)
        torch._foreach_copy_([g.view(-1) for g in grads], list(flat.split([g.numel() for g in grads])))

    def _local_grads(self) -> list[Tensor]:
        """The gradient of every synchronised parameter as a plain tensor (its local shard under
        FSDP2), zeros where a parameter got none."""
        grads = []
        for segment in self.layout.segments:
            if not segment.is_param:
                continue
            param = segment.dtensor if segment.dtensor is not None else segment.tensor
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
            grads.append(grad.to_local() if segment.dtensor is not None else grad)
        return grads

    @torch.no_grad()
    def finalize(self) -> None:
        """End of training: apply every worker's steps and leave all workers on the final anchor.

        A partial round runs its boundary now; an in-flight all-reduce is waited for and applied
        with the same rule. Afterwards nothing is in flight, the round counters restart at 0 and
        the outer momentum is kept.
        """
        if not self.warmup_done:
            self._take_anchor()
            self.warmup_done = True
        if self.round_step > 0:
            self._boundary()
        if self._receive(record=False):
            # with a partial-overlap window nothing moved the anchor since this D's base
            self._direction(stale=self.config.co2_overlap_steps is None)
            self._exchange(apply=True, write=False)
            self._have_d = False
        if self._own is not None:
            self._own.zero_()
        self._reset_live(buffers=True)
        self.round = self.round_step = 0

    def anchor_state(self) -> dict[str, Tensor]:
        """The module's ``state_dict`` with every synchronised tensor taken from the anchor.

        Values are in each tensor's own dtype and on its own device (views of the fp32 anchor where
        both match; copies when the state is held in host memory, ``co2_state_device=cpu``):
        read-only, valid until the next boundary. During the warm-up the live tensors are the
        global model and are returned as they are.
        """
        state = self.model.state_dict()
        if not self.warmup_done:
            return state
        anchor = self._full_anchor() if self.layout.gathers else self._anchor
        for segment in self.layout.segments:
            flat = anchor[segment.offset : segment.offset + segment.numel]
            # on the tensor's own device: host-memory state (co2_state_device=cpu) is copied there
            value = flat.view(segment.tensor.shape).to(device=segment.tensor.device, dtype=segment.tensor.dtype)
            if segment.dtensor is not None:  # FSDP2: the anchor's local shard, as a DTensor
                d = segment.dtensor
                value = DTensor.from_local(value, d.device_mesh, d.placements, shape=d.shape, stride=d.stride())
            for name in segment.names:
                state[name] = value
        return state

    @contextlib.contextmanager
    def anchor_in_place(self):
        """Within the block the live tensors hold the anchor; on exit they get their own values back.

        For evaluating the shared model where parameters cannot be swapped for other tensors
        (FSDP2 all-gathers its own shards in forward); elsewhere prefer `anchor_state` with
        ``torch.func.functional_call``, which copies nothing. Costs one copy of this process's
        live tensors. Issues no collective unless the worker splits a flat state between its
        processes (``co2_worker_size > 1`` without FSDP2), which all-gathers the anchor.
        """
        if not self.warmup_done:  # the live tensors are the global model
            yield
            return
        saved = [segment.tensor.detach().clone() for segment in self.layout.segments]
        try:
            _reshard_fsdp(self.model)  # FSDP2 must gather the shards anew, with the anchor in them
            with torch.no_grad():
                for chunk, every_shard in zip(self.layout.chunks, self._chunks_of_every_shard):
                    for part, piece in zip(self._worker_parts(self._anchor[chunk.start : chunk.stop]), every_shard):
                        _scatter_live(piece, part, len(piece.live))
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([s.tensor for s in self.layout.segments], saved)
            # a forward without backward leaves FSDP2's root unsharded, holding the anchor: drop it,
            # so that training gathers the live shards again
            _reshard_fsdp(self.model)

    def outer_state_nbytes(self) -> int:
        """Bytes of persistent outer state held by this process (anchor, momentum, buffers)."""
        tensors = [self._anchor, self._momentum, self._buf]
        tensors += [t for t in (self._own,) if t is not None]
        if self._wire is not self._buf:
            tensors.append(self._wire)
        return sum(t.numel() * t.element_size() for t in tensors)

    def pop_metrics(self) -> dict[str, float]:
        """Mean of each per-round metric since the last call, plus the running counters."""
        out = {f"co2/{k}": sum(v) / len(v) for k, v in self._metrics.items() if v}
        if "co2/comm_s" in out and "co2/comm_wait_s" in out and out["co2/comm_s"] > 0:
            out["co2/hidden_frac"] = min(max(1 - out["co2/comm_wait_s"] / out["co2/comm_s"], 0.0), 1.0)
        out["co2/amp_skipped_steps"] = float(self.amp_skipped_steps)
        out["co2/skipped_rounds"] = float(self.skipped_rounds)
        self._metrics.clear()
        return out

    # ------------------------------------------------------------------ the round

    @torch.no_grad()
    def _boundary(self) -> None:
        compute_s = time.perf_counter() - self._round_started if self._round_started is not None else 0.0
        with record_function("co2/boundary"):
            if self.config.co2_overlap:
                have_d = self._receive(record=True)
                if have_d:
                    self._direction(stale=True)
                finite = self._exchange(apply=have_d, write=True)
                self._launch(finite)
                self._reset_live(buffers=have_d or not finite)
            else:
                finite = self._exchange(apply=False, write=True)
                self._launch(finite)
                if self._receive(record=True):
                    self._direction(stale=False)
                    self._exchange(apply=True, write=False)
                self._reset_live(buffers=True)
            self._have_d = False
            self.round += 1
            self.round_step = 0
        self._boundaries_run += 1
        if self._boundaries_run == TIMEOUT_CHECK_BOUNDARY:
            self._check_timeout(compute_s, self.last_comm_s)
        self._round_started = time.perf_counter()

    def _check_timeout(self, compute_s: float, comm_s: float) -> None:
        """Warn once when co2_timeout_s leaves too little room: a peer that is merely one slow
        round behind would be taken for a dead one. Measured after the first rounds, which may
        include compilation and warm-up."""
        needed = 2 * (compute_s + comm_s)
        if self.config.co2_timeout_s < needed:
            logger.warning(
                "CO2: co2_timeout_s=%gs is shorter than twice a round's compute (%.3gs) plus one outer "
                "all-reduce (%.3gs): a slow round could be taken for a dead peer. Set co2_timeout_s "
                "to at least %.3g.",
                self.config.co2_timeout_s,
                compute_s,
                comm_s,
                needed,
            )

    def _receive(self, *, record: bool) -> bool:
        """Wait for the in-flight all-reduce, if any; return True when the buffer holds a D."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self._have_d
        start = time.perf_counter()
        with record_function("co2/wait"):
            try:
                self.comm.wait(pending, self.config.co2_timeout_s)
            except RuntimeError as error:
                raise self._peer_failure(error) from error
        self._last_wait_s = pending.wait_seconds(since=start) if record else 0.0
        self.last_comm_s = pending.comm_seconds()
        self._metrics["comm_s"].append(self.last_comm_s)
        if self._wire is not self._buf:
            self._buf.copy_(self._wire)
        self._have_d = self._unpack_header()
        return self._have_d

    def _unpack_header(self) -> bool:
        """Check the round bits, read the wait times, turn the sum into a mean over finite workers."""
        h, g = self._header, self.num_workers
        bits = self._buf[h + 1 : h + 1 + ROUND_BITS]
        expected = ((self._sent_round >> torch.arange(ROUND_BITS)) & 1).to(bits) * g
        if not torch.equal(bits, expected.to(bits.device)):
            raise RuntimeError(
                f"CO2: ranks out of step at round {self._sent_round}: the outer all-reduce mixed "
                "different rounds (every rank must call CO2.step() once per inner step)"
            )
        self._metrics["comm_wait_s"].append(float(self._buf[h + 1 + ROUND_BITS :].max()))
        count = float(self._buf[h])
        if count < 0.5:  # no worker was finite: skip this outer update
            self.skipped_rounds += 1
            self._consecutive_skipped += 1
            limit = self.config.co2_max_skipped_rounds
            if limit and self._consecutive_skipped >= limit:
                raise RuntimeError(
                    f"CO2: no worker had a finite outer gradient for {self._consecutive_skipped} "
                    f"consecutive rounds (co2_max_skipped_rounds={limit}); stopping"
                )
            return False
        self._consecutive_skipped = 0
        self._buf[:h].div_(count)
        return True

    def _direction(self, *, stale: bool) -> None:
        """Turn the received D (buffer) into the step v: penalty, momentum, clip, Nesterov."""
        cfg, n = self.config, self.layout.param_local
        d, m = self._buf[:n], self._momentum[:n]
        lam = cfg.co2_gap_penalty if stale else 0.0
        gap_aware = lam > 0 and cfg.co2_gap_penalty_mode == "gap_aware"
        sums = self.comm.reduce_stats(self._segment_abs_sums(d) if gap_aware else _norm_sq(d))
        self._metrics["outer_grad_norm"].append(float(sums[-1]) ** 0.5)
        penalty_sum = self._apply_penalty(d, m, sums[:-1] if gap_aware else None, lam)
        update.momentum_(m, d, cfg.co2_outer_momentum)
        stats = self.comm.reduce_stats(torch.stack([_norm_sq(m)[0], penalty_sum]))
        ratio = update.clip_ratio(float(stats[0]), cfg.co2_clip_threshold)
        if ratio < 1.0:
            m.mul_(ratio)
        if cfg.co2_nesterov:
            update.nesterov_direction_(d, m, cfg.co2_outer_momentum)
        self._metrics["momentum_norm"].append(float(stats[0]) ** 0.5 * ratio)
        self._metrics["clip_ratio"].append(ratio)
        self._metrics["penalty_mean"].append(float(stats[1]) / max(self.layout.total_param_numel, 1))

    def _segment_abs_sums(self, d: Tensor) -> Tensor:
        """Local partial sums of |D| per synchronised tensor, then ||D||^2, in float64.

        One fused reduction per piece of a tensor (``vector_norm`` with ord 1 allocates nothing),
        instead of materialising ``|D|``: this runs once per round over the whole shard."""
        sums = torch.zeros(len(self.layout.segments) + 1, dtype=torch.float64, device=d.device)
        parts = [torch.linalg.vector_norm(d[lo:hi], ord=1) for _, lo, hi in self._param_pieces]
        if parts:
            sums.index_add_(0, self._piece_segment_ids, torch.stack(parts).double())
        sums[-1] = _norm_sq(d)[0]
        return sums

    def _apply_penalty(self, d: Tensor, m: Tensor, seg_sums: Tensor | None, lam: float) -> Tensor:
        """In place ``d <- P * d``; return the local sum of P over parameter elements."""
        n = d.numel()
        if lam <= 0:
            return torch.tensor(float(n), dtype=torch.float64, device=d.device)
        if seg_sums is None:  # constant form
            p = update.constant_penalty(lam)
            d.mul_(p)
            return torch.tensor(p * n, dtype=torch.float64, device=d.device)
        means = (seg_sums / self.layout.segment_numels.to(seg_sums.device)).float()
        alpha = self.config.co2_outer_lr
        totals = []
        for sid, lo, hi in self._param_pieces:  # each piece lies in one tensor: its mean is a scalar
            u = m[lo:hi] if alpha == 1.0 else m[lo:hi] * alpha
            p = update.gap_aware_penalty(d[lo:hi], u, means[sid], lam)
            d[lo:hi].mul_(p)
            totals.append(p.sum(dtype=torch.float64))
        return torch.stack(totals).sum() if totals else torch.zeros((), dtype=torch.float64, device=d.device)

    def _exchange(self, *, apply: bool, write: bool) -> bool:
        """Chunk by chunk: ``d = start - x`` (write), ``a <- a - alpha*v`` (apply), buffer <- d.

        Buffers (BatchNorm statistics) travel as absolute values: ``apply`` sets their anchor to
        the received mean and ``write`` sends their live value. Returns whether d is finite.
        """
        alpha = self.config.co2_outer_lr
        v = self._buf if self.config.co2_nesterov else self._momentum
        # One sum per chunk: NaN and Inf propagate through it, and it is ~30x cheaper than
        # isfinite().all(). (A sum of finite values beyond float32's range also counts as
        # non-finite; such an outer gradient is unusable anyway.) Stays on device: no sync.
        sums = []
        for chunk in self.layout.chunks:
            lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
            if write:
                x = self._gather_live(chunk)
                torch.sub(self._anchor[lo:mid], x[: mid - lo], out=x[: mid - lo])
                if self._own is not None:
                    x[: mid - lo].sub_(self._own[lo:mid])
                sums.append(x.sum())
            if apply:
                self._anchor[lo:mid].sub_(v[lo:mid], alpha=alpha)
                self._anchor[mid:hi].copy_(self._buf[mid:hi])
            if write:
                if self._own is not None:  # eager: where the next round starts, relative to a
                    self._own_offset(lo, mid, x[: mid - lo], v[lo:mid] if apply else None)
                self._buf[lo:hi].copy_(x)
        if not write:
            return True
        finite = torch.isfinite(torch.stack(sums)).all() if sums else torch.ones((), dtype=torch.bool)
        return bool(self.comm.reduce_stats(finite.double().view(1).to(self.device)) >= self.comm.worker_size)

    def _own_offset(self, lo: int, mid: int, d: Tensor, v: Tensor | None) -> None:
        """Where the next round starts, as ``a - own``, from ``d`` (this worker's outer gradient just
        measured) and ``alpha * v`` (the anchor's move just applied; None when none was):

        - eager: ``own <- gamma * d + (1 - gamma) * alpha * v``;
        - lookahead: ``own <- alpha * step(d)``, the move the next boundary would apply if the
          in-flight average equalled ``d``: ``m' = beta * m + d`` and ``step = m'`` (Nesterov:
          ``beta * m' + d``), with ``m`` the momentum just updated (penalty and clipping ignored).

        Reads ``v`` before the buffer is overwritten."""
        cfg, own = self.config, self._own[lo:mid]
        if cfg.co2_start_rule == "lookahead":
            beta = cfg.co2_outer_momentum
            torch.add(d, self._momentum[lo:mid], alpha=beta, out=own)  # m'
            if cfg.co2_nesterov:
                own.mul_(beta).add_(d)
            own.mul_(cfg.co2_outer_lr)
            return
        gamma = cfg.co2_eager_weight
        if gamma == 1.0:
            own.copy_(d)
            return
        torch.mul(d, gamma, out=own)
        if v is not None:
            own.add_(v, alpha=(1.0 - gamma) * cfg.co2_outer_lr)

    def _launch(self, finite: bool) -> None:
        """Write the header, quarantine a non-finite worker, start the all-reduce of the buffer."""
        h = self._header
        if not finite:
            self._quarantine()
        self._buf[h] = 1.0 if finite else 0.0
        bits = (self.round >> torch.arange(ROUND_BITS)) & 1
        self._buf[h + 1 : h + 1 + ROUND_BITS].copy_(bits)
        waits = self._buf[h + 1 + ROUND_BITS :]
        waits.zero_()
        waits[self.comm.worker_index] = self._last_wait_s
        if self._wire is not self._buf:
            self._wire.copy_(self._buf)
        self._sent_round = self.round
        with record_function("co2/launch"):
            try:
                self._pending = self.comm.launch(self._wire)
            except RuntimeError as error:  # a transport may already know that a peer is gone
                raise self._peer_failure(error) from error

    def _peer_failure(self, error: Exception) -> RuntimeError:
        return RuntimeError(
            f"CO2's outer all-reduce of round {self._sent_round} failed or did not finish within "
            f"co2_timeout_s={self.config.co2_timeout_s}s (a peer may have died or stalled): {error}"
        )

    def _quarantine(self) -> None:
        """A worker whose outer gradient is not finite sends zeros with weight 0 and restarts."""
        logger.warning(
            "CO2: worker %d has a non-finite outer gradient at round %d; it sends nothing this "
            "round, returns to the anchor and clears its inner optimizer state",
            self.comm.worker_index,
            self.round,
        )
        self._buf[: self._header].zero_()
        if self._own is not None:
            self._own.zero_()
        if self.optimizer is not None:
            self.optimizer.state.clear()

    def _reset_live(self, *, buffers: bool) -> None:
        """``x <- a`` (``a - own`` under the eager rule), in place; buffers only when told. Each
        process of a worker holds 1/k of the anchor: the worker all-gathers it chunk by chunk."""
        for chunk, every_shard in zip(self.layout.chunks, self._chunks_of_every_shard):
            lo, mid = chunk.start, chunk.param_stop
            src = self._anchor[lo : chunk.stop]
            if self._own is not None:
                src = src.clone()
                src[: mid - lo].sub_(self._own[lo:mid])
            for part, piece in zip(self._worker_parts(src), every_shard):
                _scatter_live(piece, part, len(piece.live) if buffers else piece.param_pieces)

    @torch.no_grad()
    def _apply_in_round(self) -> None:
        """Partial overlap (``co2_overlap_steps = k``): k steps into a round, apply the last
        round's average. Its base is still the anchor, so nothing is stale (P = 1)."""
        if self._pending is None and not self._have_d:
            return  # round 0, or the round's average was skipped
        with record_function("co2/apply_in_round"):
            if self._receive(record=True):
                self._direction(stale=False)
                self._exchange(apply=True, write=False)
                self._shift_live()
            self._have_d = False

    def _shift_live(self) -> None:
        """Move each live parameter by (new anchor - where its round started), keeping the steps
        it took since; buffers take the received mean. Runs right after the anchor moved by
        ``-alpha * v``; a round started at ``a - own`` (``own = 0`` under the anchor rule)."""
        alpha = self.config.co2_outer_lr
        v = self._buf if self.config.co2_nesterov else self._momentum
        for chunk, every_shard in zip(self.layout.chunks, self._chunks_of_every_shard):
            lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
            move = torch.empty(hi - lo, dtype=torch.float32, device=self.device)
            torch.mul(v[lo:mid], -alpha, out=move[: mid - lo])  # parameters: add the anchor's move
            if self._own is not None:
                move[: mid - lo].add_(self._own[lo:mid])
            move[mid - lo :].copy_(self._anchor[mid:hi])  # buffers (and padding): set to the mean
            for part, piece in zip(self._worker_parts(move), every_shard):
                x = self._gather_live(piece)
                n = piece.param_stop - piece.start
                x[:n].add_(part[:n])
                x[n:].copy_(part[n:])
                _scatter_live(piece, x, len(piece.live))
        if self._own is not None:
            self._own.zero_()  # the round now counts as started at the new anchor

    def _worker_parts(self, chunk: Tensor) -> list[Tensor]:
        """This chunk from every process of the worker (all-gathered over its fast link) when the
        flat state is split between them; just this one when each process owns what it resets."""
        return self.comm.all_gather(chunk) if self.layout.gathers else [chunk]

    def _full_anchor(self) -> Tensor:
        """The whole anchor, all-gathered from the processes of this worker (k > 1)."""
        full = torch.empty(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        shard = self.layout.shard_numel
        for chunk in self.layout.chunks:
            for j, part in enumerate(self.comm.all_gather(self._anchor[chunk.start : chunk.stop])):
                full[j * shard + chunk.start : j * shard + chunk.stop].copy_(part)
        return full

    def _gather_live(self, chunk) -> Tensor:
        x = torch.zeros(chunk.stop - chunk.start, dtype=torch.float32, device=self.device)
        if chunk.live:
            pieces = list(x[: sum(chunk.lengths)].split(chunk.lengths))
            torch._foreach_copy_(pieces, chunk.live)
        return x

    @torch.no_grad()
    def _take_anchor(self) -> None:
        """Broadcast the live tensors from the first rank, then copy them into the anchor."""
        self.comm.broadcast_([s.tensor.data for s in self.layout.segments])
        for chunk in self.layout.chunks:
            self._anchor[chunk.start : chunk.stop].copy_(self._gather_live(chunk))

    def _index_param_pieces(self) -> list[tuple[int, int, int]]:
        """Every parameter piece of this shard as (segment id, start, stop) in the flat state; a
        piece is the part of one synchronised tensor inside one chunk."""
        pieces = []
        for chunk in self.layout.chunks:
            start = chunk.start
            for sid, length in zip(chunk.segment_ids[: chunk.param_pieces], chunk.lengths):
                pieces.append((sid, start, start + length))
                start += length
        return pieces


def _scatter_live(chunk, src: Tensor, count: int) -> None:
    """Copy the first ``count`` pieces of a chunk-shaped fp32 ``src`` into the live tensors."""
    if count:
        pieces = list(src[: sum(chunk.lengths[:count])].split(chunk.lengths[:count]))
        torch._foreach_copy_(chunk.live[:count], pieces)


def _norm_sq(x: Tensor) -> Tensor:
    return torch.linalg.vector_norm(x).double().square().view(1)


def _reshard_fsdp(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _has_dtensors(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _pin_state(model: nn.Module, state_device: torch.device) -> bool:
    """Host-memory state for a model on a GPU is pinned: the boundary's copies between the two
    then run at full PCIe speed. Nothing to pin when everything lives on the CPU."""
    return state_device.type == "cpu" and any(p.device.type == "cuda" for p in model.parameters())


def _state_device(model: nn.Module, config: CO2Config) -> torch.device:
    if config.co2_state_device == "cpu":
        return torch.device("cpu")
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")
