"""The rounds of a peer restore's fetch (:func:`~ckptmgr.distributed.peer_restore._fetch`),
each rank a thread of one process: a barrier for the collective, a queue per direction for
the transport, real peer areas on disk and the real shard mover. The lost-node restores
between real processes (gloo) are in tests/test_peer_tier.py."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ckptmgr.distributed import peer_restore
from ckptmgr.distributed.peer_mover import ShardMover
from ckptmgr.format.checksum import chunk_ranges, crc32c_hex
from ckptmgr.format.manifest import FileRecord, Manifest
from ckptmgr.storage.peer_tier import PeerArea, ShardRecord

WAIT = 30.0  # the longest any gate, barrier or queue is waited for (a hang fails the test instead)
CHUNK = 8192
STEP = 3


class Group:
    """``n`` ranks' collective and transport: ``all_gather`` through a barrier, ``exchange``
    through one queue per direction (both ranks of an exchange name each other). ``mover``
    gives a rank its shard mover the way the restore makes it: as a collective (every rank
    must make it at the same point, or the barrier times out), counted in ``made``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=WAIT)
        self.slots: list[Any] = [None] * n
        self.whats: list[str] = [""] * n
        self.q = {(a, b): queue.Queue() for a in range(n) for b in range(n)}
        self.made = [0] * n

    def coord(self, rank: int) -> Any:
        def all_gather(value: Any, what: str) -> list[Any]:
            self.slots[rank], self.whats[rank] = value, what
            self.barrier.wait()
            out, whats = list(self.slots), list(self.whats)
            self.barrier.wait()
            assert len(set(whats)) == 1, f"the ranks are in different collectives: {whats}"
            return out
        return SimpleNamespace(rank=rank, world=self.n, all_gather=all_gather, timeout_s=WAIT)

    def transport(self, rank: int) -> Any:
        group = self

        class T:
            timeout_s = WAIT
            device = torch.device("cpu")
            coord = SimpleNamespace(timeout_s=WAIT)

            def exchange(self, sends: list[tuple[int, np.ndarray]], recvs: list[tuple[int, np.ndarray]]) -> None:
                for r, a in sends:
                    group.q[(rank, r)].put(a.copy())
                for r, dst in recvs:
                    dst[:] = group.q[(r, rank)].get(timeout=WAIT)
        return T()

    def fetching(self, rank: int, mover: ShardMover) -> Any:
        coord = self.coord(rank)

        def make() -> ShardMover:
            if not self.made[rank]:
                coord.all_gather("mover", "making the restore's transport")
                self.made[rank] = 1
            return mover
        return SimpleNamespace(mover=make, host=False)


def _record(rank: int, data: np.ndarray, world: int = 2) -> ShardRecord:
    crcs = tuple(crc32c_hex(data[b:e]) for b, e in chunk_ranges(data.size, CHUNK))
    name = f"data-r{rank:05d}-00000.safetensors"
    n = data.size - 4096
    tensors = {f"rank{rank:05d}/x": {"file": name, "dtype": "U8", "shape": [n], "offsets": [0, n]}}
    m = Manifest(step=STEP, state={"x": 1}, tensors=tensors, files={name: FileRecord(data.size, CHUNK, crcs, 4096)})
    return ShardRecord.make(m, rank, world, "A")


def _hold(area: PeerArea, rec: ShardRecord, data: np.ndarray) -> None:
    slot = area.take_slot(rec.rank)
    assert slot is not None
    files = area.create(rec.rank, slot, rec)
    next(iter(files.values()))[:] = data
    del files
    area.commit(rec.rank, slot, rec)


def _rep(area: PeerArea, node: str, nodes: list[str], io: Any) -> Any:
    return SimpleNamespace(area=area, node=node, nodes=nodes, io=io, opts=SimpleNamespace(timeout_s=WAIT),
                           count=lambda *a, **k: None)


