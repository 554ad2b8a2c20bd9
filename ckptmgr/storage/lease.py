"""Who is writing: the identity a save in progress leaves beside its files, and the rule that
says when its writer is provably gone.

Several processes may share a root (a trainer and an evaluator, a restarted job while the
old one still writes, the ranks of one job). A manager starting up removes the leftovers of
interrupted saves, and must never remove those of a live writer. Every save in progress
therefore carries a *lease* naming its writer: machine, process id and process start time,
plus a heartbeat that the writer refreshes while it lives:

* local and NFS roots: the lock file of the temporary directory, ``flock()``ed by the writer
  for its whole life (the kernel, or NFS's lock manager, drops the lock when the process
  dies); its mtime is the heartbeat;
* object stores: the ``writer.lease`` object in the step's prefix, rewritten as heartbeat.

A writer is gone when its lock can be taken (local/NFS) and, in every case, when its lease
names this machine (same boot and PID namespace) and no process with its pid and start time
is alive, or its heartbeat is older than ``stale_after_s`` (another machine: only time can
tell). See docs/SECURITY.md for the NFS and object-store caveats.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Protocol

__all__ = ["LEASE_STALE_S", "Lease", "LeaseKeeper", "Refreshable", "current", "process_alive", "release",
           "writer_gone"]

log = logging.getLogger("ckptmgr")

LEASE_STALE_S = 600.0  # a heartbeat older than this proves a writer on another machine gone
_MAX_LEASE_BYTES = 4096


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read(200).strip()
    except (OSError, ValueError):
        return ""


def _machine() -> str:
    """This boot of this machine, and this PID namespace: where a pid means one process."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    boot = _read("/proc/sys/kernel/random/boot_id")
    return f"{boot}/{pidns}" if boot else ""


def _start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), None when the
    process does not exist (or /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Lease:
    """A writer's identity, as stored in its lease."""

    host: str
    machine: str  # boot id / PID namespace; "" where the platform cannot tell
    pid: int
    start: int  # the process's start time in ticks (-1: unknown)
    token: str  # random, per writer
    time: float  # wall time of the last heartbeat, seconds since the epoch

    def to_bytes(self) -> bytes:
        return json.dumps({"ckptmgr_lease": 1, **asdict(self)}, sort_keys=True).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> Lease | None:
        """The lease in ``data``; None when it is not one of ours (never raises: leases are
        written by other processes and read as untrusted)."""
        if len(data) > _MAX_LEASE_BYTES:
            return None
        try:
            d = json.loads(data)
        except ValueError:
            return None
        if not isinstance(d, dict) or d.get("ckptmgr_lease") != 1:
            return None
        types = {"host": str, "machine": str, "pid": int, "start": int, "token": str, "time": float}
        for k, t in types.items():
            v = d.get(k)
            if t is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, t) or isinstance(v, bool):
                return None
            d[k] = v
        if not (0 < d["pid"] < 2**32 and d["time"] == d["time"]):  # (NaN is not a time)
            return None
        return cls(**{k: d[k] for k in types})

    def on_this_machine(self) -> bool:
        return bool(self.machine) and self.machine == _machine()

    def refreshed(self) -> Lease:
        return Lease(self.host, self.machine, self.pid, self.start, self.token, time.time())


_live_mu = threading.Lock()
_live: set[str] = set()  # tokens of this process's writers that have not released their lease (_live_mu)


def current() -> Lease:
    """A fresh lease for a new writer in this process (a new token every call), live until
    :func:`release`."""
    pid = os.getpid()
    start = _start_ticks(pid)
    lease = Lease(socket.gethostname(), _machine(), pid, -1 if start is None else start, secrets.token_hex(8),
                  time.time())
    with _live_mu:
        _live.add(lease.token)
    return lease


def release(lease: Lease) -> None:
    """The writer holding ``lease`` is done (committed or aborted): from now on it is gone,
    even where its lock or lease object could not be removed."""
    with _live_mu:
        _live.discard(lease.token)


def _ours_and_live(lease: Lease) -> bool | None:
    """For a lease of this very process: whether its writer is still working; else None."""
    if lease.pid != os.getpid() or not lease.on_this_machine():
        return None
    start = _start_ticks(lease.pid)
    if start is not None and lease.start >= 0 and start != lease.start:
        return None
    with _live_mu:
        return lease.token in _live


def process_alive(pid: int, start: int) -> bool:
    """Whether process ``pid`` that started at ``start`` ticks still runs on this machine."""
    ticks = _start_ticks(pid)
    if ticks is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:  # EPERM: it exists, owned by someone else
            return True
        return True  # no /proc: the pid exists, and might be reused
    return start < 0 or ticks == start


def writer_gone(lease: Lease | None, heartbeat_age_s: float, stale_after_s: float) -> bool:
    """Whether the writer that holds ``lease`` is provably gone: it names this machine and its
    process no longer runs, or its heartbeat is ``stale_after_s`` old. ``lease`` None (no
    readable identity) is decided by the heartbeat's age alone."""
    if lease is not None and lease.on_this_machine():
        mine = _ours_and_live(lease)
        return not process_alive(lease.pid, lease.start) if mine is None else not mine
    return heartbeat_age_s > stale_after_s


class Refreshable(Protocol):
    def refresh(self) -> None:
        """Renew the heartbeat of a live writer's lease."""


class LeaseKeeper:
    """Renews the leases of this target's live writers every ``interval_s`` on one daemon
    thread, which runs only while there are leases (a writer dropped without closing stops
    being renewed: they are held weakly)."""

    def __init__(self, name: str, interval_s: float) -> None:
        self.name = name
        self.interval_s = interval_s
        self._mu = threading.Lock()  # guards _leases, _thread
        self._leases: weakref.WeakSet[Refreshable] = weakref.WeakSet()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def add(self, lease: Refreshable) -> None:
        with self._mu:
            self._leases.add(lease)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name=f"ckptmgr-lease-{self.name}", daemon=True)
                self._thread.start()

    def remove(self, lease: Refreshable) -> None:
        with self._mu:
            self._leases.discard(lease)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._mu:
                leases = list(self._leases)
                if not leases:
                    self._thread = None
                    return
            for lease in leases:
                try:
                    lease.refresh()
                except Exception as exc:  # the next beat tries again; the commit checks the lease
                    log.warning("could not renew the lease of a save in progress (%s: %s)", type(exc).__name__, exc)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._mu:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
