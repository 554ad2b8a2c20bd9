"""The local tier's half of the saver: local commits, adoption of an earlier run's slots, flush.

A save with a local tier is one tiered write (see :mod:`.persist`): the local commit runs on
the saver's local-commit thread as soon as the copies have landed, while the durable write
waits for the picker (:mod:`.coalesce`). This module holds what the saver does on that
local-commit thread and with the tier at start and end:

* :meth:`TierSaves._commit_local`: the step is committed in the tier and its slot released.
  This is the point where "a step landed in the local tier" is observable (marked there): on
  the local-commit thread, after the tier lists the step and before its ticket or the
  durable write hear of it.
* :meth:`TierSaves.adopt`: the slots an earlier process left committed are taken over, and
  the steps that never reached the durable target are queued for it.
* :meth:`TierSaves.flush`: the newest step the tier alone holds is sent to the durable target.

:class:`TierSaves` is a base of :class:`~.saver.Saver`: its state is the saver's, owned and
guarded as :mod:`.saver`'s docstring says (``_mu`` for the bookkeeping; ``_root_bound``
belongs to the local-commit thread).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from .._threads import DaemonPool
from ..errors import SaveError, StorageError
from ..format.manifest import Manifest
from ..storage import Target
from ..storage.tier import LocalTier
from .coalesce import Coalescing
from .engine import AsyncWriter
from .outcome import Ticket
from .persist import PersistJob, SaveInfo, commit_local
from .slots import Slot, SlotPool
from .staging import StagingJob

if TYPE_CHECKING:
    import torch

__all__ = ["TierSaves"]

log = logging.getLogger("ckptmgr")


class TierSaves:
    """The saver's local-tier side (see the module docstring); not used on its own."""

    _target: Target
    _tier: LocalTier | None
    _chunk_size: int
    _mu: threading.Condition
    _engine: AsyncWriter
    _picks: Coalescing
    _side: DaemonPool
    pool: SlotPool
    _pending: dict[int, PersistJob]
    _durable: set[int]
    _protect: set[int]
    _failed: set[int]
    _counts: dict[str, int]
    _closing: bool
    _root_bound: bool

    # Queue a job for the durable write: the hook this mixin calls and Saver implements (its
    # coalescing queue)
    _enqueue: Callable[[PersistJob, Ticket], None]

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
        # <- the step has landed in the local tier (listed there, its slot released): the
        #    point where a step in the local tier is observable, before its ticket or the
        #    durable write hear of it
        job.local_commit.set_result(records)  # (after the bookkeeping: persist() waits for it)
        if local_only:
            self._finish_local(job, ticket, None)

    def _local_failed(self, job: PersistJob, ticket: Ticket) -> None:
        """A step the schedule kept local whose local commit failed is written durably
        instead (it is never dropped without a word)."""
        with self._mu:
            if not job.durable and not job.picked:
                job.durable = True
                self._picks.queue.append((job, ticket))
                self._mu.notify_all()

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
            self._engine.settled()

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
                        "it is written to %s unless a newer one is written first", m.step, self._tier.path,
                        self._target.url)
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
                ticket = self._engine.outstanding(job.step)
                if job.durable or job.picked or ticket is None:
                    return None  # on its way already
                job.durable = True  # (its local commit still runs: it hands the slot to the persist thread)
                self.pool.mark_wanted(job.slot, True)
                self._picks.queue.append((job, ticket))
                self._mu.notify_all()
                return job.step
            if (newest is None or newest in self._durable or self._picks.retrying(newest)
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
            steps = [*self._pending, *(j.step for _, j in self._picks.retries)]
        local = self._tier.steps() if self._tier is not None else {}
        return {s: (f"is kept in the local tier {self._tier.path}; the next start on this root writes it"
                    if self._tier is not None and s in local else "is lost (it was only in this process's memory)")
                for s in sorted(set(steps))}
