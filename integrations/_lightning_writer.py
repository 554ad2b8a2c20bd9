"""The Lightning plugin's save pipeline: torch checkpoint files written from reused staging.

``save()`` (training thread): lay the checkpoint out as the file ``torch.save`` would write
(:mod:`ckptmgr.format.torchzip`), take a staging slot (reused host memory, pinned where CUDA
is), copy torch's static bytes into it and enqueue the tensors' copies (device-to-host DMA on
a side stream, or CPU copies on helper threads). It returns with the copies in flight.

The worker thread, one per writer, takes saves and removals in the order they were made:
for a save it waits for the copies, seals the image (CRC-32 of every storage record and the
CRC32C chunks, on the I/O threads), writes it beside the destination and renames it over the
destination (:mod:`ckptmgr.storage.onefile`), then frees the slot. A removal runs after every
save enqueued before it. So a ``.ckpt`` path that exists always holds a complete file, and a
removal never overtakes a save in flight.

Threads: the worker, the I/O pool and the stager's copy threads. :meth:`Writer.park` stops
them all (the slots stay allocated for the next save); :meth:`Writer.close` also frees the
slots. Nothing here is a daemon thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptmgr import _lifecycle as lifecycle
from ckptmgr.errors import CkptTimeoutError
from ckptmgr.format.layout import FilePlan, Plan, StoredTensor
from ckptmgr.format.torchzip import TorchZipImage, plan_image, seal
from ckptmgr.options import S3Options
from ckptmgr.save.slots import Slot, SlotPool
from ckptmgr.save.staging import Stager, StagingJob
from ckptmgr.storage import open_target
from ckptmgr.storage.onefile import remove_stale_temps, write_file_atomic, write_s3_object, write_url_atomic

__all__ = ["Staged", "Writer"]

log = logging.getLogger("ckptmgr")


class Staged:
    """A save's copies, as :class:`~integrations._fence.StagingFence` waits for them."""

    def __init__(self, job: StagingJob, image: TorchZipImage) -> None:
        self._job = job
        self.image = image

    def staged(self) -> bool:
        return self._job.done()

    def wait_staged(self, timeout: float | None = None) -> None:
        self._job.wait(timeout)


@dataclass
class _Save:
    path: str
    fs: Any  # None: a local path
    image: TorchZipImage
    slot: Slot
    staging: StagingJob
    done: Future[None]
    background: bool  # a failure is also reported at the next save, wait or teardown


@dataclass
class _Remove:
    path: str
    fs: Any
    done: Future[None]


