"""What a `Fragment` holds, shows and saves, apart from the phases that change it (``fragment.py``).

`FragmentState` is a part of `Fragment` (it reads the attributes `Fragment.__init__` sets: the
`WireLink`, the start rule, the codec, the progress and the tally row): where the fragment's state
lives while it works (host-memory state is brought to the device by its `Residency` for its events),
what its owner may read (the all-reduce in flight, its times, the counters) and its part of a
checkpoint (``state.py``). A separate module so that ``fragment.py`` reads as the phases of a
boundary, not for use apart.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from . import tally
from .comm import Pending
from .residency import Residency
from .state import FragmentProgress, from_dict, to_dict
from .wire import WireBuffer


class FragmentState:
    """A `Fragment`'s read-outs, checkpoint and residency (the module docstring)."""

    # ------------------------------------------------------------------ what the owner reads

    @property
    def residency(self) -> Residency | None:
        """Host-memory state staged on the device: where this fragment's state is (None: it stays put)."""
        return self._residency

    @property
    def pending(self) -> Pending | None:
        """The all-reduce in flight, if any."""
        return self._link.pending

    @property
    def in_flight(self) -> bool:
        return self._link.pending is not None

    @property
    def wire(self) -> WireBuffer | None:
        """The communication buffer this fragment holds now (None: it needs none until its boundary)."""
        return self._link.buffer

    @property
    def last_wait_s(self) -> float:
        """Seconds this rank waited at this fragment's last boundary (exposed communication). On a
        GPU reading it waits for the device: for scripts, not for the training loop."""
        return self._link.last_wait.get()

    @property
    def last_comm_s(self) -> float:
        """Launch-to-completion of the last all-reduce received (this rank); on a GPU reading it waits
        for the device, as `last_wait_s` does."""
        return self._link.last_comm.get()

    def last_comm_known(self) -> float | None:
        """`last_comm_s` if the host knows it without waiting for the device, else None."""
        return self._link.last_comm.get() if self._link.last_comm.ready() else None

    def comm_s(self, *, pop: bool) -> float | None:
        """The mean launch-to-completion time of the all-reduces received since the last pop (None:
        none was); ``pop`` starts the next window. On a GPU this waits for their CUDA events: call
        it at logging steps."""
        return self._link.comm_s(pop=pop)

    def counters(self) -> dict[str, Any]:
        """`FragmentProgress` as a checkpoint holds it: the skip counters read from the device (a wait,
        once), ``have_d`` False for a D of weight 0 (nothing to apply)."""
        row = self._counts[: tally.HEALTH_COLUMNS].tolist()
        have_d = self.progress.have_d and bool(self._applies)
        return {
            **to_dict(self.progress),
            "have_d": have_d,
            "skipped_rounds": int(row[tally.SKIPPED]),
            "consecutive_skipped": int(row[tally.CONSECUTIVE_SKIPPED]),
        }

    def state_dict(self) -> dict[str, Any]:
        """This fragment's part of a checkpoint (``core/state.py``), its all-reduce waited for first.
        ``buffer`` is held only where it means something: one fragment's (always), or a fragment's
        with a received D in it (``have_d``); None otherwise."""
        self.drain()
        counters = self.counters()
        saved = self._keeps_buffer or counters["have_d"]
        return {
            "buffer": self.wire.fp32 if saved else None,
            "own_outer_grad": self.start.offset,  # None under the anchor start rule
            "counters": counters,
            "residuals": None if self.codec is None else self.codec.state(),  # int8/int4/sparse wires
        }

    def load_state_dict(self, kept: dict[str, Any]) -> None:
        """Restore `state_dict`'s output (or a format-2 fragment of an older version, whose buffer of a
        fragment without a received D is not needed and not read)."""
        counters = kept["counters"]
        self.progress = from_dict(FragmentProgress, counters)
        self._counts[tally.SKIPPED].fill_(float(counters["skipped_rounds"]))
        self._counts[tally.CONSECUTIVE_SKIPPED].fill_(float(counters["consecutive_skipped"]))
        self._decided(weight=torch.ones((), device=self.device))  # a saved D is a mean to apply
        if self._keeps_buffer or self.progress.have_d:
            self._link.hold().fp32.copy_(kept["buffer"])
        self._release_if_idle()
        self.start.load_(kept["own_outer_grad"])
        if self.codec is not None:
            self.codec.load_(kept["residuals"])

    def nbytes(self) -> int:
        """Persistent bytes of its own: the start rule's offset and the codec's residuals (the buffer
        belongs to the pool)."""
        return self.start.nbytes() + (0 if self.codec is None else self.codec.nbytes())

    # ------------------------------------------------------------------ where the state is

    def _state(self) -> dict[str, Tensor]:
        """The tensors of this fragment's outer state that it reads and writes in place."""
        state = {"anchor": self._anchor, "momentum": self._momentum}
        if self.start.offset is not None:
            state["offset"] = self.start.offset
        return state

    def _bind(self, state: dict[str, Tensor]) -> None:
        self._anchor, self._momentum = state["anchor"], state["momentum"]
        self.start.bind_(offset=state.get("offset"), momentum=state["momentum"])

    @contextlib.contextmanager
    def _working(self, *, keep: bool | None):
        """Within the block the fragment works on its state on its device (host-memory state: brought
        over, ``residency.py``). ``keep``: stay there after (True: a boundary, whose apply follows),
        go back (False), or stay only if it was there before (None)."""
        residency = self._residency
        if residency is None:
            yield
            return
        was_there = residency.resident
        self._bind(residency.acquire())
        try:
            yield
        finally:
            if keep is False or (keep is None and not was_there):
                self._working_done()

    def _working_done(self) -> None:
        self._residency.release()
        self._bind(self._residency.host)
