"""Checkpointing for plain training loops: resume, save on a schedule, save on preemption.

Checkpoint ``s`` holds the state after step ``s`` has run, so a resumed loop continues at
``s + 1``: :meth:`CheckpointCallback.resume` returns that step, and a restart never trains a
step twice or saves a committed step again.

Example:
    >>> from ckptmgr import CheckpointManager
    >>> from ckptmgr.integrations.callbacks import CheckpointCallback
    >>> state = {"model": model, "optim": opt, "sched": sched}  # doctest: +SKIP
    >>> ckpt = CheckpointCallback(CheckpointManager("/data/run1"), state, every_n_steps=500,
    ...                           save_on_signals=(signal.SIGTERM,))  # doctest: +SKIP
    >>> for step in range(ckpt.resume(), total_steps):  # doctest: +SKIP
    ...     loss = model(batch).loss
    ...     loss.backward()
    ...     ckpt.before_optimizer_step(step)  # the last save's copy has landed
    ...     opt.step(); opt.zero_grad(); sched.step()
    ...     if ckpt.after_step(step):  # saved because of a preemption signal: stop
    ...         break
    >>> ckpt.close()  # waits for the saves, then closes the manager  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import warnings
from collections.abc import Iterable
from types import FrameType
from typing import Any

from ckptmgr import CheckpointCorruptError, CheckpointManager, ConfigError, SaveHandle, StepNotFoundError

__all__ = ["CheckpointCallback"]

log = logging.getLogger("ckptmgr")


class CheckpointCallback:
    """Drives a :class:`~ckptmgr.CheckpointManager` from a plain training loop.

    The callback owns the manager: :meth:`close` (or leaving a ``with`` block) closes it.

    Args:
        manager: where checkpoints go; closed by :meth:`close`.
        state: the training state (a dict of modules, optimizers, schedulers, RNG holders,
            plain values...). It is saved as is and restored into in place.
        every_n_steps: save after every step that is a multiple of this.
        every_n_seconds: save after a step once this many seconds have passed since the
            last save (or the start).

            With a manager whose :class:`~ckptmgr.Schedule` has a budget (e.g.
            ``CheckpointManager(root, schedule=Schedule(max_overhead=0.01))``), leave both
            unset: :meth:`after_step` then asks the manager's ``should_save`` every step, and
            it saves as often as the budget allows (see docs/SCHEDULES.md).
        save_on_signals: signals (e.g. ``signal.SIGTERM``, ``signal.SIGUSR1``) that request a
            save at the end of the current step; :meth:`after_step` then saves, waits until
            the checkpoint is durable and returns True so the loop can stop. Installed from
            the main thread; the previous handlers come back at :meth:`close`.
        block: False (the default) overlaps the copy with the next forward and backward;
            :meth:`before_optimizer_step` waits for it.

    Raises:
        ConfigError: no schedule at all, or a bad value.
    """

    def __init__(self, manager: CheckpointManager, state: Any, *, every_n_steps: int | None = None,
                 every_n_seconds: float | None = None, save_on_signals: Iterable[int] = (),
                 block: bool = False) -> None:
        if not isinstance(manager, CheckpointManager):
            raise ConfigError(f"manager must be a CheckpointManager, got {type(manager).__name__}")
        if every_n_steps is not None and (type(every_n_steps) is not int or every_n_steps <= 0):
            raise ConfigError(f"every_n_steps must be a positive int or None, got {every_n_steps!r}")
        if every_n_seconds is not None and (not isinstance(every_n_seconds, (int, float))
                                            or isinstance(every_n_seconds, bool) or every_n_seconds <= 0):
            raise ConfigError(f"every_n_seconds must be a positive number or None, got {every_n_seconds!r}")
        signals = tuple(save_on_signals)
        self.by_budget = every_n_steps is None and every_n_seconds is None and manager.schedule.budget
        if every_n_steps is None and every_n_seconds is None and not signals and not self.by_budget:
            raise ConfigError("CheckpointCallback needs every_n_steps, every_n_seconds, save_on_signals or a manager "
                              "whose Schedule has a budget (e.g. Schedule(max_overhead=0.01))")
        self.manager = manager
        self.state = state
        self.every_n_steps = every_n_steps
        self.every_n_seconds = every_n_seconds
        self.block = bool(block)
        self.stop_requested = False
        self.resumed_step: int | None = None  # the step resume() restored, if any
        self._signalled: int | None = None
        self._pending: SaveHandle | None = None
        self._last_save = time.monotonic()
        self._previous: dict[int, Any] = {}
        if signals and threading.current_thread() is not threading.main_thread():
            raise ConfigError("save_on_signals needs the callback to be made on the main thread")
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = signum  # acted on at the end of the current step, never mid-step

    def resume(self) -> int:
        """Restore the newest checkpoint that verifies into ``state``; return the step to run
        next: ``s + 1`` after restoring step ``s``, 0 on a fresh start.

        A newer checkpoint that fails verification is skipped with a warning, as
        :meth:`CheckpointManager.restore` does; :attr:`resumed_step` says which step was
        restored.

        Raises:
            StepNotFoundError: there are checkpoints, but none verifies.
            StateMismatchError: ``state`` does not match the checkpoint; nothing was changed.
        """
        steps = self.manager.steps()
        for step in reversed(steps):
            try:
                self.manager.restore(step, target=self.state)
            except (CheckpointCorruptError, StepNotFoundError) as exc:
                warnings.warn(f"skipping step {step}: {exc}", RuntimeWarning, stacklevel=2)
                continue
            log.info("resumed from step %d", step)
            self.resumed_step = step
            return step + 1
        if steps:
            raise StepNotFoundError(f"no checkpoint under {self.manager.root} verifies (tried steps {steps})")
        return 0

    def before_optimizer_step(self, step: int) -> None:
        """Call right before ``optimizer.step()``: the last save's copy must have landed
        before the weights change."""
        if self._pending is not None:
            self._pending.wait_staged()
            self._pending = None

    def after_step(self, step: int) -> bool:
        """Call after the optimizer step of ``step``: saves when the schedule says so.

        Returns:
            True when a preemption signal arrived: the state of ``step`` is then durable
            and the loop should stop.
        """
        if self._signalled is not None:
            log.warning("signal %d: saving step %d before stopping", self._signalled, step)
            self.before_optimizer_step(step)
            if step not in self.manager.steps():
                self.manager.save(step, self.state).result()
            self.manager.wait()
            self.stop_requested = True
            self._signalled = None
            return True
        due = self.by_budget and self.manager.should_save(step)
        due = due or (self.every_n_steps is not None and step % self.every_n_steps == 0)
        due = due or (self.every_n_seconds is not None and time.monotonic() - self._last_save >= self.every_n_seconds)
        if due:
            self.before_optimizer_step(step)
            self._pending = self.manager.save(step, self.state, block=self.block)
            self._last_save = time.monotonic()
        return False

    def close(self) -> None:
        """Wait for pending saves, put the signal handlers back, and close the manager.

        Raises:
            SaveError: a save failed and nobody has been told yet (the manager is closed all
                the same).
        """
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        try:
            self.before_optimizer_step(-1)
        finally:
            self.manager.close()

    def __enter__(self) -> CheckpointCallback:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # failing already: close, but do not replace the exception
            self.close()
        except Exception as close_exc:
            log.error("while handling %s: %s", getattr(exc_type, "__name__", exc_type), close_exc)
