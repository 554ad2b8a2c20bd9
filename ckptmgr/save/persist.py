"""Persist: one tiered write of a staged slot to its targets, run by the saver's persist thread.

A save has up to two targets: the local tier (the slot's own files in tmpfs) and the durable
root. They are written as one tiered write:

1. the local commit (:func:`commit_local`, on the saver's local-commit thread, started by
   ``save()`` itself): wait until the staging copies have landed, checksum the images (they
   are in place already) and commit the step in RAM. It never waits for the durable tier;
2. the durable write (:func:`persist`, on the persist thread, whenever the saver picks the
   job): the durable target's writer writes the files on its I/O threads, beside the local
   commit when that is still running;
3. the durable commit, with the checksums computed once (by the local commit when there is
   one; the durable writer then skips them: they measured ~4% of the write time).

A job is data, not a closure: the saver's persist thread *picks* jobs (see
:meth:`ckptmgr.save.saver.Saver._next_job`): when saves come faster than the durable target
absorbs them it picks the newest locally committed step and the older ones are superseded
for the durable tier. A failed durable write is retried by running the same job again.

How the durable write is claimed and committed is the job's :class:`StepCommit`: the target's
own claim and manifest-last commit (:data:`PLAIN`), or, for a multi-rank save, the agreement
of every rank around it (:class:`ckptmgr.distributed.save.CoordinatedCommit`, which wraps it
and is not retried alone); the peer tier wraps either to wait for its RAM copy first.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError, StepExistsError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import FileRecord, Manifest
from ..format.naming import plain_name
from ..storage import StepWriter, Target
from ..storage.tier import LocalTier
from .slots import Slot
from .staging import StagingJob

__all__ = ["PLAIN", "PersistJob", "SaveInfo", "StepCommit", "persist"]

log = logging.getLogger("ckptmgr")


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
        blocked_s: seconds ``save()`` itself took, from its first to its last instruction
            (with ``block=False``, until the copies were enqueued).
        busy_wait_s: seconds ``save()`` waited for a free staging slot.
        local_s: seconds from ``save()`` until the local tier listed the checkpoint (None
            when the slot is not in the local tier).
        attempts: durable writes it took (more than 1 when a failed write was retried; 0
            when the step was not written to the durable target).
        durable: True when the step is committed on the durable target. False when it is
            committed in the local tier only: the schedule did not ask for a durable copy
            of it, or ``superseded_by`` is set. ``url`` is then the local tier's directory,
            and ``persist_s``/``total_s`` end at the local commit.
        superseded_by: the newer step that took this step's place in the durable write
            (saves came faster than the durable target absorbs them); None otherwise. The
            step stays in the local tier until its slot is reused.
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
    attempts: int = 1
    durable: bool = True
    superseded_by: int | None = None

    @property
    def throughput_gbps(self) -> float:
        """Bytes written per second of persisting, in GB/s."""
        return self.bytes / self.persist_s / 1e9 if self.persist_s > 0 else float("inf")


class StepCommit:
    """How one persisted step is claimed and committed on the durable target: here, the
    target's own writer (its claim at :meth:`begin`, its commit of the manifest, its abort).
    Subclasses wrap it (a multi-rank agreement, the peer tier's copy); one instance serves
    one job, on the persist thread."""

    prefix = ""  # the data files' name prefix (a rank's own in multi-rank saves)
    retryable = True  # a failed write may be tried again by this process alone

    def begin(self, target: Target, step: int) -> StepWriter:
        """Claim ``step`` on ``target`` and return its writer."""
        return target.begin(step, self.prefix)

    def commit(self, writer: StepWriter, m: Manifest) -> None:
        """Make the step visible: its manifest, written last."""
        writer.commit(m.to_bytes())

    def failed(self, writer: StepWriter | None, m: Manifest, error: BaseException) -> None:
        """The write or the commit failed with ``error``: remove what this writer wrote
        (``writer`` is None when the claim itself failed). An abort that fails raises in
        place of ``error``."""
        if writer is not None:
            writer.abort()


PLAIN = StepCommit()  # (stateless: shared by every single-rank job)


@dataclass
class PersistJob:
    """Everything the persist thread needs to write one staged step (owned by that thread
    once queued)."""

    manifest: Manifest  # ``files`` is filled in by the first attempt that knows the checksums
    names: list[str]
    header_sizes: list[int]
    slot: Slot
    staging: StagingJob
    t0: float  # perf_counter() at save()
    blocked_s: float
    busy_wait_s: float
    commit: StepCommit = PLAIN  # how the durable write is claimed and committed (set once, by the saver)
    attempts: int = 0  # durable writes tried so far
    local_s: float | None = None  # when the local tier listed the step
    nbytes: int = 0  # the files' bytes, all together
    durable: bool = True  # the schedule wants this step on the durable target
    adopted: bool = False  # an earlier process's local-tier slot: checked against its manifest as it is written
    # the local commit (see commit_local); its result is the files' records
    local_commit: Future[dict[str, FileRecord]] | None = None
    # (Saver._mu) the persist thread took the job; the local commit released the slot
    picked: bool = False
    released: bool = False

    @property
    def step(self) -> int:
        return self.manifest.step


def slot_files(job: PersistJob) -> list[tuple[str, np.ndarray[Any, Any]]]:
    return [(name, seg.numpy()) for name, seg in zip(job.names, job.slot.segments, strict=True)]


def commit_local(job: PersistJob, tier: LocalTier, chunk_size: int) -> dict[str, FileRecord]:
    """Commit ``job``'s slot in the local tier once its copies have landed; return the files'
    records (with their checksums). Runs on the saver's local-commit thread."""
    job.staging.wait()
    files = slot_files(job)
    writer = tier.begin(job.step, job.slot.index)
    crcs = writer.write_files(files, chunk_size, checksum=True)
    records = {name: FileRecord(arr.size, chunk_size, c, hs)
               for (name, arr), c, hs in zip(files, crcs, job.header_sizes, strict=True)}
    writer.commit(dataclasses.replace(job.manifest, files=records).to_bytes())
    job.local_s = time.perf_counter() - job.t0
    return records


def persist(job: PersistJob, *, target: Target, chunk_size: int,
            progress: Callable[[int], None] | None = None) -> SaveInfo:
    """Write ``job``'s slot to ``target`` and commit it there, with the checksums of the job's
    local commit when it has one (waited for). Runs on the persist thread. ``progress``: told
    the bytes written as they are (by targets that can tell, see ``StepWriter.progress``).

    Raises:
        Exception: whatever failed; the durable step is then not committed (its partial files
            are removed by the writer's abort), the local one may be.
    """
    m = job.manifest
    job.attempts += 1
    job.staging.wait()
    t_staged = job.staging.finished_at or time.perf_counter()
    files = slot_files(job)
    local = job.local_commit if not m.files else None
    writer: StepWriter | None = None
    try:
        try:
            writer = job.commit.begin(target, m.step)
        except StepExistsError:
            if job.attempts > 1 and m.files and _committed_before(target, m):
                log.warning("step %d: the commit of an earlier attempt is in place under %s (what failed came after "
                            "its manifest's write); it is durable", m.step, target.url)
                return _info(job, target, files, t_staged)
            raise
        writer.progress = progress
        chunk = next(iter(m.files.values())).chunk_size if m.files else chunk_size
        known_ahead = bool(m.files) or local is not None  # checksums computed once, not twice
        written = writer.write_files(files, chunk, checksum=not known_ahead or job.adopted)
        if job.adopted:
            _check_adopted(m, files, written, target.url)
        if local is not None:
            try:
                m.files = local.result()
            except Exception as exc:  # the local copy is lost; the durable one need not be
                log.warning("the local tier could not commit step %d (%s: %s); it is written to %s only",
                            m.step, type(exc).__name__, exc, target.url)
                written = [tuple(crc32c_hex(a[b:e]) for b, e in chunk_ranges(a.size, chunk)) for _, a in files]
                m.files = {}
        if not m.files:
            m.files = {name: FileRecord(arr.size, chunk, crcs, hs)
                       for (name, arr), crcs, hs in zip(files, written, job.header_sizes, strict=True)}
        job.commit.commit(writer, m)
    except BaseException as exc:
        job.commit.failed(writer, m, exc)
        if local is not None:  # never leave it running on a slot about to be released
            concurrent.futures.wait([local])
            if not local.cancelled() and local.exception() is None and not m.files:
                m.files = local.result()  # a retry writes with these
        raise
    info = _info(job, target, files, t_staged)
    log.info("committed step %d: %.1f MB, safe to mutate after %.3f s (caller blocked %.3f s), durable after "
             "%.3f s (%.2f GB/s)", info.step, info.bytes / 1e6, info.staging_s, info.blocked_s, info.total_s,
             info.throughput_gbps)
    return info


def _info(job: PersistJob, target: Target, files: list[tuple[str, np.ndarray[Any, Any]]],
          t_staged: float) -> SaveInfo:
    t_end = time.perf_counter()
    return SaveInfo(step=job.step, url=target.url, bytes=sum(a.size for _, a in files), files=len(files),
                    staging_s=t_staged - job.t0, persist_s=t_end - t_staged, total_s=t_end - job.t0,
                    blocked_s=job.blocked_s, busy_wait_s=job.busy_wait_s, local_s=job.local_s,
                    attempts=job.attempts)


def _committed_before(target: Target, m: Manifest) -> bool:
    """True when step ``m.step`` is committed on ``target`` as ``m`` itself (data objects under
    any claim's names, each in place with its size): an earlier attempt of this job whose
    manifest landed though what followed it failed (a lease renewal, an answer lost). Anything
    else there, or that cannot be read, is not ours."""
    try:
        there = Manifest.from_bytes(target.read_manifest(m.step), where=f"{target.url}: step {m.step}")
        plain = {n: plain_name(n) for n in there.files}
        files = {plain[n]: r for n, r in there.files.items()}
        tensors = {k: {**e, "file": plain.get(e["file"], e["file"])} if "file" in e else e
                   for k, e in there.tensors.items()}
        if len(files) != len(there.files) or dataclasses.replace(there, files=files, tensors=tensors) != m:
            return False
        return all(target.file_size(m.step, n, fresh=True) == r.size for n, r in there.files.items())
    except Exception:  # (not readable now: not known to be ours)
        return False


def _check_adopted(m: Manifest, files: list[tuple[str, np.ndarray[Any, Any]]], written: list[tuple[str, ...]],
                   url: str) -> None:
    """An adopted slot's bytes, checksummed as they were written, against the manifest they
    were committed with in the tier (the slot may have been damaged while no process held it).

    Raises:
        CheckpointCorruptError: they differ; the step is not committed to ``url``.
    """
    for (name, _), crcs in zip(files, written, strict=True):  # (the job's files are the manifest's)
        if tuple(crcs) != tuple(m.files[name].crc32c):
            raise CheckpointCorruptError(f"step {m.step}: {name} in the local tier no longer matches its manifest "
                                         f"(damaged since it was committed there); not written to {url}")
