"""The deleter: applies a retention policy in the background, after each commit.

Each run lists the committed steps, asks the policy for a keep-mask, and deletes the rest,
except, whatever the policy says:

* the newest committed step, and the step this manager committed last (``current``): after
  a roll-back (restore an older step, save on from there) that step is older than the
  steps of the abandoned run, which stay the newest until the new run passes them;
* a step carrying the protection marker (``mgr.protect(step)``);
* a step being restored (see :class:`StepGuard`); a restore never starts on a step being
  deleted.

Protection is checked twice: once when the run decides, and again right before each
deletion, under the guard, so that ``protect(step)`` either returns before that check (and
the step is kept) or finds the step being deleted and says so (StepNotFoundError): a
protection that returned always holds.

Steps being written are not committed yet, so they are never listed. A target deletes the
commit record first and only files it wrote, so a crash mid-delete leaves garbage that the
next start removes, never a step that looks complete.

A step that cannot be judged (its manifest unreadable) or deleted (EPERM, EACCES, I/O) is
skipped, never fatal to the run: the others are deleted as the policy says. It is listed in
:attr:`Deleter.skipped` and logged once; a failed deletion is also kept and raised once, at
the manager's next ``save()``, ``wait()`` or ``close()``, like a failed save. Later runs try
the step again, quietly (the operator may have fixed it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

from .._threads import DaemonPool
from ..errors import CkptError, CkptTimeoutError, StorageError
from ..format.manifest import Manifest
from ..format.tree import decode_plain
from ..storage import Target
from .policies import KeepAll, RetentionPolicy, StepInfo

__all__ = ["Deleter", "StepGuard"]

log = logging.getLogger("ckptmgr")


class StepGuard:
    """Per-step exclusion between the deleter and everyone else: a step being deleted is
    never read or marked, and a step being read or marked is never deleted. The lock is held
    only to update the tables, never across I/O."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._reading: Counter[int] = Counter()  # reads and protection markers in progress
        self._deleting: set[int] = set()

    @contextlib.contextmanager
    def reading(self, step: int) -> Iterator[bool]:
        """Yields False when ``step`` is being deleted (then do not read it)."""
        with self._mu:
            ok = step not in self._deleting
            if ok:
                self._reading[step] += 1
        try:
            yield ok
        finally:
            if ok:
                with self._mu:
                    self._reading[step] -= 1

    marking = reading  # writing a protection marker excludes deletion the same way

    @contextlib.contextmanager
    def deleting(self, step: int) -> Iterator[bool]:
        """Yields False when ``step`` is being read or marked (then do not delete it)."""
        with self._mu:
            ok = self._reading[step] == 0
            if ok:
                self._deleting.add(step)
        try:
            yield ok
        finally:
            if ok:
                with self._mu:
                    self._deleting.discard(step)


