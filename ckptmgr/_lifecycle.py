"""Process lifecycle: managers left open are closed at interpreter exit.

The hook is registered with ``threading``'s exit hooks, which run before the thread pools
refuse new work (``concurrent.futures`` registers its own hook at import, and these run in
reverse order), so pending saves can still use their I/O threads. A plain ``atexit`` hook
would run too late: the persist thread's writes would fail with "cannot schedule new futures
after interpreter shutdown". Failures are logged and printed, never swallowed.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from typing import Any

__all__ = ["close_at_exit", "forget"]

log = logging.getLogger("ckptmgr")
_open: weakref.WeakSet[Any] = weakref.WeakSet()


def close_at_exit(manager: Any) -> None:
    """Close ``manager`` at interpreter exit unless it was closed before."""
    _open.add(manager)


def forget(manager: Any) -> None:
    """``manager`` was closed: nothing to do for it at exit."""
    _open.discard(manager)


def _close_open_managers() -> None:
    for mgr in list(_open):
        try:
            mgr.close()
        except Exception as exc:
            log.error("at exit, %r: %s", mgr, exc)
            print(f"ckptmgr: at exit, {mgr!r}: {exc}", file=sys.stderr)


getattr(threading, "_register_atexit", atexit.register)(_close_open_managers)
