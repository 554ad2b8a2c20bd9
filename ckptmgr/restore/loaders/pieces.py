"""Pinning a mapped file in pieces, and copying out of the pinned pieces.

A :class:`~ckptmgr.restore.pinned.PinnedWeights` handle pins a file of a RAM filesystem
(/dev/shm, any tmpfs or ramfs) where it lies, once, and copies from it at link speed at every
load. The file goes in pieces of :data:`PIECE_BYTES` (from the start of the mapping,
page-aligned):

1. **populate**: worker threads fault each piece's pages into this process's page tables
   (``madvise(MADV_POPULATE_READ)``; one read per page on kernels without it), in file
   order, ahead of the thread that registers: the page-table work leaves the serial path;
2. **register**: the calling thread pins each piece (read-only registration, the exact
   range), :func:`pin_pieces`;
3. **copy**: each load queues every piece's copies on stream ``k % COPY_STREAMS`` and
   synchronises them, :func:`copy_in_pieces`;
4. when the handle closes, every piece is unregistered at the exact pointer registered.

No copy spans two pieces (a copy across two separately registered ranges fails with
``cudaErrorInvalidValue``): the landing plan is fed one piece at a time.

A single load of a file does not pin it (registering costs more than the copy it enables):
:mod:`.bounce` reads it through small pinned buffers.

Checksums, where the file carries them, are verified by the caller where the bytes lie, on
threads of their own (:func:`checkers`), while the copies run. The daemon pools are the
process's, made at first use (:func:`shared_pool`).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor

import torch

from ... import _cuda
from ..._threads import DaemonPool
from ..preflight import drain
from .landing import Landing

__all__ = ["COPY_STREAMS", "PIECE_BYTES", "POPULATE", "WAIT_S", "Pins", "checkers", "copy_in_pieces",
           "page_aligned", "piece_ranges", "pin_pieces", "populate", "shared_pool", "workers"]

# One registration and one group of copies. Registering populated pages took ~3 ms per 64 MiB on an
# H200 (save/buffers.py), about twice a 64 MiB copy at the link's speed: the registrations set the
# pace, and small pieces shorten what is not overlapped (the first registration, the last copy).
PIECE_BYTES = 64 << 20
COPY_STREAMS = 4  # the pieces' copies go round-robin on this many streams
POPULATE = True  # fault pages in on the worker threads before they are registered
WAIT_S = 600.0  # the longest a piece's populate may take before the load gives up

_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22  # Linux >= 5.14

_libc: ctypes.CDLL | None = None
_pool_mu = threading.Lock()
_pools: dict[str, DaemonPool] = {}  # made once each, guarded by _pool_mu


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = lib
    return _libc


def workers() -> DaemonPool:
    """The threads that populate pieces ahead of their registration (daemon threads, made at
    first use, shared by the process)."""
    return shared_pool("populate")


def checkers() -> DaemonPool:
    """The threads that verify checksums where the bytes lie for :func:`ckptmgr.load_file`
    and pinned-weights handles: apart from :func:`workers`, so that no populate ever waits
    behind a file's checks."""
    return shared_pool("verify")


def shared_pool(name: str, threads: int = 0) -> DaemonPool:
    """The process's pool ``name`` of daemon threads (made at first use with ``threads``
    threads; 0: as many as CPUs, from 2 to 8)."""
    with _pool_mu:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = DaemonPool(threads or max(2, min(8, os.cpu_count() or 1)),
                                             thread_name_prefix=f"ckptmgr-inplace-{name}")
        return pool


def piece_ranges(size: int, piece: int = 0) -> list[tuple[int, int]]:
    """``[begin, end)`` of each piece of a ``size``-byte mapping (``piece``: the piece size,
    a multiple of the page size; 0: :data:`PIECE_BYTES`)."""
    piece = piece or PIECE_BYTES
    return [(b, min(b + piece, size)) for b in range(0, size, piece)]


