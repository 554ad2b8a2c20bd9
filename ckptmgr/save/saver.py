"""The saver: the manager's policies on the save engine (which owns the slot pool, the stager
and the worker thread): coalescing, retries, the two tiers; it settles every save.

Who owns what (each piece of mutable state has one owner)::

    Saver._mu (a Condition; never held across I/O, taken briefly by save() on the training thread)
        _pending      steps submitted whose outcome has not been decided
        _picks        the coalescing picker's queue and retries (see coalesce.py); each job's
                      ``picked`` and ``released`` flags
        _durable      the durable target's committed steps as this manager knows them: the
                      start-up listing, plus its own commits, less the deleter's deletions
                      (so save() never lists the target)
        _protect      steps to protect as soon as they commit
        _counts       steps superseded for the durable tier, steps kept local only
        _last_durable when the last save meant for the durable target was made (the schedule)
        _writes       the durable writes' timing (the write in flight, the last rate), for the
                      forecast that decides when the default options make a third slot
    AsyncWriter._mu   the saves not settled and the failures nobody was told of (engine.py):
                      lock order Saver._mu -> engine
    SlotPool._cond    the slot table (see slots.py); lock order: Saver._mu -> pool -> tier
                      (the pool never calls back into the saver with its lock held)
    the persist thread  (the engine's worker) a job from the moment the picker hands it over
                      until the job's settle() returns

The saver is the manager's policies on the save engine (:class:`~.engine.AsyncWriter`): its
slots, stager, worker thread ("ckptmgr-persist"), per-save pending and error surfacing are the
engine's; the saver adds the two tiers, the coalescing picker and retries (:mod:`.coalesce`),
the schedule, protection and retention scheduling.

The life of a save: ``save()`` (training thread) acquires a slot, fits and stages into it,
queues a :class:`PersistJob` and starts its local commit on the local-commit thread. The local
commit, once the copies have landed, commits the step in the local tier and *releases* the slot
(it still holds the step; the reuse rule keeps it while the step is the newest committed one):
that is the point where "a step landed in the local tier" is observable
(:meth:`~.tiered.TierSaves._commit_local`, after ``commit_local`` returns). The persist thread picks jobs:
the newest locally committed one; the older locally committed ones it passes over are
*superseded* for the durable tier (their tickets resolve with ``SaveInfo.superseded_by``; their
steps stay in the local tier until their slots are reused). A save that reuses such a slot
before the persist thread got to it supersedes the step the same way. Without a local tier the
persist thread takes jobs in save order. After the durable write, in the job's own ``finally``
(:meth:`Saver._settle`), it releases the slot, writes a pending protection marker, schedules
retention, completes the ticket and does the accounting. Nothing happens in a Future callback,
so no failure there can leave ``wait()`` blocked.

A failed durable write (an ``OSError``: the target is unreachable, throttling) is reported on
the ticket at once, and retried with exponential backoff while its slot still holds the step
and no newer step has committed; a success is logged. One that retrying cannot fix (the
target is full or read-only, see :func:`~ckptmgr.save.outcome.permanent`) is logged once and
not retried. ``flush()`` (and ``close()``) send the newest step the local tier alone holds to
the durable target, from its slot.
"""

from __future__ import annotations

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
from .coalesce import RETRY_FIRST_S, RETRY_MAX_S, Coalescing
from .engine import AsyncWriter
from .forecast import Progress, WriteWatch
from .outcome import Ticket, permanent, report_interrupted, report_permanent, retryable
from .persist import PLAIN, PersistJob, SaveInfo, StepCommit, persist
from .slot_capacity import Make
from .slots import Slot
from .staging import StagingJob
from .tiered import TierSaves

if TYPE_CHECKING:
    import torch

    from .budget import DurablePolicy

__all__ = ["RETRY_FIRST_S", "RETRY_MAX_S", "Saver", "Ticket"]

log = logging.getLogger("ckptmgr")
AFTER_COPIES_WAIT_S = 60.0  # a spare slot is made once the copies of the save that asked for it land


