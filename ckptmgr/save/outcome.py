"""How a save ends: its :class:`Pending` handle, and which failed durable writes are worth a retry.

A durable write that fails with an ``OSError`` is retried (with backoff, by the saver) when
trying again can help: the target was unreachable, throttled, or failed a request. It is
not retried when only a person can fix the cause (:func:`permanent`): the target is full
(``ENOSPC``, ``EDQUOT``, ``EFBIG``), read-only (``EROFS``) or refuses this process
(``EACCES``, ``EPERM``); nor when another writer committed the step (``FileExistsError``).
"""

from __future__ import annotations

import errno
import logging
import threading
from concurrent.futures import Future
from typing import Generic, TypeVar

from ..errors import SaveError, SaveSkippedError
from .persist import SaveInfo
from .staging import StagingJob

__all__ = ["PERMANENT_ERRNOS", "Pending", "Ticket", "as_save_error", "permanent", "report_interrupted",
           "report_permanent", "retryable"]

log = logging.getLogger("ckptmgr")

# errors that another attempt cannot fix: the space, the quota, the mount or the permissions must change first
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM})


def as_save_error(step: int, exc: BaseException) -> SaveError:
    return SaveError(f"save of step {step} failed: {type(exc).__name__}: {exc}")


T = TypeVar("T")


class Pending(Generic[T]):
    """One save in flight: its copies and its outcome (a future completed by the worker).

    A failure is told once: ``observed`` flips under ``_lock`` by whoever tells it (a save
    whose caller waits for it itself is observed from the start).

    Args:
        step: the save's step (or a sequence number where there is none).
        future: completed with the save's result.
        staging: its copies (None: nothing staged).
        skipped: the save was skipped (its future already holds the reason).
        observed: nobody else needs to be told of a failure.
    """

    def __init__(self, step: int, future: Future[T], staging: StagingJob | None, *, skipped: bool = False,
                 observed: bool = False) -> None:
        self.step = step
        self.future = future
        self.staging = staging
        self.skipped = skipped
        self._lock = threading.Lock()
        self._observed = skipped or observed

    @classmethod
    def skip(cls, step: int, reason: str) -> Pending[T]:
        future: Future[T] = Future()
        future.set_exception(SaveSkippedError(f"step {step} was not saved: {reason}"))
        return cls(step, future, None, skipped=True)

    def staged(self) -> bool:
        """True once every copy has landed (the tensors may change)."""
        return self.staging is None or self.staging.done()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until every copy has landed (raises CkptTimeoutError after ``timeout`` s)."""
        if self.staging is not None:
            self.staging.wait(timeout)

    def result(self, timeout: float | None = None) -> T:
        """The save's result; raises its error."""
        return self.future.result(timeout)

    def failure(self) -> BaseException | None:
        """The save's exception once it has failed (None while pending or after success)."""
        return self.future.exception() if self.future.done() else None

    def observe(self) -> bool:
        """Mark the outcome told; True when nobody had been told before."""
        with self._lock:
            first, self._observed = not self._observed, True
        return first

    @property
    def observed(self) -> bool:
        with self._lock:
            return self._observed

    def take_error(self) -> SaveError | None:
        """The failure as a SaveError, if nobody has been told of it yet (then it is told)."""
        exc = self.failure()
        if exc is None or not self.observe():
            return None
        err = as_save_error(self.step, exc)
        err.__cause__ = exc
        return err


Ticket = Pending[SaveInfo]  # the outcome of one save as the saver tracks it (SaveHandle wraps it)


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


def report_permanent(step: int, url: str, error: BaseException, code: int, *, kept_in: str | None,
                     attempt: int | None) -> None:
    """Log, once, a durable write of ``step`` to ``url`` that failed for a reason retrying
    cannot fix (the save's handle raises it too), and where the step is left: in the local
    tier ``kept_in``, or nowhere but this process's memory. ``attempt``: of a retry."""
    where = (f"it stays in the local tier {kept_in}, and the next start on this root writes it" if kept_in
             else "it was only in this process's memory and is dropped when its staging slot is reused")
    log.error("the durable write of step %d to %s failed%s: %s: %s; retrying cannot fix %s (free space, raise the "
              "quota or fix the mount or permissions), so it is not retried; %s", step, url,
              f" at attempt {attempt}" if attempt is not None else "", type(error).__name__, error,
              errno.errorcode.get(code, str(code)), where)


def report_interrupted(url: str, exc: BaseException, fates: dict[int, str]) -> None:
    """Log the steps not yet durable on ``url`` when closing was interrupted by ``exc``
    (Ctrl-C) while it waited for them, and what a kill would make of each (``fates``)."""
    if fates:
        steps = "step " + ", ".join(map(str, fates)) + (" was" if len(fates) == 1 else " were")
        log.error("closing the manager for %s was interrupted (%s) before %s written: the writes go on, the manager "
                  "stays open, and interpreter exit (or close()) waits for them again; if the process ends first, %s",
                  url, type(exc).__name__, steps, "; ".join(f"step {s} {fate}" for s, fate in fates.items()))