def populate(view: torch.Tensor) -> None:
    """Fault every page of ``view`` (uint8, starting on a page boundary of a mapping) into this
    process's page tables for reading, without CUDA."""
    n = view.numel()
    if n == 0:
        return
    if _c().madvise(ctypes.c_void_p(view.data_ptr()), ctypes.c_size_t(n), _MADV_POPULATE_READ) == 0:
        return  # (ctypes releases the GIL for the call)
    view[::_PAGE].clone()  # older kernels: one read per page (torch releases the GIL)


class Pins:
    """The pieces of one mapping registered with CUDA, each by its exact pointer. Owned by one
    thread at a time (the loading thread, or the handle's lock holder)."""

    def __init__(self) -> None:
        self.pointers: list[int] = []

    def register(self, view: torch.Tensor) -> None:
        """Pin ``view`` in place (read-only registration)."""
        ptr = view.data_ptr()
        _cuda.host_register(ptr, view.numel(), read_only=True)  # (releases the GIL)
        self.pointers.append(ptr)

    def release(self) -> None:
        """Unpin every piece, last first, at the pointers registered; call once no copy from
        them is still running."""
        while self.pointers:
            _cuda.host_unregister(self.pointers.pop())


class _Ahead(list):  # type: ignore[type-arg]
    """The populate tasks of one mapping. They reach the mapping through ``box``, which
    :meth:`end` empties once they are drained: a cancelled task still waiting in the pool's
    queue then holds no view of the mapping, which goes with its last view (a failed pin
    leaves nothing mapped)."""

    def __init__(self) -> None:
        super().__init__()
        self.box: list[torch.Tensor] = []

    def end(self) -> None:
        drain(self)
        self.box.clear()


def _populate_piece(box: list[torch.Tensor], b: int, e: int) -> None:
    if box:  # (empty: the load is over, this task was cancelled in the queue)
        populate(box[0][b:e])


def _populate_ahead(data: torch.Tensor, pieces: Sequence[tuple[int, int]], pool: Executor) -> _Ahead:
    ahead = _Ahead()
    if POPULATE:
        ahead.box.append(data)
        ahead.extend(pool.submit(_populate_piece, ahead.box, b, e) for b, e in pieces)
    return ahead


def pin_pieces(data: torch.Tensor, pieces: Sequence[tuple[int, int]], pins: Pins, pool: Executor) -> None:
    """Register every piece of ``data`` (a whole mapping) in ``pins``, each populated first on
    ``pool`` (nothing without CUDA). On failure the pieces registered stay in ``pins`` for the
    caller to release."""
    if not _cuda.available():
        return
    ahead = _populate_ahead(data, pieces, pool)
    try:
        for k, (b, e) in enumerate(pieces):
            if ahead:
                ahead[k].result(timeout=WAIT_S)
            pins.register(data[b:e])
    finally:
        ahead.end()


def copy_in_pieces(data: torch.Tensor, landing: Landing, device: torch.device,
                   pieces: Sequence[tuple[int, int]]) -> None:
    """Copy every byte of ``data`` (a whole mapping, its pieces pinned by :func:`pin_pieces`:
    ``data[b:e]`` are the file's bytes ``[b, e)``) that ``landing`` wants, one piece at a
    time, and wait for the copies. On a GPU the copies run on :data:`COPY_STREAMS` streams,
    ordered after the work already queued on the current stream; every stream is
    synchronised before this returns or raises.
    """
    streams: list[torch.cuda.Stream] = []
    try:
        if device.type == "cuda":
            ready = _cuda.ready_event(device)
            streams = [_cuda.staging_stream(device) for _ in range(max(1, min(COPY_STREAMS, len(pieces))))]
            for s in streams:
                s.wait_event(ready)
        for k, (b, e) in enumerate(pieces):
            with torch.cuda.stream(streams[k % len(streams)]) if streams else contextlib.nullcontext():
                landing.land(b, data[b:e])
    finally:  # the copies end before the pieces may be unpinned or the mapping go
        for s in streams:
            s.synchronize()


def page_aligned(nbytes: int) -> torch.Tensor:
    """Host memory starting on a page boundary (as pinned buffers do), so that direct reads
    can fill it."""
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    return raw[skip:skip + nbytes]
