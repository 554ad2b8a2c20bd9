"""Pinned-ring loader: parallel reads into a small reusable pinned ring, each chunk copied to
the GPU as soon as it lands, its checksum verified beside the copy.

For files on disk, NFS or object stores, where mapping in place would fault every page in one
thread. Each checksum chunk of a file is read by one task into a ring buffer (pinned memory,
allocated once per manager and reused) and its CRC32C computed there; the caller's thread
enqueues the chunk's host-to-device copies on a side stream in file order, so reads and
copies overlap. A ring buffer is reused only once its copy has finished. Host memory stays
at the ring's size whatever the checkpoint's. Where the bytes land is a
:mod:`~ckptmgr.loaders.landing` plan: one fresh device allocation per file, or the target's
own tensors.

The same machinery serves a step whose images are already pinned in this process (the
staging slot): the chunks are then verified where they lie and copied straight from there.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from .. import _cuda
from .._checksum import chunk_ranges, crc32c_hex
from .._layout import ST_TO_DTYPE
from .._manifest import FileRecord, Manifest
from ..errors import CheckpointCorruptError
from .host import Source, _build_views, check_file_size
from .landing import Entry, Landing, plan_landing

__all__ = ["PinnedRing", "file_entries", "read_tensors_pinned", "read_tensors_ring"]


class PinnedRing:
    """``threads + 2`` host buffers of ``slot_bytes`` each (pinned with CUDA, plain without)
    and ``threads`` reader threads, made at first use and reused by every restore."""

    def __init__(self, threads: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.slots = threads + 2  # every reader busy while two chunks wait for their copies
        self.threads = threads
        self._buffers: list[torch.Tensor] = []
        self._pool: ThreadPoolExecutor | None = None
        self._mu = threading.Lock()

    @property
    def pool(self) -> ThreadPoolExecutor:
        with self._mu:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckptmgr-restore")
            return self._pool

    def close(self) -> None:
        with self._mu:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._buffers = []

    def buffers(self) -> list[torch.Tensor]:
        with self._mu:
            if not self._buffers:
                make = _cuda.pinned_empty if _cuda.available() else (
                    lambda n: torch.empty(n, dtype=torch.uint8))
                self._buffers = [make(self.slot_bytes) for _ in range(self.slots)]
            return self._buffers


def file_entries(manifest: Manifest, fname: str, where: str) -> list[Entry]:
    """The stored tensors of data file ``fname`` as the manifest describes them."""
    out = []
    for name, e in manifest.tensors.items():
        if e.get("file") != fname:
            continue
        dtype = ST_TO_DTYPE.get(e["dtype"])
        if dtype is None:
            raise CheckpointCorruptError(f"{where}: tensor {name!r} has unknown dtype {e['dtype']!r}")
        b, en = (int(x) for x in e["offsets"])
        out.append(Entry(name, dtype, tuple(int(s) for s in e["shape"]), b, en))
    return out


# fetch(buffer index, begin, end) -> (the bytes [begin, end) of the file in host memory, their CRC32C)
Fetch = Callable[[int, int, int], tuple[torch.Tensor, str]]


class _Chunk(NamedTuple):
    fname: str
    rec: FileRecord
    landing: Landing
    fetch: Fetch
    number: int  # of the checksum chunk in its file
    begin: int
    end: int


def _pipeline(chunks: list[_Chunk], stream: Any, ring: PinnedRing, where: str) -> None:
    """Fetch the chunks (of every file, one continuous stream) on the ring's threads, every
    reader busy; verify each and land it in order on ``stream``. A buffer is reused only
    once its copy has finished, and a few copies stay queued, so neither the readers nor the
    copy engine wait for this thread."""
    free: deque[int] = deque(range(ring.slots))
    copying: deque[tuple[int, Any]] = deque()  # (buffer, its copy's end), in the stream's order
    pending: deque[tuple[_Chunk, int, Future[tuple[torch.Tensor, str]]]] = deque()

    def land() -> None:
        c, slot, fut = pending.popleft()
        src, crc = fut.result()
        if crc != c.rec.crc32c[c.number]:
            raise CheckpointCorruptError(f"{where}: {c.fname}: checksum mismatch in bytes [{c.begin}, {c.end})")
        if stream is None:
            c.landing.land(c.begin, src)
            free.append(slot)
            return
        with torch.cuda.stream(stream):
            c.landing.land(c.begin, src)
        copying.append((slot, _cuda.CopyDone([stream])))

    try:
        for c in chunks:
            if len(pending) >= ring.threads:  # every reader busy: land the oldest
                land()
            if not free:  # reuse the buffer whose copy was queued first
                slot, done = copying.popleft()
                done.synchronize()
                free.append(slot)
            slot = free.popleft()
            pending.append((c, slot, ring.pool.submit(c.fetch, slot, c.begin, c.end)))
        while pending:
            land()
    finally:
        for *_, fut in pending:
            fut.cancel()
        for *_, fut in pending:
            if not fut.cancelled():
                fut.exception()  # fetches finish before their buffers can be reused
        if stream is not None:
            stream.synchronize()


def _read_all(manifest: Manifest, device: torch.device, ring: PinnedRing, where: str,
              dests: dict[str, torch.Tensor] | None, fetch_for: Callable[[str, FileRecord], Fetch]
              ) -> dict[str, torch.Tensor]:
    fetches = {fname: fetch_for(fname, rec) for fname, rec in manifest.files.items()}  # checked before allocating
    landings = {fname: plan_landing(file_entries(manifest, fname, where), rec.header_size,
                                    rec.size - rec.header_size, device, dests)
                for fname, rec in manifest.files.items()}
    chunks = [_Chunk(fname, rec, landings[fname], fetches[fname], i, b, e)
              for fname, rec in manifest.files.items()
              for i, (b, e) in enumerate(chunk_ranges(rec.size, rec.chunk_size))]
    _pipeline(chunks, _cuda.staging_stream(device) if device.type == "cuda" else None, ring, where)
    out: dict[str, torch.Tensor] = {}
    for landing in landings.values():
        out.update(landing.tensors())
    _build_views(manifest, out, where)
    return out


def read_tensors_ring(source: Source, step: int, manifest: Manifest, device: torch.device,
                      ring: PinnedRing, dests: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of committed ``step`` on ``device`` (or in the matching tensors of
    ``dests``), read through ``ring``.

    Raises:
        CheckpointCorruptError: a file is missing, has the wrong size, or fails a checksum.
    """
    where = f"{source.url}: step {step}"
    bufs = ring.buffers()

    def fetch_for(fname: str, rec: FileRecord) -> Fetch:
        if rec.chunk_size > ring.slot_bytes:
            raise CheckpointCorruptError(f"{where}: {fname} has chunks of {rec.chunk_size} bytes, "
                                         f"more than the ring's {ring.slot_bytes}")
        check_file_size(source, step, fname, rec.size)

        def fetch(slot: int, b: int, e: int) -> tuple[torch.Tensor, str]:
            buf = bufs[slot][:e - b]
            arr = buf.numpy()
            source.read_into(step, fname, b, [arr])
            return buf, crc32c_hex(arr)
        return fetch

    return _read_all(manifest, device, ring, where, dests, fetch_for)


def read_tensors_pinned(images: dict[str, torch.Tensor], manifest: Manifest, device: torch.device,
                        ring: PinnedRing, where: str, dests: dict[str, torch.Tensor] | None = None
                        ) -> dict[str, torch.Tensor]:
    """Every tensor of a step whose file images are already in pinned host memory (the
    staging slot of this process): copied straight from there, each chunk verified on the
    ring's threads just before its copy.

    Raises:
        CheckpointCorruptError: an image does not match the manifest.
    """
    def fetch_for(fname: str, rec: FileRecord) -> Fetch:
        image = images.get(fname)
        if image is None or image.numel() != rec.size:
            raise CheckpointCorruptError(f"{where}: the staged image of {fname} does not match the manifest")

        def fetch(slot: int, b: int, e: int) -> tuple[torch.Tensor, str]:
            src = image[b:e]
            return src, crc32c_hex(src.numpy())
        return fetch

    return _read_all(manifest, device, ring, where, dests, fetch_for)
