"""`DispatchTrace`: the tensor operations a block dispatches, their bytes, and its host reads."""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


class DispatchTrace(TorchDispatchMode):
    """Inside its block, counts the tensor operations this thread dispatches, the bytes they read and
    write, and every **host read**: what makes the host wait for a device on a GPU. Run it on the CPU
    and it tells what the same code would make a GPU wait for (tests/test_host_reads.py, the
    engine's guard; ``scripts/boundary_trace.py``).

    A host read is any of: a device value turned into a Python number (``float(t)``, ``bool(t)``,
    ``t.item()``: ``_local_scalar_dense``; ``torch.equal``; ``tolist()``/``numpy()``, which the CPU
    does without dispatching anything, so those are caught by patching them); a tensor made from host
    data (``torch.tensor(x)``: ``lift_fresh``, on a GPU a copy that waits); a blocking copy between
    devices (a copy into or out of pinned memory with ``non_blocking=True`` does not wait); an
    operation whose output size depends on the values (``nonzero``, ``masked_select``,
    ``repeat_interleave`` without ``output_size``). Host copies that the engine made for the host on
    purpose (`co2_hf.core.tally.HostMirror`, marked ``_co2_host_mirror``) are not reads of the device.
    ``reads`` lists each as ``(operation, where)``, where the innermost frame of the package names it.

    Byte counts are of the tensors an operation takes and returns (views count nothing): what it would
    move through memory if nothing were cached, an upper bound of its traffic."""

    READS = ("aten._local_scalar_dense", "aten.equal", "aten.is_nonzero", "aten.lift_fresh", "aten.lift_fresh_copy")
    SIZE_FROM_VALUES = ("aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique2", "aten.bincount")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.reads: list[tuple[str, str]] = []
        self.bytes_read = self.bytes_written = 0
        self._patched: list[tuple[str, Callable]] = []

    def __enter__(self):
        self._owner = threading.current_thread()  # the mode sees this thread only; so do the patches
        for name in ("tolist", "numpy", "__array__"):
            original = getattr(Tensor, name)
            self._patched.append((name, original))
            setattr(Tensor, name, self._host_read_of(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, original in self._patched:
            setattr(Tensor, name, original)
        self._patched.clear()

    def _host_read_of(self, name: str, original: Callable) -> Callable:
        trace = self

        def read(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            if not getattr(tensor, "_co2_host_mirror", False) and threading.current_thread() is trace._owner:
                trace.reads.append((f"Tensor.{name}", _caller()))
            return original(tensor, *args, **kwargs)

        return read

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        self.ops.append(str(func))
        reason = self._reason(name, args, kwargs)
        if reason is not None:
            self.reads.append((reason, _caller()))
        out = func(*args, **kwargs)
        if not func.is_view:
            self.bytes_read += sum(_nbytes(a) for a in (*args, *kwargs.values()) if a is not kwargs.get("out"))
            self.bytes_written += sum(_nbytes(o) for o in (out if isinstance(out, (list, tuple)) else [out]))
        return out

    def _reason(self, name: str, args: tuple, kwargs: dict) -> str | None:
        if name in self.READS or name in self.SIZE_FROM_VALUES:
            return name
        if name == "aten.repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            return "aten.repeat_interleave without output_size"
        if name == "aten.copy_" and args[0].device != args[1].device:
            host = args[0] if args[0].device.type == "cpu" else args[1]
            if not (kwargs.get("non_blocking", len(args) > 2 and args[2]) and host.is_pinned()):
                return f"blocking copy {args[1].device} -> {args[0].device}"
        if name == "aten._to_copy" and kwargs.get("device") is not None:
            source, target = args[0], torch.device(kwargs["device"])
            if target != source.device:
                pinned = kwargs.get("pin_memory") or (source.device.type == "cpu" and source.is_pinned())
                if not (kwargs.get("non_blocking") and pinned):
                    return f"blocking copy {source.device} -> {target}"
        return None

    def __call__(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` inside the trace."""
        with self:
            return fn(*args, **kwargs)


def _nbytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


# the frames of this package are the trace's own, never the code it traces
_PACKAGE = os.path.join("co2_hf", "testing", "")


def _caller() -> str:
    """The innermost frame inside co2_hf but outside this package (else the innermost), as
    ``file:line function``."""
    frames = traceback.extract_stack()[:-2]
    inside = [f for f in frames if "co2_hf" in f.filename and _PACKAGE not in f.filename]
    frame = (inside or frames)[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
