"""Process lifecycle: managers left open are closed at interpreter exit, within a bound.

The hook is registered with ``threading``'s exit hooks, which run before the thread pools
refuse new work (``concurrent.futures`` registers its own hook at import, and these run in
reverse order), so pending saves can still use their threads. A plain ``atexit`` hook would
run too late: the persist thread's writes would fail with "cannot schedule new futures after
interpreter shutdown".

Each manager's close waits at most its ``close_timeout`` (600 s by default). A write that is
still hung then is given up: the log names each step that is not durable and what becomes of
it (kept in the local tier for the next start, or lost), and the process exits anyway, since
every ckptmgr thread is a daemon thread. Failures are logged and printed, never swallowed.

Open managers are held by strong references until they are closed: a manager dropped
without ``close()`` still finishes its saves and removes its local-tier directory at exit.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
from typing import Any

__all__ = ["close_at_exit", "forget"]

log = logging.getLogger("ckptmgr")
_mu = threading.Lock()
_open: dict[int, Any] = {}  # id -> manager, in creation order (guarded by _mu)


def close_at_exit(manager: Any) -> None:
    """Close ``manager`` at interpreter exit unless it was closed before."""
    with _mu:
        _open[id(manager)] = manager


def forget(manager: Any) -> None:
    """``manager`` was closed: nothing to do for it at exit."""
    with _mu:
        _open.pop(id(manager), None)


def _close_open_managers() -> None:
    with _mu:
        managers = list(_open.values())
    for mgr in reversed(managers):
        try:
            mgr.close()
        except Exception as exc:
            log.error("at exit, %r: %s", mgr, exc)
            print(f"ckptmgr: at exit, {mgr!r}: {exc}", file=sys.stderr)


getattr(threading, "_register_atexit", atexit.register)(_close_open_managers)
