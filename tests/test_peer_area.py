"""The peer area of a node's tier directory (ckptmgr/storage/peer_tier.py), in one process:
slot reuse, "never give up the newest", records as untrusted input, checksums."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from ckptmgr.errors import CheckpointCorruptError
from ckptmgr.format.checksum import chunk_ranges, crc32c_hex
from ckptmgr.format.manifest import FileRecord, Manifest
from ckptmgr.storage.peer_tier import PeerArea, ShardRecord, check_files
from ckptmgr.storage.private import UnsafePathError

CHUNK = 4096


def _record(step: int, rank: int, data: bytes, node: str = "a") -> ShardRecord:
    arr = np.frombuffer(data, dtype=np.uint8)
    crcs = tuple(crc32c_hex(arr[b:e]) for b, e in chunk_ranges(arr.size, CHUNK))
    name = f"data-r{rank:05d}-00000.safetensors"
    n = arr.size - 4096  # the data region, after a 4096-byte header
    tensors = {f"rank{rank:05d}/x": {"file": name, "dtype": "U8", "shape": [n], "offsets": [0, n]}}
    m = Manifest(step=step, state={"x": 1}, tensors=tensors, files={name: FileRecord(arr.size, CHUNK, crcs, 4096)})
    return ShardRecord.make(m, rank, 2, node)


def _write(area: PeerArea, rec: ShardRecord, data: bytes) -> int:
    slot = area.take_slot(rec.rank)
    assert slot is not None
    files = area.create(rec.rank, slot, rec)
    next(iter(files.values()))[:] = np.frombuffer(data, dtype=np.uint8)
    area.commit(rec.rank, slot, rec)
    return slot


def test_a_record_round_trips_and_its_state_travels_beside_the_manifest():
    rec = _record(7, 1, bytes(range(256)) * 40)
    back = ShardRecord.parse(rec.raw, "here")
    assert (back.step, back.rank, back.world, back.node) == (7, 1, 2, "a")
    assert back.manifest.state == {"x": 1} and back.manifest.files == rec.manifest.files


@pytest.mark.parametrize("damage", ["truncate", "flip", "other-rank", "path"])
def test_a_damaged_or_crafted_record_is_refused(damage):
    rec = _record(7, 1, b"x" * 9000)
    raw = rec.raw
    if damage == "truncate":
        raw = raw[:len(raw) // 2]
    elif damage == "flip":
        raw = raw[:-40] + bytes([raw[-40] ^ 1]) + raw[-39:]
    elif damage == "other-rank":  # a file named for another rank
        raw = ShardRecord.make(rec.manifest, 0, 2, "a").raw
    else:
        name = "data-r00001-../../x.safetensors"
        tensors = {k: {**v, "file": name} for k, v in rec.manifest.tensors.items()}
        m = Manifest(step=7, state=None, tensors=tensors, files={name: next(iter(rec.manifest.files.values()))})
        raw = ShardRecord.make(m, 1, 2, "a").raw
    with pytest.raises(CheckpointCorruptError):
        ShardRecord.parse(raw, "here")


def test_slots_are_reused_but_the_newest_copy_is_never_given_up(tmp_path):
    area = PeerArea(str(tmp_path), "/root/of/job")
    for step in (1, 2, 3, 4):
        _write(area, _record(step, 0, bytes([step]) * 9000), bytes([step]) * 9000)
        steps = sorted(c.record.step for c in area.copies())
        assert steps == ([step] if step == 1 else [step - 1, step])  # 2 slots: the newest and the one before
    newest = next(c for c in area.copies() if c.record.step == 4)
    assert area.verify(newest) is None
    # while the older copy is read, the only slot that may be taken is... none: the newest stays
    older = next(c for c in area.copies() if c.record.step == 3)
    with area.mapped(older):
        assert area.take_slot(0) is None
    assert area.take_slot(0) == older.slot  # once the read ends
    area.abort(0, older.slot)
    assert [c.record.step for c in area.copies()] == [4]


def test_a_writer_waits_for_a_reader_of_the_slot_it_needs(tmp_path):
    area = PeerArea(str(tmp_path), "/root")
    _write(area, _record(1, 0, b"a" * 9000), b"a" * 9000)
    _write(area, _record(2, 0, b"b" * 9000), b"b" * 9000)
    older = next(c for c in area.copies() if c.record.step == 1)
    got: list[int | None] = []
    entered, leave = threading.Event(), threading.Event()

    def reader() -> None:
        with area.mapped(older):
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=reader)
    t.start()
    assert entered.wait(30)
    w = threading.Thread(target=lambda: got.append(area.take_slot(0, wait_s=30)))
    w.start()
    leave.set()  # the read ends: the writer gets the slot
    w.join(30)
    t.join(30)
    assert got == [older.slot]


def test_a_copy_whose_bytes_changed_fails_its_check(tmp_path):
    area = PeerArea(str(tmp_path), "/root")
    data = os.urandom(3 * CHUNK + 100)
    _write(area, _record(5, 1, data), data)
    copy = area.copies()[0]
    with open(area.path_of(copy, next(iter(copy.record.manifest.files))), "r+b") as f:
        f.seek(2 * CHUNK + 7)
        f.write(bytes([data[2 * CHUNK + 7] ^ 0x40]))
    bad = area.verify(copy)
    assert bad is not None and "chunk 2" in bad
    assert check_files(copy.record, {}, None) is not None  # a missing file


def test_a_copy_whose_size_changed_is_not_listed(tmp_path):
    area = PeerArea(str(tmp_path), "/root")
    _write(area, _record(5, 1, b"z" * 9000), b"z" * 9000)
    copy = area.copies()[0]
    with open(area.path_of(copy, next(iter(copy.record.manifest.files))), "ab") as f:
        f.write(b"more")
    assert area.copies() == []


def test_a_planted_symlink_is_never_followed(tmp_path):
    area = PeerArea(str(tmp_path), "/root")
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    os.symlink(outside, os.path.join(area.path, "r00003"))
    assert area.copies() == []
    with pytest.raises(UnsafePathError):
        area.take_slot(3)


def test_a_slot_whose_directory_is_refused_is_not_held_for_good(tmp_path):
    area = PeerArea(str(tmp_path), "/root")
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    os.mkdir(os.path.join(area.path, "r00003"), 0o700)
    planted = os.path.join(area.path, "r00003", "s0")
    os.symlink(outside, planted)
    with pytest.raises(UnsafePathError):
        area.take_slot(3)
    os.unlink(planted)  # once the directory is sound again, both slots may be taken
    assert {area.take_slot(3), area.take_slot(3)} == {0, 1}


def test_a_copy_that_failed_its_check_is_discarded_unless_read_or_replaced(tmp_path):
    """``discard`` removes a copy (its slot takes the next one), but not while the copy is
    being read, nor once its slot holds another copy."""
    area = PeerArea(str(tmp_path), "/root")
    try:
        _write(area, _record(1, 0, b"a" * 9000), b"a" * 9000)
        _write(area, _record(2, 0, b"b" * 9000), b"b" * 9000)
        older = next(c for c in area.copies() if c.record.step == 1)
        with area.mapped(older):
            assert area.discard(older) is False  # (being read)
        assert sorted(c.record.step for c in area.copies()) == [1, 2]
        assert area.discard(older) is True
        assert [c.record.step for c in area.copies()] == [2]
        assert os.listdir(os.path.join(area.path, "r00000", f"s{older.slot}")) == []
        assert area.discard(older) is False  # (gone already)
        _write(area, _record(3, 0, b"c" * 9000), b"c" * 9000)  # into the freed slot
        assert area.discard(older) is False  # (the slot holds another copy now)
        assert sorted(c.record.step for c in area.copies()) == [2, 3]
    finally:
        area.close()
