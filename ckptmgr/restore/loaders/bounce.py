"""Files copied to the GPU through small reusable pinned buffers: the bounce readers.

Used by ``load_file`` and the in-place loader (:func:`copy_through_bounce`: one file, reader
``w`` of ``T`` reading pieces ``w``, ``w + T``, ...) and by a restore of a local-tier slot its
adoption still pins (:func:`start_readers` over the slot's files with a ``take`` that hands out
pieces from the far end, :class:`Ends`; see :mod:`.images`). A cold file on disk is read with
``O_DIRECT`` into the same buffers (:class:`Source` ``direct``).

Pinning a fresh mapping where it lies (cudaHostRegister) runs at 11-17 GB/s on an H100,
slower than the copy it enables (about 50 GB/s): for a single load of a file the
registration sets the pace (``load_file`` took 0.47-0.59 s, median, for 4 GiB that way,
fresh processes on H100s), and it does not scale with threads: the driver serialises it
(4 GiB in 64 MiB pieces, 0.41-0.43 s on 1, 4, 8 or 16 threads, H200,
``benchmarks/results/h200-2026-11-28-loader/call1/``). Here :data:`THREADS` threads each read
the file (``pread``: the kernel copies from the page cache, with no page-table work on a
mapping) into one of their two pinned buffers of :data:`PIECE_BYTES` and copy it to the GPU on
a stream of their own while they read the next piece into the other buffer.

Measured for 4 GiB from /dev/shm in fresh processes (H200, 3 rounds each): 8 threads with
4 MiB buffers 0.144 s (0.134-0.173), 4 threads with 8 MiB 0.215 s, fastsafetensors 0.192 s in
the same call (``benchmarks/results/h200x2-2026-11-28-loader/call1/bounce.json``); as shipped,
``load_file`` 0.170 s (0.145-0.179) against fastsafetensors' 0.175 s (``call2/loadfile.json``).

The buffers are slices of one block of ``THREADS x 2 x PIECE_BYTES`` (64 MiB, a
power of two: PyTorch's pinned allocator rounds each allocation up to one), taken from
PyTorch's pinned host allocator on the calling thread before any reader starts, and kept by it
for later loads in the process. Pinned allocation costs about 0.4 ms per MiB whoever makes it
(``cudaHostAlloc``, or anonymous memory registered in place: ``probes/pinned_alloc.py``,
``call1/alloc.json``), so the block is small, and made once: twelve 8 MiB buffers took 0.035 s, one block of
128 MiB 0.065 s, of 64 MiB 0.024 s. Host memory grows by the block only. Repeated loads of one
file pin it once instead (:class:`~ckptmgr.restore.pinned.PinnedWeights`).

Each piece's bytes go to the file's :class:`~.landing.Landing`: on a GPU its raw spans (the
parts of the piece that tensors want, as addresses, worked out for every piece before the
readers start) are queued through the CUDA runtime library PyTorch loaded
(:class:`ckptmgr._cuda.Runtime`), and the piece is read by address
(:func:`~ckptmgr.storage.posix.pread_address`), each call with the GIL released, so the
readers run little Python between their calls (the loop, and the ``take`` that picks the
next piece); elsewhere, or where the library is not found,
:meth:`~.landing.Landing.land` copies them with ``torch`` (``non_blocking``). A buffer is read
into again only once the copies queued from it have run. Every stream is synchronised before
:func:`copy_through_bounce` returns or raises, so no copy outlives the buffers or the call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, NamedTuple

import torch

from ... import _cuda
from ...storage.posix import DirectFile, pread_address, preadv_fd
from ..preflight import drain
from .landing import Landing
from .pieces import WAIT_S, page_aligned, shared_pool

__all__ = ["PIECE_BYTES", "THREADS", "Ends", "Piece", "Readers", "Source", "buffers", "copy_through_bounce", "readers",
           "runtime_for", "start_readers"]

THREADS = 8  # threads reading the file, each with two buffers and a stream
PIECE_BYTES = 4 << 20  # one read and one group of copies (THREADS x 2 x PIECE_BYTES: a power of two, see above)


def readers() -> Executor:
    """The threads that read files through the bounce buffers (daemon threads, made at first
    use, shared by the process)."""
    return shared_pool("bounce", THREADS)


def runtime_for(landing: Landing, device: torch.device) -> _cuda.Runtime | None:
    """The CUDA runtime the readers queue their copies through for ``landing`` on ``device``
    (:class:`ckptmgr._cuda.Runtime`: no GIL held), or None: they copy with ``torch`` (on the
    CPU, without the runtime library, or where a destination is not plain bytes on ``device``)."""
    if device.type != "cuda" or not landing.plain or any(d.device != device for _, _, d in landing.spans):
        return None
    return _cuda.runtime()


def buffers(threads: int, gpu: bool) -> list[list[torch.Tensor]]:
    """Two buffers of :data:`PIECE_BYTES` for each of ``threads`` readers, all slices of one
    block of ``THREADS x 2 x PIECE_BYTES`` whatever ``threads`` is (a small file's load takes
    the block of the same size as a large one's, so every load reuses the one cached block):
    pinned (from PyTorch's pinned host allocator, which keeps it for the next load once the
    views are dropped) for a GPU, plain page-aligned memory otherwise (direct reads fill both)."""
    total = max(threads, THREADS) * 2 * PIECE_BYTES
    block = _cuda.pinned_empty(total) if gpu else page_aligned(total)
    return [[block[(2 * w + k) * PIECE_BYTES:(2 * w + k + 1) * PIECE_BYTES] for k in range(2)]
            for w in range(threads)]


def _plan(sources: list[Source], pieces: list[Piece]) -> list[list[tuple[int, int, int]]]:
    """Each piece's copies (destination address, offset in the piece, bytes), for landings
    of plain bytes (the runtime path's)."""
    plan = []
    for src, b, e in pieces:
        spans = sources[src].landing.raw(b, e - b)
        if spans is None:  # (runtime_for gives the runtime only to a plain landing)
            raise AssertionError("a landing without raw spans on the runtime path")
        plan.append(spans)
    return plan


def _finish(rt: _cuda.Runtime | None, stream: Any, handle: int, events: list[int], *, quiet: bool) -> None:
    """Wait for a reader's copies and give back its events, every one whatever happens. A
    failure here (a sticky CUDA error) is raised unless ``quiet``: some reader failed first,
    and its error is the one reported."""
    failed: Exception | None = None
    try:
        if rt is not None:
            rt.sync_stream(handle)
        elif stream is not None:
            stream.synchronize()
    except Exception as exc:
        failed = exc
    for ev in events:
        try:
            if rt is not None:
                rt.free_event(ev)
        except Exception as exc:
            failed = failed or exc
    if failed is not None and not quiet:
        raise failed


class Source(NamedTuple):
    """A file the readers read: its descriptor (``path`` names it in errors), where its bytes
    land (file offsets), and ``direct``: the same file open for direct reads, read through
    instead (a cold file on disk; then every piece begins on a multiple of
    :data:`~ckptmgr.storage.posix.DIRECT_ALIGN`)."""

    fd: int
    path: str
    landing: Landing
    direct: DirectFile | None = None


class Piece(NamedTuple):
    """Bytes ``[begin, end)`` (at most :data:`PIECE_BYTES`) of source ``source``."""

    source: int
    begin: int
    end: int


# take(w, k): the index of the piece reader ``w`` reads ``k``-th (k = 0, 1, ...), or None: it is done.
Take = Callable[[int, int], "int | None"]


def copy_through_bounce(fd: int, begin: int, end: int, landing: Landing, device: torch.device, path: str,
                        pool: Executor | None = None, direct: DirectFile | None = None) -> None:
    """Read bytes ``[begin, end)`` of the open file ``fd`` (named ``path`` in errors) and give
    each piece to ``landing`` (file offsets), through pinned buffers, copies on ``device``'s
    side streams ordered after the work already queued on its current stream. Returns once
    every copy has run. ``direct``: the same file open for direct reads (a cold file on
    disk, ``begin`` a multiple of :data:`~ckptmgr.storage.posix.DIRECT_ALIGN`), read through
    it instead. Reader ``w`` of ``T`` reads pieces ``w``, ``w + T``, ... in file order.

    Raises:
        CheckpointCorruptError: the file ended before ``end`` (cut short under the load).
        TimeoutError: a reader still busy after :data:`.pieces.WAIT_S` seconds.
    """
    pieces = [Piece(0, b, min(b + PIECE_BYTES, end)) for b in range(begin, end, PIECE_BYTES)]
    start_readers([Source(fd, path, landing, direct)], pieces, device, pool).wait()


class Readers:
    """Readers started by :func:`start_readers`: :meth:`wait` for them, or :meth:`drain` them,
    before the sources' descriptors, landings or buffers go."""

    def __init__(self, runs: list[Future[None]], stop: threading.Event) -> None:
        self._runs = runs  # (the caller's thread's)
        self._stop = stop

    def drain(self) -> None:
        """Stop the readers and wait for every one started, raising none of their failures
        (see :func:`~ckptmgr.restore.preflight.drain`)."""
        self._stop.set()
        drain(self._runs)

    def wait(self) -> None:
        """Wait for every reader; raise the first failure. Once this returns or raises, no
        reader runs and no copy it queued is pending.

        Raises:
            CheckpointCorruptError: a file ended early.
            TimeoutError: a reader still busy after :data:`.pieces.WAIT_S` seconds.
        """
        try:
            for f in self._runs:
                f.result(timeout=WAIT_S)
        except BaseException:
            self.drain()
            raise


def start_readers(sources: list[Source], pieces: list[Piece], device: torch.device, pool: Executor | None = None,
                  take: Take | None = None) -> Readers:
    """Start the readers on ``pieces`` of ``sources`` (see the module docstring): each piece
    read into a pinned buffer and given to its source's landing, copies on ``device``'s side
    streams ordered after the work already queued on its current stream. ``take``: which
    piece each reader reads next (default: reader ``w`` of ``T`` reads ``w``, ``w + T``, ...);
    a piece is read once whoever asks. Returns at once; :meth:`Readers.wait` ends them."""
    stop = threading.Event()  # set by the first failure: the other readers leave at their next piece
    if not pieces:
        return Readers([], stop)
    threads = max(1, min(THREADS, len(pieces)))
    if take is None:
        def take(w: int, k: int) -> int | None:
            i = w + k * threads
            return i if i < len(pieces) else None
    gpu = device.type == "cuda"
    if gpu:  # ("cuda" alone: the current device, where fresh tensors land)
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    rts = {runtime_for(src.landing, device) for src in sources}
    rt = rts.pop() if len(rts) == 1 else None  # (the runtime path for every source, or none)
    ready = _cuda.ready_event(device) if gpu else None
    streams = [_cuda.staging_stream(device) for _ in range(threads)] if gpu else []  # (made on this thread)
    # (taken here, before any copy runs: see the module docstring)
    held = buffers(threads, gpu)
    # With the runtime: each piece's copies (destination address, offset in the piece, bytes),
    # worked out here once, so the readers run no Python between their calls but the loop's own.
    plan = _plan(sources, pieces) if rt is not None else []

    def read(w: int) -> None:
        stream = streams[w] if gpu else None
        handle = stream.cuda_stream if stream is not None else 0
        bufs = held[w]
        ptrs = [buf.data_ptr() for buf in bufs]
        views = [buf.numpy().data for buf in bufs] if any(src.direct is not None for src in sources) else []
        done: list[Any] = [None, None]  # each buffer's copies queued since it was read into (owned by this thread)
        events: list[int] = []  # with ``rt``: the two buffers' events, each added as it is made (this thread's)
        try:
            if stream is not None:
                stream.wait_event(ready)
            if rt is not None:
                rt.set_device(device.index or 0)  # (a pool thread: its device stays set, as every reader's is)
                for _ in range(2):
                    events.append(rt.new_event())
            k = 0
            while not stop.is_set():
                i = take(w, k)
                if i is None:
                    return
                if type(i) is not int or not 0 <= i < len(pieces) or k >= len(pieces):
                    raise ValueError(f"reader {w} was given piece {i!r} as its piece {k}, of {len(pieces)}")
                src_i, b, e = pieces[i]
                src = sources[src_i]
                slot = k % 2
                k += 1
                if done[slot] is not None:  # the copies from this buffer have run
                    if rt is not None:
                        rt.wait_event(events[slot])
                    else:
                        done[slot].synchronize()
                if src.direct is not None:  # (a whole buffer of room: the read may run past ``e`` to a block's end)
                    src.direct.read(b, views[slot], e - b)
                elif rt is not None:  # (by address, the GIL released: no tensor made per piece)
                    pread_address(src.fd, ptrs[slot], e - b, b, src.path)
                else:
                    preadv_fd(src.fd, b, [bufs[slot][:e - b].numpy()], src.path)
                if rt is not None:
                    for dst, off, n in plan[i]:
                        rt.copy_to_device(dst, ptrs[slot] + off, n, handle)
                    rt.record(events[slot], handle)
                    done[slot] = True
                    continue
                buf = bufs[slot][:e - b]
                if stream is None:
                    src.landing.land(b, buf)
                else:
                    with torch.cuda.stream(stream):
                        src.landing.land(b, buf)
                        done[slot] = _cuda.CopyDone([stream])
        except BaseException:
            stop.set()
            raise
        finally:
            # No copy from the buffers may outlive them: PyTorch's pinned allocator does not know of
            # the copies queued through ``rt``, only this wait keeps the buffers from being reused.
            _finish(rt, stream, handle, events, quiet=stop.is_set())

    runs: list[Future[None]] = []
    try:
        for w in range(threads):  # (appended one by one: a failed submit still drains those started)
            runs.append((pool or readers()).submit(read, w))
    except BaseException:
        stop.set()
        drain(runs)
        raise
    return Readers(runs, stop)


class Ends:
    """Pieces shared out from both ends: the caller takes runs from the front
    (:meth:`front`), readers take single pieces from the back (:meth:`back`, a ``take`` for
    :func:`start_readers`); each piece goes to one side. Guarded by ``_mu`` (held for no
    more than the arithmetic)."""

    def __init__(self, count: int) -> None:
        self._mu = threading.Lock()
        self._lo = 0  # the front's next piece    (_mu)
        self._hi = count  # the back's last piece taken, or ``count``    (_mu)

    def front(self, upto: int) -> range:
        """The next pieces from the front, up to (not including) index ``upto``, that the back
        has not taken; empty when none is left."""
        with self._mu:
            got = range(self._lo, max(self._lo, min(upto, self._hi)))
            self._lo = got.stop
            return got

    def back(self, w: int, k: int) -> int | None:
        """The last piece the front has not taken, or None."""
        with self._mu:
            if self._hi <= self._lo:
                return None
            self._hi -= 1
            return self._hi
