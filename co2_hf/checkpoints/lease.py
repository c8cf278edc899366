"""A run's lease on its output folder: one live run at a time saves into a folder.

A folder may be reused by a later run, as with the Trainer (a rerun of the same script is the most
common thing there is): a run that finished or died left its checkpoints, and the new run replaces
those it saves over. What must never happen is two runs *alive* in one folder, each replacing or
rotating away the other's checkpoints. So the run's save leader holds the folder's lease for as
long as it trains: the file `LEASE_FILE` in the folder, held open with an exclusive
``fcntl.flock``. The kernel releases the lock when the process ends, however it ends (SIGKILL and
power loss included), so a dead run never blocks a rerun, and there is nothing to renew.

Shared filesystems. On Linux, ``flock`` on NFS (v3 through NLM, v4 natively) is carried out as a
POSIX byte-range lock that the server arbitrates, so it excludes runs on other machines too; a
machine that dies holding it loses it when the server's lease on the client expires (NFSv4: 90 s
by default). Filesystems that do not lock (some FUSE mounts, Lustre mounted without ``flock``)
answer ``ENOLCK``/``ENOSYS``/``EOPNOTSUPP``: `take` then returns None and the caller says, once,
that live runs in that folder are not kept apart there.

The lease file records the holder (run, host, process, start time) for the refusal's message; its
leading "_" keeps it out of the Trainer's Hub uploads and it does not match ``checkpoint-*``. The
holder removes it when it ends cleanly (a killed one leaves it, to be reused). Removing a lock file
races with a process that opened it just before: so a taker checks, once locked, that the path
still names the file it locked, and starts over if not.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time

from .agreement import all_gather

LEASE_FILE = "_co2_lease"
_HOLDER_BYTES = 4096  # what the holder's record can need: a run id, a host name, a pid and a time
_ATTEMPTS = 5  # a lease file removed under a taker this often in a row: something else is at work
_NO_LOCKING = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class Lease:
    """A held lease (`take`); `release` ends it (the process ending does too)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the file (while still locked, so no one holds it meanwhile) and drop the lock."""
        if self._fd is None:
            return
        if _names(self.path, self._fd):
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        os.close(self._fd)  # closing the descriptor drops the lock
        self._fd = None


def take(folder: str, *, run: str) -> Lease | None:
    """Hold ``folder``'s lease for run ``run``; None where the filesystem does not lock (module
    docstring). Raises ``ValueError`` naming the live run that holds it, and how to go on."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LEASE_FILE)
    for _ in range(_ATTEMPTS):
        fd = _lock(path, folder, run)
        if fd is None or _names(path, fd):
            break
        os.close(fd)  # the holder removed it as we locked it: lock the file now at that path
    else:
        raise ValueError(f"CO2 cannot take the lease {path}: it was replaced {_ATTEMPTS} times while being locked")
    if fd is None:
        return None
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    record = {"run": run, "host": socket.gethostname(), "pid": os.getpid(), "since": since}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return Lease(path, fd)


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        here, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _lock(path: str, folder: str, run: str) -> int | None:
    """The locked descriptor of ``path``; None where the filesystem does not lock."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise ValueError(f"CO2 cannot take the lease {path} on its output folder: {error}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ValueError(_held_by(folder, holder, run)) from None
    except OSError as error:
        os.close(fd)
        if error.errno in _NO_LOCKING:
            return None
        raise ValueError(f"CO2 cannot lock {path}: {error}") from None
    return fd


def hold(folder: str, *, run: str, holder: bool) -> tuple[Lease | None, bool]:
    """`take` on the rank that holds the lease (``holder``), its outcome on every rank; collective.
    Returns the lease (None on the other ranks) and whether the filesystem locks; raises the
    holder's ``ValueError`` on every rank."""
    held, outcome = None, ("none", "")
    if holder:
        try:
            held = take(folder, run=run)
            outcome = ("held", "") if held is not None else ("unlocked", "")
        except ValueError as error:
            outcome = ("refused", str(error))
    statuses = [status for status in all_gather(outcome) if status[0] != "none"]
    refused = [message for status, message in statuses if status == "refused"]
    if refused:
        if held is not None:
            held.release()
        raise ValueError(refused[0])
    return held, all(status == "held" for status, _ in statuses)


def _holder(fd: int) -> dict[str, object]:
    """The holder's record, as far as it can be read (it may be mid-write, or not CO2's)."""
    try:
        record = json.loads(os.pread(fd, _HOLDER_BYTES, 0))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _held_by(folder: str, holder: dict[str, object], run: str) -> str:
    who = ", ".join(f"{key} {holder[key]}" for key in ("run", "host", "pid", "since") if key in holder)
    return (
        f"CO2 will not train into {folder}: another run is training into it now ({who or 'unknown'}), "
        f"and two live runs in one folder would replace and rotate away each other's checkpoints (this is run "
        f"{run}). Give this run its own output_dir, or wait for the other to end (a finished or dead run's "
        "folder may be reused: its checkpoints are then replaced, as with the Trainer)"
    )