def _restore(areas: list[PeerArea], nodes: list[str], shards: dict[int, list[int]], recs: list[ShardRecord], *,
             wrap: Any = None) -> tuple[Group, list[Any]]:
    """Every rank's ``_fetch`` of step ``STEP`` at once (rank r on node ``nodes[r]``, its
    area ``areas[r]``; its sources: the holders of its shard on other nodes; its files:
    those of ``recs[r]``), each rank's own copies checked by ``_OwnCheck``. Returns the
    group and, per rank, ((shard fetched, why), the own check's files, its why)."""
    n = len(nodes)
    group = Group(n)
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def rank(r: int, io: Any) -> None:
        try:
            rep = _rep(areas[r], nodes[r], nodes, io)
            mover = ShardMover(group.transport(r), areas[r], nodes[r], CHUNK, None, io)
            if wrap is not None:
                wrap(r, mover)
            copies = [c for c in areas[r].copies() if c.rank == r]
            own = peer_restore._OwnCheck(rep, STEP, copies) if copies else None
            sources = [h for h in shards.get(r, []) if nodes[h] != nodes[r]]
            try:
                got = peer_restore._fetch(rep, group.fetching(r, mover), group.coord(r), STEP, shards, own=own,
                                          sources=sources, files=dict(recs[r].manifest.files))
            finally:
                if own is not None:
                    own.close()
            out[r] = (got, own.local if own is not None else None, own.why if own is not None else None)
        except BaseException as exc:  # (reported by the main thread)
            errors.append(exc)
            group.barrier.abort()

    with ThreadPoolExecutor(4) as io:
        threads = [threading.Thread(target=rank, args=(r, io), daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 2)
    assert not errors, errors
    assert all(o is not None for o in out), "a rank did not finish its fetch"
    return group, out


def _bytes(fetched: Any) -> bytes:
    """The one file of a fetched shard, as it landed in memory."""
    (image,) = fetched.files.values()
    return image.numpy().tobytes()


def _areas(tmp_path: Any, nodes: list[str]) -> list[PeerArea]:
    for n in set(nodes):
        (tmp_path / n).mkdir(exist_ok=True)
    return [PeerArea(str(tmp_path / n), str(tmp_path / "root")) for n in nodes]


def _data(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, 5 * CHUNK, dtype=np.uint8) for _ in range(n)]


def test_a_rank_checks_its_own_copy_while_the_first_round_moves_another_ranks_shard(tmp_path, monkeypatch):
    """Rank 0 (node A) holds its own shard and rank 1's replica; rank 1 comes back on an empty
    node B and fetches its shard from rank 0. Rank 0's check of its own copy is held until rank
    1 has received its shard: the restore goes through only because that check runs beside
    the first round's transfer (a check made before the rounds, or waited for in the first
    one, would hold rank 0 and the transfer with it). Rank 1 receives its shard bit-exact,
    in memory (node B's peer area stays empty), rank 0 keeps its own copy."""
    data = _data(2)
    recs = [_record(r, data[r]) for r in range(2)]
    areas = _areas(tmp_path, ["A", "B"])
    try:
        _hold(areas[0], recs[0], data[0])
        _hold(areas[0], recs[1], data[1])
        received = threading.Event()
        verify = PeerArea.verify

        def gated(self: PeerArea, copy: Any, pool: Any = None) -> str | None:
            assert received.wait(WAIT), "rank 0's own check was waited for before rank 1's shard could travel"
            return verify(self, copy, pool)

        monkeypatch.setattr(PeerArea, "verify", gated)

        def wrap(r: int, mover: ShardMover) -> None:
            transfer = mover.transfer

            def watched(*a: Any, **k: Any) -> Any:
                got = transfer(*a, **k)
                if r == 1 and got:
                    received.set()
                return got
            mover.transfer = watched  # type: ignore[method-assign]

        _, out = _restore(areas, ["A", "B"], {0: [0], 1: [0]}, recs, wrap=wrap)
        ((fetched0, _), local0, _), ((fetched1, why1), local1, _) = out
        assert fetched0 is None and local0 and local1 is None
        assert fetched1 is not None and fetched1.record.rank == 1 and why1 == ""
        assert _bytes(fetched1) == data[1].tobytes() and areas[1].copies() == []
    finally:
        for a in areas:
            a.close()


def test_ranks_whose_own_copies_pass_move_nothing_and_never_make_the_transport(tmp_path):
    """Every rank holds a good copy of its own shard: one round says "checking", the next
    ends the fetch; no rank asked, so the restore's transport (a collective) is never made."""
    data = _data(2)
    areas = _areas(tmp_path, ["A", "B"])
    try:
        recs = [_record(r, data[r]) for r in range(2)]
        for r in range(2):
            _hold(areas[r], recs[r], data[r])
        group, out = _restore(areas, ["A", "B"], {0: [0], 1: [1]}, recs)
        assert [o[0] for o in out] == [(None, ""), (None, "")] and all(o[1] for o in out)
        assert group.made == [0, 0]
    finally:
        for a in areas:
            a.close()


