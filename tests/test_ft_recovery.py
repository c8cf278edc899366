"""The recovery transport of CO2 on torchft (``co2_hf/torchft/transport.py``), one check at a time and
without a Lighthouse: a state moves only between the job's replicas, as the quorum planned, within
the size the receiver expects, from a server that a flood cannot grow; a replica without the job's
secret does not start. tests/test_ft.py has the rogue joiner of a real job."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import pickle
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("torchft")

import torch  # noqa: E402

from co2_hf import CO2Config  # noqa: E402
from co2_hf.torchft.transport import (  # noqa: E402
    JOB_ENV,
    SECRET_ENV,
    SECRET_FILE_ENV,
    Position,
    RecoveryRefused,
    RecoveryTransport,
    SecretRefused,
    job_secret,
    sign,
    size_limit,
)

pytestmark = [pytest.mark.torchft, pytest.mark.timeout(60)]
SECRET = b"the tests' job secret, not a real one"
QUORUM = 7  # the quorum every transport here is in


def _state() -> dict:
    return {"user": {"model": {"w": torch.arange(4.0)}}, "torchft": {"step": 3, "batches_committed": 9}}


def _transport(rank: int, *, secret: bytes = SECRET, timeout_s: float = 5.0, **kwargs) -> RecoveryTransport:
    """A replica's transport, ranked ``rank`` in quorum 7, its own state `_state`'s."""
    return RecoveryTransport(
        "127.0.0.1",
        timedelta(seconds=timeout_s),
        secret=secret,
        position=lambda: Position(QUORUM, rank, "127.0.0.1"),  # every source here is on 127.0.0.1
        own_state=_state,
        **kwargs,
    )


@contextlib.contextmanager
def _running(*transports: RecoveryTransport) -> Iterator[tuple[RecoveryTransport, ...]]:
    try:
        yield transports
    finally:
        for transport in transports:
            transport.shutdown()


def _recv(replacement: RecoveryTransport, metadata: str, *, step: int = 3, timeout_s: float = 5.0):
    """What replica 1 receives from replica 0 (its source) at ``step``, the quorum's max step."""
    return replacement.recv_checkpoint(0, metadata, step=step, timeout=timedelta(seconds=timeout_s))


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@contextlib.contextmanager
def _answering(answer: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """A peer's address whose server answers every GET with ``answer`` (a rogue's, or a bad one)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            answer(self)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/co2"
    finally:
        server.shutdown()
        server.server_close()


def _signed(
    body: bytes, claim: tuple[int, int, int, int], *, secret: bytes = SECRET, signed_body: bytes | None = None
):
    """An answer with ``body`` and a claim (step, quorum, from, to) signed with ``secret`` (over
    ``signed_body`` if given: a body changed after its signature)."""
    over = body if signed_body is None else signed_body
    tag = sign(secret, "co2/state", *claim, len(over), hashlib.sha256(over).hexdigest())

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        for name, value in zip(("Step", "Quorum", "From", "To"), claim, strict=True):
            handler.send_header(f"X-CO2-{name}", str(value))
        handler.send_header("X-CO2-HMAC", tag)
        handler.end_headers()
        handler.wfile.write(body)

    return answer


PLANNED = (3, QUORUM, 0, 1)  # what replica 1 expects from replica 0: step 3, quorum 7


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo exploited",))


def test_a_state_moves_between_the_job_s_replicas_and_no_object_is_loaded():
    with _running(_transport(0, timeout_s=1), _transport(1)) as (peer, replacement):
        peer.send_checkpoint([1], step=3, state_dict=_state(), timeout=timedelta(seconds=5))
        got = _recv(replacement, peer.metadata())
        assert torch.equal(got["user"]["model"]["w"], torch.arange(4.0)) and got["torchft"]["step"] == 3
        with pytest.raises(RecoveryRefused, match="HTTP 404"):  # nothing staged for that step (1 s)
            _recv(replacement, peer.metadata(), step=4)
        # a replica of the job that sends a pickled object (code to run on load): weights_only=True
        with _answering(_signed(pickle.dumps({"user": _Exploit()}, protocol=2), PLANNED)) as rogue:
            with pytest.raises(pickle.UnpicklingError):
                _recv(replacement, rogue)


@pytest.mark.parametrize("forgery", ["no_tag", "another_secret", "body_changed_after_signing"])
def test_a_state_not_signed_with_the_job_s_secret_is_refused_before_anything_is_deserialised(forgery, monkeypatch):
    """The issue's rogue joiner offered weights of 40.81 at step 100000: signed by no secret, a
    guessed one, or the job's over another body, nothing of it is unpickled."""
    poison = _saved({"user": {"model": {"w": torch.full((4,), 40.81)}}, "torchft": {"step": 3}})
    answer = {
        "no_tag": _signed(poison, PLANNED, secret=b""),
        "another_secret": _signed(poison, PLANNED, secret=b"a guess at the job's secret"),
        "body_changed_after_signing": _signed(poison, PLANNED, signed_body=_saved(_state())),
    }[forgery]
    loaded = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loaded.append(a))
    with _running(_transport(1)) as (replacement,), _answering(answer) as rogue:
        with pytest.raises(RecoveryRefused, match="not signed with this job's secret .CO2_FT_SECRET."):
            _recv(replacement, rogue)
    assert loaded == []


