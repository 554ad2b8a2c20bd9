"""The peer tier's shard mover writes each received piece on a writer thread while the next
piece travels (:meth:`~ckptmgr.distributed.peer_mover.ShardMover.transfer`), in one process:
a loopback transport hands each sent piece to the receive buffer of the same round, and a gate
holds the writer. The lock-step exchanges between real processes (gloo, NCCL) are in
tests/test_peer_tier.py."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from ckptmgr.distributed import peer_mover
from ckptmgr.distributed.peer_mover import ShardMover
from ckptmgr.errors import CkptError
from ckptmgr.format.checksum import chunk_ranges, crc32c_hex
from ckptmgr.format.manifest import FileRecord, Manifest
from ckptmgr.storage.peer_tier import IncomingFile, PeerArea, ShardRecord

WAIT = 30.0  # the longest any gate or event is waited for (a hang fails the test instead)
CHUNK = 8192


class Loopback:
    """A transport whose exchange gives each piece sent to this rank's own receive of the same
    round (one rank that sends to and receives from itself), calling ``seen`` first with the
    round's receive buffers (round 0: the first piece; the header and the record travel in the
    two exchanges before it, rounds -2 and -1)."""

    def __init__(self, seen: Any) -> None:
        self.timeout_s = WAIT
        self.coord = SimpleNamespace(timeout_s=WAIT)
        self.seen = seen
        self.rounds = -2

    def exchange(self, sends: list[tuple[int, np.ndarray]], recvs: list[tuple[int, np.ndarray]]) -> None:
        self.seen(self.rounds, [a for _, a in recvs])
        for (_, src), (_, dst) in zip(sends, recvs, strict=True):
            dst[:] = src
        self.rounds += 1


def _shard(data: np.ndarray) -> tuple[ShardRecord, dict[str, np.ndarray]]:
    crcs = tuple(crc32c_hex(data[b:e]) for b, e in chunk_ranges(data.size, CHUNK))
    name = "data-r00000-00000.safetensors"
    n = data.size - 4096
    tensors = {"rank00000/x": {"file": name, "dtype": "U8", "shape": [n], "offsets": [0, n]}}
    m = Manifest(step=3, state={"x": 1}, tensors=tensors, files={name: FileRecord(data.size, CHUNK, crcs, 4096)})
    return ShardRecord.make(m, 0, 1, "A"), {name: data}


def _transfer(tmp_path, seen, data):
    (tmp_path / "node").mkdir(exist_ok=True)
    area = PeerArea(str(tmp_path / "node"), str(tmp_path / "root"))
    rec, files = _shard(data)
    try:
        with ThreadPoolExecutor(2) as io:
            mover = ShardMover(Loopback(seen), area, "B", CHUNK, None, io)
            got = mover.transfer([(0, rec, files)], [0], own_node_ok=True)
        copies = area.copies()
        held = None
        if copies:
            with area.mapped(copies[0]) as m:
                held = next(iter(m.values())).tobytes()
        return got, held
    finally:
        area.close()


def test_a_piece_travels_while_the_one_before_is_written_and_no_buffer_is_refilled_before_its_write_ends(
        tmp_path, monkeypatch):
    """Round 1's exchange runs while round 0's write is held; round 2's, which reuses round 0's
    buffer, waits for that write; every piece lands where it belongs and the copy is kept."""
    data = np.random.default_rng(5).integers(0, 256, 6 * CHUNK + 123, dtype=np.uint8)
    release = threading.Event()
    in_write: set[int] = set()  # buffer addresses being written now
    mu = threading.Lock()
    late: list[int] = []  # rounds whose receive buffer was being written when they began
    first_ahead = threading.Event()  # round 1 began while round 0's write was held
    real = peer_mover._write_piece

    def gated(jobs):
        addrs = {buf.__array_interface__["data"][0] for _, _, buf in jobs}
        with mu:
            in_write.update(addrs)
        try:
            if not release.is_set():
                assert release.wait(WAIT), "the test never released the first write"
            real(jobs)
        finally:
            with mu:
                in_write.difference_update(addrs)

    def seen(i, bufs):
        with mu:
            if any(b.__array_interface__["data"][0] in in_write for b in bufs):
                late.append(i)
        if i == 1:
            first_ahead.set()
        if i == 2:
            release.set()  # (a mover that did not wait would be here with round 0's write still held)

    monkeypatch.setattr(peer_mover, "_write_piece", gated)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["out"] = _transfer(tmp_path, seen, data)
        except BaseException as exc:  # (raised below, on the test's thread)
            result["error"] = exc
            first_ahead.set()

    t = threading.Thread(target=run)
    t.start()
    try:
        assert first_ahead.wait(WAIT), "round 1 did not start while round 0 was being written"
        if "error" in result:
            raise result["error"]
        assert not release.is_set()  # round 2 has not begun: it waits for round 0's write
        release.set()
    finally:
        release.set()
        t.join(WAIT)
    assert not t.is_alive()
    got, held = result["out"]
    assert late == []
    assert got[0][1] is True and held == data.tobytes()


def _closes_watched(monkeypatch) -> tuple[list[bool], Any, threading.Event]:
    """Record, at every IncomingFile.close, whether a piece was being written then; returns
    (that record, a wrapper of _write_piece that marks its writes, the mark)."""
    running = threading.Event()
    record: list[bool] = []
    real_close, real_write = IncomingFile.close, peer_mover._write_piece

    def close(self):
        record.append(running.is_set())
        real_close(self)

    def write(jobs):
        running.set()
        try:
            real_write(jobs)
        finally:
            running.clear()

    monkeypatch.setattr(IncomingFile, "close", close)
    return record, write, running


@pytest.mark.parametrize("fails", [2, 4])
def test_a_failed_write_fails_the_transfer_after_every_write_has_ended_and_gives_the_slot_back(tmp_path, monkeypatch,
                                                                                             fails):
    """A write that fails (the second piece's, or the last one's: never taken for a bad copy
    from the sender) fails the transfer with its error and gives the slot back. (No write is
    still running when these files close; a close while one runs is the next test's case.)"""
    data = np.random.default_rng(6).integers(0, 256, 4 * CHUNK, dtype=np.uint8)
    calls = []
    closes, write, _ = _closes_watched(monkeypatch)

    def failing(jobs):
        calls.append(len(calls))
        if len(calls) == fails:
            raise OSError(28, "No space left on device")
        write(jobs)

    monkeypatch.setattr(peer_mover, "_write_piece", failing)
    with pytest.raises(OSError, match="No space left"):
        _transfer(tmp_path, lambda i, bufs: None, data)
    assert closes and not any(closes)
    area = PeerArea(str(tmp_path / "node"), str(tmp_path / "root"))
    try:
        assert area.copies() == []
        slot = area.take_slot(0)  # (the slot taken for the failed copy was given back)
        assert slot is not None
        area.abort(0, slot)
    finally:
        area.close()


def test_an_exchange_that_fails_while_a_piece_is_written_closes_the_files_only_after_that_write(tmp_path,
                                                                                                monkeypatch):
    """Round 2's exchange fails while round 1's piece is being written: the transfer raises the
    exchange's error, and the files are closed only once that write has ended (it is let go as
    the exchange fails, and then given a moment in which a close would be seen)."""
    data = np.random.default_rng(7).integers(0, 256, 6 * CHUNK, dtype=np.uint8)
    closes, write, running = _closes_watched(monkeypatch)
    go = threading.Event()
    never = threading.Event()

    def gated(jobs):
        if len(calls) == 1:  # round 1's piece
            calls.append(1)
            running.set()
            assert go.wait(WAIT)
            never.wait(0.3)  # (a window in which a close that does not wait for this write is seen)
        else:
            calls.append(0)
        write(jobs)

    calls: list[int] = []

    def seen(i, bufs):
        if i == 2:
            go.set()
            raise ConnectionError("peer gone")

    monkeypatch.setattr(peer_mover, "_write_piece", gated)
    with pytest.raises(ConnectionError, match="peer gone"):
        _transfer(tmp_path, seen, data)
    assert closes and not any(closes)


def test_a_write_after_close_is_refused_rather_than_written_to_a_reused_descriptor(tmp_path):
    (tmp_path / "node").mkdir()
    area = PeerArea(str(tmp_path / "node"), str(tmp_path / "root"))
    try:
        rec, _ = _shard(np.zeros(2 * CHUNK, dtype=np.uint8))
        slot = area.take_slot(0)
        assert slot is not None
        f = next(iter(area.receive(0, slot, rec).values()))
        f.close()
        with pytest.raises(CkptError, match="closed"):
            f.write(0, np.ones(16, dtype=np.uint8))
        area.abort(0, slot)
    finally:
        area.close()


def test_closing_a_file_while_a_write_runs_waits_at_most_its_bound_and_the_write_closes_it_as_it_ends(
        tmp_path, monkeypatch):
    """close() waits for a running write at most ``_CLOSE_WAIT_S`` (here 0.05 s; the join
    allows 200 times that), then leaves the descriptor to the write, which closes it as it ends."""
    from ckptmgr.storage import peer_tier

    monkeypatch.setattr(peer_tier, "_CLOSE_WAIT_S", 0.05)
    (tmp_path / "node").mkdir()
    area = PeerArea(str(tmp_path / "node"), str(tmp_path / "root"))
    inside, release = threading.Event(), threading.Event()
    real = peer_tier.pwrite_all

    def held(fd, data, offset):
        inside.set()
        assert release.wait(WAIT)
        real(fd, data, offset)

    try:
        rec, _ = _shard(np.zeros(2 * CHUNK, dtype=np.uint8))
        slot = area.take_slot(0)
        assert slot is not None
        f = next(iter(area.receive(0, slot, rec).values()))
        monkeypatch.setattr(peer_tier, "pwrite_all", held)
        w = threading.Thread(target=f.write, args=(0, np.ones(16, dtype=np.uint8)))
        w.start()
        assert inside.wait(WAIT)
        closer = threading.Thread(target=f.close)
        closer.start()
        closer.join(10.0)
        assert not closer.is_alive()  # it did not wait for the write (still held at the gate)
        assert f.fd is not None  # (the write still uses it: not closed under it)
        release.set()
        w.join(WAIT)
        assert not w.is_alive() and f.fd is None  # the write closed it as it ended
        area.abort(0, slot)
    finally:
        release.set()
        area.close()


def test_a_write_that_outlasts_the_transfers_timeout_fails_it_and_the_write_closes_its_file_as_it_ends(
        tmp_path, monkeypatch):
    """The second piece's write is held past the transport's timeout (0.3 s here): the transfer
    fails with CkptTimeoutError naming the write and gives its slot back; the held write keeps
    its descriptor (never closed under it) and closes it as it ends."""
    from ckptmgr.errors import CkptTimeoutError
    from ckptmgr.storage import peer_tier

    monkeypatch.setattr(peer_tier, "_CLOSE_WAIT_S", 0.05)
    data = np.random.default_rng(8).integers(0, 256, 6 * CHUNK, dtype=np.uint8)
    rec, files = _shard(data)
    (tmp_path / "node").mkdir()
    area = PeerArea(str(tmp_path / "node"), str(tmp_path / "root"))
    real = peer_tier.pwrite_all
    held, release, ended = threading.Event(), threading.Event(), threading.Event()
    opened: list[IncomingFile] = []
    calls: list[int] = []
    real_receive = PeerArea.receive

    def receive(self, *a, **k):
        out = real_receive(self, *a, **k)
        opened.extend(out.values())
        return out

    def slow(fd, data, offset):
        calls.append(offset)
        if len(calls) == 2:
            held.set()
            assert release.wait(WAIT)
        real(fd, data, offset)
        if len(calls) == 2:
            ended.set()

    closed = threading.Event()
    real_close_fd = IncomingFile._close_fd

    def close_fd(self):
        real_close_fd(self)
        closed.set()

    monkeypatch.setattr(PeerArea, "receive", receive)
    monkeypatch.setattr(peer_tier, "pwrite_all", slow)
    monkeypatch.setattr(IncomingFile, "_close_fd", close_fd)
    loop = Loopback(lambda i, bufs: None)
    loop.timeout_s = 0.3
    try:
        with ThreadPoolExecutor(2) as io:
            mover = ShardMover(loop, area, "B", CHUNK, None, io)
            with pytest.raises(CkptTimeoutError, match="writing a received piece"):
                mover.transfer([(0, rec, files)], [0], own_node_ok=True)
        assert held.is_set() and not ended.is_set() and not closed.is_set()
        [f] = opened
        assert f.fd is not None  # (the held write still uses it)
        assert area.copies() == []
        slot = area.take_slot(0)  # (the slot taken for the failed copy was given back)
        assert slot is not None
        area.abort(0, slot)
        release.set()
        assert ended.wait(WAIT) and closed.wait(WAIT)  # (the write closes it as it ends)
        assert f.fd is None
    finally:
        release.set()
        area.close()


def test_a_refused_shards_pieces_are_cut_as_its_bytes_arrive_whatever_size_it_announced():
    """A refused shard's bytes are dropped piece by piece; its pieces are those of one file of
    the announced size, made when asked (16 TiB announced allocates nothing up front)."""
    for n in (0, 1, CHUNK - 1, CHUNK, 5 * CHUNK + 7):
        assert list(peer_mover._Dropped(n, CHUNK)) == peer_mover._cut([n], CHUNK)
    big = peer_mover._Dropped(peer_mover.MAX_SHARD_BYTES, CHUNK)
    assert len(big) == peer_mover.MAX_SHARD_BYTES // CHUNK
    assert big[len(big) - 1] == [(0, peer_mover.MAX_SHARD_BYTES - CHUNK, CHUNK)]
    with pytest.raises(IndexError):
        big[len(big)]


def test_a_close_that_fails_forgets_the_descriptor_so_its_number_is_never_closed_again(tmp_path, monkeypatch):
    """close(2) frees the number even when it reports an error (EIO): a write's end that
    closes the file and fails, then the close() that waited for it, never close the number
    again (another file opened meanwhile may hold it)."""
    from ckptmgr.storage import peer_tier

    monkeypatch.setattr(peer_tier, "_CLOSE_WAIT_S", 0.05)
    fd = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, 4096)
    f = IncomingFile(fd, 4096, "a")
    inside, release = threading.Event(), threading.Event()
    real_pwrite, real_close = peer_tier.pwrite_all, os.close
    victim: list[int] = []

    def held(fd_, data, offset):
        inside.set()
        assert release.wait(WAIT)
        real_pwrite(fd_, data, offset)

    class EioOs:  # os.close frees the number, another file takes it at once, then close reports EIO
        def __getattr__(self, name):
            return getattr(os, name)

        def close(self, n):
            real_close(n)
            if not victim:
                victim.append(os.open(tmp_path / "b", os.O_RDWR | os.O_CREAT))
                raise OSError(5, "EIO")

    monkeypatch.setattr(peer_tier, "pwrite_all", held)
    monkeypatch.setattr(peer_tier, "os", EioOs())
    raised: list[BaseException] = []

    def write():
        try:
            f.write(0, np.zeros(16, dtype=np.uint8))
        except OSError as exc:  # (the write's end closed the file: EIO)
            raised.append(exc)

    w = threading.Thread(target=write)
    w.start()
    try:
        assert inside.wait(WAIT)
        closer = threading.Thread(target=f.close)
        closer.start()
        closer.join(10.0)  # (it waited its 0.05 s and left the close to the write)
        assert not closer.is_alive()
        release.set()
        w.join(WAIT)
        assert victim and f.fd is None and raised
        f.close()  # (again: nothing left to close)
        os.fstat(victim[0])  # the file that took the number is still open
    finally:
        release.set()
        for n in victim:
            real_close(n)


