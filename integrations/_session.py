"""What the Hugging Face integrations share: their options, one writer per process with its
staging fence and multi-rank agreement, and retention over a library's checkpoint directories.

The writer (:class:`DirectoryWriter`) saves checkpoint directories on the save engine
(:class:`ckptmgr.save.engine.AsyncWriter`). Training thread: :meth:`DirectoryWriter.begin`
makes the temporary directory and a :class:`~._fileset.FileSet` for it; the library then
writes its checkpoint there (its big ``torch.save``/``save_file`` calls captured into the set,
its small files written as usual); :meth:`DirectoryWriter.commit` submits the set's staged
files as the save's images, with a :class:`~ckptmgr.storage.commit.directory.DirectoryCommit`,
and returns with the copies in flight. On the engine's worker, in save order, the commit
writes each file into the temporary directory (chunks in parallel, CRC32C on the way, fsync),
checksums the files the library wrote itself, writes ``ckptmgr.json`` and puts the directory
under its final name (:func:`ckptmgr.storage.commit.directory.replace_dir`: an existing
directory of that name is exchanged, or renamed away, never deleted first), then the caller's
``after`` hook runs (retention). In a multi-rank job each rank writes its own files into the
shared temporary directory, the ranks agree over a gloo group that all are durable, and rank 0
alone writes the record and renames; a failure or a dead rank commits nothing.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptmgr import CheckpointCorruptError, ConfigError, KeepLatest, RetentionPolicy, SaveError, StepInfo, __version__
from ckptmgr.extend import (
    RECORD_NAME,
    AsyncWriter,
    DirectoryCommit,
    FileRecord,
    Pending,
    committed_dirs,
    coordinator_for,
    delete_dir,
    dir_temp_name,
    newest_verified,
    recover,
    remove_stale_temps,
    verify_dir,
)

from ._fence import StagingFence
from ._fileset import FileSet

__all__ = ["AsyncSaveOptions", "DirectoryWriter", "Pending", "Session", "apply_retention", "check_checkpoint",
           "default_policy", "latest_checkpoint"]

log = logging.getLogger("ckptmgr")


@dataclass(frozen=True, kw_only=True)
class AsyncSaveOptions:
    """How checkpoints are saved in the background.

    Attributes:
        retention: which committed checkpoints to keep (e.g. ``AnyOf(KeepLatest(3),
            KeepEvery(1000))``); None keeps what the library's own limit says
            (``save_total_limit``, ``total_limit``), or everything. Applied after each commit;
            the newest checkpoint, the best one and saves in flight are never deleted.
        overlap: True (the default) lets the copy off the training tensors run on into the
            next step, waited for right before the next ``optimizer.step()``; False waits
            for it inside the save call.
        slots: saves staged or being written at once (each slot holds one whole checkpoint
            in host memory, pinned where CUDA is).
        copy_threads: threads copying CPU tensors into the slot.
        io_threads: threads writing and hashing file chunks in parallel.
        chunk_size: bytes per write task and per CRC32C chunk.
        max_host_bytes: cap on the staging memory (None: no cap).
        verify_on_resume: check each checkpoint's checksums before resuming from it, and
            fall back to the previous one when damaged.
        timeout: seconds any wait (a free slot, the other ranks) may take.
    """

    retention: RetentionPolicy | None = None
    overlap: bool = True
    slots: int = 1
    copy_threads: int = 4
    io_threads: int = 8
    chunk_size: int = 64 << 20
    max_host_bytes: int | None = None
    verify_on_resume: bool = True
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.retention is not None and not isinstance(self.retention, RetentionPolicy):
            raise ConfigError(f"retention must be a RetentionPolicy or None, got {type(self.retention).__name__}")
        for name in ("slots", "copy_threads", "io_threads", "chunk_size"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ConfigError(f"AsyncSaveOptions.{name} must be a positive int, got {v!r}")
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or self.timeout <= 0:
            raise ConfigError(f"AsyncSaveOptions.timeout must be a positive number, got {self.timeout!r}")


class DirectoryWriter:
    """Saves of checkpoint directories on one save engine (see the module docstring).

    Args:
        slots: saves staged or in flight at once; a save waits for a free one.
        copy_threads: threads for CPU tensor copies.
        io_threads: threads that write and hash chunks in parallel.
        chunk_size: bytes per write task and per CRC32C chunk.
        max_host_bytes: cap on the staging memory (None: no cap).
        coordinator: a :class:`ckptmgr.distributed.coordinator.Coordinator` in a multi-rank
            job (every rank has a writer and saves the same steps in the same order).
        timeout: seconds the worker waits for a save's copies to land.
    """

    def __init__(self, *, slots: int = 1, copy_threads: int = 4, io_threads: int = 8, chunk_size: int = 64 << 20,
                 max_host_bytes: int | None = None, coordinator: Any = None, timeout: float = 600.0) -> None:
        self.engine = AsyncWriter(slots=slots, copy_threads=copy_threads, io_threads=io_threads,
                                  max_host_bytes=max_host_bytes, stage_timeout=timeout, name="ckptmgr-dir-writer")
        self.chunk_size = chunk_size
        self.coordinator = coordinator
        self.timeout = timeout
        self._mu = threading.Lock()  # guards the two fields below
        self._cleaned: set[str] = set()  # scratch directories swept of stale temporaries
        self._in_flight: dict[str, int] = {}  # final path -> step, saves not committed yet

    @property
    def is_leader(self) -> bool:
        return self.coordinator is None or self.coordinator.is_leader

    def begin(self, parent: str, token: str | None = None, pid: int | None = None, *,
              scratch: str | None = None) -> FileSet:
        """Make a temporary directory in ``scratch`` (default ``parent``, the checkpoints'
        directory; see :func:`ckptmgr.storage.commit.directory.scratch_dir`) and return the file set for it.

        The first save into a scratch directory first finishes the replacements a crash
        interrupted there and removes the temporaries of writers that are gone. In a
        multi-rank save every rank passes the same ``token`` and ``pid`` (rank 0's), so all
        write into one directory."""
        self.raise_errors()
        parent = os.path.abspath(parent)
        scratch = parent if scratch is None else os.path.abspath(scratch)
        os.makedirs(parent, exist_ok=True)
        with self._mu:
            first = scratch not in self._cleaned
            self._cleaned.add(scratch)
        if first and self.is_leader:
            recover(scratch)  # logs what it restores
            removed = remove_stale_temps(scratch)
            if scratch != parent:  # where temporaries went before they moved out of parent
                removed += remove_stale_temps(parent)
            if removed:
                log.info("removed %d leftovers of interrupted saves in %s", len(removed), scratch)
        tmp = os.path.join(scratch, dir_temp_name(pid, token))
        os.makedirs(tmp, exist_ok=token is not None)
        return FileSet(tmp, _original_torch_save())

    def commit(self, fs: FileSet, final: str, *, step: int, metadata: dict[str, Any] | None = None,
               after: Callable[[], None] | None = None, timeout: float | None = None) -> Pending[str]:
        """Stage ``fs``'s tensors and enqueue its write and commit as ``final``.

        Returns with the copies in flight: the staged tensors must not change before
        :meth:`Pending.wait_staged` returns. ``after`` runs on the worker once committed
        (on rank 0 only).

        Raises:
            CkptTimeoutError: no staging slot became free within ``timeout`` seconds.
        """
        final = os.path.abspath(final)
        commit = DirectoryCommit(fs.directory, final, step=step, metadata=dict(metadata or {}),
                                 chunk_size=self.chunk_size, write=functools.partial(_write_files, fs, self.chunk_size),
                                 coordinator=self.coordinator, library=f"ckptmgr {__version__}",
                                 done=functools.partial(self._done, final))
        with self._mu:
            self._in_flight[final] = step
        try:
            return self.engine.submit(fs.staged(), commit, step=step, label=f"checkpoint {final}", timeout=timeout,
                                      after=None if after is None or not self.is_leader else lambda _: after())
        except BaseException:
            self._done(final)
            raise

    def in_flight(self) -> dict[str, int]:
        """``{final path: step}`` of the saves not committed yet."""
        with self._mu:
            return dict(self._in_flight)

    def _done(self, final: str) -> None:
        with self._mu:
            self._in_flight.pop(final, None)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every enqueued save has finished, then raise the first failure.

        Raises:
            CkptTimeoutError: still busy after ``timeout`` seconds.
        """
        self.engine.wait(timeout)
        self.raise_errors()

    def raise_errors(self) -> None:
        """Raise the first background failure nobody has been told of."""
        errors = self.engine.take_errors()
        if errors:
            raise SaveError(f"a background checkpoint save failed: {errors[0]}") from errors[0]

    def close(self, timeout: float | None = None) -> None:
        """Wait for everything enqueued, stop the threads and free the staging memory."""
        try:
            self.wait(timeout)
        finally:
            self.engine.close(timeout)


def _write_files(fs: FileSet, chunk_size: int, buffers: list[np.ndarray[Any, Any]], io: Executor
                 ) -> dict[str, FileRecord]:
    """This rank's files in the temporary directory, written from their staged buffers (or,
    for the library's own files, checksummed) and fsynced."""
    staged = iter(buffers)
    records: dict[str, FileRecord] = {}
    for name, entry in fs.entries.items():
        seg = next(staged) if entry.plan is not None else None
        path = os.path.join(fs.directory, *name.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        records[name] = entry.write(seg, path, io, chunk_size)
    return records


def _original_torch_save() -> Callable[[Any, Any], None]:
    save = torch.save
    while hasattr(save, "__wrapped__"):  # never a captured torch.save
        save = save.__wrapped__
    return save


class Session:
    """One writer, its fence and (in a multi-rank job) the ranks' agreement, made lazily on
    the first save (every rank saves the same steps, so collectives line up there)."""

    def __init__(self, options: AsyncSaveOptions) -> None:
        # every field belongs to the training thread (the writer's own state has its own lock)
        self.options = options
        self.writer: DirectoryWriter | None = None
        self.fence = StagingFence()
        self._pid: int | None = None
        self._nonce: str | None = None

    def start(self) -> DirectoryWriter:
        if self.writer is None:
            coord = coordinator_for(None, self.options.timeout)
            o = self.options
            self.writer = DirectoryWriter(slots=o.slots, copy_threads=o.copy_threads, io_threads=o.io_threads,
                                          chunk_size=o.chunk_size, max_host_bytes=o.max_host_bytes,
                                          coordinator=coord, timeout=o.timeout)
            if coord is not None:  # one temporary directory per save for all ranks
                self._pid, self._nonce = coord.broadcast((os.getpid(), secrets.token_hex(6)), "checkpoint naming")
        return self.writer

    def token(self, step: int) -> tuple[str | None, int | None]:
        """The temporary directory's token and pid for ``step`` (None, None: single process)."""
        if self._nonce is None:
            return None, None
        return f"{self._nonce}{step:012x}", self._pid

    def guard(self, pending: Pending[str]) -> None:
        """Hold the next optimizer step until ``pending``'s copies have landed (or wait now)."""
        if self.options.overlap:
            self.fence.arm(pending)  # the fence needs staged()/wait_staged() only
        else:
            pending.wait_staged(self.options.timeout)

    def wait(self, timeout: float | None = None) -> None:
        self.fence.wait()
        if self.writer is not None:
            self.writer.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        self.fence.wait()
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close(timeout)
            if writer.coordinator is not None:
                writer.coordinator.destroy()


def _step_info(step: int, path: str) -> StepInfo:
    try:
        with open(os.path.join(path, RECORD_NAME), "rb") as f:
            doc = json.loads(f.read(1 << 20))
        return StepInfo(step, float(doc["time"]), dict(doc.get("metadata") or {}))
    except (OSError, ValueError, KeyError, TypeError):
        return StepInfo(step, os.path.getmtime(path), {})


def apply_retention(parent: str, pattern: re.Pattern[str], policy: RetentionPolicy | None,
                    protect: set[int], scratch: str | None = None) -> list[int]:
    """Delete the committed directories under ``parent`` that ``policy`` drops, never the
    newest nor those in ``protect`` (renamed away into ``scratch`` first, default
    ``parent``); return the deleted steps."""
    if policy is None:
        return []
    dirs = committed_dirs(parent, pattern)
    steps = sorted(dirs)
    if len(steps) < 2:
        return []
    infos = [_step_info(s, dirs[s]) for s in steps]
    mask = policy.keep(infos)
    if len(mask) != len(steps):
        raise ConfigError(f"{policy!r} returned {len(mask)} decisions for {len(steps)} checkpoints")
    deleted = []
    for s, keep in zip(steps, mask, strict=True):
        if keep or s == steps[-1] or s in protect:
            continue
        log.info("retention: deleting %s", dirs[s])
        delete_dir(dirs[s], scratch)
        deleted.append(s)
    return deleted


def latest_checkpoint(parent: str, pattern: re.Pattern[str], *, verify: bool = True,
                      scratch: str | None = None) -> str | None:
    """The newest complete checkpoint directory under ``parent`` (verified against its record
    when it has one; damaged ones are skipped with a warning), or None. Replacements a crash
    interrupted in ``scratch`` (default ``parent``) are finished first."""
    recover(scratch if scratch is not None else parent)
    dirs = committed_dirs(parent, pattern)
    if not verify:
        return dirs[max(dirs)] if dirs else None
    found = newest_verified(dirs, log)
    return found[1] if found else None


def check_checkpoint(path: str, *, verify: bool = True) -> None:
    """Raise CheckpointCorruptError when ``path`` (a checkpoint the caller named) is damaged."""
    if verify and os.path.isdir(path):
        try:
            verify_dir(path)
        except CheckpointCorruptError as exc:
            raise CheckpointCorruptError(f"{exc}; resume from another checkpoint") from None


def default_policy(limit: int | None) -> RetentionPolicy | None:
    """The library's "keep the last N" as a policy (None or <= 0: keep everything)."""
    return KeepLatest(limit) if limit is not None and limit > 0 else None

