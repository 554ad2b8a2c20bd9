"""Ranged reads of an object store, cut and counted by the store's answers.

An object store answers each request after a latency of its own (tens to hundreds of
milliseconds) and serves each connection at some tens of MB/s: a read is fast only with
many long ranges in flight. :class:`RangedTransport` reads the chunks of a plan (see
:class:`~ckptmgr.restore.read.Transport`) with ranged GETs whose length and number in
flight a :class:`~ckptmgr.storage.throttle.ReadTuner` adapts as the answers come (it starts
with several at once, grows while the store answers faster, and stays inside the target's
request window, which halves on SlowDown). A request may span several adjacent chunks of a
file, or a part of one; its bytes go straight into the chunks' destinations where those
offer memory of their own (:meth:`~ckptmgr.restore.read.Dest.into`), else into one scratch
buffer per chunk. A chunk is handed to ``land`` (verified there) by the request that
brings its last byte: every byte is fetched once, and checked where it landed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...errors import CheckpointCorruptError, CkptTimeoutError
from ..preflight import drain
from ..read import Chunk, Land

if TYPE_CHECKING:
    from ...storage.throttle import ReadTuner

__all__ = ["RangedSource", "RangedTransport"]

SCRATCH_BYTES = 256 << 20  # scratch memory of chunks without memory of their own, in flight at once
# (or the one chunk in flight, where a chunk is larger: its ranges then share that chunk's scratch)
_ANSWER_WAIT = 600.0  # seconds the dispatcher waits for any one answer


class RangedSource(Protocol):
    """An object store read by ranges: its ``read_into`` is one ranged GET (retried under
    the target's policy and request window)."""

    url: str

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None: ...

    def read_tuner(self) -> ReadTuner: ...


def _slice(pieces: list[np.ndarray[Any, Any]], offset: int, n: int) -> list[np.ndarray[Any, Any]]:
    """Bytes ``[offset, offset + n)`` of the concatenation of ``pieces``, as views."""
    out = []
    for a in pieces:
        if n <= 0:
            break
        if offset >= a.size:
            offset -= a.size
            continue
        take = min(a.size - offset, n)
        out.append(a[offset:offset + take])
        n -= take
        offset = 0
    return out


class _State:
    """The chunks of one read and what of each has landed. Owned by the dispatching thread,
    except ``left``, ``failed`` and ``scratch_used``, guarded by ``mu`` (the requests' threads count
    down), and a chunk's ``memory`` once made: dropped by the request that accounts for its last
    byte (:meth:`release`)."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        self.chunks = chunks
        self.memory: list[list[np.ndarray[Any, Any]] | None] = [None] * len(chunks)
        self.in_place = [False] * len(chunks)
        self.mu = threading.Lock()
        self.left = [c.size for c in chunks]
        self.failed: set[int] = set()  # chunks whose fetch failed (reported once)
        self.scratch_used = 0

    def memory_of(self, i: int) -> list[np.ndarray[Any, Any]]:
        """Chunk ``i``'s memory: its destination's own, or a scratch buffer made now."""
        mem = self.memory[i]
        if mem is None:
            c = self.chunks[i]
            into = getattr(c.dest, "into", None)
            pieces = into(c.begin, c.end) if into is not None else None
            if pieces is not None:
                self.in_place[i] = True
                mem = pieces
            else:
                with self.mu:
                    self.scratch_used += c.size
                mem = [np.empty(c.size, dtype=np.uint8)]
            self.memory[i] = mem
        return mem

    def release(self, i: int) -> None:
        """Chunk ``i``'s every byte is accounted for (landed, or its fetch failed): its scratch
        is given back (called once a chunk, by the request that accounts for its last byte)."""
        if not self.in_place[i]:
            self.memory[i] = None
            with self.mu:
                self.scratch_used -= self.chunks[i].size

    def needs_scratch(self, i: int) -> int:
        c = self.chunks[i]
        return c.size if self.memory[i] is None and getattr(c.dest, "into", None) is None else 0


class RangedTransport:
    """Reads ``step``'s chunks from ``source`` by ranged requests on threads of its own (as
    many as the target's request window allows at most). Serves several reads at once:
    each has its own tuner, threads and buffers."""

    def __init__(self, source: RangedSource, step: int, *, scratch_bytes: int = SCRATCH_BYTES,
                 tuner: ReadTuner | None = None) -> None:
        self.source = source
        self.step = step
        self.scratch_bytes = scratch_bytes
        self.tuner = tuner  # given: used by the next read only; else the last read's (for telemetry and tests)

    def read(self, chunks: Sequence[Chunk], land: Land) -> None:
        """Fetch and land every chunk (see :class:`~ckptmgr.restore.read.Transport`)."""
        if not chunks:
            return
        tuner = self.tuner if self.tuner is not None and self.tuner.requests == 0 else self.source.read_tuner()
        self.tuner = tuner
        st = _State(chunks)
        stop = threading.Event()  # set at the first failure: no request starts after it
        total = sum(c.size for c in chunks)
        pos = [0, 0]  # the next byte to ask for: (chunk index, offset in it)
        asked = 0

        def request(segs: list[tuple[int, int, int]]) -> None:
            """One ranged GET of the adjacent ``segs`` (chunk index, offset, length), then
            every chunk it completes landed (verified)."""
            if stop.is_set():
                return
            try:
                first = chunks[segs[0][0]]
                out = [a for i, off, n in segs for a in _slice(st.memory_of(i), off, n)]
                nbytes = sum(n for _, _, n in segs)
                t0 = time.monotonic()
                try:
                    self.source.read_into(self.step, first.file, first.begin + segs[0][1], out)
                except Exception as exc:  # (raised again by land, unless the run lists faults)
                    if isinstance(exc, CheckpointCorruptError) and len(segs) > 1:
                        for seg in segs:  # the object ends early: asked again chunk by chunk, only
                            request([seg])  # the chunks it cuts short fail (a run listing faults)
                        return
                    with st.mu:
                        fresh = [i for i, _, _ in segs if i not in st.failed]
                        st.failed.update(fresh)
                        ended = []  # chunks whose every byte is now accounted for: their scratch goes
                        for i, _, n in segs:
                            st.left[i] -= n
                            if st.left[i] == 0:
                                ended.append(i)
                    try:
                        for i in fresh:
                            land(chunks[i], exc)
                    finally:
                        for i in ended:
                            st.release(i)
                    return
                now = time.monotonic()
                tuner.observe(nbytes, now - t0, now)
                done = []
                with st.mu:
                    for i, _, n in segs:
                        st.left[i] -= n
                        if st.left[i] == 0:
                            done.append(i)
                for i in done:
                    self._land(st, i, land)
            except BaseException:
                stop.set()
                raise

        def next_request(size: int, room: int) -> list[tuple[int, int, int]]:
            """The segments of the next ``size`` bytes: adjacent chunks of one file only, and
            no chunk beyond the first whose scratch would not fit in ``room`` bytes."""
            segs: list[tuple[int, int, int]] = []
            while size > 0 and pos[0] < len(chunks):
                i, off = pos
                c = chunks[i]
                if segs and (chunks[segs[-1][0]].file, chunks[segs[-1][0]].end) != (c.file, c.begin):
                    break  # another file, or a gap: the next request
                need = st.needs_scratch(i)
                if segs and need and need > room:
                    break  # (its scratch once some lands: the next request)
                room -= need
                n = min(c.size - off, size)
                segs.append((i, off, n))
                size -= n
                pos[:] = [i + 1, 0] if off + n == c.size else [i, off + n]
            return segs

        first_chunk: dict[Future[None], int] = {}  # each request's first chunk, to raise the earliest failure
        pool = ThreadPoolExecutor(tuner.window.ceiling, thread_name_prefix="ckptmgr-range")
        running: set[Future[None]] = set()
        ended = False  # every request submitted has ended: the pool's threads may be joined
        try:
            while pos[0] < len(chunks) or running:
                while pos[0] < len(chunks) and len(running) < tuner.inflight() and not stop.is_set():
                    need = st.needs_scratch(pos[0])
                    with st.mu:
                        room = self.scratch_bytes - st.scratch_used
                    if running and need and need > room:
                        break  # (scratch is freed as chunks land)
                    segs = next_request(tuner.range_size(total - asked), room)
                    asked += sum(n for _, _, n in segs)
                    for i, _, _ in segs:
                        st.memory_of(i)  # (made here, on one thread)
                    tuner.started(time.monotonic())
                    fut = pool.submit(request, segs)
                    first_chunk[fut] = segs[0][0]
                    running.add(fut)
                if stop.is_set() and not running:
                    break
                done, _ = wait(running, timeout=_ANSWER_WAIT, return_when=FIRST_COMPLETED)
                if not done:
                    raise CkptTimeoutError(f"{self.source.url}: no ranged read answered in {_ANSWER_WAIT} s")
                running -= done
                if any(f.exception() is not None for f in done):
                    stop.set()
            ended = True
        except BaseException:  # (an interrupt too) nothing more starts; the started end first
            stop.set()
            drain(list(running))  # (CkptTimeoutError when they do not: then their threads are left behind)
            ended = True
            raise
        finally:
            pool.shutdown(wait=ended, cancel_futures=True)
        errors = [(first_chunk[f], exc) for f in first_chunk if (exc := f.exception()) is not None]
        if errors:
            raise min(errors, key=lambda e: e[0])[1]  # the earliest chunk's

    @staticmethod
    def _land(st: _State, i: int, land: Land) -> None:
        c, mem = st.chunks[i], st.memory[i]
        assert mem is not None
        try:
            with st.mu:
                failed = i in st.failed
            if failed:
                return  # (reported already, by the request that failed)
            if st.in_place[i] or c.dest is None:
                land(c, mem)  # verified where it lies
            else:
                import torch  # (only a restore lands tensors: a check needs no torch)

                land(c, torch.from_numpy(mem[0]))
        finally:
            st.release(i)
