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
from typing import Any

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


def _land_file(fetch: Fetch, fname: str, rec: FileRecord, landing: Landing, stream: Any, ring: PinnedRing,
               where: str) -> None:
    """Fetch every checksum chunk of one file on the ring's threads (at most ``ring.slots`` in
    flight), verify it, and land it in file order on ``stream``."""
    done_events: dict[int, Any] = {}
    free: deque[int] = deque(range(ring.slots))
    pending: deque[tuple[int, int, int, Future[tuple[torch.Tensor, str]]]] = deque()

    def land(i: int, slot: int, b: int, fut: Future[tuple[torch.Tensor, str]]) -> None:
        src, crc = fut.result()
        if crc != rec.crc32c[i]:
            raise CheckpointCorruptError(
                f"{where}: {fname}: checksum mismatch in bytes [{b}, {b + src.numel()})")
        if stream is not None:
            with torch.cuda.stream(stream):
                landing.land(b, src)
            done_events[slot] = _cuda.CopyDone([stream])
        else:
            landing.land(b, src)
        free.append(slot)

    try:
        for i, (b, e) in enumerate(chunk_ranges(rec.size, rec.chunk_size)):
            while not free:  # the oldest fetch lands before its buffer is reused
                land(*pending.popleft())
            slot = free.popleft()
            if slot in done_events:
                done_events.pop(slot).synchronize()  # its previous copy has left the buffer
            pending.append((i, slot, b, ring.pool.submit(fetch, slot, b, e)))
        while pending:
            land(*pending.popleft())
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
    stream = _cuda.staging_stream(device) if device.type == "cuda" else None
    out: dict[str, torch.Tensor] = {}
    for fname, rec in manifest.files.items():
        fetch = fetch_for(fname, rec)  # checks the file before anything is allocated
        landing = plan_landing(file_entries(manifest, fname, where), rec.header_size, rec.size - rec.header_size,
                               device, dests)
        _land_file(fetch, fname, rec, landing, stream, ring, where)
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