class Deleter:
    """Runs the policy on one background thread; runs requested while one is queued merge."""

    def __init__(self, target: Target, policy: RetentionPolicy, guard: StepGuard,
                 on_deleted: Callable[[int], None] | None = None) -> None:
        self.target = target
        self.policy = policy
        self.guard = guard
        self.on_deleted = on_deleted  # told of each step deleted (the saver's catalog)
        self._pool = DaemonPool(1, thread_name_prefix="ckptmgr-delete")
        self._mu = threading.Lock()
        self._queued: Future[None] | None = None
        self._futures: list[Future[None]] = []
        self._errors: list[CkptError] = []
        self._infos: dict[int, StepInfo] = {}  # committed steps never change: cache what we read
        self._skipped: dict[int, str] = {}  # step -> why retention leaves it (_mu)
        self.deleted: list[int] = []
        self.current: int | None = None  # the step this manager committed last (set by the saver): kept

    @property
    def skipped(self) -> dict[int, str]:
        """Steps that retention could not judge or delete in its last attempt, with why."""
        with self._mu:
            return dict(self._skipped)

    def _skip(self, step: int, why: str) -> bool:
        """Record that ``step`` is left for ``why``; True the first time (then tell)."""
        with self._mu:
            first = step not in self._skipped
            self._skipped[step] = why
        return first

    def _unskip(self, step: int) -> None:
        with self._mu:
            self._skipped.pop(step, None)

    def schedule(self) -> None:
        """Apply the policy soon (after the commit that just happened)."""
        if isinstance(self.policy, KeepAll):
            return
        with self._mu:
            if self._queued is not None and not self._queued.running() and not self._queued.done():
                return  # a run that has not started yet will see this commit too
            fut = self._pool.submit(self._run)
            self._queued = fut
            self._futures = [f for f in self._futures if not f.done()] + [fut]

    def _info(self, step: int) -> StepInfo | None:
        if step not in self._infos:
            try:
                m = Manifest.from_bytes(self.target.read_manifest(step), where=f"{self.target.url}: step {step}")
            except (CkptError, OSError) as exc:  # damaged or unreadable: not ours to judge; keep it
                if self._skip(step, f"kept: its manifest cannot be read: {exc}"):
                    log.warning("retention: keeping step %d, its manifest cannot be read: %s", step, exc)
                return None
            self._unskip(step)
            meta = decode_plain(m.metadata) if m.metadata is not None else {}
            self._infos[step] = StepInfo(step, m.time, meta if isinstance(meta, dict) else {})
        return self._infos[step]

    def plan(self) -> list[int]:
        """The committed steps that the policy would delete now, ascending: those it does not
        keep, less the newest and the protected ones."""
        steps = self.target.list_steps()
        with self._mu:  # (steps gone meanwhile are no longer skipped)
            self._skipped = {s: why for s, why in self._skipped.items() if s in steps}
        infos = [i for i in (self._info(s) for s in steps) if i is not None]
        if not steps or not infos:
            return []
        mask = self.policy.keep(infos)
        if len(mask) != len(infos):
            raise ValueError(f"{self.policy!r} returned {len(mask)} decisions for {len(infos)} steps")
        newest = steps[-1]
        return [info.step for info, keep in zip(infos, mask, strict=True)
                if not keep and info.step not in (newest, self.current) and not self.target.is_protected(info.step)]

    def delete(self, steps: list[int]) -> list[int]:
        """Delete ``steps`` (from :meth:`plan`), skipping any being restored or protected since
        the plan; return those deleted."""
        done = []
        for step in steps:
            with self.guard.deleting(step) as ok:
                if not ok:
                    log.info("retention: step %d is being restored or protected; deciding again later", step)
                    continue
                try:
                    if self.target.is_protected(step):  # protected after the plan: keep it
                        continue
                    self.target.delete(step)
                except Exception as exc:  # this step only: the others are deleted all the same
                    if self._skip(step, f"cannot be deleted: {type(exc).__name__}: {exc}"):
                        err = StorageError(f"retention could not delete step {step} under {self.target.url} "
                                           f"({type(exc).__name__}: {exc}); it is kept and tried again at later "
                                           "runs, the other steps are deleted as the policy says")
                        err.__cause__ = exc
                        self.report(err)
                    else:
                        log.debug("retention: step %d still cannot be deleted: %s", step, exc)
                    continue
            self._unskip(step)
            if self.on_deleted is not None:
                self.on_deleted(step)
            self._infos.pop(step, None)
            self.deleted.append(step)
            done.append(step)
            log.info("retention: deleted step %d under %s", step, self.target.url)
        return done

    def _run(self) -> None:
        try:
            self.delete(self.plan())
        except Exception as exc:
            err = StorageError(f"retention under {self.target.url} failed: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            with self._mu:
                self._errors.append(err)
            log.error("%s", err)

    def report(self, err: CkptError) -> None:
        """Keep ``err`` to be raised, once, like a deletion failure."""
        with self._mu:
            self._errors.append(err)
        log.error("%s", err)

    def take_error(self) -> CkptError | None:
        """The oldest deletion failure nobody was told of yet."""
        with self._mu:
            return self._errors.pop(0) if self._errors else None

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every run decided so far.

        Raises:
            CkptTimeoutError: runs still going after ``timeout`` seconds.
        """
        with self._mu:
            pending = list(self._futures)
        _, not_done = wait_futures(pending, timeout)
        if not_done:
            raise CkptTimeoutError(f"retention still deleting after {timeout} s")

    def close(self, timeout: float | None = None) -> bool:
        """Stop: runs not started are dropped, a run in progress gets ``timeout`` seconds.
        Returns False when one is still running (its daemon thread never keeps the process
        alive)."""
        return self._pool.stop(timeout=timeout)

    def __repr__(self) -> str:
        return f"Deleter({self.policy!r})"
