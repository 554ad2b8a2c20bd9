"""A peer restore's fetch lands the shard in memory (:class:`~ckptmgr.distributed.peer_memory.Into`),
verified there by the read driver over :class:`~ckptmgr.restore.transports.memory.MemoryTransport`,
and the restore takes its tensors as views of it (:meth:`PeerSource.staged`). In one process,
on the host: a loopback transport hands each piece sent to the receive of the same round. The
same path between real processes (gloo; NCCL into GPU memory on 2 GPUs) is in
tests/test_peer_tier.py."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from ckptmgr.distributed import peer_memory, peer_mover
from ckptmgr.distributed.peer_memory import Into
from ckptmgr.distributed.peer_mover import ShardMover
from ckptmgr.distributed.peer_restore import PeerSource
from ckptmgr.distributed.peer_transport import Transport
from ckptmgr.errors import CheckpointCorruptError, CkptError, CkptTimeoutError
from ckptmgr.format.checksum import chunk_ranges, crc32c_hex
from ckptmgr.format.manifest import FileRecord, Manifest
from ckptmgr.restore.read import ChecksumMismatchError, Chunk, plan_check, run
from ckptmgr.restore.transports.memory import MemoryTransport
from ckptmgr.storage.peer_tier import PeerArea, ShardRecord
from ckptmgr.storage.posix import populate

WAIT = 30.0
CHUNK = 8192
HEADER = 4096


class Loopback:
    """Each piece sent to this rank lands in its own receive of the same round; ``spoil``
    (round, receive buffers) runs after the copy."""

    def __init__(self, spoil: Any = None) -> None:
        self.timeout_s = WAIT
        self.coord = SimpleNamespace(timeout_s=WAIT)
        self.device = torch.device("cpu")
        self.spoil = spoil
        self.rounds = -2  # (the header and the record travel in the two exchanges before the pieces)

    def exchange(self, sends: list[tuple[int, np.ndarray]], recvs: list[tuple[int, Any]]) -> None:
        for (_, src), (_, dst) in zip(sends, recvs, strict=True):
            dst[:] = src
        if self.spoil is not None:
            self.spoil(self.rounds, [a for _, a in recvs])
        self.rounds += 1


def _file(i: int, name: str, data: np.ndarray, header: int = HEADER) -> tuple[FileRecord, dict[str, Any]]:
    """File ``i``'s record and tensors: a float32 tensor ``t<i>``, then the bytes left as ``r<i>``."""
    crcs = tuple(crc32c_hex(data[b:e]) for b, e in chunk_ranges(data.size, CHUNK))
    n, rest = divmod(data.size - header, 4)
    tensors = {f"rank00000/t{i}": {"file": name, "dtype": "F32", "shape": [n], "offsets": [0, 4 * n]}}
    if rest:
        tensors[f"rank00000/r{i}"] = {"file": name, "dtype": "U8", "shape": [rest], "offsets": [4 * n, 4 * n + rest]}
    return FileRecord(data.size, CHUNK, crcs, header), tensors


def _shard(sizes: tuple[int, ...] = (3 * CHUNK + 200, 2 * CHUNK + 72),
           headers: tuple[int, ...] = (HEADER, HEADER)) -> tuple[ShardRecord, dict[str, np.ndarray]]:
    """A shard of rank 0 of two files whose sizes are not multiples of the piece size (pieces
    span both files)."""
    rng = np.random.default_rng(5)
    files, tensors, data = {}, {}, {}
    for i, (size, header) in enumerate(zip(sizes, headers, strict=True)):
        name = f"data-r00000-{i:05d}.safetensors"
        data[name] = rng.integers(0, 256, size, dtype=np.uint8)
        files[name], more = _file(i, name, data[name], header)
        tensors.update(more)
    m = Manifest(step=3, state={"x": 1}, tensors=tensors, files=files)
    return ShardRecord.make(m, 0, 2, "A"), data


