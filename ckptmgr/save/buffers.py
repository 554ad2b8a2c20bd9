"""Host buffers for staging slots: mapped, populated, then pinned in pieces.

A buffer holds one file image. It is a tmpfs file of the local tier (opened by the tier with
O_NOFOLLOW, mapped MAP_SHARED) or anonymous memory, and with CUDA it is pinned in place with
cudaHostRegister. It is made in three steps, none of which may stall the training thread:

1. **map** the file or the anonymous memory (no CUDA);
2. **populate** every page (``madvise(MADV_POPULATE_WRITE)`` in pieces of
   :data:`POPULATE_PIECE_BYTES`, or one write per page where the kernel lacks it): the
   kernel's page-fault work happens here, on this thread, with no CUDA lock held;
3. **pin** the populated pages in pieces of :data:`PIN_PIECE_BYTES`, pausing
   :data:`PIN_PAUSE_S` between pieces (a spare slot, made while training runs for a later
   save: :data:`SPARE_DUTY` times each piece's registration, and populated by fewer threads).

Why, measured on an H200 with a 52 ms training step running on the main thread while another
thread pinned a 4 GiB /dev/shm mapping: cudaHostRegister holds the CUDA driver for its whole
duration, and the training thread's kernel launches queue behind it. Fresh pages (faulted in
by the registration itself) took 1.1-1.4 s and stalled one step for all of it, whether in one
call or in back-to-back 64-256 MiB calls (the driver lock is not fair to the waiting thread).
Populated pages register at ~0.04 s per GiB (0.15-0.19 s for 4 GiB, one step of 0.2 s when
done in one call). So populate first, then pin populated pages in 64 MiB pieces (~3 ms
each) with a pause between them, and the training thread waits at most one piece.

Populating holds the process's memory-map lock for reading for the whole of one madvise
call. A thread that maps or unmaps memory meanwhile (another buffer being made, the CUDA
driver, malloc) waits for the lock as a writer, and every page fault of every other thread,
the training thread's included, queues behind that writer. Measured on an H200 with the
every-25-steps loop of bench_training.py (three slots of 4.83 GB, eight files each, made
eight files at a time while the loop ran): one call per file left the GPU idle for 0.19-1.14 s
at a time in four runs of five, +1.0 to +12.5% on the step time over 200 steps; one call per
16 MiB left no stall, +1.04 to +1.10%, as with every slot made before the loop (+0.93 to
+0.95%).

A copy that spans two separately registered ranges fails (``cudaErrorInvalidValue``), so
pieces are aligned to the file's checksum chunks (every piece is a whole number of chunks
from the image's start), and every copy into or out of a buffer stays inside one chunk or
is split at :meth:`HostBuffer.piece` boundaries (see :mod:`ckptmgr.save.staging`).

:data:`PIN_MODE` is the one switch between the strategies (benchmarks/bench_pinning.py
measures each): ``"pieces"`` (the default, above), ``"populate"`` (populate, then one call),
``"whole"`` (one call on fresh pages: what ckptmgr did before; it stalls training).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .. import _cuda
from .._threads import DaemonPool

__all__ = ["PIN_MODE", "PIN_PAUSE_S", "PIN_PIECE_BYTES", "POPULATE_PIECE_BYTES", "POPULATE_THREADS", "SPARE_DUTY",
           "HostBuffer", "PopulateAhead", "anonymous_buffer", "file_buffer", "piece_bytes"]

log = logging.getLogger("ckptmgr")

PIN_MODE = "pieces"  # "pieces" | "populate" | "whole": see the module docstring
PIN_PIECE_BYTES = 64 << 20  # target size of one cudaHostRegister call (rounded to whole chunks)
PIN_PAUSE_S = 0.002  # between two pieces: the training thread's CUDA calls get through here
SPARE_DUTY = 4.0  # a spare slot's pieces: the pause after each is this many times its registration
POPULATE_PIECE_BYTES = 16 << 20  # one madvise(MADV_POPULATE_WRITE) call: see the module docstring
POPULATE_THREADS = 4  # PopulateAhead: threads faulting pages in at once
POPULATE_WAIT_S = 600.0  # at most this long, a piece's registration waits for its pages to be faulted in

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_PAGE = mmap.PAGESIZE
_libc: Any = None


class Flag(Protocol):
    """What :meth:`HostBuffer.pin` asks of its ``hurry`` flag (a :class:`threading.Event`, or several)."""

    def is_set(self) -> bool: ...


def _pause(seconds: float, hurry: Flag | None) -> None:
    """Sleep ``seconds``, or less once ``hurry`` is set (an event: woken at once)."""
    wait = getattr(hurry, "wait", None)
    if seconds > PIN_PAUSE_S and callable(wait):
        wait(seconds)
    else:
        time.sleep(seconds)


def piece_bytes(chunk_size: int) -> int:
    """The pinning piece for images checksummed in ``chunk_size`` chunks: a whole number of
    chunks, about :data:`PIN_PIECE_BYTES`."""
    return chunk_size * max(1, PIN_PIECE_BYTES // chunk_size)


@dataclass
class HostBuffer:
    """One file image in host memory. Owned by its slot (see :mod:`ckptmgr.save.slots`)."""

    tensor: torch.Tensor  # uint8, exactly ``nbytes`` long, page-aligned
    nbytes: int
    mapping: mmap.mmap  # kept alive by the tensor too; never closed by hand (unmapped by GC)
    path: str | None = None  # the tmpfs file, for the local tier
    piece: int = 0  # registered in pieces of this many bytes from the start (0: not pinned)
    registered: list[int] = field(default_factory=list)  # every pointer passed to cudaHostRegister
    populated: bool = False
    identity: tuple[int, int] | None = None  # the mapped file's (device, inode), for a file's image

    @property
    def pinned(self) -> bool:
        return bool(self.registered) and sum(self._sizes()) == self.nbytes

    def _sizes(self) -> list[int]:
        return [min(self.piece, self.nbytes - i * self.piece) for i in range(len(self.registered))]

    def populate(self) -> None:
        """Fault every page in, writable, without CUDA (when it will be pinned: pinning fresh
        pages is what stalls). Idempotent."""
        if self.populated or not _cuda.available() or PIN_MODE == "whole":
            return
        _populate(self.tensor.data_ptr(), self.nbytes, self.tensor)
        self.populated = True

    def pin(self, chunk_size: int, *, hurry: Flag | None = None, stop: threading.Event | None = None,
            on_piece: Callable[[int], None] | None = None, on_undo: Callable[[], None] | None = None,
            ahead: PopulateAhead | None = None, duty: float = 0.0) -> bool:
        """Pin the buffer with CUDA (nothing without CUDA), as :data:`PIN_MODE` says.

        ``hurry`` set: skip the pauses (the training thread itself waits for this buffer).
        ``stop`` set: give up between two pieces (returns False; :meth:`unpin` undoes it).
        ``on_piece(n)``: told after each registration that the first ``n`` bytes are pinned
        (so that they can be copied from before the rest is); ``on_undo()``: told before the
        pieces of a failed pin are undone (it returns once nothing copies from them).
        ``ahead``: the buffer's pages are being faulted in there; each piece waits for its own
        (instead of the whole buffer populated first, on this thread). ``duty``: unless
        hurried, the pause after a piece is at least this many times what its registration
        took (a spare slot, not needed before a later save: the driver is held at most
        ``1 / (1 + duty)`` of the time).

        Raises:
            RuntimeError: a registration failed (the pieces registered before are undone).
        """
        if not _cuda.available() or self.registered:
            return True
        try:
            return self._pin(chunk_size, hurry, stop, on_piece, ahead, duty)
        except BaseException:
            try:
                if on_undo is not None and self.registered:
                    on_undo()
            finally:
                self.unpin()  # all or nothing: a copy may not span registered and unregistered pages
            raise

    def _pin(self, chunk_size: int, hurry: Flag | None, stop: threading.Event | None,
             on_piece: Callable[[int], None] | None, ahead: PopulateAhead | None, duty: float = 0.0) -> bool:
        mode = PIN_MODE
        if mode != "whole" and ahead is None:
            self.populate()
        if mode in ("whole", "populate"):
            if ahead is not None:
                ahead.wait(self, self.nbytes)
            self.piece = self.nbytes
            self._register(0, self.nbytes)
            if on_piece is not None:
                on_piece(self.nbytes)
            return True
        self.piece = piece_bytes(chunk_size)
        took = 0.0  # the last piece's registration
        for begin in range(0, self.nbytes, self.piece):
            if stop is not None and stop.is_set():
                return False
            if begin and PIN_PAUSE_S > 0 and not (hurry is not None and hurry.is_set()):
                # let the training thread's queued CUDA calls through
                _pause(max(PIN_PAUSE_S, duty * took), hurry)
            end = min(begin + self.piece, self.nbytes)
            if ahead is not None:
                ahead.wait(self, end)
            t0 = time.perf_counter()
            self._register(begin, end - begin)
            took = time.perf_counter() - t0
            if on_piece is not None:
                on_piece(end)
        return True

    def _register(self, begin: int, n: int) -> None:
        ptr = self.tensor.data_ptr() + begin
        _cuda.host_register(ptr, n)  # releases the GIL
        self.registered.append(ptr)

    def unpin(self) -> None:
        """Undo every registration, at the exact pointers registered, before the memory goes."""
        while self.registered:
            _cuda.host_unregister(self.registered.pop())

    def boundaries(self) -> int:
        """The distance between two registration boundaries (0: no boundary to respect)."""
        return self.piece if len(self.registered) > 1 else 0

    def drop(self) -> None:
        """Unpin, and remove the tmpfs file if there is one. The memory goes with the last
        tensor that views it."""
        try:
            self.unpin()
        finally:
            if self.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                self.path = None


def anonymous_buffer(nbytes: int) -> HostBuffer:
    """Fresh anonymous memory of ``nbytes`` (page-aligned, private: never a file's copy-on-write
    pages)."""
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return HostBuffer(torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else
                      torch.empty(0, dtype=torch.uint8), nbytes, mm)


def file_buffer(fd: int, nbytes: int, path: str) -> HostBuffer:
    """Map ``nbytes`` of the open tmpfs file ``fd`` (the caller closes ``fd``) MAP_SHARED."""
    st = os.fstat(fd)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return HostBuffer(torch.frombuffer(mm, dtype=torch.uint8, count=nbytes), nbytes, mm, path=path,
                      identity=(st.st_dev, st.st_ino))


def _populate(ptr: int, nbytes: int, tensor: torch.Tensor) -> None:
    global _libc
    if nbytes <= 0:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    begin, end = ptr - ptr % _PAGE, ptr + nbytes
    for at in range(begin, end, POPULATE_PIECE_BYTES):  # (ctypes releases the GIL for each call)
        n = min(POPULATE_PIECE_BYTES, end - at)
        if _libc.madvise(ctypes.c_void_p(at), ctypes.c_size_t(n), _MADV_POPULATE_WRITE) != 0:
            break
    else:
        return
    # Older kernels: one write per page, keeping its value (torch releases the GIL).
    pages = tensor[(-ptr) % _PAGE::_PAGE]
    pages.copy_(pages.clone())


class PopulateAhead:
    """:meth:`HostBuffer.populate` of several buffers, in spans of a few populate pieces on up
    to ``threads`` threads at once (None: :data:`POPULATE_THREADS`; one thread faults in ~0.1-0.3 s
    per GiB), in buffer and
    file order, so that the thread that pins them can register each piece as soon as its own
    pages are in (:meth:`wait`) rather than after all of them. ``stop`` set: the spans not
    begun are skipped and the buffers stay unpopulated (pinning populates them). ``pause``:
    called before each span, which starts once it returns (the adoption's: while a restore
    holds it, see :meth:`~ckptmgr.storage.tier_pinning.Pinning.unheld`).

    Made and used by one thread (the one that pins); :meth:`close` ends it: the spans not
    begun are cancelled, those running waited for, and the buffers fully populated marked so.
    """

    def __init__(self, buffers: list[HostBuffer], *, stop: threading.Event | None = None,
                 threads: int | None = None, pause: Callable[[], None] | None = None) -> None:
        todo = [b for b in buffers if not b.populated and b.nbytes > 0]
        if not _cuda.available() or PIN_MODE == "whole":
            todo = []
        span = POPULATE_PIECE_BYTES * 8
        spans = [(b, at, min(span, b.nbytes - at)) for b in todo for at in range(0, b.nbytes, span)]
        self._stop = stop
        self._pause = pause  # called before each span: returns once the spans may go on (bounded)
        self._todo = todo
        self._spans: dict[int, list[tuple[int, Future[None]]]] = {id(b): [] for b in todo}  # buffer -> (begin, task)
        threads = POPULATE_THREADS if threads is None else threads
        self._pool = DaemonPool(max(1, min(threads, len(spans))), thread_name_prefix="ckptmgr-populate") \
            if spans else None
        try:
            for b, at, n in spans:
                assert self._pool is not None
                self._spans[id(b)].append((at, self._pool.submit(self._run, b, at, n)))
        except BaseException:
            self.close()
            raise

    def _run(self, b: HostBuffer, at: int, n: int) -> None:
        def stopped() -> bool:
            return self._stop is not None and self._stop.is_set()

        if self._pause is not None and not stopped():
            self._pause()
        if not stopped():
            _populate(b.tensor.data_ptr() + at, n, b.tensor[at:at + n])

    def wait(self, buf: HostBuffer, end: int) -> None:
        """Return once the pages of ``buf``'s first ``end`` bytes have been faulted in (or
        skipped after ``stop``).

        Raises:
            OSError: faulting them in failed.
            TimeoutError: they were not in after :data:`POPULATE_WAIT_S`.
        """
        for at, fut in self._spans.get(id(buf), []):
            if at >= end:
                break
            fut.result(timeout=POPULATE_WAIT_S)

    def close(self) -> None:
        """Cancel the spans not begun, wait for those running; mark the buffers whose every
        span ran populated."""
        futures = [f for spans in self._spans.values() for _, f in spans]
        for f in futures:
            f.cancel()
        if self._pool is not None:
            self._pool.stop(cancel=True, timeout=POPULATE_WAIT_S)
        for b in self._todo:
            done = all(f.done() and not f.cancelled() and f.exception() is None for _, f in self._spans[id(b)])
            if done and (self._stop is None or not self._stop.is_set()):
                b.populated = True

    def __enter__(self) -> PopulateAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
