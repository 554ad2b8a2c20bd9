"""Cold files read as the disk reads fastest: one queue of 512 KiB direct reads, in file order,
kept in flight by the kernel.

A step restored from a local disk whose files are not in the page cache is read with
``O_DIRECT``, and how the reads reach the device decides the restore's speed. Sixteen reads
of 512 KiB in flight, all within a few megabytes of each other as the queue runs through the
files in order (the pattern of fastsafetensors' reader), are what the disk serves fastest;
submitted with Linux AIO from one thread (:mod:`~ckptmgr.storage.aio`) the queue never
drains while Python gets back to it, which sixteen Python threads each issuing ``pread``
could not do (``benchmarks/results/h200-2026-11-23d/cold-read``).

Checksums stay per chunk: the blocks of a chunk land in one ring buffer, leased for the step
before the first read; once a chunk's last block is in, a task on the ring's threads verifies
its CRC32C, copies it to its landing on the buffer's own stream and waits for the copy, and
the buffer then serves the next chunk. A step holds at most :data:`CHUNKS_IN_FLIGHT` buffers,
whatever its size. Only the calling thread touches the queue's state.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait

import torch

from ...errors import CheckpointCorruptError, CkptTimeoutError
from ...storage.aio import AioContext
from ...storage.posix import DIRECT_ALIGN, DirectFile
from ..preflight import drain

__all__ = ["BLOCK", "CHUNKS_IN_FLIGHT", "DEPTH", "read_window"]

BLOCK = 512 << 10  # bytes per read; a multiple of the direct-I/O alignment
DEPTH = 16  # reads in flight
CHUNKS_IN_FLIGHT = 6  # chunk buffers one step uses: 16 reads of 512 KiB span at most two chunks
_STALL = 600.0  # seconds without a read completing or a chunk finishing before the restore gives up

# finish(chunk index, buffer index, the chunk's bytes): verify them and copy them to where they land
Finish = Callable[[int, int, torch.Tensor], None]


def read_window(spans: list[tuple[str, int, int]], files: dict[str, DirectFile], buffers: list[int],
                buffer: Callable[[int], torch.Tensor], finish: Finish, submit: Callable[..., Future[None]],
                aio: AioContext) -> None:
    """Read every chunk ``spans[i] = (file name, begin, end)`` of ``files`` into the ring's
    ``buffers`` (leased by the caller; ``buffer(i)`` is buffer ``i``'s memory) through
    ``aio``, and have ``submit`` run ``finish`` for each chunk once its last block is in.

    Returns once every read and every finish has ended, ``aio`` closed; raises the failure of
    the earliest chunk that failed (no further block is read after a failure), or what
    interrupted.

    Raises:
        CheckpointCorruptError: a file ended early, or a chunk failed its checksum.
        CkptTimeoutError: nothing completed for :data:`_STALL` seconds.
    """
    blocks = [(ci, off, min(off + BLOCK, end)) for ci, (_, begin, end) in enumerate(spans)
              for off in range(begin, end, BLOCK)]
    unread = [0] * len(spans)  # per chunk: blocks not yet read
    for ci, _, _ in blocks:
        unread[ci] += 1
    holder: dict[int, int] = {}  # chunk index -> buffer index, from its first read to its finish
    free = list(buffers)
    memory: dict[int, tuple[torch.Tensor, int]] = {}  # buffer index -> (its tensor, its address)
    reading: dict[int, tuple[int, int, int]] = {}  # aio slot -> (chunk index, begin, end)
    idle = list(range(aio.depth))  # aio slots free
    finishing: dict[Future[None], int] = {}  # -> chunk index
    failed: dict[int, BaseException] = {}
    nxt = 0
    last_progress = time.monotonic()

    def address(slot: int) -> tuple[torch.Tensor, int]:
        if slot not in memory:
            tensor = buffer(slot)
            memory[slot] = tensor, tensor.data_ptr()
        return memory[slot]

    def finished(fut: Future[None]) -> None:
        ci = finishing.pop(fut)
        exc = fut.exception()
        if exc is not None:
            failed.setdefault(ci, exc)
        else:
            free.append(holder.pop(ci))  # the chunk is verified and copied: its buffer serves the next

    try:
        while True:
            batch = []
            while not failed and nxt < len(blocks) and idle:
                ci, begin, end = blocks[nxt]
                if ci not in holder:
                    if not free:
                        break
                    holder[ci] = free.pop()
                fname, first, _ = spans[ci]
                _, base = address(holder[ci])
                slot = idle.pop()
                reading[slot] = (ci, begin, end)
                batch.append((slot, files[fname].direct_fd, begin,
                              -(-(end - begin) // DIRECT_ALIGN) * DIRECT_ALIGN, base + begin - first))
                nxt += 1
            if batch:
                aio.submit(batch)
            if reading:
                done = aio.reap(min(1.0, _STALL))
            elif finishing:
                futures_wait(list(finishing), timeout=1.0, return_when=FIRST_COMPLETED)
                done = []
            else:
                break
            for slot, result in done:
                ci, begin, end = reading.pop(slot)
                idle.append(slot)
                fname, first, last = spans[ci]
                try:
                    _check_read(files[fname], result, begin, end, address(holder[ci])[0][begin - first:end - first])
                except Exception as exc:  # the chunk failed: no further reads are submitted
                    failed.setdefault(ci, exc)
                    continue
                unread[ci] -= 1
                if unread[ci] == 0 and not failed:
                    fut = submit(finish, ci, holder[ci], address(holder[ci])[0][:last - first])
                    finishing[fut] = ci
            ended = [f for f in finishing if f.done()]
            for fut in ended:
                finished(fut)
            if done or ended:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > _STALL:
                raise CkptTimeoutError(f"no read completed and no chunk finished for {_STALL} s")
            if failed and not reading and not finishing:
                break
    finally:  # what is in flight ends before the caller gives the buffers back
        aio.close()
        drain(list(finishing))
    if failed:
        raise failed[min(failed)]
    if nxt < len(blocks) or holder:
        raise RuntimeError(f"the read queue stopped with {len(blocks) - nxt} blocks unread")  # (a bug, not bad data)


def _check_read(file: DirectFile, result: int, begin: int, end: int, landed: torch.Tensor) -> None:
    """A completed read of bytes ``[begin, end)`` into ``landed``: all of them, or the block
    read again plainly where the filesystem refused the direct read after the open.

    Raises:
        CheckpointCorruptError: the file ended early.
        OSError: the read failed.
    """
    if result == -errno.EINVAL:
        file.read(begin, memoryview(landed.numpy()), end - begin, plain=True)  # type: ignore[arg-type]
        return
    if result < 0:
        raise OSError(-result, f"{file.where}: reading bytes [{begin}, {end}): {os.strerror(-result)}")
    if result < end - begin:
        raise CheckpointCorruptError(f"{file.where} ended early, at byte {begin + result}")
