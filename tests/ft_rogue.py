"""A process outside a torchft job that joins it through its Lighthouse, for tests/test_ft.py: what
anyone who reaches the Lighthouse can try (docs/reliability.md, "torchft: who can reach what").

    python tests/ft_rogue.py --out FILE --claim_step 100000 --seconds 4   # ahead: offers poisoned weights
    python tests/ft_rogue.py --out FILE --claim_step 0                    # behind: asks for the live state
    python tests/ft_rogue.py --out FILE --claim_step 100000 --trickle_s 2  # ahead: answers a byte each 2 s

It runs torchft's own Manager (a ManagerServer, a store, a gloo group) under the Lighthouse that
TORCHFT_LIGHTHOUSE names, without the job's secret. Its state is that of tests/ft_workers.py's
model and engine with every weight set to 40.81, and the step it claims. Its transport answers
anyone who asks with that state, in the form CO2's transport answers (the claim the receiver
expects, the body's SHA-256, an HMAC under a guessed secret). Behind the others, it asks its
recovery source for the live state with a request signed by a guessed secret, and appends what it
got (HTTP status, bytes) to ``--out``. With ``--trickle_s``, it sends its answer's status line and
headers one byte every so many seconds (each read within any read timeout), to hold whoever heals.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import io
import json
import os
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from torchft.checkpointing.transport import CheckpointTransport
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from co2_hf import CO2Config
from co2_hf.core import CO2
from co2_hf.testing import FakeCommunicator

POISON = 40.81
GUESS = b"a guess at the job's secret"


def poisoned_state(claim_step: int) -> bytes:
    """torchft's recovery state of a tests/ft_workers.py replica, every weight 40.81, at ``claim_step``."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(POISON)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = CO2Config(co2_local_steps=4, co2_fragments=1, co2_comm_dtype="float32")
    co2 = CO2(model, config, optimizer, communicator=FakeCommunicator(num_workers=2))
    user = {"co2": {"engine": co2.state_dict(), "at_boundary": True}, "model": model.state_dict()}
    user["optimizer"] = optimizer.state_dict()
    buffer = io.BytesIO()
    torch.save({"user": user, "torchft": {"step": claim_step, "batches_committed": 0}}, buffer)
    return buffer.getvalue()


class RogueTransport(CheckpointTransport):
    """Serves the poisoned state to any request; asks a peer for its state without the secret."""

    def __init__(self, host: str, body: bytes, claim_step: int, out: str, trickle_s: float = 0.0) -> None:
        self.out, self.asked = out, False

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if trickle_s:
                    head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n" + b"X-Pad: x\r\n" * 100
                    for byte in head:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(trickle_s)
                    return
                claim = [str(claim_step)] + [self.headers.get(f"X-CO2-{n}", "0") for n in ("Quorum", "From", "To")]
                digest = hashlib.sha256(body).hexdigest()
                tag = hmac.new(GUESS, "\n".join(["co2/state", *claim, str(len(body)), digest]).encode(), "sha256")
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                for name, value in zip(("Step", "Quorum", "From", "To"), claim):
                    self.send_header(f"X-CO2-{name}", value)
                self.send_header("X-CO2-HMAC", tag.hexdigest())
                self.send_header("X-CO2-SHA256", digest)  # what co2_hf checked before the secret
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.address = f"http://{host}:{self.server.server_address[1]}/co2"

    def metadata(self) -> str:
        return self.address

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        pass  # its server answers with the poison whatever is asked

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        headers = {"X-CO2-Quorum": "0", "X-CO2-From": str(src_rank), "X-CO2-To": "0", "X-CO2-HMAC": "0" * 64}
        request = urllib.request.Request(f"{metadata}/{step}", headers=headers)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=timeout.total_seconds()) as response:
                got = dict(status=response.status, bytes=len(response.read()))
        except urllib.error.HTTPError as error:
            got = dict(status=error.code, bytes=len(error.read()))
        with open(self.out, "a") as f:
            f.write(json.dumps(dict(asked=metadata, **got)) + "\n")
        self.asked = True
        raise RuntimeError(f"rogue: the live state was asked for: {got}")

    def shutdown(self, wait: bool = True) -> None:
        self.server.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--claim_step", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--trickle_s", type=float, default=0.0)
    a = parser.parse_args()
    host, timeout = "127.0.0.1", timedelta(seconds=5)
    store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        replica_id="co2_rogue",
        hostname=host,
        checkpoint_transport=(
            transport := RogueTransport(host, poisoned_state(a.claim_step), a.claim_step, a.out, a.trickle_s)
        ),
        init_sync=True,
    )
    manager.register_state_dict_fn("model", lambda _: None, lambda: {})
    manager.load_state_dict({"step": a.claim_step, "batches_committed": 0})
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline and not transport.asked:  # behind: until it has asked once
        manager.start_quorum()
        time.sleep(0.1)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
