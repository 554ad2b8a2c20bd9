"""Checkpoint directories written in the background from ckptmgr's reused staging, committed by
an atomic rename.

Training thread: :meth:`DirectoryWriter.begin` makes the temporary directory and a
:class:`~._fileset.FileSet` for it; the library then writes its checkpoint there (its big
``torch.save``/``save_file`` calls captured into the set, its small files written as usual);
:meth:`DirectoryWriter.commit` takes a staging slot (host memory reused from save to save,
pinned where CUDA is), lays each staged file out in it and enqueues the copies. It returns
with the copies in flight (:meth:`Pending.wait_staged` says when the tensors may change).

Worker thread (one per writer, saves in the order they were made): waits for
the copies, writes each file into the temporary directory (chunks in parallel, CRC32C on the
way, fsync), checksums the files the library wrote itself, writes ``ckptmgr.json`` and
puts the directory under its final name (:func:`._dirreplace.replace_dir`: an existing
directory of that name is exchanged, never deleted first), then runs the caller's ``after``
hook (retention).
In a multi-rank job each rank writes its own files into the shared temporary directory, the
ranks agree over a gloo group that all are durable, and rank 0 alone writes the record and
renames; a failure or a dead rank commits nothing.

Threads: the worker, the I/O pool and the stager's copy threads; :meth:`close` stops them.
State shared with the worker is guarded by ``_mu``.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptmgr.errors import CkptTimeoutError, SaveError
from ckptmgr.format.layout import Plan
from ckptmgr.save.slots import Slot, SlotPool
from ckptmgr.save.staging import Stager, StagingJob

from ._dirrecord import fsync_dir, remove_stale_temps, temp_name, write_record
from ._dirreplace import recover, replace_dir
from ._fileset import FileRecord, FileSet, hash_file

__all__ = ["DirectoryWriter", "Pending"]

log = logging.getLogger("ckptmgr")


class Pending:
    """A save in flight: its copies (for the staging fence) and its commit (a future)."""

    def __init__(self, final: str, job: StagingJob | None) -> None:
        self.final = final
        self.committed: Future[str] = Future()
        self._job = job

    def staged(self) -> bool:
        return self._job is None or self._job.done()

    def wait_staged(self, timeout: float | None = None) -> None:
        if self._job is not None:
            self._job.wait(timeout)

    def result(self, timeout: float | None = None) -> str:
        """The committed directory; raises the save's error."""
        return self.committed.result(timeout)


@dataclass
class _Save:  # made on the training thread, owned by the worker once enqueued
    fs: FileSet
    final: str
    step: int
    metadata: dict[str, Any]
    slot: Slot | None
    pending: Pending
    after: Callable[[], None] | None
    staged: list[Any] = field(default_factory=list)


