"""Direct reads (:class:`DirectTransport`): cold files read as the disk reads fastest, a queue
of 512 KiB direct reads in file order, kept sixteen deep by the kernel and each submitted on
its own, landing in a small ring of block slots.

A step restored from a local disk whose files are not in the page cache is read with
``O_DIRECT``, and how the reads reach the device decides the restore's speed. Sixteen reads
of 512 KiB in flight, all within a few megabytes of each other as the queue runs through the
files in order, are the pattern of fastsafetensors' reader threads. From Python, Linux AIO
(:mod:`~ckptmgr.storage.aio`) keeps them in flight from one thread, which sixteen Python
threads each issuing ``pread`` could not do; and each read goes to the kernel in a system
call of its own, because reads submitted together are merged into 4 MiB requests that the
disk then serves two at a time (one H200 machine's disk, reads alone: 1.43 s for a 4 GiB
step submitted one by one, 1.65 s submitted together, fastsafetensors 1.52 s;
``benchmarks/results/h200-2026-11-23e``).

Where the reads land matters as much: the same reads into six rotating 16 MiB buffers took
2.31 s against 1.73 s into 8 MiB of slots reused at once (``benchmarks/results/h200-2026-11-23h``).
So each read lands in a *block slot* of a few leased ring buffers, and a block is done with
as soon as it lands: a verifier thread computes its CRC32C and copies it to where it lands,
and the slot serves the next read once that copy has finished. A chunk's checksum is its
blocks' CRCs combined in file order (:func:`~ckptmgr.format.checksum.crc32c_combine`),
checked once its last block is in, by the read driver (:func:`~ckptmgr.restore.read.run`),
which is handed the chunk as :class:`~ckptmgr.restore.read.Landed`: its bytes already where
they go, with their CRC32C. Blocks thus reach their landing before their chunk has verified:
the caller uses this transport only where a failed step's bytes land nowhere they could be
seen (fresh memory, or spare device memory that moves into a target only after the whole
step verified).

The reads are kept going in bunches: a reap waits until :data:`_REAP_AT_LEAST` reads (half
the queue) are in, or every read in flight where fewer are, and they are resubmitted
together, one system call each. Reaped one by one as they came in, and submitted releasing
the GIL (:class:`~ckptmgr.storage.aio.AioContext`), the reads drifted apart in some
restores, came back 1.5 at a time, and the restore took 40-60% longer than the median. On
one H200 machine, the same 4 GiB step, 6 restores each: reaping half the queue 2.159 s
(1.854-2.486), reaping each read as it came 2.262 s (1.858-2.463), the queue before 2.463 s
(1.999-2.729), fastsafetensors 2.331 s (1.758-2.762): ranges that overlap, but with half the
queue every run reaped 14-16 reads at a time (``benchmarks/results/h200-2026-11-23i``).
Between a reap and its reads the loop does as little as it can: the slots of the blocks
checked since are freed first, each read is resubmitted at once into a free slot, a block's
result is only compared with its length (the slow paths, a refused direct read or a short
one, are taken only then), and the landed blocks of one reap go to the verifier threads in a
few batches.
Only the calling thread touches the queue's state.

:func:`read_window` runs a plan of bare :class:`Span` s through the transport, for callers that
lease the buffers themselves (the pinned ring's restore of cold files).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures import wait as futures_wait
from typing import Any, NamedTuple

import torch

from ...errors import CheckpointCorruptError, CkptTimeoutError
from ...format.checksum import crc32c_combine, crc32c_value
from ...storage.aio import AioContext
from ...storage.posix import DIRECT_ALIGN, DirectFile
from ..preflight import drain
from ..read import Chunk, Land, Landed, ReadPlan, run

__all__ = ["BLOCK", "DEPTH", "LANDING_SLOTS", "Copy", "DirectTransport", "Span", "landing_buffers", "read_window"]

BLOCK = 512 << 10  # bytes per read; a multiple of the direct-I/O alignment
DEPTH = 16  # reads in flight
LANDING_SLOTS = 32  # block slots the reads land in: 16 MiB, half of them read into while the others are copied
_BATCH = 8  # landed blocks per verifier task: a reap's blocks shared between the verifier threads
_REAP_AT_LEAST = DEPTH // 2  # a reap waits for this many reads, or all in flight (see the module's docstring)
_STALL = 600.0  # seconds without a read completing or a block finishing before the restore gives up


class Span(NamedTuple):
    """One checksum chunk to read: bytes ``[begin, end)`` of file ``fname``, whose CRC32C is ``crc``."""

    fname: str
    begin: int
    end: int
    crc: str


def landing_buffers(buffer_bytes: int) -> int:
    """How many ring buffers of ``buffer_bytes`` hold :data:`LANDING_SLOTS` block slots."""
    per = buffer_bytes // BLOCK
    if per == 0:
        raise ValueError(f"ring buffers of {buffer_bytes} bytes cannot hold a {BLOCK}-byte block")
    return -(-LANDING_SLOTS // per)


# copy(blocks, key): copy each (chunk index, file offset, bytes) to where it lands and wait for
# the copies (on a stream chosen by ``key``, where there are streams); the bytes may then change.
# The chunk index is the chunk's place in the chunks of the read.
Copy = Callable[[list[tuple[int, int, torch.Tensor]], int], None]


class DirectTransport:
    """Reads a plan's chunks (:class:`~ckptmgr.restore.read.Transport`) as one queue of direct
    reads of ``files`` in the order given, through the kernel AIO context ``aio()`` gives for
    each read (the read destroys it at its end, which waits for the reads in flight), landing
    in the block slots of the ring buffers ``lease()`` holds for the read (``buffer(i)`` makes
    or gives buffer ``i``'s memory, all of one size). ``submit`` runs the verifier tasks (each
    checksums a few landed blocks and has ``copy`` move them to where they land) and makes the
    buffers. Without ``copy``, each block lands on its chunk's destination on the verifier
    thread.

    Each block reaches its chunk's destination before the chunk has verified (see the module's
    docstring): a run that fails leaves unverified bytes there, and the caller gives this
    transport only destinations that a failed run leaves unseen. The driver is handed each
    chunk as :class:`~ckptmgr.restore.read.Landed` once all its blocks are in; a chunk with
    sub-chunk checksums cannot be checked so and is refused. Serves one read at a time.
    """

    def __init__(self, files: dict[str, DirectFile], aio: Callable[[], AioContext],
                 lease: Callable[[], contextlib.AbstractContextManager[list[int]]],
                 buffer: Callable[[int], torch.Tensor], submit: Callable[..., Future[Any]],
                 copy: Copy | None = None) -> None:
        self.files = files
        self.aio = aio
        self.lease = lease
        self.buffer = buffer
        self.submit = submit
        self.copy = copy

    def read(self, chunks: Sequence[Chunk], land: Land) -> None:
        """Fetch and land every chunk (see :class:`~ckptmgr.restore.read.Transport`).

        Raises:
            ValueError: a chunk has sub-chunk checksums, or lies in a file not open here.
        """
        for c in chunks:
            if c.subs or c.file not in self.files:
                raise ValueError(f"{c.file}: bytes [{c.begin}, {c.end}) cannot be read as direct blocks "
                                 f"({'sub-chunk checksums' if c.subs else 'the file is not open for direct reads'})")
        copy = self.copy if self.copy is not None else _land_here(chunks)
        with self.lease() as held:
            _queue(chunks, self.files, held, self.buffer, copy, self.submit, self.aio(), land)


def _land_here(chunks: Sequence[Chunk]) -> Copy:
    def copy(blocks: list[tuple[int, int, torch.Tensor]], key: int) -> None:
        for ci, begin, src in blocks:
            dest = chunks[ci].dest
            if dest is not None:
                dest.land(begin, src)
    return copy


def read_window(spans: list[Span], files: dict[str, DirectFile], buffers: list[int],
                buffer: Callable[[int], torch.Tensor], copy: Copy, submit: Callable[..., Future[Any]],
                aio: AioContext, where: str) -> None:
    """Read every chunk ``spans[i]`` of ``files`` through ``aio`` into block slots of the ring
    ``buffers`` (leased by the caller; ``buffer(i)`` makes or gives buffer ``i``'s memory, all
    of one size), and have ``submit`` check each landed block and ``copy`` it (``submit`` also
    makes the buffers, beside the first reads): the spans as a plan, run by the read driver
    through a :class:`DirectTransport`. A chunk verifies once all its blocks are in.

    Returns once every read and every block's task has ended, ``aio`` closed; raises the failure
    of the earliest chunk that failed (no read is submitted after a failure is seen), or what
    interrupted.

    Raises:
        CheckpointCorruptError: a file ended early, or a chunk failed its checksum.
        CkptTimeoutError: nothing completed for :data:`_STALL` seconds.
    """
    plan = ReadPlan(where, tuple(Chunk(s.fname, i, s.begin, s.end, s.crc) for i, s in enumerate(spans)))
    run(plan, DirectTransport(files, lambda: aio, lambda: contextlib.nullcontext(buffers), buffer, submit, copy))


def _queue(chunks: Sequence[Chunk], files: dict[str, DirectFile], buffers: list[int],
           buffer: Callable[[int], torch.Tensor], copy: Copy, submit: Callable[..., Future[Any]],
           aio: AioContext, land: Land) -> None:
    """The queue of direct reads of :class:`DirectTransport`: every chunk of ``files`` read
    through ``aio`` into block slots of ``buffers``, each block checked and copied on a task of
    ``submit``'s, and each chunk handed to ``land`` once all its blocks are in (a read that
    failed: the failure instead). Returns once every read and every block's task has ended,
    ``aio`` closed; raises the failure of the earliest chunk that failed (no read is submitted
    after a failure is seen), or what interrupted.
    """
    # Owned by the calling thread: everything below but ``blocks`` and ``slots``, which the
    # verifier threads only read, and which are complete before the first of them starts.
    blocks = [(ci, off, min(off + BLOCK, chunk.end)) for ci, chunk in enumerate(chunks)
              for off in range(chunk.begin, chunk.end, BLOCK)]
    fds = [files[chunk.file].direct_fd for chunk in chunks]  # per chunk
    unread = [0] * len(chunks)  # per chunk: blocks not yet checked (or dropped)
    for ci, _, _ in blocks:
        unread[ci] += 1
    crcs: list[dict[int, tuple[int, int]]] = [{} for _ in chunks]  # per chunk: file offset -> (CRC, length)
    made: list[Future[torch.Tensor]] = []  # the buffers' making, on the verifier threads
    slots: list[tuple[torch.Tensor, int, int]] = []  # block slot -> (its buffer, its offset there, its address)
    # Block slots no read or copy uses: a stack, so that the slots used last (still in cache) go
    # first, in ascending order, so that blocks read one after the other mostly lie side by side
    # and a verifier checksums and copies each such run at once.
    free: list[int] = []
    reading: list[tuple[int, int]] = [(-1, -1)] * aio.depth  # aio tag -> (block, slot) it reads
    # a verifier task -> the (block, slot)s it checks and copies
    checking: dict[Future[list[tuple[int, int, int, int]]], list[tuple[int, int]]] = {}
    failed: dict[int, BaseException] = {}
    dropped: set[int] = set()  # chunks whose read failed and that ``land`` listed as a fault: never verified
    tasks = 0
    nxt = 0

    def start(tag: int) -> bool:
        """Submit the next block into a free slot under ``tag``; False where no slot is free."""
        nonlocal nxt
        if not free:
            return False
        slot = free.pop()
        ci, begin, end = blocks[nxt]
        aio.submit_one(tag, fds[ci], begin, -(-(end - begin) // DIRECT_ALIGN) * DIRECT_ALIGN, slots[slot][2])
        reading[tag] = nxt, slot
        nxt += 1
        return True

    def check(batch: list[tuple[int, int]], key: int) -> list[tuple[int, int, int, int]]:
        """On a verifier thread: the CRC32C of each run of the batch's blocks that lie side by
        side in their file's chunk and in memory, as (chunk, file offset, CRC, length), then
        their copies (the slots are free on return)."""
        out, moves = [], []
        i = 0
        while i < len(batch):
            ci, begin, end = blocks[batch[i][0]]
            whole, at, _ = slots[batch[i][1]]
            j = i + 1
            while j < len(batch) and blocks[batch[j][0]][:2] == (ci, end):  # the next block of the chunk,
                following = slots[batch[j][1]]  # in the next slot of the same buffer (buffers may abut in memory)
                if following[0] is not whole or following[1] != at + end - begin:
                    break
                end = blocks[batch[j][0]][2]
                j += 1
            landed = whole[at:at + end - begin]
            out.append((ci, begin, crc32c_value(landed.numpy()), end - begin))
            moves.append((ci, begin, landed))
            i = j
        copy(moves, key)
        return out

    def finished(ci: int) -> None:
        """One more block of chunk ``ci`` checked (or dropped); the chunk to ``land`` once all are."""
        unread[ci] -= 1
        if unread[ci] == 0:
            if ci in dropped:
                crcs[ci].clear()
            else:
                _verify(chunks[ci], crcs[ci], land, failed, ci)

    def fault(ci: int, exc: Exception) -> None:
        """Chunk ``ci``'s read failed with ``exc``: to ``land``, which raises it again (the chunk
        failed: no further reads are submitted) unless the run lists faults (the chunk is dropped)."""
        if ci not in dropped:
            try:
                land(chunks[ci], exc)
            except Exception as raised:
                failed.setdefault(ci, raised)
                return
            dropped.add(ci)
        finished(ci)

    idle = list(range(aio.depth))  # aio tags free; the others have a read in flight
    last_progress = time.monotonic()
    try:
        made.extend(submit(buffer, i) for i in buffers)  # pinned while the first reads run
        for making in made:
            try:
                whole = making.result(timeout=_STALL)
            except FuturesTimeout:
                raise CkptTimeoutError(f"a restore buffer was not made within {_STALL} s") from None
            per = min(whole.numel() // BLOCK, LANDING_SLOTS - len(slots))
            base = whole.data_ptr()
            free[:0] = reversed(range(len(slots), len(slots) + per))  # (below those of the buffers before)
            slots.extend((whole, k * BLOCK, base + k * BLOCK) for k in range(per))
            while idle and nxt < len(blocks) and start(idle[-1]):  # the first buffer's slots read at once
                idle.pop()
        while True:
            while idle and nxt < len(blocks) and not failed and start(idle[-1]):
                idle.pop()
            landed: list[tuple[int, int]] = []
            if len(idle) < aio.depth:
                done = aio.reap(min(1.0, _STALL), min(_REAP_AT_LEAST, aio.depth - len(idle)))
            elif checking:
                futures_wait(list(checking), timeout=1.0, return_when=FIRST_COMPLETED)
                done = []
            else:
                break
            ended = [f for f in checking if f.done()]  # (their slots free before the reads go again)
            for fut in ended:
                batch = checking.pop(fut)
                free.extend(slot for _, slot in reversed(batch))  # the batch's first slot on top
                error = fut.exception()
                if error is not None:
                    for bi, _ in batch:
                        failed.setdefault(blocks[bi][0], error)
                    continue
                for ci, begin, crc, length in fut.result():
                    crcs[ci][begin] = crc, length
                for bi, _ in batch:
                    finished(blocks[bi][0])
            for tag, result in done:
                bi, slot = reading[tag]
                ci, begin, end = blocks[bi]
                if result < end - begin:  # refused direct, failed, or short: see _check_read
                    try:
                        whole, at, _ = slots[slot]
                        _check_read(files[chunks[ci].file], result, begin, end, whole[at:at + end - begin])
                    except Exception as exc:  # see fault()
                        fault(ci, exc)
                        free.append(slot)
                        idle.append(tag)
                        continue
                if failed and ci > min(failed):  # after the earliest failure only earlier chunks matter
                    free.append(slot)
                    idle.append(tag)
                    continue
                landed.append((bi, slot))
                if failed or nxt == len(blocks) or not start(tag):  # else the next read went at once
                    idle.append(tag)
            for i in range(0, len(landed), _BATCH):
                batch = landed[i:i + _BATCH]
                checking[submit(check, batch, tasks)] = batch
                tasks += 1
            if done or ended:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > _STALL:
                raise CkptTimeoutError(f"no read completed and no block finished for {_STALL} s")
            if failed and len(idle) == aio.depth and not checking:
                break
    finally:  # what is in flight ends before the caller gives the buffers back, also through an interrupt
        try:
            aio.close()
        finally:
            drain([*checking, *made])
    if failed:
        raise failed[min(failed)]
    if nxt < len(blocks) or any(unread):
        raise RuntimeError(f"the read queue stopped with {len(blocks) - nxt} blocks unread")  # (a bug, not bad data)


def _verify(chunk: Chunk, crcs: dict[int, tuple[int, int]], land: Land, failed: dict[int, BaseException],
            ci: int) -> None:
    """Chunk ``ci``'s CRC32C, combined from its blocks' in file order, to ``land`` (which checks
    it against the plan's)."""
    value, length = -1, 0
    for begin in sorted(crcs):
        crc, n = crcs[begin]
        value = crc if value < 0 else crc32c_combine(value, crc, n)
        length += n
    crcs.clear()
    try:
        land(chunk, Landed(value, length))
    except Exception as exc:
        failed.setdefault(ci, exc)


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
