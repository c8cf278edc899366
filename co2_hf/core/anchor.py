"""Evaluation on the anchor: the model every worker shares, read without disturbing training.

`AnchorViews` is mixed into `CO2` (``co2.py``), whose attributes it reads: ``model``, ``progress``,
``layout``, ``live`` (``live.py``), ``_anchor`` and ``_flush`` (host-memory state back in place).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .live import reshard_fsdp


class AnchorViews:
    """`CO2.anchor_state` and `CO2.anchor_in_place` (see the module docstring)."""

    def anchor_state(self) -> dict[str, Tensor]:
        """The module's ``state_dict`` with every synchronised tensor taken from the anchor.

        Values are in each tensor's own dtype and on its own device (views of the fp32 anchor where
        both match; copies when the state is held in host memory, ``co2_state_device=cpu``):
        read-only, valid until the next boundary. During the warm-up the live tensors are the
        global model and are returned as they are.
        """
        state = self.model.state_dict()
        if not self.progress.warmup_done:
            return state
        self._flush()
        anchor = self.live.gather_flat(self._anchor) if self.layout.gathers else self._anchor
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
        if not self.progress.warmup_done:  # the live tensors are the global model
            yield
            return
        saved = [segment.tensor.detach().clone() for segment in self.layout.segments]
        self._flush()
        try:
            reshard_fsdp(self.model)  # FSDP2 must gather the shards anew, with the anchor in them
            with torch.no_grad():
                self.live.write_all(lambda chunk: self._anchor[chunk.start : chunk.stop])
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([s.tensor for s in self.layout.segments], saved)
            # a forward without backward leaves FSDP2's root unsharded, holding the anchor: drop it,
            # so that training gathers the live shards again
            reshard_fsdp(self.model)
