"""The links: one network namespace per node, veth pairs or a bridge, both directions shaped with tc.

Everything here only builds command lines or runs them (``ip`` and ``tc`` of iproute2); a dry run
prints the same lists. Every namespace and link starts with ``PREFIX``, so a run killed with SIGKILL
(the one exit that skips the tear-down) leaves nothing the next run cannot find and remove.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys

PREFIX = "co2b"  # every namespace and link this benchmark makes starts with it
SUBNET = "10.47.0"
SWITCH_NS, BRIDGE = f"{PREFIX}-sw", f"{PREFIX}-br"


def rate_bps(rate: str) -> float | None:
    """``'100mbit'`` -> 1e8; ``'unshaped'`` -> None."""
    if rate == "unshaped":
        return None
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: use e.g. 100mbit, 1gbit or unshaped")


def node_ns(i: int) -> str:
    return f"{PREFIX}-n{i}"


def node_dev(i: int) -> str:
    return f"{PREFIX}-e{i}"


def switch_dev(i: int) -> str:
    return f"{PREFIX}-p{i}"


def network_commands(nodes: int, mtu: int = 1500) -> tuple[list[list[str]], list[list[str]]]:
    """Set-up and tear-down commands for ``nodes`` namespaces; veths are created inside them, so a
    failed set-up never leaves a link in the root namespace. ``mtu``: of every veth end (1500, plain
    Ethernet; 9000, datacenter jumbo frames: fewer packets for the kernel to handle per byte)."""
    names = [node_ns(i) for i in range(nodes)] + ([SWITCH_NS] if nodes > 2 else [])
    up = [f"ip netns add {ns}" for ns in names] + [f"ip -n {ns} link set lo up" for ns in names]
    down = [f"ip -n {node_ns(i)} link del {node_dev(i)}" for i in range(nodes)]
    if nodes == 2:  # one cable
        up.append(f"ip link add {node_dev(0)} netns {node_ns(0)} type veth peer name {node_dev(1)} netns {node_ns(1)}")
    else:  # a cable from every node to a bridge in the switch namespace
        sw = f"ip -n {SWITCH_NS} link"
        up += [f"{sw} add {BRIDGE} type bridge", f"{sw} set {BRIDGE} up"]
        for i in range(nodes):
            up.append(
                f"ip link add {node_dev(i)} netns {node_ns(i)} type veth peer name {switch_dev(i)} netns {SWITCH_NS}"
            )
            up.append(f"{sw} set {switch_dev(i)} mtu {mtu}")
            up += [f"{sw} set {switch_dev(i)} master {BRIDGE}", f"{sw} set {switch_dev(i)} up"]
        down += [f"{sw} del {switch_dev(i)}" for i in range(nodes)] + [f"{sw} del {BRIDGE}"]
    for i in range(nodes):
        up.append(f"ip -n {node_ns(i)} link set {node_dev(i)} mtu {mtu}")
        up.append(f"ip -n {node_ns(i)} addr add {SUBNET}.{i + 1}/24 dev {node_dev(i)}")
        up.append(f"ip -n {node_ns(i)} link set {node_dev(i)} up")
    down += [f"ip netns del {ns}" for ns in names]
    return [c.split() for c in up], [c.split() for c in down]


def rate_commands(nodes: int, rate: str) -> list[list[str]]:
    """Shape both directions of every node's link: each end's egress, peer or switch side included."""
    ends = [(node_ns(i), node_dev(i)) for i in range(nodes)]
    ends += [(SWITCH_NS, switch_dev(i)) for i in range(nodes) if nodes > 2]
    bps = rate_bps(rate)
    if bps is None:
        return [f"tc -n {ns} qdisc del dev {dev} root".split() for ns, dev in ends]
    # burst: at least one GSO super-packet (64 KiB) and 2 ms at the rate; latency bounds the queue
    burst = max(128 * 1024, int(bps / 8 * 0.002))
    return [
        f"tc -n {ns} qdisc replace dev {dev} root tbf rate {rate} burst {burst} latency 100ms".split()
        for ns, dev in ends
    ]


def _execute(cmd: list[str], *, check: bool) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


class Network:
    """One topology's namespaces: built on enter, removed once on exit, error, signal or atexit."""

    def __init__(self, nodes: int, mtu: int = 1500) -> None:
        self.nodes = nodes
        self.up, self.down = network_commands(nodes, mtu)
        self.closed = False

    def __enter__(self) -> Network:
        atexit.register(self.close)
        try:
            for cmd in self.up:
                _execute(cmd, check=True)
        except BaseException:
            self.close()
            raise
        return self

    def set_rate(self, rate: str) -> None:
        for cmd in rate_commands(self.nodes, rate):
            _execute(cmd, check=rate != "unshaped")  # deleting an absent qdisc is fine

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for cmd in self.down:  # a veth goes with its peer: later deletes may find nothing
                _execute(cmd, check=False)

    def __exit__(self, *exc) -> None:
        self.close()


def remove_stale_namespaces() -> None:
    """Namespaces left by a run killed with SIGKILL (the only exit that skips the tear-down)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listing.splitlines() if line.startswith(f"{PREFIX}-")):
        print(f"# removing stale namespace {name}", flush=True)
        _execute(["ip", "netns", "del", name], check=False)


def check_privileges() -> None:
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"bench_bandwidth.py needs {' and '.join(missing)} (iproute2) to build shaped links")
    if os.geteuid() != 0:
        sys.exit(
            "bench_bandwidth.py builds network namespaces and tc shapers, which needs root: run it with "
            "sudo, or use --dry-run to print the commands, or --loopback to run unshaped without root"
        )
