"""How the peer tier moves a shard between two ranks: a record, then the files' bytes in pieces.

:class:`ShardMover` sends shards (a record, then the files' bytes) to ranks and receives shards
from ranks into this node's peer area (:class:`~ckptmgr.storage.peer_tier.PeerArea`: the
replication rounds) or into memory (:class:`Into`: a restore's fetches, the files in one
allocation on the transport's device, each on a 4 KiB boundary, each piece received straight
into its place), in
one call that every rank named on either side makes at the same time (the replication rounds and
the restore's fetches are lock-step), over a
:class:`~ckptmgr.distributed.peer_transport.Transport`. Each exchange is a header (step, record
size, data size), the record, then the bytes in pieces of ``chunk_bytes`` cut from the files'
concatenated stream, paced by ``max_bytes_per_s``. A received piece is written into its files
by a writer thread while the next piece travels (two buffers per source, each reused only once
its last write has ended). What a rank receives is untrusted: the header is bounded before
anything is allocated, the record is validated (and, into memory, its files must be the ones
expected) before a slot is taken or memory allocated, and the copy is committed (or, in memory,
used) only when every chunk matches the record's checksums; a refused shard's bytes are drained
through the same reused buffers. A thread faults in the pages of host memory received into and
of the files sent, ahead of the pieces (:data:`FAULT_AHEAD`).

Thread ownership: a mover is used by one thread at a time (the replication thread, or the
caller's during a restore after the rounds are drained); ``_mu`` guards only its counters. The
files being received are written by the mover's writer thread, which the calling thread joins
(bounded) before it reads or closes them; the faulting thread only touches pages of memory the
transfer holds, and is joined (bounded) before the transfer returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple, overload

import numpy as np
import torch

from .._threads import DaemonPool
from ..errors import CkptError, CkptTimeoutError
from ..format.schema import MAX_MANIFEST_BYTES
from ..storage.peer_tier import IncomingFile, PeerArea, ShardRecord, check_files
from ..storage.posix import populate
from . import peer_memory
from .peer_memory import Into
from .peer_transport import Buffer, Transport

__all__ = ["MAX_SHARD_BYTES", "Received", "Sends", "ShardMover"]

log = logging.getLogger("ckptmgr")
MAX_SHARD_BYTES = 1 << 44  # the most bytes a peer may announce for one shard (16 TiB)
FAULT_AHEAD = True  # a thread faults in the pages of memory received into and of files sent, ahead of the pieces
Sends = list[tuple[int, ShardRecord | None, dict[str, np.ndarray[Any, Any]]]]


def _pieces(files: list[np.ndarray[Any, Any]], size: int) -> list[list[np.ndarray[Any, Any]]]:
    """The files' bytes, concatenated, cut into pieces of ``size`` (:func:`_cut`): each piece as
    the list of the file parts it covers (both sides cut the same stream the same way)."""
    return [[files[k][at:at + n] for k, at, n in piece] for piece in _cut([a.size for a in files], size)]


def _cut(sizes: list[int], size: int) -> list[list[tuple[int, int, int]]]:
    """Files of ``sizes``, concatenated, cut into pieces of ``size``: each piece as (file index,
    offset in it, bytes) for each file part it covers."""
    out: list[list[tuple[int, int, int]]] = [[]]
    room = size
    for k, n_file in enumerate(sizes):
        at = 0
        while at < n_file:
            if room == 0:
                out.append([])
                room = size
            n = min(room, n_file - at)
            out[-1].append((k, at, n))
            at += n
            room -= n
    return [p for p in out if p]


class _Dropped(Sequence[list[tuple[int, int, int]]]):
    """The pieces of a refused shard's ``nbytes`` (as :func:`_cut` of one file of that size
    would give them), each made when asked: a size a peer announced allocates nothing."""

    def __init__(self, nbytes: int, size: int) -> None:
        self.nbytes = nbytes
        self.size = size

    def __len__(self) -> int:
        return -(-self.nbytes // self.size)

    @overload
    def __getitem__(self, i: int) -> list[tuple[int, int, int]]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[list[tuple[int, int, int]]]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not 0 <= i < len(self):
            raise IndexError(i)
        at = i * self.size
        return [(0, at, min(self.size, self.nbytes - at))]


class Received(NamedTuple):
    """What a transfer received from one rank: the record (None: nothing, or refused),
    whether the copy passed its checks (and, received into the peer area, was committed),
    the slot it was committed in (None unless it was: the area may hold other copies of the
    same shard and step, such as one that failed its own check), and, received into memory
    (:class:`Into`), its files there (None unless it passed); ``local``: why this node could
    not take it, when the reason is this node's and not the copy's (another node's copy would
    fare no better)."""

    record: ShardRecord | None
    ok: bool
    slot: int | None
    files: dict[str, torch.Tensor] | None = None
    local: str = ""  # (not taken for a reason of this node's, not the copy's: no memory, a check that could not run)


class _Incoming(NamedTuple):
    """A shard being received from one rank: its record (None: refused, its bytes dropped),
    its slot and files (into the peer area), the data bytes it announced, its memory (into
    memory; slot None then)."""

    rec: ShardRecord | None
    slot: int | None
    files: list[IncomingFile]
    nbytes: int
    image: torch.Tensor | None = None  # (received into memory: the files, each at its offset of ``bases``)
    bases: tuple[int, ...] = ()
    local: str = ""  # (refused for a reason of this node's: see Received)


class ShardMover:
    """Sends and receives shards (see the module docstring).

    Args:
        transport: the groups the bytes travel on.
        area: this node's peer area, where shards received by replication rounds land.
        node: this rank's node identity.
        chunk_bytes: bytes per piece.
        max_bytes_per_s: the most bytes per second this rank sends (None: no limit).
        io: the threads that check received copies' checksums.
    """

    def __init__(self, transport: Transport, area: PeerArea, node: str, chunk_bytes: int,
                 max_bytes_per_s: float | None, io: Any) -> None:
        self.transport, self.area, self.node, self.io = transport, area, node, io
        self.chunk_bytes, self.max_bytes_per_s = chunk_bytes, max_bytes_per_s
        self._mu = threading.Lock()
        # (_mu) peer_transfer_s: seconds moving bytes, of which peer_write_wait_s waiting for the
        # writes of received pieces; peer_check_s: seconds checking received copies' checksums
        self.counts: dict[str, float] = {"peer_bytes_sent": 0, "peer_bytes_received": 0, "peer_bad_copies": 0,
                                         "peer_transfer_s": 0.0, "peer_write_wait_s": 0.0, "peer_check_s": 0.0}

    def stats(self) -> dict[str, float]:
        with self._mu:
            return dict(self.counts)

    def transfer(self, sends: Sends, recvs: list[int], *, own_node_ok: bool,
                 expect: dict[int, tuple[int, int]] | None = None, into: Into | None = None) -> dict[int, Received]:
        """Send each (rank, record, files) (record None: tell the rank there is nothing);
        receive a shard from each rank of ``recvs`` into this node's peer area, or with
        ``into`` into memory (:class:`Into`). ``expect``: per source, the only shard taken
        from it (saved rank, step); any other it sends (or any from a source not in
        ``expect``) is refused before a slot is taken or memory allocated. None: any shard is
        taken. Returns, per source, what was received (:class:`Received`). Every rank named
        on one side must name this rank on the other side in the same call."""
        t = self.transport
        wait_s = t.timeout_s if t.timeout_s is not None else t.coord.timeout_s
        heads = {s: np.zeros(3, dtype=np.int64) for s in recvs}
        t.exchange([(d, np.array([rec.step, len(rec.raw), sum(a.size for a in fs.values())] if rec is not None
                                 else [-1, 0, 0], dtype=np.int64).view(np.uint8)) for d, rec, fs in sends],
                   [(s, h.view(np.uint8)) for s, h in heads.items()])
        sends = [x for x in sends if x[1] is not None]
        for s, h in heads.items():
            if not 0 <= h[1] <= MAX_MANIFEST_BYTES or not 0 <= h[2] <= MAX_SHARD_BYTES:
                raise CkptError(f"rank {s} announced a shard record of {h[1]} bytes and {h[2]} data bytes")
        raws = {s: np.zeros(int(h[1]), dtype=np.uint8) for s, h in heads.items() if h[1]}
        t.exchange([(d, np.frombuffer(rec.raw, dtype=np.uint8).copy()) for d, rec, _ in sends if rec is not None],
                   list(raws.items()))
        incoming: dict[int, _Incoming] = {}
        out: dict[int, Received] = {}  # (also: the slots committed or aborted)
        try:
            try:
                for s in recvs:
                    want = None if expect is None else expect.get(s, (-1, -1))
                    incoming[s] = self._open(s, raws.get(s), int(heads[s][2]), own_node_ok, want, into)
                self._pump(sends, incoming)
                mapped = {s: [f.mapped() for f in inc.files] for s, inc in incoming.items()
                          if inc.rec is not None and inc.image is None}
            finally:
                for inc in incoming.values():
                    for f in inc.files:
                        f.close()
            for s, inc in incoming.items():
                rec, slot = inc.rec, inc.slot
                if rec is not None and inc.image is not None:  # (in memory: checked there, nothing to commit)
                    t0 = time.monotonic()
                    files = peer_memory.split(inc.image, rec, inc.bases)
                    try:
                        bad = peer_memory.check(rec, files, self.io, f"the copy rank {s} sent", wait_s)
                    except CkptTimeoutError:
                        raise  # (its readers may still run: the memory is not let go under them)
                    except Exception as exc:  # (not checked is not usable; the bytes have all arrived)
                        out[s] = Received(rec, False, None, None, local=f"its check could not run: {exc!r}")
                        log.warning("peer tier: the copy of step %d of rank %d could not be checked (%r); not used",
                                    rec.step, rec.rank, exc)
                        continue
                    with self._mu:
                        self.counts["peer_check_s"] += time.monotonic() - t0
                        self.counts["peer_bad_copies"] += bad is not None
                    if bad is not None:
                        log.warning("peer tier: the copy of step %d of rank %d that rank %d sent fails its check "
                                    "(%s); not used", rec.step, rec.rank, s, bad)
                    out[s] = Received(rec, bad is None, None, files if bad is None else None)
                    continue
                if rec is None or slot is None:
                    out[s] = Received(None, False, None, local=inc.local)
                    continue
                t0 = time.monotonic()
                bad = check_files(rec, dict(zip(rec.manifest.files, mapped[s], strict=True)), self.io)
                with self._mu:
                    self.counts["peer_check_s"] += time.monotonic() - t0
                if bad is None:
                    self.area.commit(rec.rank, slot, rec)
                else:
                    self.area.abort(rec.rank, slot)
                    with self._mu:
                        self.counts["peer_bad_copies"] += 1
                    log.warning("peer tier: the copy of step %d of rank %d that rank %d sent fails its check (%s); "
                                "not kept", rec.step, rec.rank, s, bad)
                out[s] = Received(rec, bad is None, slot if bad is None else None)
        except BaseException:  # a slot taken and not settled is given back, emptied (never committed)
            for s, inc in incoming.items():
                if s not in out and inc.rec is not None and inc.slot is not None:
                    self.area.abort(inc.rec.rank, inc.slot)
            raise
        return out

    def _open(self, s: int, raw: np.ndarray[Any, Any] | None, nbytes: int, own_node_ok: bool,
              expect: tuple[int, int] | None = None, into: Into | None = None) -> _Incoming:
        """Where the shard rank ``s`` announced (its record ``raw``, ``nbytes`` of data) lands:
        the files of a slot taken for it, memory (``into``), or nowhere (refused: its bytes
        are received and dropped)."""
        rec: ShardRecord | None = None
        slot = None
        files: list[IncomingFile] = []
        if raw is not None and into is not None:
            try:
                rec = _record(s, raw, expect)
                if dict(rec.manifest.files) != into.files:
                    raise CkptError(f"rank {s} sent a shard whose files ({sorted(rec.manifest.files)}) are not the "
                                    f"step's ({sorted(into.files)})")
                if sum(f.size for f in into.files.values()) != nbytes:
                    raise CkptError(f"rank {s} announced {nbytes} data bytes for files of "
                                    f"{sum(f.size for f in into.files.values())}")
            except CkptError as exc:
                log.warning("peer tier: the shard rank %d sent is not taken: %s", s, exc)
                return _Incoming(None, None, [], nbytes)
            sizes = [f.size for f in rec.manifest.files.values()]
            bases, total = peer_memory.layout(sizes)
            across = any(len(cut) > 1 for cut in _cut(sizes, self.chunk_bytes))  # (then a scratch piece, at the end)
            try:
                image = peer_memory.allocate(total + (self.chunk_bytes if across else 0), into.device)
            except CkptError as exc:
                log.warning("peer tier: the shard rank %d sent is not taken: %s", s, exc)
                return _Incoming(None, None, [], nbytes, local=str(exc))
            for k in range(1, len(bases)):  # (the bytes between files hold nothing stale)
                image[bases[k - 1] + sizes[k - 1]:bases[k]].zero_()
            return _Incoming(rec, None, [], nbytes, image, bases)
        if raw is not None:
            try:
                rec = _record(s, raw, expect)
                if not own_node_ok and rec.node == self.node:
                    raise CkptError(f"rank {s} sent a shard saved on this very node ({rec.node})")
                slot = self.area.take_slot(rec.rank)
                if slot is None:
                    raise CkptError(f"every slot of rank {rec.rank}'s shard here is held")
                files = list(self.area.receive(rec.rank, slot, rec).values())
            except (CkptError, OSError) as exc:
                log.warning("peer tier: the shard rank %d sent is not kept: %s", s, exc)
                if rec is not None and slot is not None:
                    self.area.abort(rec.rank, slot)
                rec, slot, files = None, None, []
            except BaseException:
                if rec is not None and slot is not None:
                    self.area.abort(rec.rank, slot)
                raise
        if sum(f.size for f in files) != nbytes:
            for f in files:
                f.close()
            if rec is not None and slot is not None:
                self.area.abort(rec.rank, slot)
            return _Incoming(None, None, [], nbytes)
        return _Incoming(rec, slot, files, nbytes)

    def _pump(self, sends: Sends, incoming: dict[int, _Incoming]) -> None:
        """Move the files' bytes, piece by piece, paced by ``max_bytes_per_s``. Into the peer
        area, each source's pieces are received into two buffers of ``chunk_bytes`` taken in
        turn for all of them (never an allocation of the size a peer announced); a writer
        thread writes each received piece into the files it belongs to
        (:meth:`IncomingFile.write`) while the next one travels, and a buffer is received into
        again only once its last piece is written. Into memory (allocated once the record
        passed, at the files' own sizes), a piece within one file is received straight into
        its place; one that spans files into one reused buffer, then copied into place. A
        refused shard's pieces are dropped. Returns once every write has ended."""
        size = self.chunk_bytes
        out_pieces = [(d, _pieces(list(fs.values()), size)) for d, _, fs in sends]
        in_pieces: dict[int, Sequence[list[tuple[int, int, int]]]] = {
            s: _cut([f.size for f in inc.files], size) if inc.files else
            _cut([f.size for f in inc.rec.manifest.files.values()], size) if inc.image is not None and inc.rec else
            _Dropped(inc.nbytes, size) for s, inc in incoming.items()}
        images = {s: peer_memory.InMemory(inc.image, inc.bases, size, _end(inc)) for s, inc in incoming.items()
                  if inc.image is not None}
        scratch = {s: [np.empty(min(size, inc.nbytes), dtype=np.uint8) for _ in range(2 if inc.files else 1)]
                   for s, inc in incoming.items() if inc.nbytes and s not in images}
        rounds = max([*(len(p) for _, p in out_pieces), *(len(p) for p in in_pieces.values())], default=0)
        wait_s = self.transport.timeout_s if self.transport.timeout_s is not None else self.transport.coord.timeout_s
        writes: list[Future[None] | None] = [None, None]  # the writes of the last two rounds' pieces, by buffer
        writer = DaemonPool(1, thread_name_prefix="ckptmgr-peer-write") if incoming else None
        stuck = False  # a write outlived its wait: the one below is not made again
        waited = 0.0  # seconds spent waiting for writes (peer_write_wait_s)
        # Host memory received into is fresh, and files sent are mapped afresh: a thread faults
        # their pages in ahead of the pieces, beside the transfers, rather than the thread that
        # receives or copies each piece (FAULT_AHEAD).
        regions = [(inc.image.data_ptr(), inc.image.numel(), True) for inc in incoming.values()
                   if inc.image is not None and not inc.image.is_cuda]
        regions += [(a.ctypes.data, a.size, False) for _, _, fs in sends for a in fs.values() if a.size]
        done_ahead = threading.Event()  # (set when the pump ends: the faulting stops at its next piece)
        faulter = DaemonPool(1, thread_name_prefix="ckptmgr-peer-ahead") if regions and FAULT_AHEAD else None
        faulting = faulter.submit(_fault_in, regions, size, done_ahead) if faulter is not None else None
        joined: dict[int, np.ndarray[Any, Any]] = {}  # per rank sent to: where a piece across files is joined

        def ended(w: Future[None] | None) -> None:
            nonlocal stuck, waited
            t0 = time.monotonic()
            try:
                _ended(w, wait_s)
            except CkptTimeoutError:
                stuck = True
                raise
            finally:
                waited += time.monotonic() - t0

        start, sent = time.monotonic(), 0
        try:
            for i in range(rounds):
                tx: list[tuple[int, np.ndarray[Any, Any]]] = []
                rx: list[tuple[int, Buffer]] = []
                for d, pieces in out_pieces:
                    if i < len(pieces):
                        buf = pieces[i][0] if len(pieces[i]) == 1 else _join(pieces[i], joined, d, size)
                        tx.append((d, buf))
                        sent += buf.size
                ended(writes[i % 2])  # (this round's buffers are free again)
                for s, cuts in in_pieces.items():
                    if i < len(cuts) and s in images:
                        rx.append((s, images[s].into(cuts[i])))
                    elif i < len(cuts):
                        bufs = scratch[s]
                        rx.append((s, bufs[i % len(bufs)][:sum(n for _, _, n in cuts[i])]))
                self.transport.exchange(tx, rx)
                for s, cuts in in_pieces.items():
                    if i < len(cuts) and s in images:
                        images[s].place(cuts[i])
                jobs = [(incoming[s].files, cuts[i], scratch[s][i % len(scratch[s])])
                        for s, cuts in in_pieces.items() if i < len(cuts) and incoming[s].files]
                if jobs and writer is not None:
                    writes[i % 2] = writer.submit(_write_piece, jobs)
                if self.max_bytes_per_s:  # pace: never ahead of the allowed rate
                    ahead = sent / self.max_bytes_per_s - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)
            for w in writes:
                ended(w)
            for image in images.values():  # (the copies of pieces across files have landed)
                image.settle()
        finally:  # (no write may be running once the caller closes or reads the files)
            done_ahead.set()
            if faulter is not None and faulting is not None:  # (one piece's faulting at most, after done_ahead)
                wait_futures([faulting], timeout=wait_s)
                faulter.shutdown(wait=False)
            if writer is not None:
                late = [w for w in writes if w is not None and not w.done()]
                if late and not stuck:
                    _, still = wait_futures(late, timeout=wait_s)
                    stuck = bool(still)
                if stuck:  # (the files close as it ends: IncomingFile.close waits for it at most 1 s)
                    log.warning("peer tier: a write into the peer area still runs after %g s; its copy is dropped",
                                wait_s)
                writer.shutdown(wait=False, cancel_futures=True)
        with self._mu:
            self.counts["peer_bytes_sent"] += sent
            self.counts["peer_bytes_received"] += sum(inc.nbytes for inc in incoming.values())
            self.counts["peer_transfer_s"] += time.monotonic() - start
            self.counts["peer_write_wait_s"] += waited


