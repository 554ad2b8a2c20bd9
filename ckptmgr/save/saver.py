"""The saver: owns the slot pool, the stager and the persist thread, and settles every save.

Who owns what (each piece of mutable state has one owner)::

    Saver._mu (a Condition; never held across I/O, taken briefly by save() on the training thread)
        _pending      steps submitted whose outcome has not been decided
        _queue        jobs waiting for the persist thread (first attempts, in save order);
                      each job's ``picked`` and ``released`` flags
        _retries      jobs whose durable write failed, waiting for their next attempt
        _durable      the durable target's committed steps as this manager knows them: the
                      start-up listing, plus its own commits, less the deleter's deletions
                      (so save() never lists the target)
        _protect      steps to protect as soon as they commit
        _unsettled    first attempts and prepare() runs not finished (what wait() waits for)
        _tickets      outcomes nobody has been told of yet
        _counts       steps superseded for the durable tier, steps kept local only
        _last_durable when the last save meant for the durable target was made (the schedule)
    SlotPool._cond    the slot table (see slots.py); lock order: Saver._mu -> pool -> tier
                      (the pool never calls back into the saver with its lock held)
    the persist thread  a job from the moment it picks it until the job's settle() returns

The life of a save: ``save()`` (training thread) acquires a slot, fits and stages into it,
queues a :class:`PersistJob` and starts its local commit on the local-commit thread. The
local commit, once the copies have landed, commits the step in the local tier and *releases*
the slot (it still holds the step; the reuse rule keeps it while the step is the newest
committed one). The persist thread picks jobs: the newest locally committed one; the older
locally committed ones it passes over are *superseded* for the durable tier (their tickets
resolve with ``SaveInfo.superseded_by``; their steps stay in the local tier until their slots
are reused). A save that reuses such a slot before the persist thread got to it supersedes
the step the same way. Without a local tier the persist thread takes jobs in save order.
After the durable write, in the job's own ``finally`` (:meth:`Saver._settle`), it releases
the slot, writes a pending protection marker, schedules retention, completes the ticket and
does the accounting. Nothing happens in a Future callback, so no failure there can leave
``wait()`` blocked.

A failed durable write (an ``OSError``: the target is unreachable, throttling) is reported on
the ticket at once, and retried with exponential backoff while its slot still holds the step
and no newer step has committed; a success is logged. One that retrying cannot fix (the
target is full or read-only, see :func:`~ckptmgr.save.outcome.permanent`) is logged once and
not retried. ``flush()`` (and ``close()``) send the newest step the local tier alone holds to
the durable target, from its slot.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .._threads import DaemonPool
from ..errors import CheckpointCorruptError, CkptTimeoutError, SaveError, StepExistsError, StorageError
from ..format.layout import Plan
from ..format.manifest import Manifest
from ..options import StagingOptions
from ..retention.deleter import Deleter, StepGuard
from ..storage import Target
from ..storage.tier import LocalTier
from .outcome import Ticket, permanent, report_interrupted, report_permanent, retryable
from .persist import PersistJob, SaveInfo, commit_local, persist
from .slots import Slot, SlotPool
from .staging import Stager, StagingJob

if TYPE_CHECKING:
    import torch

    from .budget import DurablePolicy

__all__ = ["RETRY_FIRST_S", "RETRY_MAX_S", "Saver", "Ticket"]

log = logging.getLogger("ckptmgr")

RETRY_FIRST_S = 1.0  # first delay before a failed durable write is tried again; doubles per failure
RETRY_MAX_S = 60.0  # longest delay between two attempts


class Saver:
    """The save path of one manager: slots, staging, the persist thread, settlement.

    Args:
        target: the durable root.
        tier: the local tier, or None.
        opts: slot count, backpressure and copy threads.
        chunk_size: checksum chunk of the files written.
        deleter: the retention deleter; the saver schedules a run after each commit (when
            ``retention`` is True: in a multi-rank job only rank 0 decides) and reports
            protection failures through it.
        durable: the durable target's committed steps at start-up.
    """

    def __init__(self, target: Target, tier: LocalTier | None, opts: StagingOptions, *, chunk_size: int,
                 deleter: Deleter, guard: StepGuard, durable: list[int], retention: bool = True) -> None:
        self._target = target
        self._tier = tier
        self._opts = opts
        self._chunk_size = chunk_size
        self._deleter = deleter
        self._guard = guard
        self._retention = retention
        self.pool = SlotPool(opts.slots, tier=tier, max_host_bytes=opts.max_host_bytes, chunk_size=chunk_size)
        self._stager = Stager(opts.copy_threads, device_buffer_bytes=opts.device_buffer_bytes)
        self._side = DaemonPool(1, thread_name_prefix="ckptmgr-local-commit")
        self._mu = threading.Condition()
        self._pending: dict[int, PersistJob] = {}
        self._queue: collections.deque[tuple[PersistJob, Ticket]] = collections.deque()
        self._retries: list[tuple[float, PersistJob]] = []
        self._durable: set[int] = set(durable)
        self._protect: set[int] = set()
        self._failed: set[int] = set()  # steps whose durable write failed and is not retried
        self._unsettled = 0
        self._tickets: list[Ticket] = []
        self._counts = {"durable_superseded": 0, "local_only": 0}
        self._last_durable: float | None = None  # monotonic time of the last save sent to the durable target
        self._closing = False
        self._root_bound = False  # (local-commit thread) the tier recorded the root's identity
        self._slot_wanted = threading.Event()  # a save waits for a slot (set by the pool, under its lock)
        if durable:
            self.pool.note_durable(max(durable))
        self.pool.on_wait = self._save_waits
        self._thread = threading.Thread(target=self._persist_loop, name="ckptmgr-persist", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ training thread

    def is_durable(self, step: int) -> bool:
        """Whether ``step`` was written to the durable target by this saver (or found there)."""
        with self._mu:
            return step in self._durable

    def check_new(self, step: int) -> None:
        """Raise StepExistsError when ``step`` is committed or being saved (no storage I/O)."""
        with self._mu:
            if step in self._pending or any(j.step == step for _, j in self._retries):
                raise StepExistsError(f"step {step} is already being saved")
            known = step in self._durable
        if known or (self._tier is not None and step in self._tier.steps()):
            raise StepExistsError(f"step {step} is already committed under {self._target.url}; committed "
                                  "checkpoints are never overwritten")

    def save(self, manifest: Manifest, plan: Plan, sizes: list[int], *, block: bool, t0: float,
             coordinate: Callable[[PersistJob], None] | None = None, schedule: DurablePolicy | None = None,
             durable: bool | None = None) -> Ticket:
        """Stage ``plan`` into a slot and queue its persist job; return its ticket (skipped
        when every slot is busy and ``on_busy="skip"``). ``schedule`` says whether the step
        goes to the durable target too, or to the local tier only (every step goes durable
        when there is no local tier); ``durable`` (True/False) overrides it for this save."""
        step = manifest.step
        with self._mu:
            if self._closing:
                raise SaveError(f"cannot save step {step}: the manager is closing")
        opts = self._opts
        slot, waited = self.pool.acquire(wait=opts.on_busy == "wait", timeout=opts.busy_timeout)
        if slot is None:
            reason = self.pool.why_busy()
            log.warning("skipped step %d: %s", step, reason)
            return Ticket.skip(step, f"{reason} (on_busy='skip')")
        if waited > 1e-3:
            log.info("step %d waited %.3f s for a free staging slot", step, waited)
        if slot.replaced is not None:  # the slot held an older step, maybe still queued
            self._supersede_queued(slot.replaced)
        made = self.pool.allocations
        job: StagingJob | None = None
        try:
            self.pool.fit(slot, sizes)
            job = self._stager.stage(plan, slot.segments, slot.piece)
            if block:
                job.wait_safe()
        except BaseException:
            try:  # (interrupted while copies run: they must land before the slot is free again)
                if job is not None:
                    job.wait(timeout=60)
            except BaseException:
                pass
            finally:
                self.pool.release(slot, step=None, durable=False)
            raise
        if self.pool.allocations != made and any(s.kind == "none" for s in self.pool.slots):
            self.prepare(sizes)  # the first save made its slot; make the others in the background
        local = self._tier is not None and slot.kind == "tmpfs"
        wanted = True if durable is None else durable
        if schedule is not None or durable is not None:
            with self._mu:
                now = time.monotonic()
                if durable is None and schedule is not None:
                    wanted = schedule.durable(step, None if self._last_durable is None else now - self._last_durable)
                if wanted or not local:
                    self._last_durable = now
        durable = wanted
        self.pool.mark_wanted(slot, durable and local, local_only=local and not durable)
        pjob = PersistJob(manifest, [f.name for f in plan.files], [len(f.header) for f in plan.files],
                          slot, job, t0, 0.0, waited, nbytes=sum(sizes), durable=durable or not local,
                          local_commit=Future() if local else None)
        if coordinate is not None:
            coordinate(pjob)
        ticket = Ticket(step, Future(), job)
        pjob.blocked_s = time.perf_counter() - t0
        self._enqueue(pjob, ticket)
        return ticket

    def _save_waits(self) -> None:
        """A save waits for a slot. Called with the pool's lock held: only flags it (the
        persist thread then retries held writes after the shortest delay, and logs why)."""
        self._slot_wanted.set()

    def _enqueue(self, job: PersistJob, ticket: Ticket) -> None:
        with self._mu:
            self._pending[job.step] = job
            self._tickets.append(ticket)
            self._unsettled += 1
            if job.durable:
                self._queue.append((job, ticket))
            self._mu.notify_all()
        if job.local_commit is not None:
            try:
                self._side.submit(self._commit_local, job, ticket)
            except BaseException as exc:  # (the pool is shut down: closing)
                job.local_commit.set_exception(exc)
                self._local_failed(job, ticket)

    # ------------------------------------------------------------ local-commit thread

    def _commit_local(self, job: PersistJob, ticket: Ticket) -> None:
        """Commit ``job`` in the local tier once its copies have landed, then hand its slot
        back to the pool (unless the persist thread already writes from it)."""
        assert self._tier is not None
        assert job.local_commit is not None
        try:
            if not self._root_bound:
                self.bind_root()
            records = commit_local(job, self._tier, self._chunk_size)
        except BaseException as exc:
            job.local_commit.set_exception(exc)  # the durable write computes the checksums itself
            self._local_failed(job, ticket)
            if not isinstance(exc, Exception):
                raise
            return
        local_only = False
        with self._mu:
            if not job.picked:
                job.released = True
                self.pool.release(job.slot, step=job.step, durable=False, wanted=job.durable)
                if not job.durable:
                    local_only = self._pending.pop(job.step, None) is not None
                    self._counts["local_only"] += local_only
                self._mu.notify_all()
        job.local_commit.set_result(records)  # (after the bookkeeping: persist() waits for it)
        if local_only:
            self._finish_local(job, ticket, None)

    def _local_failed(self, job: PersistJob, ticket: Ticket) -> None:
        """A step the schedule kept local whose local commit failed is written durably
        instead (it is never dropped without a word)."""
        with self._mu:
            if not job.durable and not job.picked:
                job.durable = True
                self._queue.append((job, ticket))
                self._mu.notify_all()

    def _supersede_queued(self, step: int) -> None:
        """A save took the slot of ``step`` (older than the newest committed step): if the
        step still waited for its durable write, it is superseded."""
        with self._mu:
            entry = next((e for e in self._queue if e[0].step == step and e[0].released and not e[0].picked), None)
            if entry is None:
                return
            self._queue.remove(entry)
            self._pending.pop(step, None)
            self._counts["durable_superseded"] += 1
        self._finish_local(entry[0], entry[1], self.pool.newest_committed())

    def _finish_local(self, job: PersistJob, ticket: Ticket, superseded_by: int | None) -> None:
        """Resolve the ticket of a step committed in the local tier only (not an error)."""
        info: SaveInfo | None = None
        try:
            with self._mu:
                dropped = job.step in self._protect
                self._protect.discard(job.step)
            if superseded_by is not None:
                log.info("step %d is not written to %s: step %d supersedes it there (saves come faster than the "
                         "durable target absorbs them); it stays in the local tier until its slot is reused",
                         job.step, self._target.url, superseded_by)
            if dropped:
                log.warning("step %d was protected, but it is kept in the local tier only, where protection does "
                            "not apply", job.step)
            now = time.perf_counter()
            staged = job.staging.finished_at or now
            info = SaveInfo(step=job.step, url=self._tier.path if self._tier is not None else "", bytes=job.nbytes,
                            files=len(job.names), staging_s=staged - job.t0, persist_s=now - staged,
                            total_s=now - job.t0, blocked_s=job.blocked_s, busy_wait_s=job.busy_wait_s,
                            local_s=job.local_s, attempts=0, durable=False, superseded_by=superseded_by)
        finally:
            if info is not None:
                ticket.future.set_result(info)
            else:
                ticket.future.set_exception(SaveError(f"save of step {job.step}: its local commit could not be "
                                                      "recorded"))
            self._settled()

    def prepare(self, sizes: list[int], plan: Plan | None = None) -> None:
        """Make and pin the slots never filled yet, on a helper thread; a save that needs one
        of them waits for it (never skips), and :meth:`wait` waits for it. With ``plan``
        (training thread), also allocate the device snapshot buffers it needs, now."""
        if plan is not None:
            self._stager.reserve(plan)
        with self._mu:
            if self._closing:
                return
            self._unsettled += 1
        try:
            threading.Thread(target=self._prepare, args=(sizes,), name="ckptmgr-prepare", daemon=True).start()
        except BaseException:
            self._settled()
            raise

    def _prepare(self, sizes: list[int]) -> None:
        try:
            self.pool.prepare(sizes)
        finally:
            self._settled()

    def _settled(self) -> None:
        with self._mu:
            self._unsettled -= 1
            self._mu.notify_all()

    def defer_protection(self, step: int, protected: bool) -> bool:
        """Record a protection for ``step`` to apply when it commits; False when the step is
        not being saved (then the caller marks it on the target)."""
        with self._mu:
            if step not in self._pending and not any(j.step == step for _, j in self._retries):
                return False
            (self._protect.add if protected else self._protect.discard)(step)
            return True

    def protection_pending(self, step: int) -> bool:
        with self._mu:
            return step in self._protect

    def forget(self, step: int) -> None:
        """``step`` was deleted from the durable target (called by the deleter)."""
        with self._mu:
            self._durable.discard(step)

    def pending_steps(self) -> list[int]:
        with self._mu:
            return sorted(self._pending)

    def take_failure(self) -> SaveError | None:
        """The oldest save failure nobody has been told of, as a SaveError."""
        with self._mu:
            tickets = list(self._tickets)
        err = None
        keep = []
        for t in tickets:
            if err is None and t.future.done():
                err = t.take_error()
            if not t.future.done() or (t.failure() is not None and not t._observed):
                keep.append(t)
        with self._mu:
            known = set(map(id, tickets))
            self._tickets = keep + [t for t in self._tickets if id(t) not in known]
        return err

    def wait(self, timeout: float | None) -> None:
        """Block until every save submitted so far, and every prepare(), has settled.

        Raises:
            CkptTimeoutError: still pending after ``timeout`` seconds.
        """
        with self._mu:
            if not self._mu.wait_for(lambda: not self._unsettled, timeout):
                raise CkptTimeoutError(f"saves of steps {sorted(self._pending)} not finished after {timeout} s")

    # ------------------------------------------------------------ persist thread

    def _persist_loop(self) -> None:
        while True:
            picked = self._next_job()
            if picked is None:
                return
            job, ticket = picked
            self._run(job, ticket)

    def _next_job(self) -> tuple[PersistJob, Ticket | None] | None:
        """The next job to write; None once the saver closes. (This is the one place that
        decides which steps are written durably, and in what order.)

        Queued saves first: the newest one committed in the local tier (the older locally
        committed ones are superseded for the durable tier), else the oldest queued one (its
        local commit still runs, or there is no local tier); then a retry that is due.
        """
        while True:
            self._hurry_retries()
            superseded: list[tuple[PersistJob, Ticket]] = []
            picked: tuple[PersistJob, Ticket] | None = None
            held = True
            with self._mu:
                if self._queue:
                    ready = [e for e in self._queue if e[0].released]
                    picked = max(ready, key=lambda e: e[0].step) if ready else self._queue[0]
                    superseded = [e for e in ready if e[0].step < picked[0].step]
                    for e in (picked, *superseded):
                        self._queue.remove(e)
                    picked[0].picked = True
                    if picked[0].released:  # the pool may have handed its slot to a newer save
                        held = self.pool.hold(picked[0].slot, picked[0].step)
                    if not held:
                        superseded.append(picked)
                    for e in superseded:
                        self._pending.pop(e[0].step, None)
                    self._counts["durable_superseded"] += len(superseded)
                elif self._closing:
                    return None
                else:
                    now = time.monotonic()
                    due = [r for r in self._retries if r[0] <= now]
                    if not due:
                        # (bounded while retries wait: a save that wants a slot shortens them)
                        self._mu.wait(min(min(r[0] for r in self._retries) - now, 0.25) if self._retries else None)
                        continue
                    first = min(due, key=lambda r: r[0])
                    self._retries.remove(first)
            if picked is not None:
                by = picked[0].step if held else self.pool.newest_committed()
                for job, ticket in superseded:
                    self._finish_local(job, ticket, by)
                if held:
                    return picked
                continue
            job = first[1]
            if self.pool.hold_for_retry(job.slot, job.step):
                return job, None
            self._drop_retry(job, "its staging slot no longer holds it" if not self.pool.superseded(job.step)
                             else "a newer step has committed since")

    def _hurry_retries(self) -> None:
        """When a save waits for a slot, retry the held writes after the shortest delay, not
        the grown one (the training loop is waiting for them), and say so once."""
        if not self._slot_wanted.is_set():
            return
        self._slot_wanted.clear()
        with self._mu:
            if not self._retries:
                return
            soon = time.monotonic() + RETRY_FIRST_S
            self._retries = [(min(at, soon), job) for at, job in self._retries]
        log.warning("a save waits for a staging slot: the slots hold steps whose durable write failed and is "
                    "being retried (the newest checkpoint is never given up); set StagingOptions(slots=2) "
                    "to keep saving meanwhile, or busy_timeout / on_busy='skip' not to wait")

    def _drop_retry(self, job: PersistJob, why: str) -> None:
        with self._mu:
            self._protect.discard(job.step)
        log.warning("step %d was never written to %s and is no longer retried: %s", job.step, self._target.url, why)

    def _run(self, job: PersistJob, ticket: Ticket | None) -> None:
        info: SaveInfo | None = None
        error: BaseException | None = None
        try:
            info = persist(job, target=self._target, chunk_size=self._chunk_size)
        except BaseException as exc:  # settled below, reported on the ticket
            error = exc
        finally:
            self._settle(job, ticket, info, error)

    def bind_root(self) -> None:
        """Record the root's identity in the tier (written in the root if it has none yet:
        this is the root's first commit), so that a later start adopts these slots only for
        this very root. Called before the first local commit when the root had no identity at
        start-up. A failure is logged, not raised: the local commits go on, and a tier never
        bound is adopted only by a root that has neither an identity nor a committed step."""
        assert self._tier is not None
        try:
            root_id = self._target.root_id(create=True)
            if root_id is None:
                raise StorageError("it has no identity and none could be written")
            self._tier.bind(root_id)
            self._root_bound = True
        except Exception as exc:
            log.warning("the local tier %s could not record the identity of %s (%s: %s); a later start will "
                        "not adopt its slots", self._tier.path, self._target.url, type(exc).__name__, exc)

    def _settle(self, job: PersistJob, ticket: Ticket | None, info: SaveInfo | None,
                error: BaseException | None) -> None:
        """Everything after a durable write, in the job's own thread; each part runs whatever
        the parts before it did, and the accounting always runs last."""
        step = job.step
        staged = job.staging.finished_at is not None
        retry = error is not None and staged and job.coordinate is None and retryable(error)
        damaged = job.adopted and isinstance(error, CheckpointCorruptError)
        protect = False
        try:
            if error is None and self._tier is not None and self._tier.holds(job.slot.index) == step:
                self._tier.mark_durable(job.slot.index, step)  # (before the slot is released: it still holds it)
            if damaged and self._tier is not None:  # nobody may restore it, and its slot is free again
                log.error("step %d in the local tier %s is damaged (%s); it is removed from there", step,
                          self._tier.path, error)
                self._tier.invalidate(job.slot.index)
            lasting = permanent(error) if error is not None else None
            self.pool.release(job.slot, step=step if staged and not damaged else None, durable=error is None,
                              given_up=lasting is not None and not retry)
            with self._mu:
                self._pending.pop(step, None)
                if error is None:
                    self._durable.add(step)
                    self._failed.discard(step)
                    self._deleter.current = step  # its own retention run keeps it (see Deleter)
                    protect = step in self._protect
                    self._protect.discard(step)
                elif retry and not self._closing:
                    delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (job.attempts - 1))
                    self._retries.append((time.monotonic() + delay, job))
                    self._mu.notify_all()
                    log.warning("the durable write of step %d failed (attempt %d: %s: %s); it stays in its "
                                "staging slot and is tried again in %.1f s", step, job.attempts,
                                type(error).__name__, error, delay)
                else:
                    self._protect.discard(step)
                    self._failed.add(step)
            if error is not None and lasting is not None:  # told once, not retried
                tier = self._tier
                kept = tier.path if tier is not None and tier.holds(job.slot.index) == step else None
                report_permanent(step, self._target.url, error, lasting, kept_in=kept,
                                 attempt=job.attempts if ticket is None else None)
            elif error is not None and ticket is None and not retry:
                log.warning("the durable write of step %d is given up after %d attempts: %s: %s", step,
                            job.attempts, type(error).__name__, error)
            if error is None and ticket is None:
                log.info("step %d written to %s at attempt %d", step, self._target.url, job.attempts)
            if protect:
                self._mark_protected(step)
            if error is None and self._retention and not self._closing:
                self._deleter.schedule()
        except BaseException as exc:  # reported like a deletion failure; the accounting still runs
            log.error("after the save of step %d: %s: %s", step, type(exc).__name__, exc)
            self._deleter.report(StorageError(f"after the save of step {step}: {type(exc).__name__}: {exc}"))
        finally:
            if ticket is not None:
                if error is None and info is not None:
                    ticket.future.set_result(info)
                else:
                    ticket.future.set_exception(error or SaveError(f"save of step {step} failed"))
                self._settled()

    def _mark_protected(self, step: int) -> None:
        try:
            with self._guard.marking(step) as ok:
                if ok:
                    self._target.set_protected(step, True)
        except Exception as exc:  # told at the next save/wait/close, like a deletion failure
            self._deleter.report(StorageError(f"could not protect step {step} under {self._target.url}: {exc}"))

    # ------------------------------------------------------------ start and end

    def adopt(self, found: dict[int, Manifest], durable: set[int], root_id: str | None, *,
              on_mapped: Callable[[Manifest, dict[str, torch.Tensor]], None] | None = None) -> None:
        """Take over the slots an earlier process left committed in the tier (those
        :meth:`LocalTier.scan` found to belong to this root); queue the durable write of the
        steps that never reached the target. ``root_id``: the root's identity, if it has one.
        ``on_mapped``: told each slot's manifest and file images once they are mapped and
        before they are pinned (with CUDA only: only pinned images are read where they lie)."""
        assert self._tier is not None
        if root_id is not None:
            self._tier.bind(root_id)
            self._root_bound = True
        adopted: list[tuple[PersistJob, Ticket]] = []
        for index, m in sorted(found.items(), key=lambda item: -item[1].step):  # the newest first
            names = sorted(m.files)
            chunk = next(iter(m.files.values())).chunk_size if m.files else self._chunk_size
            told = None if on_mapped is None else functools.partial(on_mapped, m)
            slot = self.pool.adopt(index, m.step, [m.files[n].size for n in names], chunk, durable=m.step in durable,
                                   on_mapped=told)
            if m.step in durable:
                self._tier.mark_durable(index, m.step)
                continue
            log.warning("step %d exists only in the local tier %s (the last run stopped before writing it); "
                        "it is written to %s unless a newer one is", m.step, self._tier.path, self._target.url)
            adopted.append(self._tier_job(m, slot, adopted=True))
        with self._mu:  # (re-entrant) queued together: the persist thread picks the newest of them
            for job, ticket in adopted:
                self._enqueue(job, ticket)

    def _tier_job(self, m: Manifest, slot: Slot, *, adopted: bool) -> tuple[PersistJob, Ticket]:
        """The durable write of step ``m.step``, committed in the local tier in ``slot`` (idle:
        the newest of such jobs is written, the others superseded); ``adopted``: an earlier
        process's slot, whose bytes are checked against ``m`` as they are written."""
        names = sorted(m.files)
        staging = StagingJob(None, None)
        job = PersistJob(m, names, [m.files[n].header_size for n in names], slot, staging, time.perf_counter(),
                         0.0, 0.0, nbytes=sum(m.files[n].size for n in names), adopted=adopted)
        job.released = True
        self.pool.mark_wanted(slot, True)
        return job, Ticket(m.step, Future(), staging)

    def flush(self, *, failed_too: bool = True) -> int | None:
        """Send the newest committed step to the durable target when it is not on its way
        there (the schedule, or ``save(durable=False)``, kept it in the local tier only; or,
        with ``failed_too``, its write failed for good); return that step, or None when there
        is nothing to send. Wait with :meth:`wait`."""
        tier = self._tier
        if tier is None:  # (every save is written durably)
            return None
        with self._mu:
            if self._closing:
                raise SaveError("cannot flush: the manager is closing")
            local = tier.steps()
            newest = max(local, default=None)
            job = max(self._pending.values(), key=lambda j: j.step, default=None)
            if job is not None and (newest is None or job.step >= newest):
                ticket = next((t for t in self._tickets if t.step == job.step and not t.future.done()), None)
                if job.durable or job.picked or ticket is None:
                    return None  # on its way already
                job.durable = True  # (its local commit still runs: it hands the slot to the persist thread)
                self.pool.mark_wanted(job.slot, True)
                self._queue.append((job, ticket))
                self._mu.notify_all()
                return job.step
            if (newest is None or newest in self._durable or any(j.step == newest for _, j in self._retries)
                    or (newest in self._failed and not failed_too)):
                return None
        slot = self.pool.slots[local[newest]]
        m = Manifest.from_bytes(tier.read_manifest(newest), where=f"{tier.url}: step {newest}")
        if slot.step != newest or m.step != newest:  # (a save took the slot meanwhile)
            return None
        log.info("step %d is written to %s from the local tier (flush)", newest, self._target.url)
        self._enqueue(*self._tier_job(m, slot, adopted=False))
        return newest

    def unfinished(self) -> dict[int, str]:
        """Steps not durable yet and what becomes of them if the process ends now."""
        with self._mu:
            steps = [*self._pending, *(j.step for _, j in self._retries)]
        local = self._tier.steps() if self._tier is not None else {}
        return {s: (f"is kept in the local tier {self._tier.path}; the next start on this root writes it"
                    if self._tier is not None and s in local else "is lost (it was only in this process's memory)")
                for s in sorted(set(steps))}

    def close(self, timeout: float | None) -> tuple[dict[int, str], list[int]]:
        """Stop: wait up to ``timeout`` s for the saves submitted (retries are dropped), then
        free what no writer still uses.

        Returns:
            The steps given up on because they were still being written after ``timeout``
            (with what becomes of each, see :meth:`unfinished`), and the committed steps kept
            in the local tier for the next start. The threads still writing are left running
            (daemon threads: they never keep the process alive), their slots mapped.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.wait(timeout)
            given_up: dict[int, str] = {}
        except CkptTimeoutError:
            given_up = self.unfinished()
        except BaseException as exc:  # interrupted (Ctrl-C): nothing is closed, the writes go on
            report_interrupted(self._target.url, exc, self.unfinished())
            raise
        with self._mu:
            self._closing = True
            dropped = sorted(j.step for _, j in self._retries)
            self._retries.clear()
            self._mu.notify_all()
        if dropped:
            log.warning("steps %s were never written to %s; retries stop with the manager", dropped, self._target.url)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._thread.join(left)
        self.pool.stop.set()
        if not self._thread.is_alive():  # (else a write is hung: its threads and slot stay as they are)
            self._stager.close(timeout=left)
            self._side.stop(timeout=left)
        kept, _ = self.pool.close()
        return given_up, kept

    @property
    def closing(self) -> bool:
        with self._mu:
            return self._closing

    @property
    def hung(self) -> bool:
        """True when a write outlived :meth:`close`."""
        return self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        with self._mu:
            counts = dict(self._counts)
        return {**self.pool.counts, "slot_allocations": self.pool.allocations,
                "slot_registrations": self.pool.registrations,
                "device_buffer_bytes": self._stager.buffers.allocated(), **counts}