@pytest.mark.parametrize(
    "claim, named",
    [
        ((100000, QUORUM, 0, 1), "step 100000 (the quorum's: 3)"),
        ((3, QUORUM - 1, 0, 1), "quorum 6 (the quorum's: 7)"),
        ((3, QUORUM, 2, 1), "sender's rank 2 (the quorum's: 0)"),
        ((3, QUORUM, 0, 2), "receiver's rank 2 (the quorum's: 1)"),
    ],
)
def test_a_signed_state_other_than_the_one_the_quorum_planned_is_refused(claim, named):
    """Signed with the job's secret (a replica of the job, an answer recorded in another quorum),
    but not from this replica's source, at the quorum's max step, in this quorum, for this replica."""
    with _running(_transport(1)) as (replacement,), _answering(_signed(_saved(_state()), claim)) as peer:
        with pytest.raises(RecoveryRefused, match=re.escape(f"not the one this quorum planned: it claims {named}")):
            _recv(replacement, peer)


def test_a_request_without_the_job_s_secret_gets_403_and_nothing_of_the_state(caplog):
    """A process that joined the quorum behind the others is named a recovery destination; asking
    with another secret, or none, it gets 403 at once, and the replica says so once at WARNING."""
    with _running(_transport(0, timeout_s=1), _transport(1, secret=b"a guess at the job's secret")) as (peer, rogue):
        peer.send_checkpoint([1], step=3, state_dict=_state(), timeout=timedelta(seconds=5))
        with caplog.at_level(logging.WARNING, logger="co2_hf.torchft.transport"):
            for ask in (lambda: _recv(rogue, peer.metadata()), lambda: urllib.request.urlopen(peer.metadata() + "/3")):
                start = time.monotonic()
                with pytest.raises((urllib.error.HTTPError, RecoveryRefused), match="403"):
                    ask()
                assert time.monotonic() - start < 0.9
            told = f"different secrets \\({SECRET_ENV}, or the file {SECRET_FILE_ENV}"
            with pytest.raises(SecretRefused, match=told):
                _recv(rogue, peer.metadata())  # the replica refused is told where the secret comes from
        warnings = [r.getMessage() for r in caplog.records if "refused a recovery request" in r.getMessage()]
        assert len(warnings) == 1 and "from 127.0.0.1: not signed with this job's secret" in warnings[0]
        # signed with the job's secret but for a replica torchft did not name: nothing (404)
        with _running(_transport(2)) as (stranger,), pytest.raises(RecoveryRefused, match="HTTP 404"):
            stranger.recv_checkpoint(0, peer.metadata(), step=3, timeout=timedelta(seconds=5))