class DirectoryWriter:
    """Saves of checkpoint directories, in order, on one worker thread.

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
        self._pool = SlotPool(slots, tier=None, max_host_bytes=max_host_bytes)
        self._copy_threads = copy_threads
        self._io_threads = io_threads
        self.chunk_size = chunk_size
        self.coordinator = coordinator
        self.timeout = timeout
        self._mu = threading.Lock()  # guards everything below
        self._stager: Stager | None = None
        self._io: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[_Save | None] = queue.Queue()
        self._pending = 0  # operations enqueued and not finished
        self._idle = threading.Condition(self._mu)
        self._errors: list[BaseException] = []  # background failures nobody has been told of
        self._cleaned: set[str] = set()  # parents whose stale temporaries were removed
        self._in_flight: dict[str, int] = {}  # final path -> step, saves not committed yet
        self._closed = False

    @property
    def is_leader(self) -> bool:
        return self.coordinator is None or self.coordinator.is_leader

    # ------------------------------------------------------------ training thread

    def begin(self, parent: str, token: str | None = None, pid: int | None = None, *,
              scratch: str | None = None) -> FileSet:
        """Make a temporary directory in ``scratch`` (default ``parent``, the checkpoints'
        directory; see :func:`._dirreplace.scratch_dir`) and return the file set for it.

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
        tmp = os.path.join(scratch, temp_name(pid, token))
        os.makedirs(tmp, exist_ok=token is not None)
        return FileSet(tmp, _original_torch_save())

    def commit(self, fs: FileSet, final: str, *, step: int, metadata: dict[str, Any] | None = None,
               after: Callable[[], None] | None = None, timeout: float | None = None) -> Pending:
        """Stage ``fs``'s tensors and enqueue its write and commit as ``final``.

        Returns with the copies in flight: the staged tensors must not change before
        :meth:`Pending.wait_staged` returns. ``after`` runs on the worker once committed
        (on rank 0 only).

        Raises:
            CkptTimeoutError: no staging slot became free within ``timeout`` seconds.
        """
        entries = fs.staged()
        slot, job = None, None
        if entries:
            sizes = fs.sizes()
            self._pool.check_capacity(sizes)
            self._start()
            slot, waited = self._pool.acquire(wait=True, timeout=timeout)
            assert slot is not None
            if waited > 1e-3:
                log.info("checkpoint %s waited %.3f s for a free staging slot", final, waited)
            try:
                self._pool.fit(slot, sizes)
                for entry, segment in zip(entries, slot.segments, strict=True):
                    entry.fill(segment)
                stager = self._stager
                assert stager is not None
                job = stager.stage(Plan([e.plan for e in entries if e.plan is not None], []), slot.segments,
                                   slot.piece)  # (copies never span two pinned pieces)
            except BaseException:
                self._pool.release(slot, step=None, durable=False)
                raise
        else:
            self._start()
        pending = Pending(os.path.abspath(final), job)
        with self._mu:
            self._in_flight[pending.final] = step
        self._enqueue(_Save(fs, pending.final, step, dict(metadata or {}), slot, pending, after))
        return pending

    def in_flight(self) -> dict[str, int]:
        """``{final path: step}`` of the saves not committed yet."""
        with self._mu:
            return dict(self._in_flight)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every enqueued operation has finished, then raise the first failure.

        Raises:
            CkptTimeoutError: still busy after ``timeout`` seconds.
        """
        with self._idle:
            if not self._idle.wait_for(lambda: not self._pending, timeout):
                raise CkptTimeoutError(f"{self._pending} checkpoint write(s) still running after {timeout} s")
        self.raise_errors()

    def raise_errors(self) -> None:
        """Raise the first background failure nobody has been told of."""
        with self._mu:
            errors, self._errors = self._errors, []
        if errors:
            raise SaveError(f"a background checkpoint save failed: {errors[0]}") from errors[0]

    def close(self, timeout: float | None = None) -> None:
        """Wait for everything enqueued, stop the threads and free the staging memory."""
        try:
            self.wait(timeout)
        finally:
            with self._mu:
                self._closed = True
                thread, self._thread = self._thread, None
                io, self._io = self._io, None
                stager, self._stager = self._stager, None
            if thread is not None:
                self._queue.put(None)
                thread.join(timeout)
            if io is not None:
                io.shutdown(wait=True)
            if stager is not None:
                stager.close()
            self._pool.close()

    # ---------------------------------------------------------------- internals

    def _start(self) -> None:
        with self._mu:
            if self._closed:
                raise SaveError("the checkpoint writer is closed")
            if self._stager is None:
                self._stager = Stager(self._copy_threads)
            if self._io is None:
                self._io = ThreadPoolExecutor(self._io_threads, thread_name_prefix="ckptmgr-dir-io")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptmgr-dir-writer", daemon=True)
                self._thread.start()

    def _enqueue(self, op: _Save) -> None:
        with self._mu:
            self._pending += 1
        self._queue.put(op)

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            try:
                self._save(op)
            except BaseException as exc:  # told at the next save, wait or close
                log.error("checkpoint %s: %s: %s", op.final, type(exc).__name__, exc)
                if not op.pending.committed.done():
                    op.pending.committed.set_exception(exc)
                with self._mu:
                    self._errors.append(exc)
            finally:
                with self._idle:
                    self._in_flight.pop(op.final, None)
                    self._pending -= 1
                    self._idle.notify_all()

    def _write_files(self, op: _Save) -> dict[str, FileRecord]:
        """This rank's files in the temporary directory, written (or, for the library's own
        files, checksummed) and fsynced."""
        op.pending.wait_staged(self.timeout)
        records: dict[str, FileRecord] = {}
        try:
            segments = op.slot.segments if op.slot is not None else []
            staged = iter(segments)
            for name, entry in op.fs.entries.items():
                seg = next(staged).numpy() if entry.plan is not None else None
                path = os.path.join(op.fs.directory, *name.split("/"))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                records[name] = entry.write(seg, path, self._io, self.chunk_size)
        finally:
            if op.slot is not None:
                self._pool.release(op.slot, step=None, durable=False)
                op.slot = None
        return records

    def _save(self, op: _Save) -> None:
        tmp = op.fs.directory
        error: BaseException | None = None
        records: dict[str, FileRecord] = {}
        try:
            records = self._write_files(op)
        except Exception as exc:
            error = exc
        coord = self.coordinator
        if coord is not None:  # every rank reports; rank 0 commits only if all succeeded
            reports = coord.all_gather((None if error is None else repr(error), records),
                                       f"commit of {op.final}", group=coord.commit)
            failed = [(r, e) for r, (e, _) in enumerate(reports) if e is not None]
            if error is None and failed:
                error = SaveError(f"rank {failed[0][0]} failed to write its files of {op.final}: {failed[0][1]}")
            for _, recs in reports:
                records.update(recs)
        if error is not None:
            if self.is_leader:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error
        if not self.is_leader:
            op.pending.committed.set_result(op.final)
            return
        self._commit_dir(op, records)
        op.pending.committed.set_result(op.final)
        if op.after is not None:
            op.after()

    def _commit_dir(self, op: _Save, records: dict[str, FileRecord]) -> None:
        tmp = op.fs.directory
        try:
            for dirpath, dirnames, filenames in os.walk(tmp):  # files the library wrote itself
                for fname in filenames:
                    rel = os.path.relpath(os.path.join(dirpath, fname), tmp).replace(os.sep, "/")
                    if rel not in records:
                        records[rel] = hash_file(os.path.join(dirpath, fname), self.chunk_size)
                for d in dirnames:
                    fsync_dir(os.path.join(dirpath, d))
            write_record(tmp, step=op.step, files=records, chunk_size=self.chunk_size, metadata=op.metadata)
            fsync_dir(tmp)
            replace_dir(tmp, op.final)  # the same step saved again: never leaves op.final missing
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _original_torch_save() -> Callable[[Any, Any], None]:
    save = torch.save
    while hasattr(save, "__wrapped__"):  # never a captured torch.save
        save = save.__wrapped__
    return save
