"""Pinned-ring loader: parallel reads into a small reusable pinned ring, each chunk copied to
the GPU by the thread that read it, its checksum verified before the copy.

For files on disk, NFS or object stores, and one-shot restores from /dev/shm. Each checksum
chunk of every file is one task on the ring's reader threads: read the chunk into the
thread's pinned buffer (allocated once per manager and reused), compute its CRC32C, copy it
to where it lands on the buffer's own stream, and wait for the copy before reading the next.
With a dozen threads the reads, the checksums and the copies all overlap; host memory stays
at the ring's size (12 x 16 MiB) whatever the checkpoint's. Where the bytes land is a
:mod:`~ckptmgr.loaders.landing` plan: one fresh device allocation per file, or the target's
own tensors.

The same machinery serves a step whose images are already pinned in this process (the
staging slot): the chunks are then verified where they lie and copied straight from there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from ... import _cuda
from ...errors import CheckpointCorruptError
from ...format.checksum import chunk_ranges, crc32c_hex
from ...format.layout import ST_TO_DTYPE
from ...format.manifest import FileRecord, Manifest
from .host import Source, _build_views, check_file_size
from .landing import Entry, Landing, plan_landing

__all__ = ["PinnedRing", "file_entries", "read_tensors_pinned", "read_tensors_ring"]


class PinnedRing:
    """``threads`` host buffers of ``slot_bytes`` each (pinned with CUDA, plain without), one
    per reader thread, and a copy stream per buffer, made at first use and reused by every
    restore."""

    def __init__(self, threads: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.slots = threads
        self.threads = threads
        self._buffers: list[torch.Tensor] = []
        self._streams: dict[torch.device, list[Any]] = {}
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
            self._streams = {}

    def buffers(self) -> list[torch.Tensor]:
        with self._mu:
            if not self._buffers:
                make = _cuda.pinned_empty if _cuda.available() else (
                    lambda n: torch.empty(n, dtype=torch.uint8))
                self._buffers = [make(self.slot_bytes) for _ in range(self.slots)]
            return self._buffers

    def streams(self, device: torch.device) -> list[Any]:
        """One copy stream per buffer on ``device`` (created on the caller's thread)."""
        with self._mu:
            if device not in self._streams:
                self._streams[device] = [_cuda.staging_stream(device) for _ in range(self.slots)]
            return self._streams[device]


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


def _pipeline(chunks: list[_Chunk], device: torch.device, ring: PinnedRing, where: str) -> None:
    """Each chunk (of every file, one continuous stream) is one task on the ring's threads:
    fetch it into a free buffer, verify it, copy it to its landing on the buffer's own stream
    and wait for that copy before the buffer is free again. Every thread reads, checks and
    copies on its own, so the copy engine always has a copy queued and no thread waits for
    another. The first failure (in file order) cancels what has not started and is raised
    once every started task has finished with its buffer.
    """
    streams = ring.streams(device) if device.type == "cuda" else None
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    for slot in range(ring.slots):
        free.put(slot)

    def task(c: _Chunk) -> None:
        slot = free.get()
        try:
            src, crc = c.fetch(slot, c.begin, c.end)
            if crc != c.rec.crc32c[c.number]:
                raise CheckpointCorruptError(f"{where}: {c.fname}: checksum mismatch in bytes [{c.begin}, {c.end})")
            if streams is None:
                c.landing.land(c.begin, src)
                return
            with torch.cuda.stream(streams[slot]):
                c.landing.land(c.begin, src)
            streams[slot].synchronize()
        finally:
            free.put(slot)

    futures = [ring.pool.submit(task, c) for c in chunks]
    failed = None
    for fut in futures:
        if failed is None and fut.exception() is not None:
            failed = fut.exception()
            for other in futures:
                other.cancel()
    for fut in futures:  # every started task is done with its buffer before anything returns
        if not fut.cancelled():
            fut.exception()
    if failed is not None:
        raise failed


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
    _pipeline(chunks, device, ring, where)
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
