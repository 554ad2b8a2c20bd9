"""Persist: what the background thread does with a staged slot.

1. wait until the staging copies have landed;
2. at the same time: the local commit (tmpfs slots: checksum the images on the tier's
   threads and write the slot's manifest, so the local tier lists the step), and the
   durable write (the target writes the files in parallel on its I/O threads and checksums
   each chunk as it goes);
3. commit on the target, with the local tier's checksums when there are some (the writer
   threads then skip checksumming: it measured ~4% of the write time).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import FileRecord, Manifest
from ..handle import SaveInfo
from ..storage import StepWriter, Target
from ..storage.tier import LocalTier
from .slots import Slot, SlotPool
from .staging import StagingJob

__all__ = ["PersistJob", "adopt_local_tier", "persist"]

log = logging.getLogger("ckptmgr")


@dataclass
class PersistJob:
    manifest: Manifest  # ``files`` is filled in here, unless the slot was adopted
    names: list[str]
    header_sizes: list[int]
    slot: Slot
    staging: StagingJob
    t0: float  # perf_counter() at save()
    blocked_s: float
    busy_wait_s: float
    local_commit: bool  # False for a slot adopted from an earlier process (already listed)
    # multi-rank saves: this rank's file prefix, and the agreement that replaces the commit
    prefix: str = ""
    coordinate: Callable[[StepWriter | None, Manifest, BaseException | None], Manifest] | None = None


def _checksums(io_pool: ThreadPoolExecutor, arrays: list[np.ndarray[Any, Any]],
               chunk_size: int) -> list[tuple[str, ...]]:
    tasks = [(i, b, e) for i, a in enumerate(arrays) for b, e in chunk_ranges(a.size, chunk_size)]
    crcs = list(io_pool.map(lambda t: crc32c_hex(arrays[t[0]][t[1]:t[2]]), tasks))
    out: list[list[str]] = [[] for _ in arrays]
    for (i, _, _), c in zip(tasks, crcs, strict=True):
        out[i].append(c)
    return [tuple(c) for c in out]


def _local_commit(job: PersistJob, tier: LocalTier, pool: SlotPool, arrays: list[np.ndarray[Any, Any]],
                  chunk_size: int) -> tuple[dict[str, FileRecord], float]:
    files = {name: FileRecord(arr.size, chunk_size, crcs, hs)
             for name, hs, arr, crcs in zip(job.names, job.header_sizes, arrays,
                                            _checksums(tier.crc_pool, arrays, chunk_size), strict=True)}
    tier.commit(job.slot.index, job.manifest.step, dataclasses.replace(job.manifest, files=files).to_bytes())
    pool.mark_committed(job.slot, job.manifest.step)
    return files, time.perf_counter() - job.t0


def persist(job: PersistJob, *, target: Target, tier: LocalTier | None, pool: SlotPool,
            chunk_size: int) -> SaveInfo:
    """Run on the persist thread: local commit and durable write side by side, then the
    durable commit."""
    m = job.manifest
    job.staging.wait()
    t_staged = job.staging.finished_at or time.perf_counter()
    arrays = [seg.numpy() for seg in job.slot.segments]
    local: Future[tuple[dict[str, FileRecord], float]] | None = None
    if job.local_commit and tier is not None and job.slot.kind == "tmpfs":
        # The local tier checksums the slot on its own threads while the target writes it.
        local = tier.commit_pool.submit(_local_commit, job, tier, pool, arrays, chunk_size)
    writer: StepWriter | None = None
    told = False  # the other ranks heard how this save went
    try:
        writer = target.begin(m.step, job.prefix)
        chunk = next(iter(m.files.values())).chunk_size if m.files else chunk_size
        # Checksums known already (an adopted slot's manifest) or computed beside the write
        # (the local tier's) are not computed again by the writer threads.
        known_ahead = bool(m.files) or local is not None
        written = writer.write_files(list(zip(job.names, arrays, strict=True)), chunk, checksum=not known_ahead)
        known = dict(m.files)
        local_s = None
        if local is not None:
            known, local_s = local.result()
        for name, hs, arr, crcs in zip(job.names, job.header_sizes, arrays, written, strict=True):
            m.files[name] = known[name] if known_ahead else FileRecord(arr.size, chunk, crcs, hs)
        if job.coordinate is None:
            writer.commit(m.to_bytes())
        else:
            told = True
            job.coordinate(writer, m, None)
    except BaseException as exc:
        if job.coordinate is not None and not told:
            try:
                job.coordinate(writer, m, exc)
            except BaseException:
                pass  # raising ``exc`` below
        if writer is not None and not (job.coordinate is not None and _committed(target, m.step)):
            writer.abort()  # (another rank's commit of this step is never undone)
        if local is not None:
            concurrent.futures.wait([local])
        raise
    t_end = time.perf_counter()
    info = SaveInfo(step=m.step, url=target.url, bytes=sum(a.size for a in arrays), files=len(arrays),
                    staging_s=t_staged - job.t0, persist_s=t_end - t_staged, total_s=t_end - job.t0,
                    blocked_s=job.blocked_s, busy_wait_s=job.busy_wait_s, local_s=local_s)
    log.info("committed step %d: %.1f MB, safe to mutate after %.3f s (caller blocked %.3f s), durable after "
             "%.3f s (%.2f GB/s)", info.step, info.bytes / 1e6, info.staging_s, info.blocked_s, info.total_s,
             info.throughput_gbps)
    return info


def _committed(target: Target, step: int) -> bool:
    try:
        return step in target.list_steps()
    except Exception:
        return False


def adopt_local_tier(tier: LocalTier, pool: SlotPool, durable: set[int], root: str) -> list[PersistJob]:
    """Take over the slots an earlier process left committed in ``tier``; return the jobs
    that write out the steps that never reached the durable target (their slots stay busy
    until then)."""
    jobs = []
    for index, m in sorted(tier.scan(len(pool.slots)).items()):
        names = sorted(m.files)
        slot = pool.adopt(index, m.step, [m.files[n].size for n in names], durable=m.step in durable)
        if m.step in durable:
            continue
        log.warning("step %d exists only in the local tier %s (the last run stopped before writing it); "
                    "writing it to %s now", m.step, tier.path, root)
        slot.busy = True
        jobs.append(PersistJob(m, names, [m.files[n].header_size for n in names], slot,
                               StagingJob(None, [], None), time.perf_counter(), 0.0, 0.0, local_commit=False))
    return jobs