def _fetch(tmp_path: Any, rec: ShardRecord, data: dict[str, np.ndarray], into: Into,
           spoil: Any = None) -> tuple[Any, ShardMover, PeerArea]:
    (tmp_path / "node").mkdir(exist_ok=True)
    area = PeerArea(str(tmp_path / "node"), str(tmp_path / "root"))
    with ThreadPoolExecutor(2) as io:
        mover = ShardMover(Loopback(spoil), area, "B", CHUNK, None, io)
        got = mover.transfer([(0, rec, data)], [0], own_node_ok=True, expect={0: (0, 3)}, into=into)
    return got[0], mover, area


def test_a_shard_fetched_into_memory_lands_bit_exact_in_one_allocation_and_the_area_stays_empty(tmp_path):
    rec, data = _shard()
    got, mover, area = _fetch(tmp_path, rec, data, Into(torch.device("cpu"), dict(rec.manifest.files)))
    try:
        assert got.ok and got.slot is None and got.record.raw == rec.raw
        assert {n: t.numpy().tobytes() for n, t in got.files.items()} == {n: a.tobytes() for n, a in data.items()}
        storages = {t.untyped_storage().data_ptr() for t in got.files.values()}
        assert len(storages) == 1  # the files back to back in one allocation
        assert area.copies() == [] and mover.stats()["peer_bad_copies"] == 0
    finally:
        area.close()


def test_a_shard_whose_files_are_not_the_steps_is_refused_before_memory_is_taken(tmp_path, monkeypatch):
    rec, data = _shard()
    step_files = dict(rec.manifest.files)
    name = next(iter(step_files))
    step_files[name] = FileRecord(step_files[name].size, CHUNK, ("00000000",) * len(step_files[name].crc32c), HEADER)
    taken: list[int] = []
    monkeypatch.setattr(peer_memory, "allocate", lambda n, device: taken.append(n))
    got, mover, area = _fetch(tmp_path, rec, data, Into(torch.device("cpu"), step_files))
    try:
        assert got == (None, False, None, None, "") and taken == [] and area.copies() == []
        assert mover.stats()["peer_bytes_received"] == sum(a.size for a in data.values())  # (drained)
    finally:
        area.close()


def test_a_byte_changed_in_transit_fails_the_check_in_memory_and_nothing_is_kept(tmp_path, caplog):
    rec, data = _shard()

    def spoil(i: int, bufs: list[Any]) -> None:
        if i == 2:  # (a piece inside the first file's fourth chunk)
            bufs[0][100] ^= 0xFF

    got, mover, area = _fetch(tmp_path, rec, data, Into(torch.device("cpu"), dict(rec.manifest.files)), spoil)
    try:
        assert got.record is not None and not got.ok and got.files is None
        assert mover.stats()["peer_bad_copies"] == 1 and area.copies() == []
        assert any("data-r00000-00000.safetensors" in r.getMessage() and "fails its check" in r.getMessage()
                   for r in caplog.records)
    finally:
        area.close()


def test_the_pages_received_into_and_sent_from_are_faulted_in_ahead_by_their_own_thread(tmp_path, monkeypatch):
    """The host memory the shard lands in is faulted in for writing, the files sent for
    reading, a piece at a time, on a thread that is not the one moving the pieces; it is done
    by the time the transfer returns."""
    rec, data = _shard()
    calls: list[tuple[int, int, bool, str]] = []
    monkeypatch.setattr(peer_mover, "populate", lambda address, n, write: calls.append(
        (address, n, write, threading.current_thread().name)) or True)
    got, _, area = _fetch(tmp_path, rec, data, Into(torch.device("cpu"), dict(rec.manifest.files)))
    area.close()
    image = next(iter(got.files.values()))
    base = image.data_ptr()
    written = sorted((a - base, n) for a, n, write, _ in calls if write)
    assert written and written[0][0] == 0 and sum(n for _, n in written) == image.untyped_storage().nbytes()
    assert max(n for _, n in written) <= CHUNK
    read = {(a, n) for a, n, write, _ in calls if not write}
    for arr in data.values():
        assert sum(n for a, n in read if arr.ctypes.data <= a < arr.ctypes.data + arr.size) == arr.size
    assert {name for *_, name in calls} != {threading.current_thread().name}
    assert all(name.startswith("ckptmgr-peer-ahead") for *_, name in calls)


