"""SaveHandle: what ``CheckpointManager.save`` returns (and SaveInfo, re-exported)."""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout

from .errors import CkptTimeoutError, SaveSkippedError
from .save.outcome import Ticket, as_save_error
from .save.persist import SaveInfo

__all__ = ["SaveHandle", "SaveInfo"]


class SaveHandle:
    """The pending result of one ``save()``.

    A failure is reported once: by ``result()`` if the caller asks, otherwise at the next
    ``save()``, ``wait()`` or ``close()`` of the manager. An interruption of the caller while
    it waits (``KeyboardInterrupt``, ``SystemExit``) passes straight through and reports
    nothing: the save's own outcome is still told later.

    When the handle resolves, and with what (:meth:`result`):

    * written durably: once the step is committed on the durable target;
      ``SaveInfo.durable`` is True.
    * superseded: the step is committed in the local tier, and a newer step took its place
      in the durable write (saves came faster than the durable target absorbs them: when
      the writer became free, or when a new save reused the step's slot, a newer step was
      already committed). It resolves at that moment, successfully: ``SaveInfo.durable`` is
      False and ``SaveInfo.superseded_by`` names the newer step (the newest committed one
      when it was passed over). The step stays listed by ``steps()`` and restorable until
      its slot is reused; it is never written to the durable target later, and a
      ``protect()`` of it is dropped with a warning.
    * local only (the manager's :class:`~ckptmgr.Schedule` did not send this step to the
      durable target): once it is committed in the local tier; ``SaveInfo.durable`` is False
      and ``superseded_by`` is None. Without a local tier every step is written durably.
    * failed: ``result()`` raises SaveError. A durable write that fails is retried in the
      background while the slot still holds the step (the failure is still reported here),
      unless retrying cannot fix it (ENOSPC, EDQUOT, EFBIG, EROFS, EACCES, EPERM: it is then
      logged once and not retried; the local tier keeps the step for the next start).

    Attributes:
        step: the step being saved.
        skipped: True when the save did not happen because every staging slot was busy
            (``StagingOptions(on_busy="skip")``); ``result()`` then raises SaveSkippedError.
    """

    def __init__(self, ticket: Ticket) -> None:
        self._ticket = ticket
        self.step = ticket.step
        self.skipped = ticket.skipped

    def done(self) -> bool:
        """True once the save has resolved: committed durably, superseded, kept local only, or failed."""
        return self._ticket.future.done()

    def staged(self) -> bool:
        """True once the state has been copied and may be mutated."""
        staging = self._ticket.staging
        return staging is None or staging.safe()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state has been copied off the caller's tensors.

        Required after ``save(..., block=False)`` before the state is changed (for example,
        right before ``optimizer.step()``); instant after a blocking save.

        Raises:
            CkptTimeoutError: the copy did not finish within ``timeout`` seconds.
            SaveError: the copy failed.
        """
        staging = self._ticket.staging
        if staging is None:
            return
        try:
            staging.wait_safe(timeout)
        except CkptTimeoutError:
            raise
        except Exception as exc:
            raise as_save_error(self.step, exc) from exc

    def result(self, timeout: float | None = None) -> SaveInfo:
        """Wait until the save resolves (see the class docstring) and return its info.

        Raises:
            SaveError: the save failed (the original exception is ``__cause__``).
            SaveSkippedError: the save was skipped.
            CkptTimeoutError: not finished within ``timeout`` seconds.
        """
        future = self._ticket.future
        try:
            return future.result(timeout)
        except BaseException as raised:
            exc = self._ticket.failure()
            if exc is not raised:  # not the save's outcome: an interruption of this caller, or a timeout
                if isinstance(raised, FutureTimeout) and not future.done():
                    raise CkptTimeoutError(f"save of step {self.step} not finished after {timeout} s") from None
                raise
        self._ticket.observe()
        if isinstance(exc, SaveSkippedError):
            raise SaveSkippedError(str(exc)) from None
        raise as_save_error(self.step, exc) from exc

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._ticket.failure() else "committed")
        state = "skipped" if self.skipped else state
        return f"<SaveHandle step={self.step} {state}>"
