"""How a live peer's state reaches a replica that is behind, on torchft: only between the job's own
replicas (docs/reliability.md, "torchft: who can reach what").

torchft's Lighthouse admits any process that reaches it, and names as a recovery source whoever
claims the quorum's highest step; torchft's own HTTPTransport serves live tensors to whoever asks
and unpickles whatever it receives. `RecoveryTransport` replaces it:

1. **The job's secret** (``CO2_FT_SECRET``, or a file ``CO2_FT_SECRET_FILE`` names; `job_secret`),
   with the job's id (``CO2_FT_JOB_ID``, which co2-ft-launch makes for each job; `job_key`), keys an
   HMAC-SHA256 on each request, over what it asks for (step, quorum, from, to), checked
   before anything is served; and on each answer, over what it claims (the state's step, the
   quorum, sender, receiver, length) and the SHA-256 of its body, checked before anything is
   deserialised. A process without the secret can neither read a state nor have one loaded, and
   an answer of one job is refused by another that shares its secret.
2. **The quorum's plan**: a state is loaded only from the replica torchft named as this one's
   source in the current quorum, addressed to this replica, at the quorum's max step; and fetched
   only from that replica's host (the one the quorum gave for its ManagerServer), at a URL built
   here (``http://HOST:PORT/co2/STEP``): the source chooses its port, nothing else.
3. **Bounded reads**: a body larger than `size_limit` (three times this replica's own state, plus
   1 MiB) is refused from its Content-Length before it is read, and read in 1 MiB pieces within the
   timeout; then `torch.load(weights_only=True)`: tensors, numbers, strings, containers, no code;
   then ``check_state`` (the engine's settings, model layout and number of workers against this
   replica's): a peer started with other settings is refused, naming what differs.
4. **A bounded server** on the job's address only: at most ``max_requests`` connections at once
   (more are closed at once, no thread), each connection closed after twice the timeout (one for
   the wait for a state), however slowly its request came; a request without the secret's tag is
   answered 403 before it can wait for anything, and the replica that sent it is told which
   variables hold the secret.

Needs torchft (the ``ft`` extra); ``job.py`` and ``communicator.py`` use it, nothing else imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import io
import logging
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

import torch
from torchft.checkpointing.transport import CheckpointTransport

logger = logging.getLogger(__name__)

SECRET_ENV, SECRET_FILE_ENV, JOB_ENV = "CO2_FT_SECRET", "CO2_FT_SECRET_FILE", "CO2_FT_JOB_ID"
MIN_SECRET_BYTES = 16
MAX_REQUESTS = 8  # the replicas healing from one source at once, and room for a few strays
PIECE = 1 << 20  # bytes read at a time
HEADER = "X-CO2-"


class RecoveryRefused(RuntimeError):
    """A recovery transfer that is not the job's own, or not the one the quorum planned: nothing
    of it is loaded (torchft reports it, and the round is dropped)."""


class SecretRefused(RecoveryRefused):
    """The recovery source answered 403: it does not hold this replica's secret (this replica, or
    the source, was started with another one)."""


class Position(NamedTuple):
    """This replica's place in torchft's current quorum: the quorum's id, this replica's rank in it,
    and the host of this quorum's recovery source (None: the quorum named none)."""

    quorum: int
    rank: int | None
    source_host: str | None = None