def test_faulting_ahead_stops_at_the_next_piece_once_the_transfer_ends():
    done = threading.Event()
    done.set()
    buf = np.zeros(4 * CHUNK, dtype=np.uint8)
    seen: list[int] = []
    real = peer_mover.populate
    try:
        peer_mover.populate = lambda a, n, write: seen.append(n) or True  # type: ignore[assignment]
        peer_mover._fault_in([(buf.ctypes.data, buf.size, True)], CHUNK, done)
    finally:
        peer_mover.populate = real
    assert seen == []


def test_populate_faults_pages_in_without_changing_them():
    t = torch.arange(3 * 4096 + 100, dtype=torch.int64).view(torch.uint8)
    before = t.clone()
    assert populate(t.data_ptr() + 1, t.numel() - 1) in (True, False)  # (False: a kernel before 5.14)
    assert populate(t.data_ptr(), t.numel(), write=False) in (True, False)
    assert torch.equal(t, before)
    assert populate(t.data_ptr(), 10)  # (no whole page inside: nothing to do)


def test_the_memory_transport_checks_files_where_they_lie_and_names_a_mismatch():
    rec, data = _shard()
    files = {n: torch.from_numpy(a.copy()) for n, a in data.items()}
    with ThreadPoolExecutor(3) as pool:
        run(plan_check(rec.manifest, "here"), MemoryTransport(files, pool, timeout_s=WAIT))
        name = sorted(files)[1]
        files[name][CHUNK + 5] ^= 1
        with pytest.raises(ChecksumMismatchError) as info:
            run(plan_check(rec.manifest, "here"), MemoryTransport(files, pool, timeout_s=WAIT))
        assert info.value.mismatch.file == name and info.value.mismatch.begin == CHUNK


def test_the_memory_transport_refuses_chunks_it_cannot_check():
    files = {"f": torch.zeros(100, dtype=torch.uint8)}
    with ThreadPoolExecutor(1) as pool:
        t = MemoryTransport(files, pool, timeout_s=WAIT)
        for chunk in (Chunk("f", 0, 0, 101, "0"), Chunk("g", 0, 0, 10, "0"),
                      Chunk("f", 0, 0, 10, "0", dest=object()), Chunk("f", 0, 0, 10, "0", subs=((0, 5, "0"),))):
            with pytest.raises(ValueError, match=r"this transport checks|not in memory here"):
                t.read([chunk], lambda c, d: None)


def test_the_restore_takes_the_fetched_files_tensors_as_views_of_them():
    rec, data = _shard()
    own = rec.manifest
    images = {n: torch.from_numpy(a.copy()) for n, a in data.items()}
    source = PeerSource({}, SimpleNamespace(), "peer tier", None, images)
    staged = source.staged(3, own, torch.device("cpu"), "here")
    assert staged is not None
    for i, (name, arr) in enumerate(sorted(data.items())):
        t = staged[f"rank00000/t{i}"]
        assert t.dtype == torch.float32 and t.untyped_storage().data_ptr() == images[name].untyped_storage().data_ptr()
        assert t.numpy().tobytes() == arr[HEADER:HEADER + 4 * t.numel()].tobytes()
    first = sorted(data)[0]
    assert source.path_of(3, first) is None and source.file_size(3, first) == data[first].size
    out = [np.empty(10, dtype=np.uint8), np.empty(5, dtype=np.uint8)]
    source.read_into(3, first, 7, out)
    assert np.concatenate(out).tobytes() == data[first][7:22].tobytes()
    with pytest.raises(CheckpointCorruptError):
        source.read_into(3, first, data[first].size - 3, out)
    # not every file in memory on that device: read through read_into instead
    one = PeerSource({}, None, "u", None, dict(list(images.items())[:1]))
    assert one.staged(3, own, torch.device("cpu"), "h") is None


