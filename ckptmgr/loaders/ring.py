"""Pinned-ring loader: parallel reads into a small reusable pinned ring, each chunk copied to
the GPU as soon as it lands, its checksum verified beside the copy.

For files on disk, NFS or object stores, where mapping in place would fault every page in one
thread. Each checksum chunk of a file is read by one task into a
ring buffer (pinned memory, allocated once per manager and reused); the caller's thread
enqueues the chunk's host-to-device copy on a side stream in file order, so reads and copies
overlap. A ring buffer is reused only once its copy has finished. Host memory stays at the
ring's size whatever the checkpoint's. Each file lands in one device allocation, of which
its tensors are views.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .. import _cuda
from .._checksum import chunk_ranges, crc32c_hex
from .._layout import ST_TO_DTYPE
from .._manifest import FileRecord, Manifest
from ..errors import CheckpointCorruptError
from .host import Source, _build_views, check_file_size

__all__ = ["PinnedRing", "read_tensors_ring"]


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


def _file_entries(manifest: Manifest, fname: str, where: str) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    out = []
    for name, e in manifest.tensors.items():
        if e.get("file") != fname:
            continue
        dtype = ST_TO_DTYPE.get(e["dtype"])
        if dtype is None:
            raise CheckpointCorruptError(f"{where}: tensor {name!r} has unknown dtype {e['dtype']!r}")
        b, en = (int(x) for x in e["offsets"])
        out.append((name, dtype, [int(s) for s in e["shape"]], b, en))
    return out


def _read_file(source: Source, step: int, fname: str, rec: FileRecord, device: torch.device, stream: Any,
               ring: PinnedRing, where: str) -> torch.Tensor:
    """The data region of one file, on ``device``, read through the ring and verified."""
    check_file_size(source, step, fname, rec.size)
    hs = rec.header_size
    region = torch.empty(rec.size - hs, dtype=torch.uint8, device=device)
    bufs = ring.buffers()
    free: deque[int] = deque(range(len(bufs)))
    done_events: dict[int, Any] = {}
    pending: deque[tuple[int, int, int, int, Future[str]]] = deque()

    def read(slot: int, b: int, e: int) -> str:
        arr = bufs[slot][:e - b].numpy()
        source.read_into(step, fname, b, [arr])
        return crc32c_hex(arr)

    def land(i: int, slot: int, b: int, e: int, fut: Future[str]) -> None:
        if fut.result() != rec.crc32c[i]:
            raise CheckpointCorruptError(f"{where}: {fname}: checksum mismatch in bytes [{b}, {e})")
        lo = max(b, hs)
        if e > lo:
            dst, src = region[lo - hs:e - hs], bufs[slot][lo - b:e - b]
            if stream is not None:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                done_events[slot] = _cuda.CopyDone([stream])
            else:
                dst.copy_(src)
        free.append(slot)

    try:
        for i, (b, e) in enumerate(chunk_ranges(rec.size, rec.chunk_size)):
            while not free:  # the oldest read lands before its buffer is reused
                land(*pending.popleft())
            slot = free.popleft()
            if slot in done_events:
                done_events.pop(slot).synchronize()  # its previous copy has left the buffer
            pending.append((i, slot, b, e, ring.pool.submit(read, slot, b, e)))
        while pending:
            land(*pending.popleft())
    finally:
        for *_, fut in pending:
            fut.cancel()
        for *_, fut in pending:
            if not fut.cancelled():
                fut.exception()  # reads finish before their buffers can be reused
        if stream is not None:
            stream.synchronize()
    return region


def read_tensors_ring(source: Source, step: int, manifest: Manifest, device: torch.device,
                      ring: PinnedRing) -> dict[str, torch.Tensor]:
    """Every tensor of committed ``step`` on ``device``, read through ``ring``.

    Raises:
        CheckpointCorruptError: a file is missing, has the wrong size, or fails a checksum.
    """
    where = f"{source.url}: step {step}"
    stream = _cuda.staging_stream(device) if device.type == "cuda" else None
    out: dict[str, torch.Tensor] = {}
    for fname, rec in manifest.files.items():
        if rec.chunk_size > ring.slot_bytes:
            raise CheckpointCorruptError(f"{where}: {fname} has chunks of {rec.chunk_size} bytes, "
                                         f"more than the ring's {ring.slot_bytes}")
        region = _read_file(source, step, fname, rec, device, stream, ring, where)
        for name, dtype, shape, b, e in _file_entries(manifest, fname, where):
            out[name] = region[b:e].view(dtype).view(shape)
    _build_views(manifest, out, where)
    return out