class QuorumWatch:
    """torchft 0.2.0's ManagerClient with the last quorum it returned kept (``last``): the Manager
    reads the recovery source's address from it and keeps nothing. Every other call passes through."""

    def __init__(self, client: Any) -> None:
        self._client, self.last = client, None

    def _quorum(self, **kwargs: Any) -> Any:
        self.last = self._client._quorum(**kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def manager_position(manager: Any) -> Position:
    """The quorum id, this replica's rank and its recovery source's host from torchft 0.2.0's
    Manager. It has no public accessor usable here (``participating_rank()`` waits for the very
    quorum the transport runs in); the id and rank are set in ``Manager._async_quorum`` before it
    sends or receives a state, the source's address is in the quorum `QuorumWatch` kept."""
    quorum = manager._client.last
    address = getattr(quorum, "recover_src_manager_address", "") or ""
    return Position(manager._quorum_id, manager._participating_replica_rank, url_host(address) if address else None)


def url_host(address: str) -> str:
    """The host of ``scheme://host:port[/...]`` (brackets of an IPv6 host removed)."""
    return address.split("://", 1)[-1].split("/", 1)[0].rpartition(":")[0].strip("[]")


# what a replica's transport gives as its metadata: its own address, always ending in /co2
_METADATA = re.compile(r"http://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):(?P<port>[0-9]{1,5})/co2")


def recovery_url(metadata: str, source_host: str | None, step: int) -> str:
    """The URL of the state at ``step`` on the recovery source, built here from its ``metadata``
    (``http://HOST:PORT/co2``), whose host must be the source's (`Position.source_host`): else
    RecoveryRefused, and nothing is asked of anyone."""
    match = _METADATA.fullmatch(metadata)
    port = int(match["port"]) if match else 0
    if match is None or not 0 < port < 65536:
        raise RecoveryRefused(
            f"CO2: a recovery source gave the address {metadata[:200]!r}, not http://HOST:PORT/co2: refused, "
            "nothing was asked of it"
        )
    if source_host is None or match["host"].strip("[]") != source_host:
        raise RecoveryRefused(
            f"CO2: a recovery source gave the address {metadata[:200]!r}, not on the host torchft's quorum names "
            f"for it ({source_host!r}): refused, nothing was asked of it"
        )
    return f"http://{match['host']}:{port}/co2/{step}"


def job_secret() -> bytes:
    """The job's secret: ``CO2_FT_SECRET``, or the contents of the file ``CO2_FT_SECRET_FILE`` names
    (readable by its owner only); at least 16 bytes. Missing or unsafe: a ValueError naming both."""
    value, path = os.environ.get(SECRET_ENV), os.environ.get(SECRET_FILE_ENV)
    if value and path:
        raise ValueError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set one of them")
    if not value and not path:
        raise ValueError(
            f"CO2 on torchft needs the job's secret: set {SECRET_ENV} (at least {MIN_SECRET_BYTES} characters, the "
            f"same for every replica group) or {SECRET_FILE_ENV} (a file that only its owner can read); "
            "co2-ft-launch makes one. It authenticates the recovery transfers between the job's replicas "
            "(docs/reliability.md, 'torchft: who can reach what')"
        )
    secret = value.encode() if value else _secret_file(path)
    if len(secret) < MIN_SECRET_BYTES:
        name = SECRET_ENV if value else f"{SECRET_FILE_ENV}={path}"
        raise ValueError(f"{name}: the secret has {len(secret)} bytes, allowed are {MIN_SECRET_BYTES} or more")
    return secret


def _secret_file(path: str) -> bytes:
    try:
        mode = os.stat(path).st_mode
        with open(path, "rb") as f:
            secret = f.read(1 << 16).strip()
    except OSError as error:
        raise ValueError(f"{SECRET_FILE_ENV}={path}: cannot read it ({error})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"{SECRET_FILE_ENV}={path}: the file is open to other users (mode {stat.filemode(mode)}); "
            f"allowed is its owner only: chmod 600 {path}"
        )
    return secret


def job_key(secret: bytes, job: str) -> bytes:
    """The key of a job's HMACs: its secret, bound to its id (``CO2_FT_JOB_ID``) when it has one, so
    that a request or answer of one job is refused by another job that shares the secret. A job
    started without an id (its own launcher, not co2-ft-launch) signs with the secret alone."""
    return hmac.new(secret, f"co2/job\n{job}".encode(), hashlib.sha256).digest() if job else secret


def size_limit(own_state: Any) -> int:
    """The most bytes this replica accepts for a peer's state: three times its own state, plus 1 MiB.
    A replacement's optimizer may hold nothing yet (Adam's two moments come with its first step),
    a Trainer's log history grows, and a small model's pickle is mostly structure."""
    return 3 * _stored_bytes(own_state) + (1 << 20)


def _stored_bytes(obj: Any) -> int:
    """About what ``torch.save`` writes for ``obj``: every tensor's whole storage and a record's
    overhead (512 bytes is more than a zip entry and its pickle take), strings, and containers."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes() + 512
    if isinstance(obj, dict):
        return 64 + sum(_stored_bytes(k) + _stored_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return 64 + sum(_stored_bytes(v) for v in obj)
    if isinstance(obj, (str, bytes)):
        return 64 + len(obj)
    return 16


def sign(secret: bytes, kind: str, *fields: object) -> str:
    """The HMAC-SHA256 (hex) of a request (``co2/get``: step, quorum, from, to) or an answer
    (``co2/state``: step, quorum, from, to, length, the body's SHA-256): its kind and fields, one a
    line (no field holds one)."""
    return hmac.new(secret, "\n".join([kind, *map(str, fields)]).encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Snapshot:
    """A state staged for the replicas torchft named (``to``), in one quorum: bytes and their claim."""

    step: int  # the quorum's max step, which torchft names it by
    state_step: int  # the step the state holds (torchft's): the claim the receiver checks
    quorum: int
    rank: int | None
    to: frozenset[int]
    data: bytes
    digest: str


class _BoundedServer(ThreadingHTTPServer):
    """An HTTP server that runs at most ``max_requests`` connections at once: one more is closed at
    once, without a thread (a flood costs no memory, a slow client holds one slot, up to the timeout)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, max_requests: int, timeout_s: float) -> None:
        self._slots = threading.BoundedSemaphore(max_requests)
        self._timeout_s = timeout_s
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        # the whole connection: its request, the wait for a state (one timeout) and the answer within
        # two timeouts, however slowly its bytes come (a slow sender frees its slot then)
        alarm = _Alarm(request, 2 * self._timeout_s)
        try:
            super().process_request_thread(request, client_address)
        finally:
            alarm.cancel()
            self._slots.release()


class RecoveryTransport(CheckpointTransport):
    """torchft's checkpoint transport for CO2's state, on ``host`` only, keyed by the job's ``secret``
    (the module's docstring says what it checks). ``follow(manager)`` gives it the quorum's id, this
    replica's rank in it and its own state (for `size_limit`); tests pass ``position`` and
    ``own_state`` instead. ``timeout`` bounds a wait for a staged state and each connection.
    ``job`` is the job's id (`job_key`); ``check_state``, set by the job once its engine exists,
    raises ValueError for a received state this replica cannot take (other settings)."""

    def __init__(
        self,
        host: str,
        timeout: timedelta,
        *,
        secret: bytes,
        position: Callable[[], Position] | None = None,
        own_state: Callable[[], Any] | None = None,
        max_requests: int = MAX_REQUESTS,
        job: str = "",
    ) -> None:
        self._timeout, self._secret = timeout, job_key(secret, job)
        self.check_state: Callable[[Any], None] | None = None
        self._position, self._own_state = position, own_state
        self._staged: Snapshot | None = None
        self._ready = threading.Condition()
        self._warned = False
        self._server = _BoundedServer((host, 0), self._handler(), max_requests, timeout.total_seconds())
        serve = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="co2_recovery", daemon=True)
        serve.start()  # polled every 50 ms for a shutdown
        self._address = f"http://{host}:{self._server.server_address[1]}/co2"

    def follow(self, manager: Any) -> None:
        """Take the quorum's position and this replica's own state from torchft's ``manager``."""
        manager._client = QuorumWatch(manager._client)
        self._position = lambda: manager_position(manager)
        self._own_state = manager._manager_state_dict  # torchft 0.2.0: what it would send a peer

    def metadata(self) -> str:
        return self._address

    def _place(self) -> Position:
        if self._position is None or self._own_state is None:
            raise RuntimeError("CO2 internal error: RecoveryTransport.follow(manager) was not called")
        return self._position()

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Snapshot ``state_dict`` into bytes (training may go on) for the replicas torchft named."""
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        data = buffer.getvalue()
        quorum, rank, _ = self._place()
        state_step = int(state_dict.get("torchft", {}).get("step", step))
        digest = hashlib.sha256(data).hexdigest()
        with self._ready:
            self._staged = Snapshot(step, state_step, quorum, rank, frozenset(dst_ranks), data, digest)
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._staged = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """The state torchft's quorum planned for this replica: from ``src_rank`` at ``step`` (the
        quorum's max step), signed with the job's secret, no larger than `size_limit`; else refused."""
        quorum, rank, source_host = self._place()
        url = recovery_url(metadata, source_host, step)
        limit = size_limit(self._own_state())
        planned = (step, quorum, src_rank, rank)
        asked = {HEADER + name: str(value) for name, value in zip(("Quorum", "From", "To"), planned[1:])}
        asked[HEADER + "HMAC"] = sign(self._secret, "co2/get", *planned)
        headers, data = _exchange(url, asked, limit=limit, timeout_s=timeout.total_seconds())
        self._check_answer(headers, data, planned, url)
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        if self.check_state is not None:
            try:
                self.check_state(state)
            except (ValueError, KeyError, TypeError) as error:
                raise RecoveryRefused(
                    f"CO2: the state offered by {url} is a replica's of the job started with other settings than "
                    f"this one: {error}. Refused: nothing of it was loaded (start every replica group with the "
                    "same settings and NUM_REPLICA_GROUPS)"
                ) from None
        return state

    def _check_answer(self, headers: Any, data: bytes, planned: tuple[int, ...], url: str) -> None:
        """The answer's claim is signed with the job's secret, and is the one the quorum planned."""
        try:
            claimed = tuple(int(headers[HEADER + name]) for name in ("Step", "Quorum", "From", "To"))
        except (TypeError, ValueError):
            claimed = None
        digest = hashlib.sha256(data).hexdigest()
        if claimed is None or not _same(headers.get(HEADER + "HMAC", ""), self._answer_tag(claimed, data, digest)):
            raise RecoveryRefused(
                f"CO2: the state offered by {url} is not signed with this job's secret ({SECRET_ENV}): a process "
                f"outside the job, a replica started with another secret, or another job's ({JOB_ENV}). Refused: "
                "nothing of it was loaded"
            )
        names = ("step", "quorum", "sender's rank", "receiver's rank")
        wrong = [f"{n} {c} (the quorum's: {p})" for n, c, p in zip(names, claimed, planned, strict=True) if c != p]
        if wrong:
            raise RecoveryRefused(
                f"CO2: the state offered by {url} is not the one this quorum planned: it claims {', '.join(wrong)}. "
                "Refused: nothing of it was loaded"
            )

    def _answer_tag(self, claimed: tuple[int, ...], data: bytes, digest: str) -> str:
        return sign(self._secret, "co2/state", *claimed, len(data), digest)

    def _handler(self) -> type:
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = transport._timeout.total_seconds()  # each read and write on a connection

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                transport._serve(self)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        asked = self._asked(handler)
        if asked is None:
            self._refuse(handler)
            return
        snapshot = self._wait_for(*asked)
        if snapshot is None:
            handler.send_error(404)
            return
        to = asked[3]
        claim = (snapshot.state_step, snapshot.quorum, snapshot.rank, to)
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(snapshot.data)))
        for name, value in zip(("Step", "Quorum", "From", "To"), claim, strict=True):
            handler.send_header(HEADER + name, str(value))
        handler.send_header(HEADER + "HMAC", self._answer_tag(claim, snapshot.data, snapshot.digest))
        handler.end_headers()
        handler.wfile.write(snapshot.data)

    def _asked(self, handler: BaseHTTPRequestHandler) -> tuple[int, int, int, int] | None:
        """(step, quorum, from, to) of a request signed with the job's secret; None: any other."""
        prefix = "/co2/"
        try:
            step = int(handler.path[len(prefix) :]) if handler.path.startswith(prefix) else None
            fields = [int(handler.headers[HEADER + name]) for name in ("Quorum", "From", "To")]
        except (TypeError, ValueError):
            return None
        tag = handler.headers.get(HEADER + "HMAC", "")
        if step is None or not _same(tag, sign(self._secret, "co2/get", step, *fields)):
            return None
        return (step, *fields)

    def _refuse(self, handler: BaseHTTPRequestHandler) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "CO2: refused a recovery request from %s: not signed with this job's secret (%s): a process "
                "outside the job, or a replica started with another secret (docs/reliability.md)",
                handler.client_address[0],
                SECRET_ENV,
            )
        handler.send_error(403)

    def _wait_for(self, step: int, quorum: int, source: int, to: int) -> Snapshot | None:
        """The snapshot staged in quorum ``quorum`` at ``step`` by this replica as ``source`` for
        ``to``, once staged; None: none within the timeout."""

        def planned(staged: Snapshot | None) -> bool:
            return (
                staged is not None
                and (staged.step, staged.quorum, staged.rank) == (step, quorum, source)
                and (to in staged.to)
            )

        with self._ready:
            self._ready.wait_for(lambda: planned(self._staged), self._timeout.total_seconds())
            staged = self._staged
        return staged if planned(staged) else None

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()