def test_a_tensor_outside_its_fetched_file_is_refused():
    rec, data = _shard()
    m = rec.manifest
    tensors = dict(m.tensors)
    name = sorted(data)[0]
    size = data[name].size
    tensors["rank00000/t0"] = {**tensors["rank00000/t0"], "offsets": [0, size], "shape": [size // 4]}
    bad = Manifest(step=3, state=m.state, tensors=tensors, files=m.files)
    source = PeerSource({}, None, "peer tier", None, {n: torch.from_numpy(a.copy()) for n, a in data.items()})
    with pytest.raises(CheckpointCorruptError, match="outside"):
        source.staged(3, bad, torch.device("cpu"), "here")


def test_a_transport_receives_only_into_plain_bytes_on_its_own_device():
    t = Transport(SimpleNamespace(global_rank=lambda r: r, timeout_s=WAIT), None, torch.device("cpu"))
    for buf in (torch.zeros(8, dtype=torch.float32), torch.zeros(16, dtype=torch.uint8)[::2],
                torch.zeros(8, dtype=torch.uint8, device="meta")):
        with pytest.raises(ValueError, match="cannot receive into"):
            t.exchange([], [(1, buf)])


def test_each_fetched_file_starts_aligned_so_the_tensors_after_an_odd_sized_file_are_views_too(tmp_path):
    """The first file's size is odd and the second's header is twice the usual: the second
    file's float32 tensor is still a view of the memory fetched (no copy), bit-exact."""
    rec, data = _shard((3 * CHUNK + 203, 2 * CHUNK + 72 + HEADER), (HEADER, 2 * HEADER))
    got, _, area = _fetch(tmp_path, rec, data, Into(torch.device("cpu"), dict(rec.manifest.files)))
    area.close()
    assert got.ok
    storage = next(iter(got.files.values())).untyped_storage().data_ptr()
    staged = PeerSource({}, None, "peer tier", None, got.files).staged(3, rec.manifest, torch.device("cpu"), "here")
    assert staged is not None
    for i, (name, arr) in enumerate(sorted(data.items())):
        t = staged[f"rank00000/t{i}"]
        header = rec.manifest.files[name].header_size
        assert t.untyped_storage().data_ptr() == storage, f"file {i}'s tensor was copied"
        assert t.numpy().tobytes() == arr[header:header + 4 * t.numel()].tobytes()


def _mover(tmp_path: Any) -> tuple[ShardMover, PeerArea]:
    (tmp_path / "node").mkdir(exist_ok=True)
    area = PeerArea(str(tmp_path / "node"), str(tmp_path / "root"))
    return ShardMover(Loopback(), area, "B", CHUNK, None, None), area


@pytest.mark.parametrize("case", ["size", "rank", "step"])
def test_a_shard_announced_with_another_size_rank_or_step_is_refused_before_memory_is_taken(tmp_path, monkeypatch,
                                                                                           case):
    rec, data = _shard()
    nbytes = sum(a.size for a in data.values())
    taken: list[int] = []
    monkeypatch.setattr(peer_memory, "allocate", lambda n, device: taken.append(n))
    mover, area = _mover(tmp_path)
    try:
        raw = np.frombuffer(rec.raw, dtype=np.uint8)
        into = Into(torch.device("cpu"), dict(rec.manifest.files))
        expect = {"size": (0, 3), "rank": (1, 3), "step": (0, 2)}[case]
        got = mover._open(0, raw, nbytes + (1 if case == "size" else 0), True, expect, into)
        assert got.rec is None and got.image is None and taken == [] and area.copies() == []
    finally:
        area.close()


def test_no_memory_for_a_shard_refuses_it_rather_than_failing_the_transfer(tmp_path, monkeypatch):
    rec, data = _shard()
    monkeypatch.setattr(peer_memory, "available", lambda: 1000)  # (less than the shard)
    got, mover, area = _fetch(tmp_path, rec, data, Into(torch.device("cpu"), dict(rec.manifest.files)))
    try:
        assert got.record is None and not got.ok and "no memory for a shard" in got.local and area.copies() == []
        assert mover.stats()["peer_bytes_received"] == sum(a.size for a in data.values())  # (drained)
    finally:
        area.close()
    monkeypatch.setattr(peer_memory, "available", lambda: None)
    with pytest.raises(CkptError, match="no memory for a shard"):
        peer_memory.allocate(1 << 60, torch.device("cpu"))  # (the allocator's own refusal)


def test_a_chunk_that_fails_stops_the_other_workers_at_their_next_chunk():
    """Worker 0's first chunk fails; worker 1 is inside its first chunk until then, and starts
    no other afterwards."""
    rec, data = _shard()
    files = {n: torch.from_numpy(a.copy()) for n, a in data.items()}
    chunks = list(plan_check(rec.manifest, "here").chunks)
    entered, failed = threading.Event(), threading.Event()
    landed: list[tuple[str, int]] = []

    def land(c: Chunk, got: Any) -> None:
        if (c.file, c.index) == (chunks[0].file, chunks[0].index):
            assert entered.wait(WAIT)  # (worker 1 is inside its first chunk)
            failed.set()
            raise CheckpointCorruptError("bad")
        entered.set()
        assert failed.wait(WAIT)
        landed.append((c.file, c.index))

    with ThreadPoolExecutor(2) as pool, pytest.raises(CheckpointCorruptError, match="bad"):
        MemoryTransport(files, pool, threads=2, timeout_s=WAIT).read(chunks, land)
    assert landed == [(chunks[1].file, chunks[1].index)]


def test_the_bytes_between_fetched_files_are_zero_and_a_scratch_piece_comes_with_the_allocation(tmp_path,
                                                                                              monkeypatch):
    """The allocation holds the files, each on a 4 KiB boundary, and, when some piece spans two
    files, one scratch piece at its end: allocated (or refused) with the rest, before any byte
    travels. What lies between the files is zeroed: a save of the restored tensors never
    carries stale memory."""
    rec, data = _shard((3 * CHUNK + 203, 2 * CHUNK + 72))
    made: list[torch.Tensor] = []
    real = peer_memory.allocate

    def memory(n: int, device: torch.device) -> torch.Tensor:
        t = real(n, device)
        t.fill_(0xAB)  # (stale bytes)
        made.append(t)
        return t

    monkeypatch.setattr(peer_memory, "allocate", memory)
    got, _, area = _fetch(tmp_path, rec, data, Into(torch.device("cpu"), dict(rec.manifest.files)))
    area.close()
    assert got.ok and len(made) == 1
    sizes = [f.size for f in rec.manifest.files.values()]
    bases, total = peer_memory.layout(sizes)
    assert bases[1] % peer_memory.FILE_ALIGN == 0 and made[0].numel() == total + CHUNK
    assert not made[0][sizes[0]:bases[1]].any()


def test_a_check_that_cannot_run_is_this_nodes_failure_not_a_bad_copy(tmp_path, monkeypatch):
    rec, data = _shard()

    def broken(self: Any, chunks: Any, land: Any) -> None:
        raise RuntimeError("no pinned memory")

    monkeypatch.setattr(MemoryTransport, "read", broken)
    got, mover, area = _fetch(tmp_path, rec, data, Into(torch.device("cpu"), dict(rec.manifest.files)))
    area.close()
    assert not got.ok and got.files is None and "no pinned memory" in got.local
    assert mover.stats()["peer_bad_copies"] == 0


def test_a_restore_onto_the_host_fetches_into_host_memory_whatever_the_transport(monkeypatch):
    """``_serve`` asks the mover for memory on the host when the restore lands there, else on
    the transport's device."""
    from ckptmgr.distributed import peer_restore

    seen: list[Any] = []
    mover = SimpleNamespace(transport=SimpleNamespace(device=torch.device("meta")),
                            transfer=lambda *a, into, **k: seen.append(into.device) or {})
    rep = SimpleNamespace(area=SimpleNamespace(copies=list))
    coord = SimpleNamespace(rank=1)
    for host in (True, False):
        fetching = SimpleNamespace(mover=lambda: mover, host=host)
        peer_restore._serve(rep, fetching, coord, 3, [None, 0], [0], {})
    assert seen == [torch.device("cpu"), torch.device("meta")]


def test_an_in_place_restore_of_files_held_in_memory_reads_them_with_the_host_loader(tmp_path):
    """The in-place loader maps files by path; files a peer restore holds in memory have none,
    so their read goes through the host loader (it failed opening "")."""
    import ckptmgr

    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64)}
    mgr = ckptmgr.CheckpointManager(str(tmp_path / "root"))
    try:
        mgr.save(4, state)
        mgr.wait()
        restorer = mgr._restorer
        m = restorer.manifest(4)
        source = restorer.source_of(4)
        images = {}
        for name, frec in m.files.items():
            buf = np.empty(frec.size, dtype=np.uint8)
            source.read_into(4, name, 0, [buf])
            images[name] = torch.from_numpy(buf)
        got = restorer.read(PeerSource({}, source, "peer tier", source.io_pool, images), 4, m, torch.device("cpu"),
                            "inplace", None, None)
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    finally:
        mgr.close()