@pytest.mark.parametrize("expect", [{0: (1, 3)}, {0: (0, 2)}, {}])
def test_a_transfer_takes_only_the_shard_it_expects_from_each_source(tmp_path, expect):
    """A restore's fetch asks a source for one shard, a replication round expects each
    source's own shard of the round's step (saved rank, step); a shard of another rank or
    step, or one from a source nothing is expected from, is refused before a slot is taken:
    its bytes are drained and nothing lands in the area. The shard expected is kept."""
    data = np.random.default_rng(10).integers(0, 256, 3 * CHUNK, dtype=np.uint8)
    (tmp_path / "node").mkdir()
    area = PeerArea(str(tmp_path / "node"), str(tmp_path / "root"))
    rec, files = _shard(data)
    try:
        with ThreadPoolExecutor(2) as io:
            mover = ShardMover(Loopback(lambda i, bufs: None), area, "B", CHUNK, None, io)
            got = mover.transfer([(0, rec, files)], [0], own_node_ok=True, expect=expect)
            assert got == {0: (None, False, None, None, "")} and area.copies() == []
            assert mover.stats()["peer_bytes_received"] == data.size  # (drained)
            mover = ShardMover(Loopback(lambda i, bufs: None), area, "B", CHUNK, None, io)
            got = mover.transfer([(0, rec, files)], [0], own_node_ok=True, expect={0: (0, 3)})
        assert got[0].ok and [c.slot for c in area.copies()] == [got[0].slot]
    finally:
        area.close()