def _raw(head: bytes, *, pieces: int, every_s: float) -> Callable[[BaseHTTPRequestHandler], None]:
    """An answer of headers ``head``, then ``pieces`` of 64 KiB, one every ``every_s`` seconds."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.wfile.write(head)
        with contextlib.suppress(OSError):
            for _ in range(pieces):
                handler.wfile.write(b"\0" * 65536)
                handler.wfile.flush()
                time.sleep(every_s)

    return answer


@pytest.mark.parametrize(
    "head, pieces, every_s, refused",
    [
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2147483648\r\n\r\n", 3, 2.0, "has 2147483648 bytes, more than"),
        (b"HTTP/1.0 200 OK\r\n\r\n", 3, 2.0, "does not say its length"),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 1048576\r\n\r\n", 16, 0.25, "did not arrive in time"),
    ],
)
def test_a_body_beyond_what_this_replica_accepts_is_refused_unread(head, pieces, every_s, refused):
    """The issue's 2 MB that inflate to 2 GiB, as a transfer: refused from its Content-Length (or
    its lack of one) at once, without reading it; a peer that trickles its bytes meets the timeout."""
    with _running(_transport(1)) as (replacement,), _answering(_raw(head, pieces=pieces, every_s=every_s)) as rogue:
        start = time.monotonic()
        with pytest.raises(RecoveryRefused, match=refused):
            _recv(replacement, rogue, timeout_s=1.5)
        assert time.monotonic() - start < 3.0


@contextlib.contextmanager
def _trickling(answer: bytes, *, every_s: float) -> Iterator[str]:
    """A peer's address whose server reads a request, then sends ``answer`` one byte every
    ``every_s`` seconds (a source that holds its receiver, each read within any read timeout)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):
            connection, _ = listener.accept()
            with connection:
                connection.recv(65536)
                for byte in answer:
                    if stop.wait(every_s):
                        return
                    connection.sendall(bytes([byte]))

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/co2"
    finally:
        stop.set()
        listener.close()


_SLOW_HEAD = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n" + b"X-Pad: x\r\n" * 40
_SLOW_BODY = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"\0" * 100


@pytest.mark.parametrize("answer, every_s", [(_SLOW_HEAD, 0.5), (_SLOW_BODY, 0.05)], ids=["status_line", "body"])
def test_a_source_that_trickles_its_answer_is_cut_off_at_the_recovery_timeout(answer, every_s):
    """A peer that claims the highest step is the recovery source: sending its status line, headers
    or body a byte at a time, it holds the replica no longer than the timeout (the whole exchange)."""
    with _running(_transport(1)) as (replacement,), _trickling(answer, every_s=every_s) as rogue:
        start = time.monotonic()
        with pytest.raises(RecoveryRefused, match="did not (answer within the recovery timeout|arrive in time)"):
            _recv(replacement, rogue, timeout_s=2.0)
        assert time.monotonic() - start < 3.0