def test_fetched_files_on_another_device_are_moved_there_whole_or_left_to_the_reads_when_it_has_no_room(
        monkeypatch):
    """Files fetched onto one device for a restore onto another are copied there whole, one
    copy per file; where that device has no room, ``staged`` gives None (the restore reads
    the files through ``read_into`` instead, with its own handling of a full device)."""
    rec, data = _shard()
    images = {n: torch.from_numpy(a.copy()) for n, a in data.items()}
    source = PeerSource({}, None, "peer tier", None, images)
    moved: list[torch.device] = []
    real = torch.Tensor.to

    def to(self: torch.Tensor, device: Any, *a: Any, **k: Any) -> torch.Tensor:
        if isinstance(device, torch.device) and device.type == "meta":  # (stands in for another GPU)
            moved.append(device)
            return self.clone()
        return real(self, device, *a, **k)

    monkeypatch.setattr(torch.Tensor, "to", to)
    staged = source.staged(3, rec.manifest, torch.device("meta"), "here")
    assert staged is not None and len(moved) == len(images)
    for i, (name, arr) in enumerate(sorted(data.items())):
        t = staged[f"rank00000/t{i}"]
        assert t.untyped_storage().data_ptr() != images[name].untyped_storage().data_ptr()  # (the copy's)
        assert t.numpy().tobytes() == arr[HEADER:HEADER + 4 * t.numel()].tobytes()

    def full(self: torch.Tensor, device: Any, *a: Any, **k: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(torch.Tensor, "to", full)
    assert source.staged(3, rec.manifest, torch.device("meta"), "here") is None


def test_the_memory_a_shard_may_take_is_the_least_of_the_hosts_and_the_cgroups_reclaimable_cache_not_taken(
        tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100000 kB\nMemAvailable:    50000 kB\n")
    (tmp_path / "cgroup").write_text("12:memory:/x\n0::/job/rank0\n")
    d = tmp_path / "fs" / "job" / "rank0"
    d.mkdir(parents=True)
    (d / "memory.max").write_text(f"{40_000 * 1024}\n")
    (d / "memory.current").write_text(f"{30_000 * 1024}\n")
    (d / "memory.stat").write_text(f"anon 1\ninactive_file {5_000 * 1024}\nactive_file 9\n")
    args = (str(tmp_path / "meminfo"), str(tmp_path / "cgroup"), str(tmp_path / "fs").encode())
    assert peer_memory.available(*args) == 15_000 * 1024  # the limit less what is used, less the dropable cache
    (d / "memory.max").write_text("max\n")
    assert peer_memory.available(*args) == 50_000 * 1024  # no limit: the host's
    (tmp_path / "meminfo").write_text("MemTotal: 1 kB\n")
    assert peer_memory.available(*args) is None


def test_a_check_in_memory_that_outlives_its_bound_fails_the_transfer(tmp_path, monkeypatch):
    """Its readers may still read the shard's memory: the transfer raises (and the restore
    fails) rather than letting that memory go as a refused copy's."""
    rec, data = _shard()

    def stuck(self: Any, chunks: Any, land: Any) -> None:
        raise CkptTimeoutError("checking took too long")

    monkeypatch.setattr(MemoryTransport, "read", stuck)
    with pytest.raises(CkptTimeoutError, match="took too long"):
        _fetch(tmp_path, rec, data, Into(torch.device("cpu"), dict(rec.manifest.files)))
