"""Waiting for a manager's background work, and closing it in a bounded sequence.

:func:`wait_pending` waits for the pending saves, the peer tier's rounds and the retention
deletions (what :meth:`CheckpointManager.wait` promises); :func:`raise_unobserved` raises a
failure of that work nobody has been told of yet. :func:`begin_close` and
:func:`close_parts` are the order in which :meth:`CheckpointManager.close` releases the
parts: the newest step made durable (when asked); then, once the manager accepts no save,
the saver's writes waited for (bounded) and its threads stopped, the deletions drained,
the pinned ring, the local tier, the target, the peer tier and the coordinator released,
then what was given up on logged and raised.

All of it runs on the caller's thread (the manager's user), under no lock of its own.
"""

from __future__ import annotations

import logging
import math
import time

from .errors import CkptTimeoutError
from .parts import Parts

__all__ = ["begin_close", "close_parts", "raise_unobserved", "wait_pending"]

log = logging.getLogger("ckptmgr")


def raise_unobserved(p: Parts) -> None:
    """Raise the first failure of a retention deletion, then of a save, nobody was told of."""
    deletion_error = p.deleter.take_error()
    if deletion_error is not None:
        raise deletion_error
    err = p.saver.take_failure()
    if err is not None:
        raise err


def wait_pending(p: Parts, timeout: float | None) -> None:
    """Wait for every pending save and prepare, the peer tier's rounds for them, and the
    deletions retention decided after them; then raise what nobody was told of.

    Raises:
        SaveError: a save failed and nobody has been told yet.
        StorageError: a retention deletion failed and nobody has been told yet.
        CkptTimeoutError: still pending after ``timeout`` seconds.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    p.saver.wait(timeout)
    if p.peers is not None:  # (and their copies in the peer tier)
        p.peers.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))
    p.deleter.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))
    raise_unobserved(p)


def begin_close(p: Parts, timeout: float | None, flush: bool) -> tuple[float | None, float | None]:
    """The first part of :meth:`CheckpointManager.close` (whose arguments these are, the
    timeout defaulted): make the newest step durable when asked. Returns the timeout (None:
    no limit) and the deadline (a ``time.monotonic()`` value) of the rest."""
    if timeout is not None and math.isinf(timeout):
        timeout = None
    deadline = None if timeout is None else time.monotonic() + timeout
    if flush:
        try:
            p.saver.flush(failed_too=False)  # (a failed write was told already, and is kept)
        except Exception as exc:  # (the newest step stays in the local tier: said below)
            log.warning("could not make the newest step durable before closing: %s: %s", type(exc).__name__, exc)
    return timeout, deadline


def close_parts(p: Parts, timeout: float | None, deadline: float | None) -> None:
    """The rest of :meth:`CheckpointManager.close`, once no save is accepted any more: the
    writes waited for (bounded), then every part released. Interrupted while it waits for
    the writes, it raises with nothing closed (``p.saver.closing`` is still False).

    Raises:
        SaveError: a save failed and nobody has been told yet.
        StorageError: a retention deletion failed and nobody has been told yet.
        CkptTimeoutError: writes or deletions were still running after ``timeout``.
    """
    lost, kept = p.saver.close(timeout)  # (lost: still being written; kept: failed, in the tier)
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        p.deleter.drain(left)
    except CkptTimeoutError:
        left = 0
    deleting = not p.deleter.close(left)
    hung = p.saver.hung
    if not hung:
        p.ring.close()
    if p.tier is not None:
        if kept:
            log.warning("steps %s were never written to %s; they stay only in the local tier %s (RAM: a reboot "
                        "loses them, another node does not see them) until the next start on this root, on "
                        "this node, writes them. To write them now: mgr.flush() or close(flush=True) before "
                        "closing, or `ckptmgr flush %s` on this node", kept, p.root, p.tier.path, p.root)
        p.tier.close(remove=not kept and not hung, wait=not hung)
    if not hung and not deleting:
        p.target.close()
    if p.peers is not None:
        p.peers.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
    if p.coord is not None:
        p.coord.destroy()
    for step, fate in lost.items():
        log.error("gave up waiting for the write of step %d to %s after %s s: it %s", step, p.root, timeout, fate)
    raise_unobserved(p)
    if lost or deleting:
        what = [f"step {s} {fate}" for s, fate in lost.items()] + (["a retention deletion"] if deleting else [])
        raise CkptTimeoutError(f"closed the manager for {p.root} after {timeout} s with work unfinished: "
                               + "; ".join(what))
