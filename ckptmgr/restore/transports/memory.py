"""Files already in memory (:class:`MemoryTransport`): a check plan's chunks read where they lie.

A peer restore's fetch lands a shard's files in memory on the restore's device: GPU memory,
received there by NCCL with no host copy, or host memory over gloo (see
:mod:`ckptmgr.distributed.peer_mover`). Those bytes came from another node and are verified
before anything uses them, by the one read driver (:func:`~ckptmgr.restore.read.run`) over a
check plan of the files' checksum chunks, with this transport handing it each chunk.

On the host, a chunk is checksummed where it lies. On a GPU, each of ``threads`` threads
copies its chunks back in pieces through two pinned buffers of its own (``pinned``: the caller
gives them; a peer restore gives the bounce readers' block, which their loads reuse) on a
stream of its own, each piece's copy queued before the piece before it is checksummed, and
hands the chunk to the driver as :class:`~ckptmgr.restore.read.Landed` (the CRC32C of its
bytes, computed piece by piece). Nothing of the files' size is allocated on the host.

Only checks: a chunk with a destination, or with sub-chunk checksums, is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from ... import _cuda
from ...errors import CkptTimeoutError
from ...format.checksum import crc32c_combine, crc32c_value
from ..preflight import drain, wait_all
from ..read import Chunk, Land, Landed

__all__ = ["MemoryTransport"]


class MemoryTransport:
    """Hands a check plan's chunks to the driver from ``files`` (data file name -> the whole
    file as a contiguous uint8 tensor, on the host or a GPU), on ``pool`` (at most
    ``threads`` tasks at once), waiting for them at most ``timeout_s`` (then, for those
    started, as long again: they read memory the caller may let go). Files on a GPU need
    ``pinned``: ``pinned(n)`` gives two pinned host buffers (uint8, of one size) for each of
    ``n`` threads.

    Example:
        >>> run(plan_check(manifest, where), MemoryTransport(images, pool, timeout_s=60))  # doctest: +SKIP
    """

    def __init__(self, files: Mapping[str, torch.Tensor], pool: Executor, threads: int = 8, *, timeout_s: float,
                 pinned: Callable[[int], list[list[torch.Tensor]]] | None = None) -> None:
        self.files, self.pool, self.threads, self.timeout_s = files, pool, max(1, threads), timeout_s
        self.pinned = pinned

    def read(self, chunks: Sequence[Chunk], land: Land) -> None:
        """Hand every chunk to ``land`` (see :class:`~ckptmgr.restore.read.Transport`)."""
        for c in chunks:
            if c.dest is not None or c.subs:
                raise ValueError(f"{c.file}: a chunk with a destination or sub-chunk checksums; this transport checks")
            t = self.files.get(c.file)
            if t is None or not 0 <= c.begin <= c.end <= t.numel():
                raise ValueError(f"{c.file}: bytes [{c.begin}, {c.end}) are not in memory here")
        if not chunks:
            return
        gpu = [t.device for t in self.files.values() if t.device.type == "cuda"]
        if gpu and self.pinned is None:
            raise ValueError("files in GPU memory are read back through pinned buffers; none were given")
        workers = min(self.threads, len(chunks))
        pairs: list[Any] = self.pinned(workers) if gpu and self.pinned is not None else [None] * workers
        streams: list[Any] = [None] * workers
        if gpu:  # (the copies back come after whatever the caller queued that writes the files)
            caller = torch.cuda.current_stream(gpu[0])
            streams = [_cuda.staging_stream(gpu[0]) for _ in range(workers)]
            for st in streams:
                st.wait_stream(caller)
        stop = threading.Event()  # set at the first failure: no worker starts another chunk

        def work(w: int) -> None:
            try:
                for c in chunks[w::workers]:
                    if stop.is_set():
                        return
                    src = self.files[c.file][c.begin:c.end]
                    land(c, _crc(src, pairs[w], streams[w]) if src.is_cuda else
                         Landed(crc32c_value(src.numpy()), c.size))
            except BaseException:
                stop.set()
                raise

        futures: list[Future[None]] = []
        try:
            futures.extend(self.pool.submit(work, w) for w in range(workers))
            _, late = wait_futures(futures, timeout=self.timeout_s)
            if late:
                raise CkptTimeoutError(f"checking {len(chunks)} chunks in memory took over {self.timeout_s:g} s")
            wait_all(futures)
        except BaseException:  # (an interrupt too) nothing more starts; the started end first
            stop.set()
            drain(futures, self.timeout_s)
            raise


def _crc(src: torch.Tensor, bufs: list[torch.Tensor] | None, stream: Any) -> Landed:
    """The CRC32C of ``src`` (GPU memory), copied back piece by piece through ``bufs`` (two
    pinned buffers of one size) on ``stream``: the next piece's copy runs while a piece is
    checksummed."""
    assert bufs is not None
    n = src.numel()
    piece = bufs[0].numel()
    crc = -1
    events: list[Any] = [None, None]
    starts = range(0, n, piece)
    with torch.cuda.stream(stream):  # (it waits for the caller's stream: see MemoryTransport.read)

        def copy(i: int) -> None:
            b = i * piece
            bufs[i % 2][:min(piece, n - b)].copy_(src[b:b + piece], non_blocking=True)
            events[i % 2] = _cuda.CopyDone([stream])

        if n:
            copy(0)
        for i, b in enumerate(starts):
            if b + piece < n:
                copy(i + 1)
            events[i % 2].synchronize()
            size = min(piece, n - b)
            value = crc32c_value(bufs[i % 2][:size].numpy())
            crc = value if crc < 0 else crc32c_combine(crc, value, size)
    return Landed(max(crc, 0), n)
