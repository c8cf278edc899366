"""Test helpers for code built on CO2, yours included: local gloo process launching and the
communicator fakes (one worker recording its calls, a recording wrapper, a slow-link wrapper, G
simulated workers in one process).

Why this module ships inside the package, public: it is to CO2 what ``accelerate.test_utils`` is to
Accelerate. Whoever writes a training loop, a Trainer subclass or a communicator on top of CO2 needs
the same things our tests need: N real ranks on one CPU machine, a communicator that records *when*
the engine launches and waits, a link that is slow on purpose, G workers in one process. It needs
torch only (importing it loads no transformers; tests/test_imports.py checks that), and nothing in
the library imports it. Every communicator fake of the repository is here, the one place to change
when the `Communicator` interface does. Research tools (the simulated-worker training harness built
on `SimulatedNetwork`, the benchmarks) are not: they live in ``scripts/``, which is not installed.

`run_processes` runs a function on N fresh CPU processes joined by gloo through a ``file://``
rendezvous (parallel runs never fight over ports); each rank's return value comes back, an
exception on any rank fails the caller with that rank's traceback, and a hang is killed.
`run_with_faults` is its counterpart for runs in which ranks die or freeze on purpose: it reports
each rank's outcome instead of failing, and forks ranks from a server that imported the heavy
modules once, so that many short runs stay cheap.

`FakeCommunicator` is one worker talking to itself (every all-reduce is the identity) that records
each call, so tests can check *when* the engine launches and waits; a hook can alter the reduced
buffer (e.g. to put ranks out of step); ``num_workers`` tells the engine it is one of several
(for what the constructor sizes; nothing travels). `RecordingCommunicator` wraps a real communicator
and keeps what this rank sent and what each all-reduce returned. `QuorumCommunicator` is one worker
on a transport that reconfigures between rounds (torchft's), dropping the rounds it is told to.
`DelayedCommunicator` wraps a real communicator and makes each outer all-reduce complete no earlier
than ``delay_s`` after its launch: a slow link simulated honestly (the compute that overlaps it is
real). Both derive from `ForwardingCommunicator`, which forwards every verb to the wrapped one:
a new wrapper overrides only the verbs it changes.

`SimulatedNetwork` stands in for the process group of G workers in one process, one thread per
worker: ``network.communicator(i)`` is worker i's `SimulatedCommunicator`, whose collectives are
matched by call order and summed in worker order (deterministic). `SimulatedCollectives` are the
all-to-all and all-gather of the quantized wire between them. `LocalCollectives` are those of a
world of one rank (each copies its input).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.comm import Communicator, LocalCommunicator, Pending


class FakeCommunicator(LocalCommunicator):
    """A single worker that records ``"launch"`` and ``"wait"`` events.

    ``num_workers > 1`` makes the engine believe it is one of that many workers (what it sizes at
    construction, e.g. the coded wire's residuals); every all-reduce is still the identity, so
    the sums are not a real run's."""

    def __init__(
        self,
        *,
        delay_s: float = 0.0,
        on_reduce: Callable[[Tensor], None] | None = None,
        num_workers: int = 1,
    ) -> None:
        self.num_workers = num_workers
        self.events: list[str] = []
        self.delay_s = delay_s
        self.on_reduce = on_reduce

    def launch(self, tensor: Tensor) -> Pending:
        self.events.append("launch")
        pending = Pending(tensor)
        pending.completed_at.append(pending.launched_at + self.delay_s)
        return pending

    def wait(self, pending: Pending, timeout_s: float) -> None:
        pending.mark_waited()
        self.events.append("wait")
        time.sleep(max(pending.completed_at[0] - time.perf_counter(), 0.0))
        if self.on_reduce is not None:
            self.on_reduce(pending.tensor)


class QuorumCommunicator(FakeCommunicator):
    """A single worker on a transport that reconfigures between rounds, as torchft does
    (``co2_hf/torchft/``): it records ``"quorum"`` (with how many all-reduces were in flight then, which
    must be none), ``"launch"``, ``"wait"`` and ``"commit"`` events, and ``commit`` answers False
    for the launches numbered in ``drop`` (0-based): those rounds are dropped, as when a
    participant dies with the all-reduce in flight. ``on_quorum`` runs inside each quorum, where
    torchft loads a live peer's state into a replica that is behind; it returns whether it loaded
    one taken at the peer's boundary (what ``start_quorum`` returns)."""

    reconfigures = True

    def __init__(
        self, *, drop: Iterable[int] = (), num_workers: int = 1, on_quorum: Callable[[], bool] | None = None
    ) -> None:
        super().__init__(num_workers=num_workers)
        self.drop, self.on_quorum, self._launched, self._in_flight = set(drop), on_quorum, [], 0

    def start_quorum(self) -> bool:
        self.events.append(f"quorum:{self._in_flight}")
        return self.on_quorum is not None and bool(self.on_quorum())

    def launch(self, tensor: Tensor) -> Pending:
        pending = super().launch(tensor)
        pending.senders = self.num_workers
        self._launched.append(pending)
        self._in_flight += 1
        return pending

    def wait(self, pending: Pending, timeout_s: float) -> None:
        super().wait(pending, timeout_s)
        self._in_flight -= 1

    def commit(self, pending: Pending) -> bool:
        self.events.append("commit")
        index = next(i for i, launched in enumerate(self._launched) if launched is pending)
        return index not in self.drop


class ForwardingCommunicator(Communicator):
    """Wraps a communicator and forwards every verb to it (tests/test_engine_local.py checks that
    none is left out): a wrapper derives from it and overrides only the verbs it changes."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.num_workers, self.worker_index = inner.num_workers, inner.worker_index
        self.worker_size, self.shard_index = inner.worker_size, inner.shard_index

    def broadcast_(self, tensors: list[Tensor]) -> None:
        self.inner.broadcast_(tensors)

    def launch(self, tensor: Tensor) -> Pending:
        return self.inner.launch(tensor)

    def launch_coded(self, tensor: Tensor, reduce_: Callable) -> Pending:
        return self.inner.launch_coded(tensor, reduce_)

    def wait(self, pending: Pending, timeout_s: float) -> None:
        self.inner.wait(pending, timeout_s)

    def all_reduce_(self, tensor: Tensor) -> None:
        self.inner.all_reduce_(tensor)

    def worker_ranks(self) -> list[int]:
        return self.inner.worker_ranks()

    def reduce_stats(self, partials: Tensor) -> Tensor:
        return self.inner.reduce_stats(partials)

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        return self.inner.all_gather(tensor)

    def worker_all_reduce_(self, tensor: Tensor) -> None:
        self.inner.worker_all_reduce_(tensor)

    @property
    def reconfigures(self) -> bool:
        return self.inner.reconfigures

    def start_quorum(self) -> bool:
        return self.inner.start_quorum()

    def commit(self, pending: Pending) -> bool:
        return self.inner.commit(pending)


class RecordingCommunicator(ForwardingCommunicator):
    """Wraps a communicator; keeps what this rank sent and what the all-reduce returned, per round
    (``sent``: the buffer at each launch; ``summed``: the raw sum at each wait, before the engine
    divides it)."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner)
        self.sent, self.summed = [], []

    def launch(self, tensor: Tensor) -> Pending:
        self.sent.append(tensor.clone())
        return super().launch(tensor)

    def launch_coded(self, tensor: Tensor, reduce_: Callable) -> Pending:
        self.sent.append(tensor.clone())
        return super().launch_coded(tensor, reduce_)

    def wait(self, pending: Pending, timeout_s: float) -> None:
        super().wait(pending, timeout_s)
        self.summed.append(pending.tensor.clone())


class DelayedCommunicator(ForwardingCommunicator):
    """Wraps a communicator; each outer all-reduce completes at least ``delay_s`` after launch (the
    verbs inside a worker, ``co2_worker_size > 1``, are not delayed). Inject it at construction,
    ``CO2(model, config, communicator=DelayedCommunicator(inner, delay_s))``: the engine's
    fragments keep the communicator they were built with."""

    def __init__(self, inner: Communicator, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    def wait(self, pending: Pending, timeout_s: float) -> None:
        super().wait(pending, timeout_s)
        due = pending.launched_at + self.delay_s
        time.sleep(max(due - time.perf_counter(), 0.0))
        real = pending.completed_at[0] if pending.completed_at else time.perf_counter()
        pending.completed_at[:] = [max(real, due)]


class SimulatedNetwork:
    """The collectives of G workers, matched by call order: the k-th launch of every worker
    belongs to the same all-reduce, as on a real process group."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._cond = threading.Condition()
        self._deposits: dict[tuple, dict[int, Tensor]] = {}

    def communicator(self, index: int) -> SimulatedCommunicator:
        return SimulatedCommunicator(self, index)

    def deposit(self, key: tuple, index: int, tensor: Tensor) -> None:
        with self._cond:
            self._deposits.setdefault(key, {})[index] = tensor.detach().clone()
            self._cond.notify_all()

    def collect(self, key: tuple, timeout_s: float) -> list[Tensor]:
        """Every worker's deposit for ``key``, in worker order, once all have arrived."""
        with self._cond:
            arrived = self._cond.wait_for(lambda: len(self._deposits.get(key, {})) == self.num_workers, timeout_s)
            if not arrived:
                raise RuntimeError(f"simulated collective {key} timed out after {timeout_s}s")
            return [self._deposits[key][i] for i in range(self.num_workers)]


class SimulatedCommunicator(Communicator):
    """Worker ``index`` of a `SimulatedNetwork`: each worker calls its own from a thread of its own
    (a blocking collective waits for the other workers' contributions)."""

    def __init__(self, network: SimulatedNetwork, index: int) -> None:
        self.network, self.worker_index, self.num_workers = network, index, network.num_workers
        self._calls: dict[str, int] = {}

    def _key(self, kind: str) -> tuple:
        n = self._calls.get(kind, 0)
        self._calls[kind] = n + 1
        return kind, n

    def broadcast_(self, tensors: list[Tensor]) -> None:
        key = self._key("broadcast")
        for j, tensor in enumerate(tensors):
            self.network.deposit((*key, j), self.worker_index, tensor)
            tensor.copy_(self.network.collect((*key, j), 60)[0])

    def launch(self, tensor: Tensor) -> Pending:
        pending = Pending(tensor, work=self._key("reduce"))
        self.network.deposit(pending.work, self.worker_index, tensor)
        return pending

    def launch_coded(self, tensor: Tensor, reduce_) -> Pending:
        # the coded all-reduce runs at the wait, in the worker's own thread: every worker waits for
        # its launches in the same order, so the collectives inside it meet as on a process group
        return Pending(tensor, work=("coded", reduce_))

    def wait(self, pending: Pending, timeout_s: float) -> None:
        pending.mark_waited()
        if pending.work[0] == "coded":
            pending.work[1](SimulatedCollectives(self))
        else:
            parts = self.network.collect(pending.work, timeout_s)
            pending.tensor.copy_(torch.stack(parts).sum(0))
        pending.completed_at.append(time.perf_counter())

    def all_reduce_(self, tensor: Tensor) -> None:
        key = self._key("all_reduce")
        self.network.deposit(key, self.worker_index, tensor)
        tensor.copy_(torch.stack(self.network.collect(key, 60)).sum(0))


class SimulatedCollectives:
    """The all-to-all and all-gather of the quantized wire (``Collectives``) between simulated workers."""

    def __init__(self, comm: SimulatedCommunicator) -> None:
        self.comm, self.world_size, self.rank = comm, comm.num_workers, comm.worker_index

    def all_to_all_(self, output: Tensor, input: Tensor) -> None:
        parts = self._exchange("all_to_all", input)
        output.copy_(torch.cat([part.view(self.world_size, -1)[self.rank] for part in parts]))

    def all_gather_(self, output: Tensor, input: Tensor) -> None:
        output.copy_(torch.cat(self._exchange("all_gather", input)))

    def _exchange(self, kind: str, tensor: Tensor) -> list[Tensor]:
        key = self.comm._key(kind)
        self.comm.network.deposit(key, self.rank, tensor)
        return self.comm.network.collect(key, 60)


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


class LocalCollectives:
    """The quantized wire's collectives (``Collectives``) in a world of one rank: each copies."""

    world_size, rank = 1, 0

    def all_to_all_(self, output: Tensor, input: Tensor) -> None:
        output.copy_(input)

    all_gather_ = all_to_all_


def _entry(fn: Callable, rank: int, world: int, init_file: str, out_dir: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, result_path)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report to the parent, which decides what fails
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        os._exit(1)


def run_processes(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(fn, rank, world, init_file, tmp, args), daemon=True)
            for rank in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        outputs = []
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} produced no result (hung ranks: {hung})")
            outputs.append(torch.load(path, weights_only=False))
        errors = [f"rank {r}:\n{o['error']}" for r, o in enumerate(outputs) if not o["ok"]]
        if errors:
            raise RuntimeError("\n".join(errors))
        if hung:
            raise RuntimeError(f"ranks {hung} did not exit within {timeout_s}s")
        return [o["result"] for o in outputs]


# what Trainer runs import: a forkserver that imported them once starts each rank in a blink (the
# forkserver skips a module that is not installed: datasets comes with the `test`/`recipes` extras)
HF_PRELOAD = ("torch", "transformers", "datasets", "accelerate", "co2_hf.integrations.trainer")


def _entry_with_faults(fn: Callable, rank: int, world: int, init_file: str, out_dir: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        rendezvous = dict(init_method=f"file://{init_file}", rank=rank, world_size=world)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60), **rendezvous)
        torch.save({"ok": True, "result": fn(rank, world, *args)}, result_path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # no barrier and no teardown: a peer may be dead or frozen, and both would then block or abort
    os._exit(0)


def run_with_faults(
    fn: Callable,
    world: int,
    *args: Any,
    wait_for: Iterable[int] | None = None,
    timeout_s: float = 120.0,
    preload: tuple[str, ...] = ("torch",),
) -> list[dict[str, Any] | None]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes in which ranks may die or freeze.

    Returns one outcome per rank: ``{"ok": True, "result": ...}``, ``{"ok": False, "error":
    traceback}``, or None for a rank that left nothing (killed). Waits up to ``timeout_s`` for the
    ranks in ``wait_for`` (default: all), then SIGKILLs every rank still there (frozen ones
    included). Ranks are forked from a forkserver that imported ``preload`` once per session.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))  # only the first call, which starts the server, counts
    waited = set(range(world) if wait_for is None else wait_for)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry_with_faults, args=(fn, rank, world, init_file, tmp, args), daemon=True)
            for rank in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for rank in sorted(waited):
            procs[rank].join(max(deadline - time.monotonic(), 0.0))
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
        outcomes: list[dict[str, Any] | None] = []
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.pt")
            outcomes.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        return outcomes
