"""SaveHandle and SaveInfo: what ``CheckpointManager.save`` returns."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from .errors import CkptTimeoutError, SaveError, SaveSkippedError
from .save.staging import StagingJob

__all__ = ["SaveHandle", "SaveInfo"]


@dataclass(frozen=True)
class SaveInfo:
    """Facts about a committed checkpoint, with the save's telemetry.

    Attributes:
        step: the step saved.
        url: where the checkpoint lives.
        bytes: bytes written, all files together.
        files: number of data files.
        staging_s: seconds from ``save()`` until the state was safe to mutate (the copy
            had landed in host memory).
        persist_s: seconds from the end of staging to the durable commit.
        total_s: seconds from ``save()`` to the durable commit.
        blocked_s: seconds ``save()`` itself took (with ``block=False``, only the enqueue).
        busy_wait_s: seconds ``save()`` waited for a free staging slot.
        local_s: seconds from ``save()`` until the local tier listed the checkpoint (None
            when the slot is not in the local tier).
    """

    step: int
    url: str
    bytes: int
    files: int
    staging_s: float
    persist_s: float
    total_s: float
    blocked_s: float = 0.0
    busy_wait_s: float = 0.0
    local_s: float | None = None

    @property
    def throughput_gbps(self) -> float:
        """Bytes written per second of persisting, in GB/s."""
        return self.bytes / self.persist_s / 1e9 if self.persist_s > 0 else float("inf")


class SaveHandle:
    """The pending result of one ``save()``.

    A failure is reported once: by ``result()`` if the caller asks, otherwise at the next
    ``save()``, ``wait()`` or ``close()`` of the manager.

    Attributes:
        step: the step being saved.
        skipped: True when the save did not happen because every staging slot was busy
            (``StagingOptions(on_busy="skip")``); ``result()`` then raises SaveSkippedError.
    """

    def __init__(self, step: int, future: Future[SaveInfo], staging: StagingJob | None = None,
                 *, skipped: bool = False) -> None:
        self.step = step
        self.skipped = skipped
        self._future = future
        self._staging = staging
        self._lock = threading.Lock()
        self._observed = skipped  # a skip is reported by result() only

    @classmethod
    def _skip(cls, step: int, reason: str) -> SaveHandle:
        future: Future[SaveInfo] = Future()
        future.set_exception(SaveSkippedError(f"step {step} was not saved: {reason}"))
        return cls(step, future, skipped=True)

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def staged(self) -> bool:
        """True once the state has been copied and may be mutated."""
        return self._staging is None or self._staging.done()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state has been copied off the caller's tensors.

        Required after ``save(..., block=False)`` before the state is changed (for example,
        right before ``optimizer.step()``); instant after a blocking save.

        Raises:
            CkptTimeoutError: the copy did not finish within ``timeout`` seconds.
            SaveError: the copy failed.
        """
        if self._staging is None:
            return
        try:
            self._staging.wait(timeout)
        except CkptTimeoutError:
            raise
        except Exception as exc:
            raise _as_save_error(self.step, exc) from exc

    def result(self, timeout: float | None = None) -> SaveInfo:
        """Wait for the commit and return its info.

        Raises:
            SaveError: the save failed (the original exception is ``__cause__``).
            CkptTimeoutError: not finished within ``timeout`` seconds.
        """
        try:
            info = self._future.result(timeout)
        except BaseException as exc:
            # (a failure of the save itself may be a TimeoutError too: a rank did not answer)
            if isinstance(exc, FutureTimeout) and not self._future.done():
                raise CkptTimeoutError(f"save of step {self.step} not finished after {timeout} s") from None
            with self._lock:
                self._observed = True
            if isinstance(exc, SaveSkippedError):
                raise SaveSkippedError(str(exc)) from None
            raise _as_save_error(self.step, exc) from exc
        return info

    def _take_error(self) -> SaveError | None:
        """The failure, if there is one that nobody has been told of yet (then marks it told)."""
        if not self._future.done():
            return None
        exc = self._future.exception()
        if exc is None:
            return None
        with self._lock:
            if self._observed:
                return None
            self._observed = True
        err = _as_save_error(self.step, exc)
        err.__cause__ = exc
        return err

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._future.exception() else "committed")
        state = "skipped" if self.skipped else state
        return f"<SaveHandle step={self.step} {state}>"


def _as_save_error(step: int, exc: BaseException) -> SaveError:
    return SaveError(f"save of step {step} failed: {type(exc).__name__}: {exc}")