def test_the_size_limit_admits_the_state_a_replacement_s_fresh_optimizer_lacks():
    """A replacement's Adam holds no moments before its first step; its peer's does. Every state
    a peer of the same job sends fits the limit the replacement computes from its own."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    fresh = torch.optim.Adam(model.parameters())
    own = {"model": model.state_dict(), "optimizer": fresh.state_dict()}
    stepped = torch.optim.Adam(model.parameters(), amsgrad=True)  # three tensors a parameter
    model(torch.randn(2, 64)).sum().backward()
    stepped.step()
    assert len(_saved({"model": model.state_dict(), "optimizer": stepped.state_dict()})) <= size_limit(own)
    scalars = {f"p{i}": torch.zeros(()) for i in range(2000)}  # a pickle mostly structure
    assert len(_saved({"model": scalars, "log": "x" * 100_000})) <= size_limit({"model": scalars})
    assert size_limit(own) < 4 * len(_saved(own)) + (1 << 20) + 100_000  # and no looser than that


def test_the_recovery_server_runs_at_most_max_requests_connections_at_once():
    """30 connections that never send a request (a flood, or a slow client) start no more than 4
    server threads (and their 4 alarms); each is closed after the timeout, and the transport then serves its peer."""
    with _running(_transport(0, timeout_s=1, max_requests=4), _transport(1)) as (peer, replacement):
        before = threading.active_count()
        port = int(peer.metadata().rsplit(":", 1)[1].split("/")[0])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(30)]
        time.sleep(0.3)
        assert threading.active_count() - before <= 2 * 4  # a thread and its alarm for each slot
        time.sleep(1.5)  # their timeout: the slots are free again
        peer.send_checkpoint([1], step=3, state_dict=_state(), timeout=timedelta(seconds=5))
        assert _recv(replacement, peer.metadata())["torchft"]["step"] == 3
        for connection in idle:
            connection.close()


def test_a_snapshot_staged_for_one_quorum_is_never_served_in_the_next():
    """torchft names a peer's snapshot by its step, which stays the same over many CO2 quorums
    (at the start, while rounds are dropped): a peer healing in a new quorum must never get the
    last quorum's snapshot (state of an earlier boundary), so it is withdrawn before asking."""
    from co2_hf.torchft.communicator import TorchFTCommunicator

    served_when_asking = []
    with _running(_transport(0, timeout_s=1), _transport(1)) as (peer, healer):

        class Manager:  # the Manager's side a quorum touches, at torchft step 1 (no start-up wait)
            def start_quorum(self) -> None:
                try:
                    _recv(healer, peer.metadata(), step=1)
                    served_when_asking.append(True)
                except RecoveryRefused:
                    served_when_asking.append(False)

            def current_step(self) -> int:
                return 1

            def num_participants(self) -> int:
                return 2

            def errored(self) -> None:
                return None

        # no process group: a quorum does not touch it (only a coded wire's collectives do)
        comm = TorchFTCommunicator(
            Manager(), peer, pg=None, timeout=timedelta(seconds=5), num_workers=2, worker_index=0
        )
        peer.send_checkpoint([1], step=1, state_dict={"torchft": {"step": 1}}, timeout=timedelta(seconds=5))
        comm.start_quorum()
    assert served_when_asking == [False]


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "needs the job's secret: set CO2_FT_SECRET .* or CO2_FT_SECRET_FILE"),
        ({SECRET_ENV: "x" * 16, SECRET_FILE_ENV: "{file}"}, "both CO2_FT_SECRET and CO2_FT_SECRET_FILE are set"),
        ({SECRET_ENV: "short"}, "CO2_FT_SECRET: the secret has 5 bytes, allowed are 16 or more"),
        (
            {SECRET_FILE_ENV: "{file}"},
            r"open to other users \(mode -rw-r--r--\); allowed is its owner only: chmod 600",
        ),
        ({SECRET_FILE_ENV: "{file}.missing"}, "CO2_FT_SECRET_FILE=.*missing: cannot read it"),
    ],
)
def test_a_replica_without_a_usable_job_secret_refuses_to_start_naming_the_variable(
    env, message, tmp_path, monkeypatch
):
    from co2_hf import CO2TrainingArguments
    from co2_hf.torchft.job import TorchFT

    secret_file = tmp_path / "secret"
    secret_file.write_text("x" * 32)
    secret_file.chmod(0o644)
    for name in (SECRET_ENV, SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(file=secret_file))
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")  # never reached: refused before
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    with pytest.raises(ValueError, match=message):
        job_secret()
    with pytest.raises(ValueError, match=message):
        TorchFT(CO2Config())
    with pytest.raises(ValueError, match=message):  # the Trainer: before any process group exists
        CO2TrainingArguments(str(tmp_path), use_cpu=True, co2_fault_tolerance="torchft")


