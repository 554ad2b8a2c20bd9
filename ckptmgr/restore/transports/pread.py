"""Threaded reads of whole chunks: into scratch host buffers (:class:`PreadTransport`), or
into the manager's pinned ring, copied from there to the GPU (:class:`RingTransport`).

Each chunk is one task on a thread pool: take a scratch buffer, read the chunk into it with
the source's ``read_into`` (``preadv`` on local files, ranged GETs on object stores), hand it
to the driver's ``land`` (which verifies it and copies it where it goes), and give the buffer
back. Up to ``workers`` buffers of one chunk each, 256 MiB in all at most, whatever the
step's size: the checks of ``ckptmgr verify``, of a restore before it lands in a target,
and the CLI's export all read this way. A destination that takes bytes straight into its
own memory (:meth:`~ckptmgr.restore.read.Dest.into`: the byte ranges of a resharded
restore) is read into without a scratch buffer, adjacent chunks in one request of up to
16 MiB, each chunk then verified where it landed. An object store that reads by ranges is
read by :class:`~.ranged.RangedTransport` (ranges sized and counted by the store's answers).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # (a check lands no tensor: reading for it needs no torch)
    import torch

from ...errors import CkptTimeoutError
from ..preflight import drain, run_all, wait_all
from ..read import Chunk, Land

__all__ = ["REQUEST_BYTES", "SCRATCH_BYTES", "Fetch", "PreadTransport", "Reader", "Ring", "RingTransport"]

REQUEST_BYTES = 16 << 20  # bytes per read request of chunks read straight into their destination
SCRATCH_BYTES = 256 << 20  # host memory one read's scratch buffers may take, whatever the chunk size
_SCRATCH_WAIT = 600.0  # seconds a task waits for a scratch buffer (one chunk read of another task)


class Reader(Protocol):
    """What :class:`PreadTransport` reads from: a :class:`~ckptmgr.restore.preflight.Source`,
    or the files of a GDS read (:mod:`.gds`)."""

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
        """Fill ``out`` (arrays in file order) with the bytes of file ``name`` of ``step`` from
        ``offset``, from any thread; a file that ends first raises
        :class:`~ckptmgr.errors.CheckpointCorruptError`."""
        ...


def _tensor(a: np.ndarray[Any, Any]) -> torch.Tensor:
    import torch

    return torch.from_numpy(a)


class PreadTransport:
    """Reads ``step``'s chunks from ``source`` on ``pool`` (or, without one, on ``workers``
    threads of its own, made for each :meth:`read`), at most ``workers`` chunks at once.
    Serves several reads at once: each has its own scratch buffers."""

    def __init__(self, source: Reader, step: int, *, pool: Executor | None = None, workers: int = 8,
                 scratch_bytes: int = SCRATCH_BYTES, request_bytes: int = REQUEST_BYTES) -> None:
        self.source = source
        self.step = step
        self.pool = pool
        self.workers = max(1, workers)
        self.scratch_bytes = scratch_bytes
        self.request_bytes = request_bytes

    @contextlib.contextmanager
    def _executor(self) -> Iterator[Executor]:
        if self.pool is not None:
            yield self.pool
            return
        with ThreadPoolExecutor(self.workers, thread_name_prefix="ckptmgr-read") as pool:
            yield pool

    def read(self, chunks: Sequence[Chunk], land: Land) -> None:
        """Fetch and land every chunk (see :class:`~ckptmgr.restore.read.Transport`). From an
        object store that reads by ranges (a source with ``read_tuner``), the chunks are read
        by :class:`~.ranged.RangedTransport` instead: ranges cut and counted by its answers."""
        if not chunks:
            return
        if getattr(self.source, "read_tuner", None) is not None:
            from .ranged import RangedTransport

            RangedTransport(self.source, self.step, scratch_bytes=self.scratch_bytes).read(  # type: ignore[arg-type]
                chunks, land)
            return
        direct, scratch = _requests(chunks, self.request_bytes)
        size = max((c.size for c in scratch), default=0)
        free: queue.SimpleQueue[np.ndarray[Any, Any]] = queue.SimpleQueue()
        for _ in range(max(1, min(self.workers, len(scratch), self.scratch_bytes // max(1, size)))) if scratch else ():
            free.put(np.empty(size, dtype=np.uint8))

        stop = threading.Event()  # set at the first failure: no fetch starts after it

        def fetch(group: list[Chunk], pieces: list[list[np.ndarray[Any, Any]]], in_place: bool) -> None:
            """One request for the adjacent ``group``: each chunk's bytes into its ``pieces``
            (its destination's own memory where ``in_place``, else one scratch buffer)."""
            try:
                self.source.read_into(self.step, group[0].file, group[0].begin, [a for p in pieces for a in p])
            except Exception as exc:  # (raised again by land, unless the run lists faults)
                for c in group:
                    land(c, exc)
                return
            for c, p in zip(group, pieces, strict=True):
                # a chunk that goes nowhere (a check) is verified as it is; else it lands as a tensor
                land(c, p if in_place or c.dest is None else _tensor(p[0]))

        def into_scratch(c: Chunk) -> None:
            try:  # waits only for another task's read of one chunk
                buf = free.get(timeout=_SCRATCH_WAIT)
            except queue.Empty:
                raise CkptTimeoutError(f"no read of one chunk finished in {_SCRATCH_WAIT} s") from None
            try:
                fetch([c], [[buf[:c.size]]], False)
            finally:
                free.put(buf)

        def task(group: list[Chunk], out: list[list[np.ndarray[Any, Any]]] | None) -> None:
            if stop.is_set():
                return
            try:
                if out is None:
                    into_scratch(group[0])
                else:
                    fetch(group, out, True)
            except BaseException:
                stop.set()
                raise

        with self._executor() as pool:
            futures: list[Future[None]] = []
            try:
                for group, out in direct:
                    futures.append(pool.submit(task, group, out))
                for c in scratch:
                    futures.append(pool.submit(task, [c], None))
                wait_all(futures)
            except BaseException:  # (an interrupt too) nothing more starts; the started end first
                drain(futures)
                raise


def _requests(chunks: Sequence[Chunk], request_bytes: int
              ) -> tuple[list[tuple[list[Chunk], list[list[np.ndarray[Any, Any]]]]], list[Chunk]]:
    """The read requests of ``chunks``: runs of adjacent chunks of one file whose destination
    takes them straight into its memory (:meth:`~ckptmgr.restore.read.Dest.into`), up to
    ``request_bytes`` each (0: one chunk a request), with each chunk's memory; and the chunks
    read into scratch buffers."""
    direct: list[tuple[list[Chunk], list[list[np.ndarray[Any, Any]]]]] = []
    scratch: list[Chunk] = []
    for c in chunks:
        into = getattr(c.dest, "into", None)
        pieces = into(c.begin, c.end) if into is not None else None
        if pieces is None:
            scratch.append(c)
            continue
        if direct:
            group, memory = direct[-1]
            last = group[-1]
            joins = (last.file, last.end, last.dest) == (c.file, c.begin, c.dest)
            if joins and c.end - group[0].begin <= request_bytes:
                group.append(c)
                memory.append(pieces)
                continue
        direct.append(([c], [pieces]))
    return direct, scratch


# fetch(buffer index, begin, end) -> the bytes [begin, end) of one file, in the ring's buffer
Fetch = Callable[[int, int, int], "torch.Tensor"]


class Ring(Protocol):
    """What :class:`RingTransport` uses of the manager's pinned ring
    (:class:`~ckptmgr.restore.loaders.ring.PinnedRing`)."""

    @property
    def pool(self) -> ThreadPoolExecutor: ...

    def lease(self, timeout: float = ...) -> contextlib.AbstractContextManager[int]: ...

    def streams(self, device: torch.device) -> list[Any]: ...


class RingTransport:
    """Reads through the manager's pinned ring: each chunk (of every file, one continuous
    stream) is one task on the ring's threads: lease a buffer, fetch the chunk into it
    (``fetches[file]``), land it (verified, then copied to where it goes on the buffer's own
    stream, and that copy waited for) before the lease ends. Every thread reads, checks and
    copies on its own, so the copy engine always has a copy queued and no thread waits for
    another. Made on the caller's thread: the copies come after the work already queued on
    what they write."""

    def __init__(self, ring: Ring, fetches: dict[str, Fetch], device: torch.device) -> None:
        self.ring = ring
        self.fetches = fetches
        self.streams = ring.streams(device) if device.type == "cuda" else None
        self.ready: Any = None
        if self.streams is not None:
            import torch

            self.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.ready.record(torch.cuda.current_stream(device))

    def read(self, chunks: Sequence[Chunk], land: Land) -> None:
        """Fetch and land every chunk (see :class:`~ckptmgr.restore.read.Transport`)."""
        import torch

        streams, ring = self.streams, self.ring

        stop = threading.Event()  # set at the first failure: no fetch starts after it

        def task(c: Chunk) -> None:
            if stop.is_set():
                return
            try:
                fetch_and_land(c)
            except BaseException:
                stop.set()
                raise

        def fetch_and_land(c: Chunk) -> None:
            with ring.lease() as slot:
                try:
                    data = self.fetches[c.file](slot, c.begin, c.end)
                except Exception as exc:  # (raised again by land, unless the run lists faults)
                    land(c, exc)
                    return
                if streams is None:
                    land(c, data)
                    return
                # (a stream another restore also copies on only orders the two: each waits for its own copies)
                stream = streams[slot % len(streams)]
                stream.wait_event(self.ready)
                try:
                    with torch.cuda.stream(stream):
                        land(c, data)
                finally:  # a copy that failed midway: what was queued ends before the buffer is freed
                    stream.synchronize()

        run_all(ring.pool, task, [(c,) for c in chunks])