def _same(given: str, expected: str) -> bool:
    """A constant-time comparison of a tag received (any text) with the one computed."""
    return hmac.compare_digest(given.encode(errors="replace"), expected.encode())


class _Alarm:
    """Shuts ``sock`` down after ``seconds`` unless cancelled: a blocked read or write on it then
    returns at once. A socket's own timeout bounds each read, so a peer that sends one byte at a
    time holds it forever; this bounds the whole exchange."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.fired = False
        self._sock = sock
        self._timer = threading.Timer(max(seconds, 0.0), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


def _exchange(url: str, asked: dict[str, str], *, limit: int, timeout_s: float) -> tuple[Any, bytes]:
    """GET ``url`` (``http://host:port/path``) with headers ``asked``, directly (a peer, never a
    proxy): the answer's headers and body, the whole exchange (connect, status line, headers,
    body) within ``timeout_s``, else RecoveryRefused. Any status but 200 is refused."""
    address, _, path = url[len("http://") :].partition("/")
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    connection = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout_s)
    alarm = None
    try:
        connection.connect()
        alarm = _Alarm(connection.sock, deadline - time.monotonic())
        connection.request("GET", "/" + path, headers=asked)
        response = connection.getresponse()
        if response.status == 403:
            raise SecretRefused(
                f"CO2: the recovery source {url} refused this replica's request (HTTP 403): the two were started "
                f"with different secrets ({SECRET_ENV}, or the file {SECRET_FILE_ENV} names; every replica group "
                "of a job needs the same one), or the source is not one of the job's replicas. Nothing loaded"
            )
        if response.status != 200:
            raise RecoveryRefused(f"CO2: {url} answered HTTP {response.status} {response.reason}: nothing loaded")
        return response.headers, _read_bounded(response, limit=limit, deadline=deadline, url=url)
    except (OSError, http.client.HTTPException) as error:
        if (alarm is not None and alarm.fired) or time.monotonic() >= deadline or isinstance(error, TimeoutError):
            raise RecoveryRefused(
                f"CO2: the recovery source {url} did not answer within the recovery timeout ({timeout_s:g} s): "
                "refused, nothing loaded"
            ) from None
        raise RecoveryRefused(f"CO2: the exchange with the recovery source {url} failed: {error!r}") from error
    finally:
        if alarm is not None:
            alarm.cancel()
        connection.close()


def _read_bounded(response: Any, *, limit: int, deadline: float, url: str) -> bytes:
    """The body of ``response``: refused unread beyond ``limit`` bytes (from its Content-Length),
    read one piece at a time (``read1``: a single receive each, so a slow peer meets the deadline)."""
    length = response.headers.get("Content-Length", "")
    if not re.fullmatch(r"[0-9]{1,19}", length):  # ASCII digits only: str.isdigit admits others int() refuses
        raise RecoveryRefused(f"CO2: the state offered by {url} does not say its length in digits: refused unread")
    length = int(length)
    if length > limit:
        raise RecoveryRefused(
            f"CO2: the state offered by {url} has {length} bytes, more than this replica accepts ({limit}: three "
            "times its own state, plus 1 MiB): refused unread"
        )
    pieces, got = [], 0
    while got < length:
        if time.monotonic() > deadline:
            raise RecoveryRefused(f"CO2: the state from {url} did not arrive in time ({got} of {length} bytes)")
        piece = response.read1(min(PIECE, length - got))
        if not piece and time.monotonic() >= deadline:  # the alarm shut the socket down
            raise RecoveryRefused(f"CO2: the state from {url} did not arrive in time ({got} of {length} bytes)")
        if not piece:
            raise RecoveryRefused(f"CO2: the state from {url} ended after {got} of its {length} bytes")
        pieces.append(piece)
        got += len(piece)
    return b"".join(pieces)