def _record(s: int, raw: np.ndarray[Any, Any], expect: tuple[int, int] | None) -> ShardRecord:
    """The record rank ``s`` sent, validated, and the shard ``expect`` names (saved rank, step;
    rank -1: none), if any is expected.

    Raises:
        CkptError: it is not a valid record, or not of the shard expected.
    """
    rec = ShardRecord.parse(raw.tobytes(), f"the shard record rank {s} sent")
    if expect is not None and (rec.rank, rec.step) != expect:
        raise CkptError(f"rank {s} sent the shard of rank {rec.rank} of step {rec.step}; " + (
            f"rank {expect[0]}'s of step {expect[1]} was asked for" if expect[0] >= 0 else "none was asked for"))
    return rec


def _join(parts: list[np.ndarray[Any, Any]], joined: dict[int, np.ndarray[Any, Any]], d: int,
          size: int) -> np.ndarray[Any, Any]:
    """A piece that spans files, joined into rank ``d``'s reused buffer of ``size`` bytes (made
    at the first such piece; an exchange has sent it by the time it returns)."""
    n = sum(p.size for p in parts)
    buf = joined.get(d)
    if buf is None:
        buf = joined[d] = np.empty(size, dtype=np.uint8)
    return np.concatenate(parts, out=buf[:n])


