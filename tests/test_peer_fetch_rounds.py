"""The rounds of a peer restore's fetch (:func:`~ckptmgr.distributed.peer_restore._fetch`),
two ranks as two threads of one process: a barrier for the collective, a loopback pair for
the transport, real peer areas on disk and the real shard mover. The lost-node restores
between real processes (gloo) are in tests/test_peer_tier.py."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np

from ckptmgr.distributed import peer_restore
from ckptmgr.distributed.peer_mover import ShardMover
from ckptmgr.format.checksum import chunk_ranges, crc32c_hex
from ckptmgr.format.manifest import FileRecord, Manifest
from ckptmgr.storage.peer_tier import PeerArea, ShardRecord

WAIT = 30.0  # the longest any gate, barrier or queue is waited for (a hang fails the test instead)
CHUNK = 8192
STEP = 3


class Pair:
    """Two ranks' collective and transport: ``all_gather`` through a barrier, ``exchange``
    through one queue per direction (both ranks of an exchange name each other)."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=WAIT)
        self.slots: list[Any] = [None, None]
        self.q = {(a, b): queue.Queue() for a in (0, 1) for b in (0, 1)}

    def coord(self, rank: int) -> Any:
        def all_gather(value: Any, what: str) -> list[Any]:
            self.slots[rank] = value
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return SimpleNamespace(rank=rank, world=2, all_gather=all_gather, timeout_s=WAIT)

    def transport(self, rank: int) -> Any:
        pair = self

        class T:
            timeout_s = WAIT
            coord = SimpleNamespace(timeout_s=WAIT)

            def exchange(self, sends: list[tuple[int, np.ndarray]], recvs: list[tuple[int, np.ndarray]]) -> None:
                for r, a in sends:
                    pair.q[(rank, r)].put(a.copy())
                for r, dst in recvs:
                    dst[:] = pair.q[(r, rank)].get(timeout=WAIT)
        return T()


def _record(rank: int, data: np.ndarray) -> ShardRecord:
    crcs = tuple(crc32c_hex(data[b:e]) for b, e in chunk_ranges(data.size, CHUNK))
    name = f"data-r{rank:05d}-00000.safetensors"
    n = data.size - 4096
    tensors = {f"rank{rank:05d}/x": {"file": name, "dtype": "U8", "shape": [n], "offsets": [0, n]}}
    m = Manifest(step=STEP, state={"x": 1}, tensors=tensors, files={name: FileRecord(data.size, CHUNK, crcs, 4096)})
    return ShardRecord.make(m, rank, 2, "A")


def _hold(area: PeerArea, rec: ShardRecord, data: np.ndarray) -> None:
    slot = area.take_slot(rec.rank)
    assert slot is not None
    files = area.create(rec.rank, slot, rec)
    next(iter(files.values()))[:] = data
    del files
    area.commit(rec.rank, slot, rec)


def _rep(area: PeerArea, node: str, io: Any) -> Any:
    return SimpleNamespace(area=area, node=node, nodes=["A", "B"], io=io, opts=SimpleNamespace(timeout_s=WAIT),
                           count=lambda *a, **k: None)


def test_a_rank_checks_its_own_copy_while_the_first_round_moves_another_ranks_shard(tmp_path, monkeypatch):
    """Rank 0 (node A) holds its own shard and rank 1's replica; rank 1 comes back on an empty
    node B and fetches its shard from rank 0. Rank 0's check of its own copy is held until rank
    1 has received its shard: the restore goes through only because that check runs beside
    the first round's transfer (a check made before the rounds, or waited for in the first
    one, would hold rank 0 and the transfer with it). Rank 1 receives its shard bit-exact,
    rank 0 keeps its own copy."""
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, 5 * CHUNK, dtype=np.uint8) for _ in range(2)]
    recs = [_record(r, data[r]) for r in range(2)]
    for n in ("A", "B"):
        (tmp_path / n).mkdir()
    areas = [PeerArea(str(tmp_path / n), str(tmp_path / "root")) for n in ("A", "B")]
    _hold(areas[0], recs[0], data[0])
    _hold(areas[0], recs[1], data[1])
    received = threading.Event()
    verify = PeerArea.verify

    def gated(self: PeerArea, copy: Any, pool: Any = None) -> str | None:
        assert received.wait(WAIT), "rank 0's own check was waited for before rank 1's shard could travel"
        return verify(self, copy, pool)

    monkeypatch.setattr(PeerArea, "verify", gated)
    pair = Pair()
    out: list[Any] = [None, None]
    errors: list[BaseException] = []

    def rank(r: int, io: Any) -> None:
        try:
            rep = _rep(areas[r], "AB"[r], io)
            mover = ShardMover(pair.transport(r), areas[r], "AB"[r], CHUNK, None, io)
            transfer = mover.transfer

            def watched(*a: Any, **k: Any) -> Any:
                got = transfer(*a, **k)
                if r == 1 and got:
                    received.set()
                return got
            mover.transfer = watched  # type: ignore[method-assign]
            fetching = SimpleNamespace(mover=lambda: mover)
            copies = [c for c in areas[r].copies() if c.rank == r]
            own = peer_restore._OwnCheck(rep, STEP, copies) if copies else None
            try:
                got = peer_restore._fetch(rep, fetching, pair.coord(r), STEP, {0: [0], 1: [0]}, own=own,
                                          sources=[0] if r == 1 else [])
            finally:
                if own is not None:
                    own.close()
            out[r] = (got, own.local if own is not None else None)
        except BaseException as exc:  # (reported by the main thread)
            errors.append(exc)
            pair.barrier.abort()

    with ThreadPoolExecutor(4) as io:
        threads = [threading.Thread(target=rank, args=(r, io)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 2)
    try:
        assert not errors, errors
        (fetched0, _), local0 = out[0]
        (fetched1, why1), local1 = out[1]
        assert fetched0 is None and local0 and local1 is None
        assert fetched1 is not None and fetched1.rank == 1 and why1 == ""
        with areas[1].mapped(fetched1) as m:
            assert next(iter(m.values())).tobytes() == data[1].tobytes()
    finally:
        for a in areas:
            a.close()

