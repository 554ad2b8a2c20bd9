"""Cold files read as the disk reads fastest: one queue of 512 KiB direct reads, in file order.

A step restored from a local disk whose files are not in the page cache is read with
``O_DIRECT``, and how those reads reach the device decides the restore's speed. Sixteen
threads, each taking the next 512 KiB block of one queue that runs through the files in order
(the pattern of fastsafetensors' reader), keep sixteen requests in flight, all within a few
megabytes of each other; on an H200 machine's disk this read a cold 4 GiB step in 1.84 s, where
sixteen threads reading a whole 16 MiB chunk each took 2.02 s and twelve took 2.42 s
(medians of 7 fresh processes, ``benchmarks/results/h200-2026-11-23d/cold-read``).

Checksums stay per chunk: the blocks of a chunk land in one buffer of the ring, leased for
the step before the first read; the thread that reads a chunk's last block verifies its
CRC32C, copies it to its landing on the buffer's own stream and waits for the copy, then hands
the buffer to the next chunk. A step thus holds at most :data:`CHUNKS_IN_FLIGHT` buffers,
whatever its size.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ...errors import CkptTimeoutError
from ...storage.posix import DirectFile
from ..preflight import drain, wait_all

__all__ = ["BLOCK", "CHUNKS_IN_FLIGHT", "read_window"]

BLOCK = 512 << 10  # bytes per read; a multiple of the direct-I/O alignment
CHUNKS_IN_FLIGHT = 6  # chunk buffers one step uses: 16 reads of 512 KiB span at most two chunks
_BUFFER_WAIT = 600.0  # seconds a reader waits for a chunk's buffer (another chunk's check and copy)

# finish(chunk index, buffer index, the chunk's bytes): verify them and copy them to where they land
Finish = Callable[[int, int, torch.Tensor], None]


class _Queue:
    """The blocks of one step and the chunk buffers they fill, shared by its reader threads.

    Every field below is guarded by ``_mu``; the buffers' bytes are written by the threads
    reading the blocks of the chunk that holds the buffer, and read by the one that finishes
    it, after all of those reads have returned.
    """

    def __init__(self, spans: list[tuple[str, int, int]], buffers: list[int]) -> None:
        self._mu = threading.Lock()
        # notified (all waiters: each waits for its own reason) when a buffer comes back, when a
        # chunk gets one (its further blocks need none), and on stop
        self._changed = threading.Condition(self._mu)
        self.blocks = [(ci, off, min(off + BLOCK, end)) for ci, (_, begin, end) in enumerate(spans)
                       for off in range(begin, end, BLOCK)]
        self.next = 0  # index in blocks of the next block to read
        self.unread = [0] * len(spans)  # per chunk: blocks not yet read
        for ci, _, _ in self.blocks:
            self.unread[ci] += 1
        self.holder: dict[int, int] = {}  # chunk index -> buffer index, from its first read to its copy
        self.free = list(buffers)
        self.failed: dict[int, BaseException] = {}  # chunk index -> what failed it
        self.stop = False

    def take(self) -> tuple[int, int, int, int] | None:
        """The next block as (chunk index, begin, end, buffer index); ``None`` when none is left
        or the step failed. Waits for a free buffer before the first block of a chunk.

        Raises:
            CkptTimeoutError: no buffer came back within the wait.
        """
        with self._mu:
            while True:
                if self.stop or self.next == len(self.blocks):
                    return None
                ci, begin, end = self.blocks[self.next]
                slot = self.holder.get(ci)
                if slot is None and self.free:
                    slot = self.holder[ci] = self.free.pop()
                    self._changed.notify_all()
                if slot is not None:
                    self.next += 1
                    return ci, begin, end, slot
                if not self._changed.wait(_BUFFER_WAIT):
                    raise CkptTimeoutError(f"no chunk buffer came back within {_BUFFER_WAIT} s")

    def read_one(self, ci: int) -> bool:
        """Count one block of chunk ``ci`` as read; whether it was the chunk's last."""
        with self._mu:
            self.unread[ci] -= 1
            return self.unread[ci] == 0

    def release(self, ci: int) -> None:
        """Chunk ``ci`` is verified and copied: its buffer serves the next chunk."""
        with self._mu:
            self.free.append(self.holder.pop(ci))
            self._changed.notify_all()

    def fail(self, ci: int, exc: BaseException) -> None:
        with self._mu:
            self.failed.setdefault(ci, exc)
            self.stop = True
            self._changed.notify_all()

    def first_failure(self) -> BaseException | None:
        with self._mu:
            return self.failed[min(self.failed)] if self.failed else None


def read_window(spans: list[tuple[str, int, int]], files: dict[str, DirectFile], buffers: list[int],
                buffer: Callable[[int], torch.Tensor], finish: Finish, submit: Callable[..., Future[None]],
                threads: int) -> None:
    """Read every chunk ``spans[i] = (file name, begin, end)`` from ``files`` into the ring's
    ``buffers`` (leased by the caller; ``buffer(i)`` is buffer ``i``'s memory, made by the
    caller's ring at first use), in blocks of :data:`BLOCK` taken from one queue by ``threads``
    tasks given to ``submit``, and ``finish`` each chunk once its last block is in.

    Returns once every task has ended; raises the failure of the earliest chunk that failed
    (after which no further block is read), or what interrupted the wait.
    """
    queue = _Queue(spans, buffers)
    made = {i: threading.Lock() for i in buffers}  # the first use of a buffer makes it, once
    memory: dict[int, tuple[torch.Tensor, memoryview]] = {}  # written under made[i], then only read

    def buffer_of(slot: int) -> tuple[torch.Tensor, memoryview]:
        with made[slot]:
            if slot not in memory:
                tensor = buffer(slot)
                memory[slot] = tensor, memoryview(tensor.numpy())  # type: ignore[arg-type]
            return memory[slot]

    def reader() -> None:
        ci = -1
        try:
            while (block := queue.take()) is not None:
                ci, begin, end, slot = block
                fname, first, last = spans[ci]
                tensor, view = buffer_of(slot)
                files[fname].read(begin, view[begin - first:], end - begin)
                if queue.read_one(ci):
                    finish(ci, slot, tensor[:last - first])
                    queue.release(ci)
        except BaseException as exc:  # recorded for the caller; an interrupt also passes on
            queue.fail(ci, exc)
            if not isinstance(exc, Exception):
                raise

    futures: list[Future[None]] = []
    try:
        futures = [submit(reader) for _ in range(min(threads, len(queue.blocks)))]
        wait_all(futures)
    except BaseException as exc:
        queue.fail(len(spans), exc)
        drain(futures)  # no reader may still write a buffer the caller is about to give back
        raise
    failure = queue.first_failure()
    if failure is not None:
        raise failure