def _fault_in(regions: list[tuple[int, int, bool]], size: int, done: threading.Event) -> None:
    """Fault in the pages of each (address, bytes, for writing) of ``regions``, ``size``
    bytes at a time from the start, until ``done`` is set or the kernel cannot
    (:func:`~ckptmgr.storage.posix.populate`)."""
    for base, n, write in regions:
        for b in range(0, n, size):
            if done.is_set() or not populate(base + b, min(size, n - b), write=write):
                return


def _write_piece(jobs: list[tuple[list[IncomingFile], list[tuple[int, int, int]], np.ndarray[Any, Any]]]) -> None:
    """Write one round's received pieces: for each source, its buffer's bytes into the file
    parts its cut names (file index, offset in it, bytes)."""
    for files, cut, buf in jobs:
        at = 0
        for k, offset, n in cut:
            files[k].write(offset, buf[at:at + n])
            at += n


def _ended(write: Future[None] | None, timeout_s: float) -> None:
    """Wait for ``write`` (None: nothing to wait for) and raise its error, if any."""
    if write is None:
        return
    done, _ = wait_futures([write], timeout=timeout_s)
    if not done:
        raise CkptTimeoutError(f"writing a received piece into the peer area took over {timeout_s:g} s")
    write.result()


def _end(inc: _Incoming) -> int:
    """Where the files of a shard received into memory end in its image (the scratch piece follows)."""
    assert inc.rec is not None
    return inc.bases[-1] + list(inc.rec.manifest.files.values())[-1].size if inc.bases else 0