def test_ft_launch_makes_a_secret_only_its_user_reads_and_removes_it(monkeypatch):
    from co2_hf.torchft.launch import job_secret as launcher_secret

    for name in (SECRET_ENV, SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    with launcher_secret() as given:
        path = given[SECRET_FILE_ENV]
        assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
        monkeypatch.setenv(SECRET_FILE_ENV, path)
        assert len(job_secret()) == 64
        monkeypatch.delenv(SECRET_FILE_ENV)
    assert not os.path.exists(os.path.dirname(path))
    monkeypatch.setenv(SECRET_ENV, "the user's own secret")  # the user's is passed on as it is
    with launcher_secret() as given:
        assert given == {SECRET_ENV: "the user's own secret"}


@pytest.mark.parametrize(
    "metadata, refused",
    [
        ("http://10.255.255.1:80/co2", "not on the host torchft's quorum names for it"),
        ("http://127.0.0.1:{port}/internal/admin?do=1#", "not http://HOST:PORT/co2"),
        ("http://127.0.0.1:{port}/co2?x=1", "not http://HOST:PORT/co2"),
        ("http://user@127.0.0.1:{port}/co2", "not http://HOST:PORT/co2"),
        ("http://127.0.0.1:99999/co2", "not http://HOST:PORT/co2"),
        ("https://127.0.0.1:{port}/co2", "not http://HOST:PORT/co2"),
    ],
    ids=["another_host", "another_path", "a_query", "a_user", "no_port", "another_scheme"],
)
def test_a_replica_fetches_only_from_its_quorum_source_s_host_at_a_url_it_builds(metadata, refused):
    """The recovery source's metadata says only where its transport listens: a source that names
    another host, path or form (a request forgery through every replica that heals from it) is
    refused before anything is asked of anyone."""
    asked = []
    with _running(_transport(1)) as (replacement,), _answering(lambda h: asked.append(h.path)) as peer:
        port = peer.rsplit(":", 1)[1].split("/")[0]
        with pytest.raises(RecoveryRefused, match=re.escape(refused)):
            _recv(replacement, metadata.format(port=port), timeout_s=1.0)
    assert asked == []


@pytest.mark.parametrize("length", ["abc", "\u00b2", "-5", "1e3", "0x10", "1 2", "9" * 20])
def test_a_content_length_that_is_not_plain_digits_is_the_transport_s_refusal(length):
    head = f"HTTP/1.0 200 OK\r\nContent-Length: {length}\r\n\r\n".encode()
    with _running(_transport(1)) as (replacement,), _answering(_raw(head, pieces=1, every_s=0.0)) as rogue:
        with pytest.raises(RecoveryRefused, match="does not say its length in digits"):
            _recv(replacement, rogue, timeout_s=1.5)


def test_eight_slow_senders_free_their_slots_when_the_timeout_is_over():
    """Eight connections that send their request one byte every 0.2 s (each read within any read
    timeout) hold every slot of the server only until twice its timeout: a signed request made
    just after is served."""
    timeout_s = 1.5
    with _running(_transport(0, timeout_s=timeout_s), _transport(1)) as (peer, replacement):
        port = int(peer.metadata().rsplit(":", 1)[1].split("/")[0])
        stop = threading.Event()

        def trickle() -> None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as connection:
                for byte in b"GET /co2/3 HTTP/1.1\r\n" + b"X-Pad: x\r\n" * 100:
                    if stop.wait(0.2):
                        return
                    connection.sendall(bytes([byte]))

        senders = [threading.Thread(target=trickle, daemon=True) for _ in range(8)]
        for sender in senders:
            sender.start()
        time.sleep(0.5)
        peer.send_checkpoint([1], step=3, state_dict=_state(), timeout=timedelta(seconds=5))
        with pytest.raises(RecoveryRefused):  # every slot is held: closed at once
            _recv(replacement, peer.metadata(), timeout_s=0.5)
        time.sleep(2 * timeout_s)  # the slow senders' connections are closed at twice the server's timeout
        start = time.monotonic()
        assert _recv(replacement, peer.metadata())["torchft"]["step"] == 3
        assert time.monotonic() - start < 1.0
        stop.set()


class _QuorumOf:
    """The Manager's side of a quorum that `TorchFTCommunicator` touches, its ``start_quorum`` given."""

    def __init__(self, start_quorum: Callable[[], None], error: Exception | None = None) -> None:
        from torchft.manager import ExceptionWithTraceback

        self.start_quorum = start_quorum
        self._error = None if error is None else ExceptionWithTraceback(error)

    def current_step(self) -> int:
        return 1

    def num_participants(self) -> int:
        return 2

    def errored(self):
        return self._error


def _communicator(manager: _QuorumOf, **kwargs):
    from co2_hf.torchft.communicator import TorchFTCommunicator

    transport = _transport(0)
    comm = TorchFTCommunicator(
        manager, transport, pg=None, timeout=timedelta(seconds=1), num_workers=2, worker_index=0, **kwargs
    )
    return comm, transport


def test_a_quorum_that_never_returns_stops_the_replica_within_its_bound():
    """torchft waits on its quorum future without a limit: CO2 bounds it (the quorum timeout and
    three recovery timeouts, and a margin) and stops the replica, which its supervisor restarts."""
    comm, transport = _communicator(_QuorumOf(lambda: time.sleep(60)), quorum_timeout=timedelta(seconds=0.5))
    comm.quorum_bound_s = 1.0  # the margin (10 s) made small for the test
    start = time.monotonic()
    with _running(transport), pytest.raises(RuntimeError, match="quorum did not return within 1 s"):
        comm.start_quorum()
    assert time.monotonic() - start < 2.0


def test_a_starting_replica_whose_secret_its_source_refuses_stops_naming_the_secret():
    """A replica started with another secret than the job's cannot heal: it stops at its first
    quorum with the source's 403 explained (not a silent stall of every round); a joined replica
    refused once drops the round and goes on."""
    refused = SecretRefused(f"started with different secrets ({SECRET_ENV}, or the file {SECRET_FILE_ENV} names)")
    comm, transport = _communicator(_QuorumOf(lambda: None, refused))
    with _running(transport), pytest.raises(RuntimeError, match="different secrets.*cannot join the job"):
        comm.start_quorum()
    comm, transport = _communicator(_QuorumOf(lambda: None, refused))
    comm.joined = True
    with _running(transport):
        assert comm.start_quorum() is False


def test_ft_launch_ends_its_replicas_and_removes_its_secret_on_sigterm(tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys

    for name in (SECRET_ENV, SECRET_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    child = f"import os, time; open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close(); time.sleep(600)"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "co2_hf.torchft.launch", "--replicas=2", "--", sys.executable, "-c", child],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [launcher.stdout.readline() for _ in range(3)]
        folder = os.path.dirname(re.search(r"secret is in (\S+)", lines[0])[1])
        deadline = time.monotonic() + 30
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(name) for name in os.listdir(tmp_path)]
        assert len(pids) == 2 and os.path.isdir(folder), lines
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        launcher.kill()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not os.path.exists(folder)


def test_an_answer_of_another_job_sharing_the_secret_is_refused():
    """The signatures are keyed by the secret and the job's id (CO2_FT_JOB_ID, co2-ft-launch makes
    one): a request or an answer of one job is refused by another job that shares its secret."""
    with _running(_transport(0, job="job-a"), _transport(1, job="job-b"), _transport(1, job="job-a")) as (
        peer,
        other_job,
        same_job,
    ):
        peer.send_checkpoint([1], step=3, state_dict=_state(), timeout=timedelta(seconds=5))
        with pytest.raises(SecretRefused):  # its request: 403
            _recv(other_job, peer.metadata())
        assert _recv(same_job, peer.metadata())["torchft"]["step"] == 3
    answer = _signed(_saved(_state()), PLANNED)  # signed with the secret alone: a job without an id
    with _running(_transport(1, job="job-b")) as (replacement,), _answering(answer) as rogue:
        with pytest.raises(RecoveryRefused, match=f"or another job's \\({JOB_ENV}\\)"):
            _recv(replacement, rogue)


def _engine(num_workers: int = 2, **settings):
    from co2_hf.core import CO2
    from co2_hf.testing import FakeCommunicator

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    config = CO2Config(**{"co2_local_steps": 4, "co2_fragments": 1, **settings})
    return CO2(
        model,
        config,
        torch.optim.SGD(model.parameters(), lr=0.1),
        communicator=FakeCommunicator(num_workers=num_workers),
    )


@pytest.mark.parametrize(
    "peer, named",
    [
        (lambda: _engine(num_workers=3), "number of workers: checkpoint 3, now 2"),
        (lambda: _engine(co2_local_steps=8), "co2_local_steps: checkpoint 8, now 4"),
        (lambda: _engine(co2_comm_dtype="int8"), "co2_comm_dtype: checkpoint 'int8'"),
    ],
    ids=["workers", "tau", "wire"],
)
def test_a_peer_started_with_other_settings_is_refused_naming_the_setting(peer, named):
    """A replica of the job started with another NUM_REPLICA_GROUPS, tau or wire: its state is
    refused by the transport (the round is dropped, the replica trains on), naming the setting,
    instead of raising out of the engine's step on every honest replica."""
    own, theirs = _engine(), peer()
    sent = {"user": {"co2": {"engine": theirs.state_dict(), "at_boundary": False}}, "torchft": {"step": 3}}
    own.check_peer_state(_engine().state_dict())  # the same settings: taken
    with _running(_transport(1)) as (replacement,), _answering(_signed(_saved(sent), PLANNED)) as source:
        replacement.check_state = lambda state: own.check_peer_state(state["user"]["co2"]["engine"])
        with pytest.raises(RecoveryRefused, match=f"started with other settings than this one: .*{re.escape(named)}"):
            _recv(replacement, source)
