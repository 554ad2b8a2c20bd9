"""How a save ends: its :class:`Ticket`, and which failed durable writes are worth a retry.

A durable write that fails with an ``OSError`` is retried (with backoff, by the saver) when
trying again can help: the target was unreachable, throttled, or failed a request. It is
not retried when only a person can fix the cause (:func:`permanent`): the target is full
(``ENOSPC``, ``EDQUOT``, ``EFBIG``), read-only (``EROFS``) or refuses this process
(``EACCES``, ``EPERM``); nor when another writer committed the step (``FileExistsError``).
"""

from __future__ import annotations

import errno
import threading
from concurrent.futures import Future

from ..errors import SaveError, SaveSkippedError
from .persist import SaveInfo
from .staging import StagingJob

__all__ = ["PERMANENT_ERRNOS", "Ticket", "as_save_error", "permanent", "retryable"]

# errors that another attempt cannot fix: the space, the quota, the mount or the permissions must change first
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})


class Ticket:
    """The outcome of one save as the saver tracks it (:class:`~ckptmgr.SaveHandle` wraps it).

    The future is completed by the persist thread, at the end of the job's settle. A failure
    is told once: ``observed`` flips under ``_lock`` by whoever tells it.
    """

    def __init__(self, step: int, future: Future[SaveInfo], staging: StagingJob | None, *, skipped: bool = False):
        self.step = step
        self.future = future
        self.staging = staging
        self.skipped = skipped
        self._lock = threading.Lock()
        self._observed = skipped  # a skip is reported by result() only

    @classmethod
    def skip(cls, step: int, reason: str) -> Ticket:
        future: Future[SaveInfo] = Future()
        future.set_exception(SaveSkippedError(f"step {step} was not saved: {reason}"))
        return cls(step, future, None, skipped=True)

    def failure(self) -> BaseException | None:
        """The save's exception once it has failed (None while pending or after success)."""
        return self.future.exception() if self.future.done() else None

    def observe(self) -> bool:
        """Mark the outcome told; True when nobody had been told before."""
        with self._lock:
            first, self._observed = not self._observed, True
        return first

    def take_error(self) -> SaveError | None:
        """The failure as a SaveError, if nobody has been told of it yet (then it is told)."""
        exc = self.failure()
        if exc is None or not self.observe():
            return None
        err = as_save_error(self.step, exc)
        err.__cause__ = exc
        return err


def as_save_error(step: int, exc: BaseException) -> SaveError:
    return SaveError(f"save of step {step} failed: {type(exc).__name__}: {exc}")


def permanent(exc: BaseException) -> int | None:
    """The errno of ``exc`` (or of an ``OSError`` it was raised from) when retrying cannot fix
    it (see :data:`PERMANENT_ERRNOS`); None otherwise."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in PERMANENT_ERRNOS:
            return e.errno
        e = e.__cause__ or e.__context__
    return None


def retryable(exc: BaseException) -> bool:
    """Storage failures are worth another try, unless retrying cannot fix them; a step
    committed by someone else is not."""
    return isinstance(exc, OSError) and not isinstance(exc, FileExistsError) and permanent(exc) is None