class Saver(TierSaves):
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
        self._mu = threading.Condition()
        self._engine = AsyncWriter(slots=opts.slots, copy_threads=opts.copy_threads, chunk_size=chunk_size,
                                   max_host_bytes=opts.max_host_bytes, tier=tier,
                                   device_buffer_bytes=opts.device_buffer_bytes, picker=self, name="ckptmgr-persist")
        self.pool = self._engine.pool
        self._stager = self._engine.stager
        self._picks = Coalescing(self._mu, self.pool, run=self._run, superseded=self._forget_superseded,
                                 finish=self._finish_local, dropped=self._drop_retry)
        self._side = DaemonPool(1, thread_name_prefix="ckptmgr-local-commit")
        self._pending: dict[int, PersistJob] = {}
        self._durable: set[int] = set(durable)
        self._protect: set[int] = set()
        self._failed: set[int] = set()  # steps whose durable write failed and is not retried
        self._counts = {"durable_superseded": 0, "local_only": 0}
        self._last_durable: float | None = None  # monotonic time of the last save sent to the durable target
        self._writes = WriteWatch()  # the durable writes' timing, for the slot forecast (see forecast.py)
        self._closing = False
        self._root_bound = False  # (local-commit thread) the tier recorded the root's identity
        if durable:
            self.pool.note_durable(max(durable))
        self.pool.on_wait = self._picks.slot_wanted.set  # (pool lock held: only flags it)
        self._engine.start()

    # the engine's job picker: the coalescing one (see coalesce.py)
    def next(self) -> Callable[[], None] | None:
        return self._picks.next()

    def stop(self) -> None:
        self._picks.stop()

    # ------------------------------------------------------------ training thread

    def is_durable(self, step: int) -> bool:
        """Whether ``step`` was written to the durable target by this saver (or found there)."""
        with self._mu:
            return step in self._durable

    def check_new(self, step: int) -> None:
        """Raise StepExistsError when ``step`` is committed or being saved (no storage I/O)."""
        with self._mu:
            if step in self._pending or self._picks.retrying(step):
                raise StepExistsError(f"step {step} is already being saved")
            known = step in self._durable
        if known or (self._tier is not None and step in self._tier.steps()):
            raise StepExistsError(f"step {step} is already committed under {self._target.url}; committed "
                                  "checkpoints are never overwritten")

    def save(self, manifest: Manifest, plan: Plan, sizes: list[int], *, block: bool, t0: float,
             commit: Callable[[PersistJob], StepCommit] | None = None, schedule: DurablePolicy | None = None,
             durable: bool | None = None, spare_after_copies: bool = False) -> Ticket:
        """Stage ``plan`` into a slot and queue its persist job; return its ticket (skipped
        when every slot is busy and ``on_busy="skip"``). ``schedule`` says whether the step
        goes to the durable target too, or to the local tier only (every step goes durable
        when there is no local tier); ``durable`` (True/False) overrides it for this save.
        ``commit`` makes the job's :class:`~.persist.StepCommit` (a multi-rank save's
        agreement); default: the target's own. ``spare_after_copies``: the next save is known to
        be far off (a ``Schedule(max_overhead=...)``), so a spare slot this save asks for is made
        once its copies have landed, not beside them (see :meth:`prepare`)."""
        step = manifest.step
        with self._mu:
            if self._closing:
                raise SaveError(f"cannot save step {step}: the manager is closing")
        opts = self._opts

        def acquired(slot: Slot) -> None:
            if slot.replaced is not None:  # the slot held an older step, maybe still queued
                self._supersede_queued(slot.replaced)

        def stage_safe(segments: list[torch.Tensor]) -> tuple[Plan, list[torch.Tensor]]:
            return plan, segments

        slot, job, waited = self._engine.stage(sizes, stage_safe, wait=opts.on_busy == "wait",
                                               timeout=opts.busy_timeout, acquired=acquired)
        if slot is None or job is None:
            reason = self.pool.why_busy()
            log.warning("skipped step %d: %s", step, reason)
            return Ticket.skip(step, f"{reason} (on_busy='skip')")
        if waited > 1e-3:
            log.info("step %d waited %.3f s for a free staging slot", step, waited)
        if block:
            try:
                job.wait_safe()
            except BaseException:
                try:  # (interrupted while copies run: they must land before the slot is free again)
                    job.wait(timeout=60)
                except BaseException:
                    pass
                finally:
                    self.pool.release(slot, step=None, durable=False)
                raise
        when = self._spare()  # a slot for the next saves, made in the background (default options)
        if when is not None:
            self.prepare(sizes, after=job if spare_after_copies or when is Make.AFTER_COPIES else None)
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
        if commit is not None:
            pjob.commit = commit(pjob)
        ticket = Ticket(step, Future(), job)
        pjob.blocked_s = time.perf_counter() - t0
        self._enqueue(pjob, ticket)
        self.pool.returned()
        return ticket

    def _spare(self) -> Make | None:
        """Whether a slot waits to be made in the background (one the pool added now, by the
        forecast of the next saves against the durable writes as timed so far, or one
        configured and never made), and when to start making it (see :meth:`SlotPool.spare`)."""
        nbytes = self.pool.slot_bytes()
        with self._mu:
            writes = None if nbytes is None else self._writes.view(time.monotonic(), nbytes)
        return self.pool.spare(writes)

    def _enqueue(self, job: PersistJob, ticket: Ticket) -> None:
        with self._mu:
            self._pending[job.step] = job
            self._engine.track(ticket)
            if job.durable:
                self._picks.queue.append((job, ticket))
            self._mu.notify_all()
        if job.local_commit is not None:
            try:
                self._side.submit(self._commit_local, job, ticket)
            except BaseException as exc:  # (the pool is shut down: closing)
                job.local_commit.set_exception(exc)
                self._local_failed(job, ticket)

    def _supersede_queued(self, step: int) -> None:
        """A save took the slot of ``step`` (older than the newest committed step): if the
        step still waited for its durable write, it is superseded."""
        with self._mu:
            queue = self._picks.queue
            entry = next((e for e in queue if e[0].step == step and e[0].released and not e[0].picked), None)
            if entry is None:
                return
            queue.remove(entry)
            self._pending.pop(step, None)
            self._counts["durable_superseded"] += 1
        self._finish_local(entry[0], entry[1], self.pool.newest_committed())

    def _forget_superseded(self, entries: list[tuple[PersistJob, Ticket]]) -> None:
        """The picker passed over ``entries`` (``_mu`` held): they are not pending any more."""
        for job, _ in entries:
            self._pending.pop(job.step, None)
        self._counts["durable_superseded"] += len(entries)

    def prepare(self, sizes: list[int], plan: Plan | None = None, *, after: StagingJob | None = None) -> None:
        """Make and pin the slots never filled yet, on a helper thread; a save that needs one
        of them waits for it (never skips), and :meth:`wait` waits for it. With ``plan``
        (training thread), also allocate the device snapshot buffers it needs, now. With
        ``after`` (a save's staging), the helper first waits, up to :data:`AFTER_COPIES_WAIT_S`,
        for that save's copies to land: making a slot (populating pages, pinning them under
        the CUDA driver's lock) beside the copies slowed them about fourfold on an H100
        (4.83 GB safe to mutate after 0.366 s instead of ~0.09 s), and the training step waits
        for those copies. A save that comes to wait for the slot meanwhile ends that wait (the
        pool's ``hurry``), as does closing. Only where the next save is far off (a
        ``Schedule(max_overhead=...)``) or the slot was added ahead of need by the forecast: the
        default's second slot, asked for by the first save, starts at once (saves 1.3 s apart,
        4.83 GB, a save every 25 steps, waited up to 2.9 s for it made later)."""
        if plan is not None:
            self._stager.reserve(plan)
        with self._mu:
            if self._closing:
                return
            self._engine.hold()
        reserved = self.pool.reserve()  # (from now on a save that needs one of them waits for it)
        try:
            threading.Thread(target=self._prepare, args=(sizes, reserved, after), name="ckptmgr-prepare",
                             daemon=True).start()
        except BaseException:
            self.pool.unreserve(reserved)
            self._engine.settled()
            raise

    def _prepare(self, sizes: list[int], reserved: tuple[list[Slot], bool], after: StagingJob | None) -> None:
        started = False
        try:
            if after is not None:
                self._await_copies(after)
            started = True
            self.pool.prepare(sizes, reserved)  # (which ends the reservation however it ends)
        finally:
            if not started:
                self.pool.unreserve(reserved)
            self._engine.settled()

    def _await_copies(self, after: StagingJob) -> None:
        """Wait, up to :data:`AFTER_COPIES_WAIT_S`, for ``after``'s copies to land; no longer
        once a save waits for the slot being made (the pool's ``hurry``) or the pool stops.
        Failed or slow copies are the save's to report: the slot is made anyway."""
        after.landed_or(lambda: self.pool.hurry.is_set() or self.pool.stop.is_set(), AFTER_COPIES_WAIT_S)

    def defer_protection(self, step: int, protected: bool) -> bool:
        """Record a protection for ``step`` to apply when it commits; False when the step is
        not being saved (then the caller marks it on the target)."""
        with self._mu:
            if step not in self._pending and not self._picks.retrying(step):
                return False
            (self._protect.add if protected else self._protect.discard)(step)
            return True

    def protection_pending(self, step: int) -> bool:
        with self._mu:
            return step in self._protect

    def forget(self, step: int) -> None:
        """``step`` was deleted from the durable target (called by the deleter): the local
        tier gives it up too where a slot holds it idle."""
        with self._mu:
            self._durable.discard(step)
        self.pool.drop_step(step)

    def pending_steps(self) -> list[int]:
        with self._mu:
            return sorted(self._pending)

    def take_failure(self) -> SaveError | None:
        """The oldest save failure nobody has been told of, as a SaveError."""
        return self._engine.take_failure()

    def wait(self, timeout: float | None) -> None:
        """Block until every save submitted so far, and every prepare(), has settled.

        Raises:
            CkptTimeoutError: still pending after ``timeout`` seconds.
        """
        self._engine.wait(timeout, what=lambda: f"saves of steps {self.pending_steps()} not finished")

    # ------------------------------------------------------------ persist thread

    def _drop_retry(self, job: PersistJob, why: str) -> None:
        with self._mu:
            self._protect.discard(job.step)
        log.warning("step %d was never written to %s and is no longer retried: %s", job.step, self._target.url, why)

    def _run(self, job: PersistJob, ticket: Ticket | None) -> None:
        info: SaveInfo | None = None
        error: BaseException | None = None
        progress = Progress()
        try:
            job.staging.wait()  # (the write's time, for the slot forecast, starts once its bytes are staged)
            with self._mu:
                self._writes.begin(job.slot.index, job.nbytes, time.monotonic(), progress)
            # (a multi-rank commit's tail, waiting for the other ranks, is not in this rank's bytes)
            info = persist(job, target=self._target, chunk_size=self._chunk_size,
                           progress=progress.add if job.commit is PLAIN else None)
        except BaseException as exc:  # settled below, reported on the ticket
            error = exc
        finally:
            with self._mu:
                self._writes.end(time.monotonic(), ok=error is None)
            self._settle(job, ticket, info, error)

    def _settle(self, job: PersistJob, ticket: Ticket | None, info: SaveInfo | None,
                error: BaseException | None) -> None:
        """Everything after a durable write, in the job's own thread; each part runs whatever
        the parts before it did, and the accounting always runs last."""
        step = job.step
        staged = job.staging.finished_at is not None
        retry = error is not None and staged and job.commit.retryable and retryable(error)
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
                    delay = self._picks.retry_later(job)
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
                self._engine.settled()

    def _mark_protected(self, step: int) -> None:
        try:
            with self._guard.marking(step) as ok:
                if ok:
                    self._target.set_protected(step, True)
        except Exception as exc:  # told at the next save/wait/close, like a deletion failure
            self._deleter.report(StorageError(f"could not protect step {step} under {self._target.url}: {exc}"))

    # ------------------------------------------------------------ start and end

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
            dropped = sorted(j.step for _, j in self._picks.retries)
            self._picks.retries.clear()
            self._mu.notify_all()
        if dropped:
            log.warning("steps %s were never written to %s; retries stop with the manager", dropped, self._target.url)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ended = self._engine.stop(left)  # (else a write is hung: its threads and slot stay as they are)
        self.pool.halt()
        if ended:
            self._side.stop(timeout=left)
        kept, _ = self.pool.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return given_up, kept

    @property
    def closing(self) -> bool:
        with self._mu:
            return self._closing

    @property
    def hung(self) -> bool:
        """True when a write outlived :meth:`close`."""
        return self._engine.hung

    def stats(self) -> dict[str, Any]:
        with self._mu:
            counts = dict(self._counts)
        return {**self.pool.counts, "slot_allocations": self.pool.allocations,
                "slot_registrations": self.pool.registrations,
                "device_buffer_bytes": self._engine.stager.buffers.allocated(), **counts}