class InFlight:
    """Paths with a save enqueued and not yet committed, counted (one lock, any thread)."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._paths: dict[str, int] = {}  # guarded by _mu

    def add(self, path: str) -> None:
        with self._mu:
            self._paths[path] = self._paths.get(path, 0) + 1

    def discard(self, path: str) -> None:
        with self._mu:
            n = self._paths.get(path, 0) - 1
            if n > 0:
                self._paths[path] = n
            else:
                self._paths.pop(path, None)

    def __contains__(self, path: object) -> bool:
        with self._mu:
            return path in self._paths


IN_FLIGHT = InFlight()  # every Writer of the process: what ModelCheckpoint must count as existing


class Writer:
    """Saves and removals of one plugin, in order, on one worker thread.

    Args:
        slots: checkpoints staged or in flight at once (each slot holds one whole file);
            None: sized by the pool as ``StagingOptions(slots=None)`` says.
        copy_threads: threads for CPU tensor copies.
        io_threads: threads that hash and write chunks of one file in parallel.
        chunk_size: bytes per CRC32C chunk and per write task.
        direct_io: O_DIRECT for the aligned bulk of local files where the filesystem allows it.
        max_host_bytes: cap on the slots' host memory (None: none).
        busy_timeout: seconds a save waits for a free slot (None: no limit).
        storage_options: fsspec options of remote paths (credentials, endpoints).
        s3_options: multipart upload and retries of ``s3://`` paths.
    """

    def __init__(self, *, slots: int | None, copy_threads: int, io_threads: int, chunk_size: int, direct_io: bool,
                 max_host_bytes: int | None, busy_timeout: float | None = None,
                 storage_options: dict[str, Any] | None = None, s3_options: S3Options | None = None) -> None:
        self._busy_timeout = busy_timeout
        self._storage_options = storage_options
        self._s3_options = s3_options
        self._s3: dict[str, Any] = {}  # directory URL -> S3Target; the worker thread's
        self._pool = SlotPool(slots, tier=None, max_host_bytes=max_host_bytes)
        self._copy_threads = copy_threads
        self._io_threads = io_threads
        self.chunk_size = chunk_size
        self._direct_io = direct_io
        self._mu = threading.Lock()  # guards the fields below
        self._stager: Stager | None = None
        self._io: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[_Save | _Remove | None] = queue.Queue()
        self._pending = 0  # operations enqueued and not finished
        self._idle = threading.Condition(self._mu)
        self._errors: list[BaseException] = []  # background failures nobody has been told of
        self._cleaned: set[str] = set()  # directories whose stale temporaries were removed

    # ------------------------------------------------------------ training thread

    def save(self, checkpoint: Any, path: str, fs: Any, *, background: bool) -> tuple[Future[None], Staged]:
        """Start saving ``checkpoint`` at ``path`` (``fs``: an fsspec filesystem, None for a
        local path). Returns when the copies are enqueued: the tensors must not change until
        :meth:`Staged.wait_staged` returns; the future completes when the file is committed.
        A ``background`` save's failure is also kept for :meth:`take_errors`.

        Raises:
            CkptTimeoutError: no staging slot became free within the busy timeout.
        """
        image = plan_image(checkpoint, chunk_size=self.chunk_size)
        self._pool.check_capacity([image.size])
        self._start()
        slot, waited = self._pool.acquire(wait=True, timeout=self._busy_timeout)
        assert slot is not None
        if waited > 1e-3:
            log.info("checkpoint %s waited %.3f s for a free staging slot", path, waited)
        try:
            self._pool.fit(slot, [image.size])
            seg = slot.segments[0]
            image.write_static(seg.numpy())
            stager = self._stager
            assert stager is not None
            plan = _plan(image)
            job = stager.stage(plan, [seg][:len(plan.files)], slot.piece)  # (copies never span two pinned pieces)
        except BaseException:
            self._pool.release(slot, step=None, durable=False)
            raise
        done: Future[None] = Future()
        IN_FLIGHT.add(path)
        self._enqueue(_Save(path, fs, image, slot, job, done, background))
        return done, Staged(job, image)

    def remove(self, path: str, fs: Any) -> None:
        """Remove ``path`` once every save enqueued before has committed: now when none is in
        flight (a failure is raised here), else on the worker thread (a failure is reported at
        the next save, wait or teardown)."""
        with self._mu:
            direct = self._pending == 0
        if direct:  # nothing in flight: no thread needed
            _remove(path, fs)
            return
        self._start()
        self._enqueue(_Remove(path, fs, Future()))

    def wait(self, timeout: float | None = None) -> None:
        """Block until every enqueued operation has finished.

        Raises:
            CkptTimeoutError: still busy after ``timeout`` seconds.
        """
        with self._idle:
            if not self._idle.wait_for(lambda: not self._pending, timeout):
                raise CkptTimeoutError(f"{self._pending} checkpoint write(s) still running after {timeout} s")

    def take_errors(self) -> list[BaseException]:
        with self._mu:
            errors, self._errors = self._errors, []
        return errors

    def park(self, timeout: float | None = None) -> None:
        """Wait for everything enqueued, then stop the threads (the slots stay)."""
        self.wait(timeout)
        with self._mu:
            thread, self._thread = self._thread, None
            io, self._io = self._io, None
            stager, self._stager = self._stager, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        if io is not None:
            io.shutdown(wait=True)
        if stager is not None:
            stager.close()
        targets, self._s3 = self._s3, {}
        for t in targets.values():
            t.close()
        lifecycle.forget(self)

    def close(self, timeout: float | None = None) -> None:
        """:meth:`park`, then free the slots."""
        self.park(timeout)
        self._pool.close()

    # ---------------------------------------------------------------- internals

    def _start(self) -> None:
        with self._mu:
            if self._stager is None:
                self._stager = Stager(self._copy_threads, daemon=False)  # (stopped at teardown)
            if self._io is None:
                self._io = ThreadPoolExecutor(self._io_threads, thread_name_prefix="ckptmgr-lightning-io")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptmgr-lightning", daemon=False)
                self._thread.start()
                lifecycle.close_at_exit(self)  # a plugin never torn down must not hang the exit

    def _enqueue(self, op: _Save | _Remove) -> None:
        with self._mu:
            self._pending += 1
        self._queue.put(op)

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            try:
                if isinstance(op, _Save):
                    self._commit(op)
                else:
                    _remove(op.path, op.fs)
                op.done.set_result(None)
            except BaseException as exc:  # told at the next save, wait or teardown
                log.error("checkpoint %s: %s: %s", op.path, type(exc).__name__, exc)
                op.done.set_exception(exc)
                if not isinstance(op, _Save) or op.background:
                    with self._mu:
                        self._errors.append(exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _commit(self, op: _Save) -> None:
        try:
            op.staging.wait()
            buf = op.slot.segments[0].numpy()
            seal(op.image, buf, self._io)
            if op.fs is None:
                directory = os.path.dirname(op.path)
                os.makedirs(directory, exist_ok=True)
                if directory not in self._cleaned:
                    self._cleaned.add(directory)
                    remove_stale_temps(directory)
                write_file_atomic(op.path, buf, pool=self._io, chunk_size=self.chunk_size, direct_io=self._direct_io)
            elif "s3" in _protocols(op.fs):
                directory, name = op.path.rsplit("/", 1)
                target = self._s3.get(directory)
                if target is None:
                    target = self._s3[directory] = open_target(directory, self._storage_options,
                                                               io_threads=self._io_threads, s3_options=self._s3_options)
                prefix = getattr(target, "prefix", "")  # an S3Target
                write_s3_object(target, f"{prefix}/{name}" if prefix else name, buf)
            else:
                write_url_atomic(op.fs, op.path, buf)
        finally:
            self._pool.release(op.slot, step=None, durable=False)
            IN_FLIGHT.discard(op.path)


def _plan(image: TorchZipImage) -> Plan:
    """The stager's view of an image: the first static segment as the header, each storage as
    a ``U8`` tensor at its offset (the other static segments are in the slot already)."""
    if not image.static:
        return Plan([], [])
    head = image.static[0][1]
    assert image.static[0][0] == 0
    assert head
    tensors = [StoredTensor(f"data/{s.key}", "U8", (s.nbytes,), s.offset - len(head), s.offset - len(head) + s.nbytes,
                            s.source) for s in image.spans]
    return Plan([FilePlan("checkpoint", head, tensors)], [])


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _remove(path: str, fs: Any) -> None:
    if fs is None:
        try:
            os.remove(path)
        except FileNotFoundError:
            return
        except IsADirectoryError:  # a directory Lightning's own plugin might have made
            import shutil

            shutil.rmtree(path)
        return
    if fs.exists(path):
        fs.rm(path, recursive=True)

