"""Protection from retention: ``protect``, ``unprotect`` and ``is_protected`` of the manager.

A protected step carries a ``protected`` marker beside its files, so the protection holds
for every later manager on the root. A step still being saved is protected when it commits
(the manager's ``_finished`` writes the marker before retention runs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from .storage import Target

__all__ = ["Protection"]


class Protection:
    """Mixed into CheckpointManager, whose lock, pending saves and target it uses."""

    _lock: threading.Lock
    _pending: dict[int, Any]
    _protect_pending: set[int]
    _target: Target
    _check_open: Callable[[], None]  # the manager's: raises once it is closed

    @staticmethod
    def _check_step(step: object) -> None:
        if type(step) is not int or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")

    def _set_protection(self, step: int, protected: bool) -> None:
        self._check_open()
        self._check_step(step)
        with self._lock:
            if step in self._pending:  # applied when it commits
                (self._protect_pending.add if protected else self._protect_pending.discard)(step)
                return
        self._target.set_protected(step, protected)

    def protect(self, step: int) -> None:
        """Keep ``step`` whatever the retention policy says, until :meth:`unprotect`.

        Recorded durably beside the checkpoint (a ``protected`` marker in its directory), so
        it holds for every later manager on this root. A step still being saved is protected
        as soon as it commits.

        Raises:
            StepNotFoundError: ``step`` is neither committed on the root nor being saved.
        """
        self._set_protection(step, True)

    def unprotect(self, step: int) -> None:
        """Let the retention policy decide about ``step`` again (from the next commit on).

        Raises:
            StepNotFoundError: ``step`` is neither committed on the root nor being saved.
        """
        self._set_protection(step, False)

    def is_protected(self, step: int) -> bool:
        """Whether ``step`` is protected from retention."""
        self._check_open()
        self._check_step(step)
        with self._lock:
            if step in self._protect_pending:
                return True
        return self._target.is_protected(step)
