"""Pinned-ring loader: parallel reads into a small reusable pinned ring, each chunk copied to
the GPU by the thread that read it, its checksum verified before the copy; and the copy of
file images already pinned in this process, verified beside the copies.

For files on disk, NFS or object stores, and one-shot restores from /dev/shm. Each checksum
chunk of every file is one task on the ring's threads: lease a pinned buffer (allocated once
per manager and reused), read the chunk into it, compute its CRC32C, copy it to where it
lands on the buffer's own stream, and wait for the copy before giving the buffer back. With
a dozen buffers the reads, the checksums and the copies all overlap; host memory stays at
the ring's size (12 x 16 MiB) whatever the checkpoint's. Local files not in the page cache
are read another way, as one queue of direct reads in file order
(:mod:`~ckptmgr.restore.transports.direct`), landing
in 32 block slots of 512 KiB in the same buffers, each block copied as it lands and each chunk
verified from its blocks' checksums; since unverified bytes then reach the landing, that
queue serves only landings a failed step leaves unseen (fresh memory, or spare device memory
moved into a target after the whole step verified). Where the bytes land is a
:mod:`~ckptmgr.restore.loaders.landing` plan: one fresh device allocation per file, or the target's
own tensors.

A step whose images are already pinned in this process is copied from there instead
(:mod:`.images`), its chunks verified by the ring's threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from ... import _cuda
from ...errors import CheckpointCorruptError, CkptTimeoutError
from ...format.checksum import chunk_ranges
from ...format.layout import ST_TO_DTYPE
from ...format.manifest import FileRecord, Manifest
from ...storage.aio import AioContext, open_context
from ...storage.posix import DIRECT_ALIGN, DirectFile
from ..preflight import Source
from ..read import Chunk, ReadPlan, run
from ..transports.direct import DEPTH, Copy, Span, landing_buffers, read_window
from ..transports.pread import Fetch, RingTransport
from .host import _build_views
from .landing import Entry, Landing, plan_landing
from .pieces import page_aligned

__all__ = ["NoDeviceRoom", "PinnedRing", "entries_by_file", "finish_landings", "plan_landings", "read_tensors_ring"]

_LEASE_TIMEOUT = 600.0  # seconds; only a caller outside the ring's threads could ever wait
VERIFIERS = 2  # threads that checksum and copy the blocks of direct reads (one keeps up with the disk)


class NoDeviceRoom(Exception):
    """Landing through spare device memory was asked for and the device has no room for the
    step; raised before anything is read (the caller verifies first instead)."""


class PinnedRing:
    """``threads`` host buffers of ``slot_bytes`` each (pinned with CUDA, plain without), a
    copy stream per buffer, the reader threads, and the threads that checksum and copy the
    blocks of direct reads (:mod:`~ckptmgr.restore.transports.direct`), made at first use and
    shared by every restore of one manager.

    Restores may run at once (several threads of the caller): a buffer is *leased* by one
    task at a time (:meth:`lease`), or by one step's queue of direct reads (:meth:`lease_many`),
    under the ring's lock, from the read into it until its copy has finished, so no two
    restores ever fill or copy from the same buffer. A reader thread waits for a lease only
    while others hold every buffer: running tasks, or a queue whose blocks finish on the
    verifier threads, which never wait for a lease.
    """

    def __init__(self, threads: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.slots = threads
        self.threads = threads
        self._mu = threading.Lock()
        self._returned = threading.Condition(self._mu)  # notified when a leased buffer comes back
        # Guarded by _mu: the streams and pool (made once), and which buffers are free.
        # _buffers[i] is made, and only ever touched, by the holder of lease i (see buffer()).
        self._buffers: list[torch.Tensor | None] = [None] * self.slots
        self._streams: dict[torch.device, list[Any]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._verifiers: ThreadPoolExecutor | None = None
        self._free: list[int] = list(range(self.slots))

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._mu:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckptmgr-restore")
            return self._pool

    @property
    def verifiers(self) -> ThreadPoolExecutor:
        """:data:`VERIFIERS` threads that checksum and copy the blocks a queue of direct reads
        brought in."""
        with self._mu:
            if self._verifiers is None:
                self._verifiers = ThreadPoolExecutor(VERIFIERS, thread_name_prefix="ckptmgr-verify")
            return self._verifiers

    def close(self) -> None:
        with self._mu:
            pools, self._pool, self._verifiers = (self._pool, self._verifiers), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)
        with self._mu:
            self._buffers = [None] * self.slots
            self._streams = {}

    def buffer(self, index: int) -> torch.Tensor:
        """The host buffer of lease ``index``; only its holder calls this. Made at its first
        use, so that in a fresh process the buffers are pinned by the reader threads at once,
        each while the others already read (pinning 18 x 16 MiB in a row took 0.10 s on an
        H200, half the time of a 4 GiB restore from /dev/shm)."""
        buf = self._buffers[index]
        if buf is None:
            make = _cuda.pinned_empty if _cuda.available() else page_aligned
            buf = self._buffers[index] = make(self.slot_bytes)
        return buf

    def streams(self, device: torch.device) -> list[Any]:
        """One copy stream per buffer on ``device`` (created on the caller's thread)."""
        with self._mu:
            if device not in self._streams:
                self._streams[device] = [_cuda.staging_stream(device) for _ in range(self.slots)]
            return self._streams[device]

    @contextlib.contextmanager
    def lease_many(self, count: int, timeout: float = _LEASE_TIMEOUT) -> Iterator[list[int]]:
        """Hold ``count`` buffers (at most all of them) for the caller alone, taken all at
        once so that two callers never each wait for what the other holds; yields their
        indices. The caller's threads share them and make each at most once at a time.

        Raises:
            CkptTimeoutError: too few buffers came back within ``timeout``.
        """
        count = min(count, self.slots)
        with self._mu:
            if not self._returned.wait_for(lambda: len(self._free) >= count, timeout):
                raise CkptTimeoutError(f"no {count} restore buffers came back within {timeout} s")
            held = [self._free.pop() for _ in range(count)]
        try:
            yield held
        finally:
            with self._mu:
                self._free.extend(held)
                self._returned.notify_all()

    @contextlib.contextmanager
    def lease(self, timeout: float = _LEASE_TIMEOUT) -> Iterator[int]:
        """Hold one buffer (and its stream) for the caller alone; yields its index. Waits at
        most ``timeout`` seconds for one to come back.

        Raises:
            CkptTimeoutError: no buffer came back within ``timeout``.
        """
        with self._mu:
            if not self._returned.wait_for(lambda: bool(self._free), timeout):
                raise CkptTimeoutError(f"no restore buffer came back within {timeout} s")
            index = self._free.pop()
        try:
            yield index
        finally:
            with self._mu:
                self._free.append(index)
                self._returned.notify_all()


def entries_by_file(manifest: Manifest, where: str) -> dict[str, list[Entry]]:
    """The stored tensors of each data file of the (validated) manifest, in one pass over its
    tensors (a step of 10,000 tensors in 8 files is 10,000 steps, not 80,000)."""
    out: dict[str, list[Entry]] = {fname: [] for fname in manifest.files}
    for name, e in manifest.tensors.items():
        entries = out.get(e.get("file"))  # type: ignore[arg-type]
        if entries is None:
            continue
        dtype = ST_TO_DTYPE.get(e["dtype"])
        if dtype is None:
            raise CheckpointCorruptError(f"{where}: tensor {name!r} has unknown dtype {e['dtype']!r}")
        b, en = e["offsets"]
        entries.append(Entry(name, dtype, tuple(map(int, e["shape"])), int(b), int(en)))
    return out




class _Chunk(NamedTuple):
    fname: str
    rec: FileRecord
    landing: Landing
    fetch: Fetch
    number: int  # of the checksum chunk in its file
    begin: int
    end: int


def _pipeline(chunks: list[_Chunk], device: torch.device, ring: PinnedRing, where: str) -> None:
    """The chunks as one plan, run by the read driver through the ring
    (:class:`~ckptmgr.restore.transports.pread.RingTransport`): each verified, then copied to
    its landing on the leased buffer's own stream. The first failure (in file order) cancels
    what has not started and is raised once every started task has given its buffer back.
    """
    plan = ReadPlan(where, tuple(Chunk(c.fname, c.number, c.begin, c.end, c.rec.crc32c[c.number], c.landing)
                                 for c in chunks))
    run(plan, RingTransport(ring, {c.fname: c.fetch for c in chunks}, device))


def _copier(chunks: list[_Chunk], device: torch.device, ring: PinnedRing) -> Copy:
    """``copy(blocks, key)``: copy each (chunk index, file offset, bytes) of a queue of direct
    reads to its landing, on stream ``key`` (modulo the ring's), and wait for the copies. Made
    on the caller's thread: the copies come after the work already queued on what they write."""
    streams = ring.streams(device) if device.type == "cuda" else None
    if streams is None:
        def copy_here(blocks: list[tuple[int, int, torch.Tensor]], key: int) -> None:
            for ci, begin, src in blocks:
                chunks[ci].landing.land(begin, src)
        return copy_here
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record(torch.cuda.current_stream(device))

    def copy(blocks: list[tuple[int, int, torch.Tensor]], key: int) -> None:
        # (a stream another restore also copies on only orders the two: each waits for its own copies)
        stream = streams[key % len(streams)]
        stream.wait_event(ready)
        try:
            with torch.cuda.stream(stream):
                for ci, begin, src in blocks:
                    chunks[ci].landing.land(begin, src)
        finally:  # a copy that failed midway: what was queued ends before the slots are freed
            stream.synchronize()
    return copy


def _windowed(chunks: list[_Chunk], cold: Cold, device: torch.device, ring: PinnedRing, where: str) -> None:
    """The chunks of cold local files: read as one queue of direct reads
    (:class:`~ckptmgr.restore.transports.direct.DirectTransport`)."""
    copy = _copier(chunks, device, ring)
    with ring.lease_many(landing_buffers(ring.slot_bytes)) as held:
        read_window([Span(c.fname, c.begin, c.end, c.rec.crc32c[c.number]) for c in chunks], cold.files, held,
                    ring.buffer, copy, ring.verifiers.submit, cold.aio, where)


def plan_landings(manifest: Manifest, device: torch.device, where: str, dests: dict[str, torch.Tensor] | None,
              through_device: bool, entries: dict[str, list[Entry]] | None) -> dict[str, Landing]:
    """A landing plan for every file of the step (see :mod:`.landing`); ``entries``: the
    step's :func:`entries_by_file`, where the caller has them."""
    if entries is None:
        entries = entries_by_file(manifest, where)
    try:
        return {fname: plan_landing(entries[fname], rec.header_size, rec.size - rec.header_size, device, dests,
                                    through_device=through_device)
                for fname, rec in manifest.files.items()}
    except torch.OutOfMemoryError:
        if not through_device:
            raise
        raise NoDeviceRoom(f"{where}: no room on {device} to land the step before it moves into the target") from None


def finish_landings(manifest: Manifest, device: torch.device, landings: dict[str, Landing], where: str,
            through_device: bool) -> dict[str, torch.Tensor]:
    """Every chunk has landed and verified: move what landed in spare memory into the target
    (only now does the target change) and build the step's tensors."""
    if through_device:
        for landing in landings.values():
            landing.commit()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    out: dict[str, torch.Tensor] = {}
    for landing in landings.values():
        out.update(landing.tensors())
    _build_views(manifest, out, where)
    return out


def _read_all(manifest: Manifest, device: torch.device, ring: PinnedRing, where: str,
              dests: dict[str, torch.Tensor] | None, fetch_for: Callable[[str, FileRecord], Fetch],
              through_device: bool = False, cold: Cold | None = None,
              entries: dict[str, list[Entry]] | None = None) -> dict[str, torch.Tensor]:
    fetches = {fname: fetch_for(fname, rec) for fname, rec in manifest.files.items()}  # checked before allocating
    landings = plan_landings(manifest, device, where, dests, through_device, entries)
    chunks = [_Chunk(fname, rec, landings[fname], fetches[fname], i, b, e)
              for fname, rec in manifest.files.items()
              for i, (b, e) in enumerate(chunk_ranges(rec.size, rec.chunk_size))]
    if cold is not None:
        _windowed([c for c in chunks if c.fname in cold.files], cold, device, ring, where)
    _pipeline([c for c in chunks if cold is None or c.fname not in cold.files], device, ring, where)
    return finish_landings(manifest, device, landings, where, through_device)


def read_tensors_ring(source: Source, step: int, manifest: Manifest, device: torch.device,
                      ring: PinnedRing, dests: dict[str, torch.Tensor] | None = None, *,
                      through_device: bool = False,
                      entries: dict[str, list[Entry]] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of committed ``step`` on ``device`` (or in the matching tensors of
    ``dests``), read through ``ring``. The files have passed the preflight checks. With
    ``through_device``, what goes to ``dests`` lands in spare device memory and moves into
    them once the whole step has verified (see :mod:`.landing`). ``entries``: the step's
    :func:`entries_by_file`, where the caller has them already.

    Raises:
        CheckpointCorruptError: a chunk fails its checksum (``dests`` untouched with
            ``through_device``).
        NoDeviceRoom: ``through_device`` and the step does not fit on the device.
    """
    where = f"{source.url}: step {step}"
    read_chunk = getattr(source, "read_chunk", None)

    def fetch_for(fname: str, rec: FileRecord) -> Fetch:
        if rec.chunk_size > ring.slot_bytes:
            raise CheckpointCorruptError(f"{where}: {fname} has chunks of {rec.chunk_size} bytes, "
                                         f"more than the ring's {ring.slot_bytes}")

        def fetch(slot: int, b: int, e: int) -> torch.Tensor:
            whole = ring.buffer(slot)
            buf = whole[:e - b]
            if read_chunk is not None:  # a cold file is read with O_DIRECT into the pinned buffer
                read_chunk(step, fname, b, whole.numpy(), e - b)
            else:
                source.read_into(step, fname, b, [buf.numpy()])
            return buf
        return fetch

    with contextlib.ExitStack() as opened:  # (the queue lands blocks before their chunk verifies: see _windowed)
        cold = _open_cold(source, step, manifest, opened) if dests is None or through_device else None
        return _read_all(manifest, device, ring, where, dests, fetch_for, through_device, cold, entries)


class Cold(NamedTuple):
    files: dict[str, DirectFile]  # the data files to read as a queue of direct reads
    aio: AioContext  # what keeps the reads in flight (closed by the queue, or by the restore's exit)


def _open_cold(source: Source, step: int, manifest: Manifest, opened: contextlib.ExitStack) -> Cold | None:
    """The data files of ``step`` that ``source`` opens for direct reads (local files not in the
    page cache, with chunks whole pages long), each closed by ``opened``, and a kernel AIO
    context for them; ``None`` where there are none, or no context to be had."""
    open_direct = getattr(source, "open_direct", None)
    if open_direct is None:
        return None
    files: dict[str, DirectFile] = {}
    for fname, rec in manifest.files.items():
        if rec.chunk_size % DIRECT_ALIGN:
            continue
        f = open_direct(step, fname)
        if f is not None:
            opened.callback(f.close)
            files[fname] = f
    aio = open_context(DEPTH) if files else None
    if aio is None:
        return None
    opened.callback(aio.close)  # also where the queue never starts (closed first: the files after it)
    return Cold(files, aio)
