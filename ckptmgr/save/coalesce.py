"""The saver's job picker: which durable write the engine's worker runs next, and retries.

This is the one place that decides which steps are written durably, and in what order.
Queued saves first: the newest one committed in the local tier (the older locally committed
ones are *superseded* for the durable tier: saves come faster than the target absorbs them),
else the oldest queued one (its local commit still runs, or there is no local tier); then a
retry that is due. A failed durable write waits in ``retries`` with exponential backoff while
its slot still holds the step and no newer step has committed; when a save waits for a slot,
the held writes are retried after the shortest delay (the training loop waits for them).

Ownership: ``queue``, ``retries`` and ``closing`` are guarded by the saver's ``_mu`` (the
Condition handed in), like the job fields ``picked`` and ``released``; the picker calls the
saver's hooks with that lock held only where it says so.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .persist import PersistJob
from .slots import SlotPool

if TYPE_CHECKING:
    from .engine import Pending, Work

__all__ = ["RETRY_FIRST_S", "RETRY_MAX_S", "Coalescing"]

log = logging.getLogger("ckptmgr")

RETRY_FIRST_S = 1.0  # first delay before a failed durable write is tried again; doubles per failure
RETRY_MAX_S = 60.0  # longest delay between two attempts

Entry = tuple[PersistJob, "Pending[Any]"]


class Coalescing:
    """Picks the saver's next durable write (see the module docstring).

    Args:
        mu: the saver's lock (guards this picker's state too).
        pool: the slot pool (asked whether a picked job's slot still holds its step).
        run: runs one durable write (``job``, its pending or None for a retry) on the worker.
        superseded: called with ``mu`` held for the entries the picker passes over; the saver
            forgets them there.
        finish: called without the lock for those entries, with the step that superseded them.
        dropped: a retry given up (its step, and why).
    """

    def __init__(self, mu: threading.Condition, pool: SlotPool, *,
                 run: Callable[[PersistJob, Pending[Any] | None], None],
                 superseded: Callable[[list[Entry]], None],
                 finish: Callable[[PersistJob, Pending[Any], int | None], None],
                 dropped: Callable[[PersistJob, str], None]) -> None:
        self._mu = mu
        self._pool = pool
        self._run = run
        self._superseded = superseded
        self._finish = finish
        self._dropped = dropped
        self.queue: collections.deque[Entry] = collections.deque()  # first attempts, in save order
        self.retries: list[tuple[float, PersistJob]] = []  # failed writes and when they are due
        self.closing = False
        self.slot_wanted = threading.Event()  # a save waits for a slot (set by the pool, under its lock)

    def retrying(self, step: int) -> bool:
        """Whether ``step`` waits for another attempt (``mu`` held)."""
        return any(j.step == step for _, j in self.retries)

    def retry_later(self, job: PersistJob) -> float:
        """Queue ``job``'s next attempt with backoff (``mu`` held); return the delay."""
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** (job.attempts - 1))
        self.retries.append((time.monotonic() + delay, job))
        self._mu.notify_all()
        return delay

    def stop(self) -> None:
        with self._mu:
            self.closing = True
            self._mu.notify_all()

    def next(self) -> Work | None:
        while True:
            self._hurry_retries()
            superseded: list[Entry] = []
            picked: Entry | None = None
            held = True
            with self._mu:
                if self.queue:
                    ready = [e for e in self.queue if e[0].released]
                    picked = max(ready, key=lambda e: e[0].step) if ready else self.queue[0]
                    superseded = [e for e in ready if e[0].step < picked[0].step]
                    for e in (picked, *superseded):
                        self.queue.remove(e)
                    picked[0].picked = True
                    if picked[0].released:  # the pool may have handed its slot to a newer save
                        held = self._pool.hold(picked[0].slot, picked[0].step)
                    if not held:
                        superseded.append(picked)
                    self._superseded(superseded)
                elif self.closing:
                    return None
                else:
                    now = time.monotonic()
                    due = [r for r in self.retries if r[0] <= now]
                    if not due:
                        # (bounded while retries wait: a save that wants a slot shortens them)
                        self._mu.wait(min(min(r[0] for r in self.retries) - now, 0.25) if self.retries else None)
                        continue
                    first = min(due, key=lambda r: r[0])
                    self.retries.remove(first)
            if picked is not None:
                by = picked[0].step if held else self._pool.newest_committed()
                for job, pending in superseded:
                    self._finish(job, pending, by)
                if held:
                    return functools.partial(self._run, *picked)
                continue
            job = first[1]
            if self._pool.hold_for_retry(job.slot, job.step):
                return functools.partial(self._run, job, None)
            self._dropped(job, "its staging slot no longer holds it" if not self._pool.superseded(job.step)
                          else "a newer step has committed since")

    def _hurry_retries(self) -> None:
        if not self.slot_wanted.is_set():
            return
        self.slot_wanted.clear()
        with self._mu:
            if not self.retries:
                return
            soon = time.monotonic() + RETRY_FIRST_S
            self.retries = [(min(at, soon), job) for at, job in self.retries]
        log.warning("a save waits for a staging slot: the slots hold steps whose durable write failed and is "
                    "being retried (the newest checkpoint is never given up); set StagingOptions(slots=2) "
                    "to keep saving meanwhile, or busy_timeout / on_busy='skip' not to wait")
