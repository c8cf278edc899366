"""The phases of a CO2 round: each method does one thing to the outer state, chunk by chunk.

`CO2` (``co2.py``) owns these phases through this base class and runs them in the orders listed
there; this class owns the outer state they work on: the anchor, the outer momentum, the
communication buffer (`WireBuffer`), the start rule and the penalty (``rules.py``), the
`FragmentProgress` counters and the all-reduce in flight. With ``co2_fragments = F > 1`` there is
one `Phases` per fragment: each runs these phases on its own slice exactly as on a whole shard.

- ``_receive`` / ``_drain``: wait for the all-reduce in flight, read its header, ``D`` = the mean;
- ``_direction``: ``P``, ``m <- beta*m + P*D``, clip ``m``, the step ``v`` (when a ``D`` came);
- ``_exchange``: ``d = start - x``; ``a <- a - alpha*v`` (when a ``D`` came); buffer <- ``d``;
- ``_launch``: header, then the all-reduce of this round's ``d`` (as codes with an int8/int4 wire);
- ``_apply``: ``a <- a - alpha*v`` alone;
- ``_reset``: ``x <- a - o``; ``_shift``: ``x <- x + (a_new - start)``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict

import torch
from torch import Tensor
from torch.profiler import record_function

from ..config import CO2Config
from . import update
from .comm import Communicator, Pending
from .layout import Chunk, FlatLayout
from .live import LiveTensors
from .quant import QuantizedWire
from .rules import NoPenalty, make_penalty, make_start_rule
from .state import FragmentProgress
from .wire import WireBuffer

# The engine warns under one logger name, whichever module of core/ notices: users filter on it.
logger = logging.getLogger("co2_hf.core.co2")


class Phases:
    """The outer state of one fragment of this process's shard (the whole shard with one fragment)
    and the phases that transform it. Indices are the fragment's own, from 0; `CO2` makes one per
    fragment, on views of its anchor and momentum, and sequences them."""

    def __init__(
        self,
        config: CO2Config,
        *,
        comm: Communicator,
        layout: FlatLayout,
        anchor: Tensor,
        momentum: Tensor,
        num_workers: int,
        optimizer: torch.optim.Optimizer | None,
        pin_memory: bool,
        clip_scale: float = 1.0,
        index: int = 0,
    ) -> None:
        self.config, self.comm, self.layout, self.device = config, comm, layout, anchor.device
        self.num_workers, self.optimizer = num_workers, optimizer
        self.live = LiveTensors(layout, comm, self.device, pin_memory=pin_memory)
        n = layout.shard_numel
        zeros = dict(dtype=torch.float32, device=self.device, pin_memory=pin_memory)
        self._anchor, self._momentum = anchor, momentum  # this fragment's views of the engine's
        wire_dtype = torch.bfloat16 if config.co2_comm_dtype == "bfloat16" else torch.float32
        self.wire = WireBuffer(n, num_workers, wire_dtype=wire_dtype, **zeros)
        self.codec = _codec(config, n, num_workers, index, self.device, pin_memory)
        self.start = make_start_rule(config, self._momentum, layout.param_local, **zeros)
        self.penalty = make_penalty(config, layout, self.device)  # for stale updates
        self._step_v = self.wire.payload if config.co2_nesterov else self._momentum  # where v lies
        # a fragment's momentum is clipped to phi * sqrt(its share of the parameters), so that the
        # whole momentum's norm stays <= phi (1 with one fragment)
        self.clip_threshold = None if config.co2_clip_threshold is None else config.co2_clip_threshold * clip_scale
        self.progress = FragmentProgress()
        self._pending: Pending | None = None
        # the anchor has values the live tensors must take in full at the next reset or shift: a
        # step moved it (float buffers got a new mean), or this worker restarts from it
        self._anchor_news = False
        self._last_wait_s = 0.0
        self.last_comm_s = 0.0  # launch-to-completion of the last all-reduce received (this rank)
        self._metrics: dict[str, list[float]] = defaultdict(list)

    def pop_metric_means(self) -> dict[str, float]:
        """Each metric's mean over this fragment's boundaries since the last call (none: absent);
        the penalty's sum and elements are summed instead, so that their ratio is the mean P."""
        means = {
            name: sum(values) / (1 if name.startswith("penalty_") else len(values))
            for name, values in self._metrics.items()
            if values
        }
        self._metrics.clear()
        return means

    # ------------------------------------------------------------------ the phases

    def _receive(self) -> None:
        """Wait for the all-reduce in flight, if any; the wait is this boundary's exposed time."""
        waited = self._complete()
        if waited is not None:
            self._last_wait_s = waited

    def _drain(self) -> None:
        """Complete the all-reduce in flight, if any, outside a boundary: the wait is not exposed
        communication of a round (recorded as 0)."""
        if self._complete() is not None:
            self._last_wait_s = 0.0

    def _complete(self) -> float | None:
        """Wait for the all-reduce in flight and read it; the seconds waited (None: none in flight)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        start = time.perf_counter()
        with record_function("co2/wait"):
            try:
                self.comm.wait(pending, self.config.co2_timeout_s)
            except RuntimeError as error:
                raise self._peer_failure(error) from error
        waited = pending.wait_seconds(since=start)  # CUDA: the compute stream's stall (comm.py)
        self.last_comm_s = pending.comm_seconds()
        self._metrics["comm_s"].append(self.last_comm_s)
        self.progress.have_d = self._read_mean()
        return waited

    def _read_mean(self) -> bool:
        """Check the header; turn the sum into a mean over finite workers (False: none was)."""
        count, max_wait = self.wire.unpack(self.progress.sent_round)
        self._metrics["comm_wait_s"].append(max_wait)
        p = self.progress
        if count < 0.5:  # no worker was finite: skip this outer update
            p.skipped_rounds += 1
            p.consecutive_skipped += 1
            limit = self.config.co2_max_skipped_rounds
            if limit and p.consecutive_skipped >= limit:
                raise RuntimeError(
                    f"CO2: no worker had a finite outer gradient for {p.consecutive_skipped} "
                    f"consecutive rounds (co2_max_skipped_rounds={limit}); stopping"
                )
            return False
        p.consecutive_skipped = 0
        self.wire.payload.div_(count)
        return True

    def _direction(self, penalty: NoPenalty) -> None:
        """Turn the received D (buffer) into the step v: ``penalty``, momentum, clip, Nesterov."""
        if not self.progress.have_d:
            return
        cfg, n = self.config, self.layout.param_local
        d, m = self.wire.payload[:n], self._momentum[:n]
        sums = self.comm.reduce_stats(penalty.partials(d))
        self._metrics["outer_grad_norm"].append(float(sums[-1]) ** 0.5)
        penalty_sum = penalty.scale_(d, m, sums[:-1])
        update.momentum_(m, d, cfg.co2_outer_momentum)
        # the worker's parameter elements in this fragment ride along, so that the penalty's mean
        # can be weighed by them across fragments (CO2.pop_metrics)
        count = torch.tensor(float(n), dtype=penalty_sum.dtype, device=penalty_sum.device)
        stats = self.comm.reduce_stats(torch.stack([update.norm_sq(m)[0], penalty_sum, count]))
        ratio = update.clip_ratio(float(stats[0]), self.clip_threshold)
        if ratio < 1.0:
            m.mul_(ratio)
        if cfg.co2_nesterov:
            update.nesterov_direction_(d, m, cfg.co2_outer_momentum)
        self._metrics["momentum_norm"].append(float(stats[0]) ** 0.5 * ratio)
        self._metrics["clip_ratio"].append(ratio)
        self._metrics["penalty_sum"].append(float(stats[1]))
        self._metrics["penalty_elements"].append(float(stats[2]))

    def _exchange(self) -> bool:
        """Chunk by chunk: ``d = start - x``; ``a <- a - alpha*v`` when a D is waiting; buffer <- d.

        ``v`` is read before its chunk of the buffer is overwritten. Float buffers travel as
        absolute values. Returns whether d is finite on every process of this worker."""
        v = self._take_step()
        sums = []
        for chunk in self.layout.chunks:
            lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
            # d = (a - o) - x, in place in the live copy
            x = self.live.read(chunk)
            torch.sub(self._anchor[lo:mid], x[: mid - lo], out=x[: mid - lo])
            self.start.subtract_offset_(x[: mid - lo], lo, mid)
            # One sum per chunk: NaN and Inf propagate through it, and it is ~30x cheaper than
            # isfinite().all(). (A sum of finite values beyond float32's range also counts as
            # non-finite; such an outer gradient is unusable anyway.) Stays on device: no sync.
            sums.append(x.sum())
            if v is not None:
                self._move_anchor(chunk, v)
            self.start.next_offset_(x[: mid - lo], None if v is None else v[lo:mid], lo, mid)
            self.wire.payload[lo:hi].copy_(x)
        finite = torch.isfinite(torch.stack(sums)).all() if sums else torch.ones((), dtype=torch.bool)
        return bool(self.comm.reduce_stats(finite.double().view(1).to(self.device)) >= self.comm.worker_size)

    def _apply(self) -> None:
        """``a <- a - alpha*v`` (float buffers: the received mean) when a D is waiting."""
        v = self._take_step()
        if v is not None:
            for chunk in self.layout.chunks:
                self._move_anchor(chunk, v)

    def _launch(self, finite: bool) -> None:
        """Quarantine a non-finite worker, write the header, start the all-reduce of the buffer."""
        if not finite:
            self._quarantine()
        p = self.progress
        tensor = self.wire.pack_header(
            finite=finite, round_index=p.round, wait_s=self._last_wait_s, worker_index=self.comm.worker_index
        )
        p.sent_round = p.round
        with record_function("co2/launch"):
            try:
                if self.codec is None:
                    self._pending = self.comm.launch(tensor)
                else:  # a non-finite worker's zeros leave its own residual for a later round
                    coded = functools.partial(
                        self.codec.all_reduce_,
                        self.wire.payload,
                        self.wire.header,
                        feedback=finite,
                        round_index=p.round,
                    )
                    self._pending = self.comm.launch_coded(tensor, coded)
            except RuntimeError as error:  # a transport may already know that a peer is gone
                raise self._peer_failure(error) from error

    def _reset(self) -> None:
        """``x <- a - o`` in place: parameters, and float buffers when the anchor has news for them.
        Each process of a worker holds 1/k of the anchor: the worker all-gathers it chunk by chunk."""
        if self._anchor_news:
            self.live.write_all(self._start_of)
        else:
            self.live.write_params(self._start_of)
        self._anchor_news = False

    def _shift(self) -> None:
        """Move each live parameter by (new anchor - where its round started), keeping the steps
        it took since; buffers take the received mean. A round started at ``a - o``; the anchor
        just moved by ``-alpha * v``. Afterwards the round counts as started at the new anchor."""
        if not self._anchor_news:
            return  # the round's average was skipped: nothing moved
        self.live.shift(self._anchor_move)
        self.start.clear_()
        self._anchor_news = False

    # ------------------------------------------------------------------ helpers of the phases

    def _take_step(self) -> Tensor | None:
        """The step v of the D waiting in the buffer, which counts as applied from now (None: none)."""
        if not self.progress.have_d:
            return None
        self.progress.have_d = False
        self._anchor_news = True
        return self._step_v

    def _move_anchor(self, chunk: Chunk, v: Tensor) -> None:
        lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
        self._anchor[lo:mid].sub_(v[lo:mid], alpha=self.config.co2_outer_lr)
        self._anchor[mid:hi].copy_(self.wire.payload[mid:hi])

    def _start_of(self, chunk: Chunk) -> Tensor:
        """Where this chunk's next round starts: ``a - o``."""
        return self.start.start_point(self._anchor[chunk.start : chunk.stop], chunk.start, chunk.param_stop)

    def _anchor_move(self, chunk: Chunk) -> Tensor:
        """What the shift adds to this chunk: ``-alpha * v + o`` on parameters, buffers' new mean."""
        lo, mid, hi = chunk.start, chunk.param_stop, chunk.stop
        move = self.live.scratch(hi - lo)
        torch.mul(self._step_v[lo:mid], -self.config.co2_outer_lr, out=move[: mid - lo])
        self.start.add_offset_(move[: mid - lo], lo, mid)
        move[mid - lo :].copy_(self._anchor[mid:hi])  # buffers (and padding): set to the mean
        return move

    def _quarantine(self) -> None:
        """A worker whose outer gradient is not finite sends zeros with weight 0 and restarts."""
        logger.warning(
            "CO2: worker %d has a non-finite outer gradient at round %d; it sends nothing this "
            "round, returns to the anchor and clears its inner optimizer state",
            self.comm.worker_index,
            self.progress.round,
        )
        self.wire.payload.zero_()
        self.start.clear_()
        self._anchor_news = True  # the reset restores the float buffers too
        if self.optimizer is not None:
            self.optimizer.state.clear()

    def _peer_failure(self, error: Exception) -> RuntimeError:
        return RuntimeError(
            f"CO2's outer all-reduce of round {self.progress.sent_round} failed or did not finish within "
            f"co2_timeout_s={self.config.co2_timeout_s}s (a peer may have died or stalled): {error}"
        )

    def _restart(self) -> None:
        """``x <- a - o``, buffers included: this round starts again from where it started (another
        fragment of this worker was non-finite; its steps since then may carry the same fault)."""
        self.live.write_all(self._start_of)
        self._anchor_news = False


def _codec(
    config: CO2Config, numel: int, num_workers: int, index: int, device: torch.device, pin_memory: bool
) -> QuantizedWire | None:
    """The fragment's quantizer with a coded wire (``co2_comm_dtype`` int8/int4) over more than one
    worker; None otherwise (one worker sends nothing, so nothing is coded)."""
    if config.code_bits is None or num_workers == 1:
        return None
    return QuantizedWire(
        numel,
        num_workers,
        bits=config.code_bits,
        block=config.co2_quant_block,
        stochastic=config.co2_quant_rounding == "stochastic",
        seed=index,
        device=device,
        pin_memory=pin_memory,
    )
