"""Cold files read as the disk reads fastest: a queue of 512 KiB direct reads, in file order,
kept sixteen deep by the kernel and each submitted on its own.

A step restored from a local disk whose files are not in the page cache is read with
``O_DIRECT``, and how the reads reach the device decides the restore's speed. Sixteen reads
of 512 KiB in flight, all within a few megabytes of each other as the queue runs through the
files in order, are the pattern of fastsafetensors' sixteen C++ reader threads. From Python,
Linux AIO (:mod:`~ckptmgr.storage.aio`) keeps them in flight from one thread, which sixteen
Python threads each issuing ``pread`` could not do; and each read goes to the kernel in a
system call of its own, because reads submitted together are merged into 4 MiB requests that
the disk then serves two at a time (one H200 machine's disk, reads alone: 1.43 s for a 4 GiB
step submitted one by one, 1.65 s submitted together, fastsafetensors 1.52 s;
``benchmarks/results/h200-2026-11-23e``).

The loop does as little as it can between a completion and the read that replaces it: the
read is resubmitted at once, a block's result is only compared with its length (the slow
paths, a refused direct read or a short one, are taken only then), and the chunk's own work
goes to the verifier threads. Checksums stay per chunk: the blocks of a chunk land in one
ring buffer, leased for the step before the first read; once a chunk's last block is in, a
verifier verifies its CRC32C, copies it to its landing on the buffer's own stream and waits
for the copy, and the buffer then serves the next chunk. A step holds at most
:data:`CHUNKS_IN_FLIGHT` buffers, whatever its size, made on the verifier threads while the
first reads run. Only the calling thread touches the queue's state.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from typing import Any

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
                buffer: Callable[[int], torch.Tensor], finish: Finish, submit: Callable[..., Future[Any]],
                aio: AioContext) -> None:
    """Read every chunk ``spans[i] = (file name, begin, end)`` of ``files`` into the ring's
    ``buffers`` (leased by the caller; ``buffer(i)`` makes or gives buffer ``i``'s memory)
    through ``aio``, and have ``submit`` run ``finish`` for each chunk once its last block is
    in (``submit`` also makes the buffers, beside the first reads).

    Returns once every read and every finish has ended, ``aio`` closed; raises the failure of
    the earliest chunk that failed (no read is submitted after a failure is seen), or what
    interrupted.

    Raises:
        CheckpointCorruptError: a file ended early, or a chunk failed its checksum.
        CkptTimeoutError: nothing completed for :data:`_STALL` seconds.
    """
    blocks = [(ci, off, min(off + BLOCK, end)) for ci, (_, begin, end) in enumerate(spans)
              for off in range(begin, end, BLOCK)]
    fds = [files[fname].direct_fd for fname, _, _ in spans]  # per chunk
    unread = [0] * len(spans)  # per chunk: blocks not yet read
    for ci, _, _ in blocks:
        unread[ci] += 1
    made: dict[int, Future[torch.Tensor]] = {}  # buffer index -> its making, on the verifier threads
    memory: dict[int, tuple[torch.Tensor, int]] = {}  # buffer index -> (its tensor, its address)
    holder: dict[int, int] = {}  # chunk index -> buffer index, from its first read to its finish
    free = list(reversed(buffers))
    reading: list[int] = [-1] * aio.depth  # aio slot -> the block it reads
    finishing: dict[Future[Any], int] = {}  # -> chunk index
    failed: dict[int, BaseException] = {}
    nxt = 0

    def address(index: int) -> tuple[torch.Tensor, int]:
        if index not in memory:
            tensor = made[index].result(timeout=_STALL)
            memory[index] = tensor, tensor.data_ptr()
        return memory[index]

    def start(slot: int) -> bool:
        """Submit the next block into ``slot``; False where its chunk waits for a buffer."""
        nonlocal nxt
        ci, begin, end = blocks[nxt]
        index = holder.get(ci)
        if index is None:
            if not free:
                return False
            index = holder[ci] = free.pop()
        first = spans[ci][1]
        aio.submit_one(slot, fds[ci], begin, -(-(end - begin) // DIRECT_ALIGN) * DIRECT_ALIGN,
                       address(index)[1] + begin - first)
        reading[slot] = nxt
        nxt += 1
        return True

    idle = list(range(aio.depth))  # aio slots free; the others have a read in flight
    last_progress = time.monotonic()
    try:
        made.update((i, submit(buffer, i)) for i in buffers)  # pinned while the first reads run
        while True:
            while idle and nxt < len(blocks) and not failed and start(idle[-1]):
                idle.pop()
            if len(idle) < aio.depth:
                done = aio.reap(min(1.0, _STALL))
            elif finishing:
                futures_wait(list(finishing), timeout=1.0, return_when=FIRST_COMPLETED)
                done = []
            else:
                break
            for slot, result in done:
                ci, begin, end = blocks[reading[slot]]
                if result < end - begin:  # refused direct, failed, or short: see _check_read
                    first = spans[ci][1]
                    try:
                        _check_read(files[spans[ci][0]], result, begin, end,
                                    address(holder[ci])[0][begin - first:end - first])
                    except Exception as exc:  # the chunk failed: no further reads are submitted
                        failed.setdefault(ci, exc)
                        idle.append(slot)
                        continue
                if failed or nxt == len(blocks) or not start(slot):  # else the next read went at once
                    idle.append(slot)
                unread[ci] -= 1
                if unread[ci] == 0 and not failed:
                    first, last = spans[ci][1], spans[ci][2]
                    finishing[submit(finish, ci, holder[ci], address(holder[ci])[0][:last - first])] = ci
            ended = [f for f in finishing if f.done()]
            for fut in ended:
                ci = finishing.pop(fut)
                error = fut.exception()
                if error is not None:
                    failed.setdefault(ci, error)
                else:
                    free.append(holder.pop(ci))  # the chunk is verified and copied: its buffer serves the next
            if done or ended:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > _STALL:
                raise CkptTimeoutError(f"no read completed and no chunk finished for {_STALL} s")
            if failed and len(idle) == aio.depth and not finishing:
                break
    finally:  # what is in flight ends before the caller gives the buffers back
        aio.close()
        drain([*finishing, *made.values()])
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