def test_a_copy_of_its_own_that_fails_its_check_is_replaced_by_the_peers_good_one(tmp_path):
    """Rank 0's own copy on node A has one byte changed; node B holds a good replica. Rank 0
    asks for it once its check has failed (the second round) and the fetch returns the copy
    received (bit-exact, in memory), never the bad one. The bad copy is removed, so node A's
    slots are free for the next saves' copies."""
    data = _data(2)
    recs = [_record(r, data[r]) for r in range(2)]
    areas = _areas(tmp_path, ["A", "B"])
    try:
        bad = data[0].copy()
        bad[100] ^= 0xFF
        _hold(areas[0], recs[0], bad)
        _hold(areas[1], recs[1], data[1])
        _hold(areas[1], recs[0], data[0])
        group, out = _restore(areas, ["A", "B"], {0: [0, 1], 1: [1]}, recs)
        (fetched0, why0), local0, ownwhy0 = out[0]
        assert "fails its check" in ownwhy0 and not local0
        assert fetched0 is not None and fetched0.record.rank == 0 and why0 == ""
        assert _bytes(fetched0) == data[0].tobytes()
        assert [c for c in areas[0].copies() if c.rank == 0] == []
        slots = [areas[0].take_slot(0), areas[0].take_slot(0)]
        assert None not in slots and len(set(slots)) == 2
        for slot in slots:
            areas[0].abort(0, slot)
        assert group.made == [1, 1]
    finally:
        for a in areas:
            a.close()


def test_a_rank_no_transfer_involves_still_makes_the_transport_with_the_others(tmp_path):
    """Three ranks: 0 and 1 on node A (their own copies good), 2 back on an empty node B,
    fetching its shard from node A (rank 0, which speaks for it). Rank 1 neither sends nor
    receives, yet makes the restore's transport at the same round as the others (it is a
    collective): otherwise the others would wait for it until the barrier timed out."""
    data = _data(3)
    recs = [_record(r, data[r], world=3) for r in range(3)]
    areas = _areas(tmp_path, ["A", "A", "B"])
    try:
        for r in range(3):
            _hold(areas[0], recs[r], data[r])
        group, out = _restore(areas, ["A", "A", "B"], {0: [0], 1: [0], 2: [0]}, recs)
        fetched2, why2 = out[2][0]
        assert fetched2 is not None and fetched2.record.rank == 2 and why2 == ""
        assert _bytes(fetched2) == data[2].tobytes()
        assert group.made == [1, 1, 1] and out[1][0] == (None, "") and out[1][1]
    finally:
        for a in areas:
            a.close()


def test_a_shard_this_node_has_no_memory_for_is_asked_of_no_other_node(tmp_path, monkeypatch):
    """Rank 1 comes back on an empty node B; nodes A and C each hold a copy of its shard. B
    has no memory for it: that is B's own failure, which another node's copy would meet
    too, so rank 1 asks once and then no more (its shard then comes from the durable target)."""
    from ckptmgr.distributed import peer_memory

    data = _data(3)
    recs = [_record(r, data[r], world=3) for r in range(3)]
    areas = _areas(tmp_path, ["A", "B", "C"])
    try:
        _hold(areas[0], recs[0], data[0])
        _hold(areas[0], recs[1], data[1])
        _hold(areas[2], recs[1], data[1])
        _hold(areas[2], recs[2], data[2])
        monkeypatch.setattr(peer_memory, "available", lambda: 1000)
        asked: list[int] = []

        def wrap(r: int, mover: ShardMover) -> None:
            transfer = mover.transfer

            def counted(sends: Any, recvs: list[int], **k: Any) -> Any:
                if r == 1:
                    asked.extend(recvs)
                return transfer(sends, recvs, **k)
            mover.transfer = counted  # type: ignore[method-assign]

        _, out = _restore(areas, ["A", "B", "C"], {0: [0], 1: [0, 2], 2: [2]}, recs, wrap=wrap)
        (fetched1, why1), _, _ = out[1]
        assert fetched1 is None and "this node could not take" in why1 and "no memory" in why1
        assert asked == [0]
    finally:
        for a in areas:
            a.close()


def test_a_shard_of_no_files_fetched_is_a_shard_fetched(tmp_path):
    """A rank that saved no tensors of its own has a shard of no files: received, it is
    usable (nothing to check), not a failure to try elsewhere."""
    data = _data(1)
    recs = [_record(0, data[0]), ShardRecord.make(Manifest(step=STEP, state={"x": 1}, tensors={}, files={}), 1, 2, "A")]
    areas = _areas(tmp_path, ["A", "B"])
    try:
        _hold(areas[0], recs[0], data[0])
        slot = areas[0].take_slot(1)
        assert slot is not None
        assert areas[0].create(1, slot, recs[1]) == {}
        areas[0].commit(1, slot, recs[1])
        _, out = _restore(areas, ["A", "B"], {0: [0], 1: [0]}, recs)
        (fetched1, why1), _, _ = out[1]
        assert fetched1 is not None and fetched1.files == {} and why1 == ""
    finally:
        for a in areas:
            a.close()
