"""SaveHandle and SaveInfo: what ``CheckpointManager.save`` returns."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from .errors import CkptTimeoutError, SaveError

__all__ = ["SaveHandle", "SaveInfo"]


@dataclass(frozen=True)
class SaveInfo:
    """Facts about a committed checkpoint, with the save's telemetry.

    Attributes:
        step: the step saved.
        url: where the checkpoint lives.
        bytes: bytes written, all files together.
        files: number of data files.
        staging_s: seconds the caller was blocked copying the state.
        persist_s: seconds from the end of staging to the commit.
        total_s: seconds from ``save()`` to the commit.
    """

    step: int
    url: str
    bytes: int
    files: int
    staging_s: float
    persist_s: float
    total_s: float

    @property
    def throughput_gbps(self) -> float:
        """Bytes written per second of persisting, in GB/s."""
        return self.bytes / self.persist_s / 1e9 if self.persist_s > 0 else float("inf")


class SaveHandle:
    """The pending result of one ``save()``.

    A failure is reported once: by ``result()`` if the caller asks, otherwise at the next
    ``save()``, ``wait()`` or ``close()`` of the manager.
    """

    def __init__(self, step: int, future: Future[SaveInfo]) -> None:
        self.step = step
        self._future = future
        self._lock = threading.Lock()
        self._observed = False

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveInfo:
        """Wait for the commit and return its info.

        Raises:
            SaveError: the save failed (the original exception is ``__cause__``).
            CkptTimeoutError: not finished within ``timeout`` seconds.
        """
        try:
            info = self._future.result(timeout)
        except FutureTimeout:
            raise CkptTimeoutError(f"save of step {self.step} not finished after {timeout} s") from None
        except BaseException as exc:
            with self._lock:
                self._observed = True
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
        return f"<SaveHandle step={self.step} {state}>"


def _as_save_error(step: int, exc: BaseException) -> SaveError:
    return SaveError(f"save of step {step} failed: {type(exc).__name__}: {exc}")
