"""ckptmgr.load_file and the in-place loader, on CPU: any safetensors file, header checks,
checksums verified beside the copy, read-only pinning of the mapping (pinning faked here; the
GPU machine runs it for real in test_cuda.py)."""

import ctypes
import json
import os
import threading

import pytest
import torch
from conftest import assert_tree_equal, evict
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file
from test_fsspec_target import faulty  # noqa: F401  (fixture)

import ckptmgr
import ckptmgr._cuda as cuda_shim
from ckptmgr import CheckpointCorruptError, CheckpointManager, StagingOptions
from ckptmgr.restore.loaders.mapped import open_mapped, read_tensors_inplace
from ckptmgr.storage.tier import LocalTier


def sample():
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(33, 7, generator=g),
        "bf16": torch.randn(5, generator=g).bfloat16(),
        "i8": torch.randint(-5, 5, (9,), dtype=torch.int8, generator=g),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
    }


def test_load_file_reads_files_written_by_safetensors(tmp_path):
    path = str(tmp_path / "m.safetensors")
    st_save_file(sample(), path)
    got = ckptmgr.load_file(path)
    want = st_load_file(path)
    assert list(got) == list(want) or sorted(got) == sorted(want)
    assert_tree_equal(dict(sorted(got.items())), dict(sorted(want.items())))
    got["f32"].add_(1)  # an owned, writable copy: the file is untouched
    assert_tree_equal(st_load_file(path)["f32"], sample()["f32"])


def test_load_file_reads_ckptmgr_files(root):
    with CheckpointManager(root) as mgr:
        mgr.save(1, sample()).result()
    d = os.path.join(root, "step_000000000001")
    got = ckptmgr.load_file(os.path.join(d, "data-00000.safetensors"))
    assert_tree_equal(dict(sorted(got.items())), dict(sorted(sample().items())))


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda b: b"\xff" * 8 + b[8:], "header length"),
    (lambda b: b[:8] + b"[" + b[9:], "not valid JSON"),
    (lambda b: b[:-8], "bad offsets"),
    (lambda b: b[:4], "too short"),
])
def test_bad_files_are_refused_with_the_reason(tmp_path, mutate, match):
    path = str(tmp_path / "m.safetensors")
    st_save_file({"x": torch.arange(16, dtype=torch.float32)}, path)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(mutate(data))
    with pytest.raises(CheckpointCorruptError, match=match):
        ckptmgr.load_file(path)


def _raw_file(path, entries: dict, data: bytes) -> None:
    """A safetensors file with exactly this header (no checks), as a crafted file would be."""
    _header_file(path, {k: {"dtype": d, "shape": s, "data_offsets": o} for k, (d, s, o) in entries.items()}, data)


def _header_file(path, header: object, data: bytes) -> None:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize(("entries", "size", "match"), [
    ({"a": ("F32", [4], [0, 16]), "b": ("F32", [4], [8, 24])}, 24, "overlaps another tensor"),
    ({"a": ("F32", [4], [0, 16]), "b": ("F32", [4], [0, 16])}, 16, "overlaps another tensor"),
    ({"a": ("F32", [2], [0, 8]), "b": ("F32", [2], [16, 24])}, 24, "hole of 8 bytes"),
    ({"a": ("F32", [2], [8, 16])}, 16, "hole of 8 bytes"),
    ({"a": ("F32", [2], [0, 8])}, 12, "cover 8 bytes of a 12-byte data region"),
])
def test_overlapping_tensors_holes_and_trailing_bytes_are_refused(tmp_path, entries, size, match):
    """As safetensors itself refuses them: every byte of the data region belongs to one tensor."""
    path = str(tmp_path / "crafted.safetensors")
    _raw_file(path, entries, bytes(size))
    with pytest.raises(CheckpointCorruptError, match=match):
        ckptmgr.load_file(path)


@pytest.mark.parametrize(("entry", "size"), [
    (("F32", [-2, -2], [0, 16]), 16),  # -2 * -2 * 4 = 16 bytes: only the sign is wrong
    (("F32", [2.0, 2], [0, 16]), 16),
    (("F32", [True, 4], [0, 16]), 16),
    (("F32", "22", [0, 16]), 16),  # a string is not a list of dimensions
    (("F32", [1] * 65, [0, 4]), 4),
    (("F32", [2**62, 0], [0, 0]), 0),
])
def test_foreign_headers_with_impossible_shapes_are_refused_before_any_allocation(tmp_path, entry, size):
    """A negative dimension (whose product still matches the byte count), a float, a bool, a
    string, too many dimensions, a dimension past the format's bound: each a
    CheckpointCorruptError naming the tensor, never torch's RuntimeError or a tensor of a shape
    no writer meant."""
    path = str(tmp_path / "crafted.safetensors")
    _raw_file(path, {"t": entry}, bytes(size))
    with pytest.raises(CheckpointCorruptError, match="tensor 't': the shape must be at most 64 ints"):
        ckptmgr.load_file(path)


@pytest.mark.parametrize(("entry", "size", "match"), [
    (("F32", [4], [0.0, 16]), 16, "data_offsets must be two ints"),
    (("F32", [4], [-16, 0]), 16, "data_offsets must be two ints"),
    (("F32", [4], [0, 16, 32]), 16, "data_offsets must be two ints"),
    (("F32", [4], [0, 2**70]), 16, "data_offsets must be two ints"),
    (("F32", [4], [16, 0]), 16, "bad offsets"),
    (("F32", [-1], [0, 0]), 0, "the shape must be"),
    (("C128", [2], [0, 32]), 32, "unknown dtype 'C128'"),
    ((["F32"], [4], [0, 16]), 16, "unknown dtype"),
    ("F32", 16, "needs dtype, shape and data_offsets"),
])
def test_bad_header_entries_are_refused_naming_what_is_wrong(tmp_path, entry, size, match):
    path = str(tmp_path / "crafted.safetensors")
    if isinstance(entry, tuple):
        _raw_file(path, {"t": entry}, bytes(size))
    else:
        _header_file(path, {"t": entry}, bytes(size))
    with pytest.raises(CheckpointCorruptError, match=f"tensor 't'.*{match}"):
        ckptmgr.load_file(path)


def test_a_header_longer_than_safetensors_allows_is_refused_unread(tmp_path):
    """The length field is bounded (100 MiB, as the manifest's header_size) before the header is
    read: a file of 200 MiB (sparse here) that claims a 150 MiB header is refused at once."""
    path = str(tmp_path / "long-header.safetensors")
    n = 150 << 20
    with open(path, "wb") as f:
        f.write(n.to_bytes(8, "little") + b"{")
        f.truncate(200 << 20)
    with pytest.raises(CheckpointCorruptError, match="header length 157286400 does not fit"):
        ckptmgr.load_file(path)


def test_load_file_refuses_a_fifo_without_blocking(tmp_path):
    path = str(tmp_path / "pipe.safetensors")
    os.mkfifo(path)  # opening it for reading in blocking mode would wait for a writer forever
    with pytest.raises(CheckpointCorruptError, match="not a regular file"):
        ckptmgr.load_file(path)


def test_in_place_read_of_a_local_tier_step_verifies_checksums(root, tmp_path):
    local = str(tmp_path / "shm")
    os.makedirs(local)
    state = {"first": torch.randn(1000), "w": torch.randn(300_000), "tied": None}  # w sits after "first"
    state["tied"] = state["w"][10:20]  # a view: rebuilt on top of its base
    with CheckpointManager(root, staging=StagingOptions(local_dir=local)) as mgr:
        mgr.save(1, state).result()
        tier: LocalTier = mgr._tier
        manifest = mgr._manifest(1, tier)
        paths = {n: tier.path_of(1, n) for n in manifest.files}
        got = read_tensors_inplace(paths, manifest, torch.device("cpu"), tier.io_pool, "tier")
        assert any(torch.equal(v, state["w"]) for v in got.values())
        view = next(n for n, e in manifest.tensors.items() if "view_of" in e)
        assert torch.equal(got[view], state["w"][10:20])  # rebuilt on its base, inside the file's buffer
        base = got[manifest.tensors[view]["view_of"]]
        assert got[view].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        # one flipped byte in the data fails the read, naming the chunk
        path = next(iter(paths.values()))
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 5)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            read_tensors_inplace(paths, manifest, torch.device("cpu"), tier.io_pool, "tier")


def test_the_mapping_is_pinned_read_only_and_unpinned_at_the_same_pointer(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_shim, "available", lambda: True)
    monkeypatch.setattr(cuda_shim, "host_register",
                        lambda p, n, read_only=False: calls.append(("reg", p, n, read_only)))
    monkeypatch.setattr(cuda_shim, "host_unregister", lambda p: calls.append(("unreg", p)))
    path = str(tmp_path / "m.safetensors")
    st_save_file(sample(), path)
    mf = open_mapped(path)
    mf.pin()
    mf.pin()  # once
    mf.close()
    assert calls == [("reg", calls[0][1], os.path.getsize(path), True), ("unreg", calls[0][1])]


@pytest.mark.parametrize("loader", ["ring", "inplace", "host"])
def test_every_loader_restores_bit_exact_and_verifies(root, loader):
    state = {"a": torch.randn(50_000), "b": torch.randn(300).bfloat16(), "n": 3}
    state["v"] = state["a"][100:110]
    with CheckpointManager(root, staging=StagingOptions(local_tier=False),
                           write_options=ckptmgr.WriteOptions(chunk_size=4096, io_threads=3)) as mgr:
        mgr.save(1, state).result()
        mgr.save(2, state).result()
        assert_tree_equal(mgr.restore(2, device="cpu", loader=loader), state)
        path = os.path.join(root, "step_000000000002", "data-00000.safetensors")
        with open(path, "r+b") as f:
            f.seek(-3, 2)
            f.write(b"\x00\x01\x02")
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(2, device="cpu", loader=loader)
        with pytest.warns(RuntimeWarning, match="skipping step 2"):
            assert_tree_equal(mgr.restore(device="cpu", loader=loader), state)  # falls back to step 1


def test_the_ring_reads_object_stores_and_inplace_refuses_them(faulty):  # noqa: F811
    state = {"a": torch.randn(20_000)}
    with CheckpointManager("faulty://ring", staging=StagingOptions(local_tier=False),
                           write_options=ckptmgr.WriteOptions(chunk_size=4096)) as mgr:
        mgr.save(1, state).result()
        assert_tree_equal(mgr.restore(device="cpu", loader="ring"), state)
        with pytest.raises(ckptmgr.ConfigError, match="local filesystem"):
            mgr.restore(device="cpu", loader="inplace")


def test_bad_loader_arguments(root):
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"a": torch.ones(3)}).result()
        with pytest.raises(ckptmgr.ConfigError, match="loader must be"):
            mgr.restore(loader="fast")
        with pytest.raises(ckptmgr.ConfigError, match="pass device="):
            mgr.restore(loader="ring")


def _bounce_landing(path):
    from ckptmgr.restore.loaders.landing import plan_landing

    mf = open_mapped(path)
    landing = plan_landing(mf.entries, mf.data_start, mf.size - mf.data_start, torch.device("cpu"))
    return mf, landing


def test_a_ram_file_is_read_through_two_buffers_per_thread_piece_by_piece(ram_dir, monkeypatch):
    """The one-shot path for files in RAM: every piece of the data region (from the page the
    header ends in) read once, by its reader in turn, into one of that reader's two buffers,
    and given to the landing with its file offset."""
    from ckptmgr._threads import DaemonPool
    from ckptmgr.restore.loaders import bounce

    monkeypatch.setattr(bounce, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(bounce, "THREADS", 3)
    path = os.path.join(ram_dir, "m.safetensors")
    want = {"a": torch.randn(170_000), "b": torch.randn(3, 1000).bfloat16(), "c": torch.arange(11, dtype=torch.int8)}
    st_save_file(want, path)
    mf, landing = _bounce_landing(path)
    assert mf.in_ram
    landed = []
    land = landing.land
    monkeypatch.setattr(landing, "land", lambda b, src: (
        landed.append((b, src.numel(), src.data_ptr(), threading.current_thread().name)), land(b, src)))
    first = mf.data_start - mf.data_start % 4096
    pool = DaemonPool(3, thread_name_prefix="bounce-test")
    try:
        bounce.copy_through_bounce(mf.fd, first, mf.size, landing, torch.device("cpu"), path, pool)
    finally:
        pool.shutdown()
        mf.close()
    want_ranges = [(b, min(b + (64 << 10), mf.size)) for b in range(first, mf.size, 64 << 10)]
    assert sorted((b, b + n) for b, n, _, _ in landed) == want_ranges and len(want_ranges) > 6
    # Reader w reads pieces w, w + 3, ... (a pool thread may run more than one reader, one after
    # the other): each reader in file order, through its own two buffers in turn.
    by_reader: dict[int, list[tuple[int, int]]] = {}
    for b, _, ptr, _ in landed:
        by_reader.setdefault(((b - first) // (64 << 10)) % 3, []).append((b, ptr))
    assert sorted(by_reader) == [0, 1, 2]
    buffers = []
    for seen in by_reader.values():
        assert [b for b, _ in seen] == sorted(b for b, _ in seen)  # in file order
        ptrs = [p for _, p in seen]
        assert ptrs[0::2] == [ptrs[0]] * len(ptrs[0::2]) and ptrs[1::2] == [ptrs[1]] * len(ptrs[1::2])  # in turn
        assert len(set(ptrs)) == min(2, len(ptrs))
        buffers += sorted(set(ptrs))
    assert len(buffers) == len(set(buffers))  # no reader shares a buffer with another
    assert_tree_equal(dict(sorted(landing.tensors().items())), dict(sorted(want.items())))


class _HostRuntime:
    """The CUDA runtime calls the bounce readers make, on the host, as a stream runs them: a
    queued copy runs only when an event recorded after it is waited for or its stream is
    synchronised, reading its source then (a buffer read into again too early lands the wrong
    bytes; an event recorded before the copies waits for nothing)."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.queued: dict[int, list[tuple[int, int, int]]] = {}  # stream -> copies not yet run
        self.marks: dict[int, tuple[int, int]] = {}  # event -> (stream, copies queued there when recorded)
        self.ran: dict[int, int] = {}  # stream -> copies run
        self.copies: list[int] = []  # bytes of each copy queued
        self.live: set[int] = set()  # events made and not yet freed
        self.made = 0
        self.devices: set[int] = set()

    def _run(self, stream, upto):
        q = self.queued.setdefault(stream, [])
        while self.ran.get(stream, 0) < upto:
            dst, src, n = q.pop(0)
            ctypes.memmove(dst, src, n)
            self.ran[stream] = self.ran.get(stream, 0) + 1

    def set_device(self, index):
        with self.mu:
            self.devices.add(index)

    def copy_to_device(self, dst, src, nbytes, stream):
        with self.mu:
            self.queued.setdefault(stream, []).append((dst, src, nbytes))
            self.copies.append(nbytes)

    def new_event(self):
        with self.mu:
            self.made += 1
            self.live.add(self.made)
            return self.made

    def record(self, event, stream):
        with self.mu:
            assert event in self.live
            self.marks[event] = (stream, self.ran.get(stream, 0) + len(self.queued.get(stream, [])))

    def wait_event(self, event):
        with self.mu:
            assert event in self.live
            stream, upto = self.marks[event]
            self._run(stream, upto)

    def free_event(self, event):
        with self.mu:
            self.live.remove(event)

    def sync_stream(self, stream):
        with self.mu:
            self._run(stream, self.ran.get(stream, 0) + len(self.queued.get(stream, [])))


def test_the_readers_queue_raw_copies_through_the_runtime_into_fresh_memory_and_a_target(ram_dir, monkeypatch):
    """Where the runtime library is found, each piece's copies are the landing's raw spans
    queued through it (a fresh allocation and a target's own tensors alike): the bytes that land
    are the file's, each copy within one span, every event given back."""
    from ckptmgr.restore.loaders import bounce
    from ckptmgr.restore.loaders.landing import plan_landing

    monkeypatch.setattr(bounce, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(bounce, "THREADS", 3)
    path = os.path.join(ram_dir, "m.safetensors")
    want = {"a": torch.randn(70_000), "b": torch.randn(3, 1000).bfloat16(), "c": torch.arange(11, dtype=torch.int8),
            "d": torch.randn(50_000).double()}
    st_save_file(want, path)
    for dests in (None, {"a": torch.zeros(70_000), "d": torch.zeros(50_000, dtype=torch.float64)}):
        rt = _HostRuntime()
        monkeypatch.setattr(bounce, "runtime_for", lambda landing, device, rt=rt: rt)
        mf = open_mapped(path)
        try:
            landing = plan_landing(mf.entries, mf.data_start, mf.size - mf.data_start, torch.device("cpu"), dests)
            spans = len(landing.spans)
            bounce.copy_through_bounce(mf.fd, 0, mf.size, landing, torch.device("cpu"), path)
            got = landing.tensors()
        finally:
            mf.close()
        assert_tree_equal(dict(sorted(got.items())), dict(sorted(want.items())))
        if dests is not None:
            assert spans > 1 and got["a"] is dests["a"] and got["d"] is dests["d"]
        assert sum(rt.copies) == mf.size - mf.data_start and max(rt.copies) <= 64 << 10
        assert rt.made == 2 * 3 and not rt.live and rt.devices == {0}


def test_a_failing_runtime_reports_the_first_error_and_frees_every_event(ram_dir, monkeypatch):
    """A copy that fails with a sticky error (the stream's synchronise then fails too) raises the
    copy's error, not the synchronise's; an event that cannot be made frees the one made before."""
    from ckptmgr.restore.loaders import bounce
    from ckptmgr.restore.loaders.landing import plan_landing

    monkeypatch.setattr(bounce, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(bounce, "THREADS", 2)
    path = os.path.join(ram_dir, "m.safetensors")
    st_save_file({"a": torch.randn(200_000)}, path)

    class Sticky(_HostRuntime):
        def copy_to_device(self, dst, src, nbytes, stream):
            raise RuntimeError("cudaMemcpyAsync failed with CUDA error 700")

        def sync_stream(self, stream):
            raise RuntimeError("cudaStreamSynchronize failed with CUDA error 700")

    class NoSecondEvent(_HostRuntime):
        def new_event(self):
            if self.made:
                raise RuntimeError("cudaEventCreateWithFlags failed with CUDA error 2")
            return super().new_event()

    for rt, message in ((Sticky(), "cudaMemcpyAsync failed"), (NoSecondEvent(), "cudaEventCreateWithFlags")):
        monkeypatch.setattr(bounce, "runtime_for", lambda landing, device, rt=rt: rt)
        mf = open_mapped(path)
        try:
            landing = plan_landing(mf.entries, mf.data_start, mf.size - mf.data_start, torch.device("cpu"))
            with pytest.raises(RuntimeError, match=message):
                bounce.copy_through_bounce(mf.fd, 0, mf.size, landing, torch.device("cpu"), path)
        finally:
            mf.close()
        assert rt.made and not rt.live


def test_the_readers_copy_with_torch_where_the_runtime_is_not_found():
    from ckptmgr.restore.loaders import bounce
    from ckptmgr.restore.loaders.landing import Entry, plan_landing

    landing = plan_landing([Entry("a", torch.float32, (4,), 0, 16)], 8, 16, torch.device("cpu"))
    assert bounce.runtime_for(landing, torch.device("cpu")) is None  # (the host: torch's copies)
    assert landing.raw(8, 16) == [(landing.spans[0][2].data_ptr(), 0, 16)]
    assert landing.raw(4, 8) == [(landing.spans[0][2].data_ptr(), 4, 4)]  # (the piece starts before the span)
    assert landing.raw(24, 8) == []
    if not torch.cuda.is_available():
        assert cuda_shim.runtime() is None


@pytest.mark.parametrize("through", ["torch", "runtime"])
def test_a_file_cut_short_under_a_one_shot_load_fails_naming_it(ram_dir, monkeypatch, through):
    from ckptmgr.restore.loaders import bounce

    monkeypatch.setattr(bounce, "PIECE_BYTES", 64 << 10)
    rt = _HostRuntime() if through == "runtime" else None
    monkeypatch.setattr(bounce, "runtime_for", lambda landing, device: rt)
    path = os.path.join(ram_dir, "m.safetensors")
    st_save_file({"a": torch.randn(200_000)}, path)
    mf, landing = _bounce_landing(path)
    try:
        os.truncate(path, mf.size // 2)  # (nothing touches the mapping past here: reads go through the descriptor)
        with pytest.raises(CheckpointCorruptError, match=r"m.safetensors ended early, at byte \d+"):
            bounce.copy_through_bounce(mf.fd, 0, mf.size, landing, torch.device("cpu"), path)
        # the readers all ended: the shared pool serves the next load
        st_save_file({"a": torch.randn(1000)}, path + "2")
        assert ckptmgr.load_file(path + "2")["a"].numel() == 1000
    finally:
        mf.close()
    assert rt is None or (rt.made and not rt.live)


def test_pread_address_reads_whole_pieces_and_names_the_file_where_it_fails(tmp_path):
    from ckptmgr.storage.posix import pread_address

    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 64
    path.write_bytes(data)
    buf = torch.zeros(4096, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        pread_address(fd, buf.data_ptr() + 10, 4000, 100, str(path))
        assert bytes(buf[10:4010].numpy()) == data[100:4100] and not buf[:10].any() and not buf[4010:].any()
        with pytest.raises(CheckpointCorruptError, match=r"f.bin ended early, at byte 16384"):
            pread_address(fd, buf.data_ptr(), 100, len(data) - 50, str(path))
    finally:
        os.close(fd)
    with pytest.raises(OSError, match=r"reading .*f.bin at byte 0"):
        pread_address(-1, buf.data_ptr(), 10, 0, str(path))  # (never a descriptor: EBADF)


def test_a_failed_piece_stops_the_readers_and_raises_once(ram_dir, monkeypatch):
    from ckptmgr.restore.loaders import bounce

    monkeypatch.setattr(bounce, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(bounce, "THREADS", 2)
    path = os.path.join(ram_dir, "m.safetensors")
    st_save_file({"a": torch.randn(400_000)}, path)
    mf, landing = _bounce_landing(path)
    calls = []
    mu = threading.Lock()

    def land(b, src):
        with mu:
            calls.append(b)
            if len(calls) == 3:
                raise RuntimeError("copy refused")
    monkeypatch.setattr(landing, "land", land)
    try:
        with pytest.raises(RuntimeError, match="copy refused"):
            bounce.copy_through_bounce(mf.fd, 0, mf.size, landing, torch.device("cpu"), path)
    finally:
        mf.close()
    assert 3 <= len(calls) < mf.size // (64 << 10)  # the other reader left at its next piece


def test_a_mapped_file_holds_its_descriptor_until_closed_and_a_bad_header_leaves_none(ram_dir):
    from test_pinned_weights import mapped_paths, open_fds_to

    path = os.path.join(ram_dir, "m.safetensors")
    st_save_file({"a": torch.randn(1000)}, path)
    before = open_fds_to(path)
    mf = open_mapped(path)
    assert open_fds_to(path) > before  # (the mapping's own, and the one reads go through)
    mf.close()
    mf.close()  # (idempotent)
    assert open_fds_to(path) == before and path not in mapped_paths()
    with open(path, "r+b") as f:
        f.write((10**9).to_bytes(8, "little"))  # a header longer than the file
    with pytest.raises(CheckpointCorruptError):
        open_mapped(path)
    assert open_fds_to(path) == before and path not in mapped_paths()


def test_load_file_verifies_a_step_file_against_the_manifest_beside_it(root):
    state = {"w": torch.randn(30_000), "b": torch.randn(100).bfloat16()}
    with CheckpointManager(root, staging=StagingOptions(local_tier=False),
                           write_options=ckptmgr.WriteOptions(chunk_size=4096)) as mgr:
        mgr.save(1, state).result()
    d = os.path.join(root, "step_000000000001")
    path = os.path.join(d, "data-00000.safetensors")
    assert_tree_equal(dict(sorted(ckptmgr.load_file(path).items())), dict(sorted(state.items())))
    with open(path, "r+b") as f:
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CheckpointCorruptError, match=r"00000.safetensors: checksum mismatch in bytes \[4096, 8192\)"):
        ckptmgr.load_file(path, device="cpu")
    # the same bytes under another name are not the manifest's file: loaded as any safetensors file
    os.rename(path, os.path.join(d, "copy.safetensors"))
    assert ckptmgr.load_file(os.path.join(d, "copy.safetensors"))["w"].numel() == 30_000
    # beside something that is no manifest, the file has no checksums: loaded as any safetensors file
    os.rename(os.path.join(d, "copy.safetensors"), path)
    with open(os.path.join(d, "manifest.json"), "wb") as f:
        f.write(b"{not json")
    assert ckptmgr.load_file(path)["w"].numel() == 30_000


def test_an_empty_tensor_at_an_odd_offset_of_a_foreign_file_loads_as_safetensors_loads_it(tmp_path):
    """A one-byte bool, then an empty bf16 tensor at offset 1 (found by the fuzzer over foreign
    headers): the empty tensor has no bytes to view, so it loads wherever it lies."""
    path = str(tmp_path / "odd.safetensors")
    _raw_file(path, {"t0": ("BOOL", [], [0, 1]), "t1": ("BF16", [0], [1, 1])}, b"\x01")
    got = ckptmgr.load_file(path)
    want = st_load_file(path)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and torch.equal(got[k], want[k])


def test_pread_address_resumes_short_reads_and_interrupted_calls(tmp_path, monkeypatch):
    """Short reads continue where they stopped (address and offset both advance); EINTR is
    retried; any other errno is raised as itself."""
    import ctypes
    import errno

    from ckptmgr.storage import posix

    path = tmp_path / "f.bin"
    data = os.urandom(5000)
    path.write_bytes(data)
    buf = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(OSError, match=r"reading .*f.bin at byte 0") as failed:  # (the real pread first)
        posix.pread_address(-1, buf.data_ptr(), 10, 0, str(path))  # (never a descriptor: EBADF)
    assert failed.value.errno == errno.EBADF
    calls = []

    def choppy(fd, address, nbytes, offset):  # at most 7 bytes a call, every other call interrupted
        calls.append(offset)
        if len(calls) % 2:
            ctypes.set_errno(errno.EINTR)
            return -1
        got = os.pread(fd, min(nbytes, 7), offset)
        ctypes.memmove(address, got, len(got))
        return len(got)

    monkeypatch.setattr(posix, "_PREAD", [choppy])
    fd = os.open(path, os.O_RDONLY)
    try:
        posix.pread_address(fd, buf.data_ptr() + 3, 4000, 900, str(path))
        assert bytes(buf[3:4003].numpy()) == data[900:4900] and not buf[:3].any() and not buf[4003:].any()
        assert len(calls) == 2 * -(-4000 // 7)
        with pytest.raises(CheckpointCorruptError, match=r"ended early, at byte 5000"):
            posix.pread_address(fd, buf.data_ptr(), 100, 4950, str(path))
        for offset in (-1, 1 << 63, 1 << 64):  # (never wrapped into a read elsewhere in the file)
            with pytest.raises(ValueError, match=r"f.bin: 10 bytes at byte -?\d+ is outside any file"):
                posix.pread_address(fd, buf.data_ptr(), 10, offset, str(path))
    finally:
        os.close(fd)


def test_the_bounce_buffers_are_disjoint_slices_of_one_block(monkeypatch):
    from ckptmgr.restore.loaders import bounce

    monkeypatch.setattr(bounce, "PIECE_BYTES", 4096)
    monkeypatch.setattr(bounce, "THREADS", 5)
    for threads in (3, 5):  # (a small file's load takes the block of THREADS readers all the same)
        held = bounce.buffers(threads, gpu=False)
        flat = [b for pair in held for b in pair]
        storage = flat[0].untyped_storage().data_ptr()
        assert all(b.numel() == 4096 and b.untyped_storage().data_ptr() == storage for b in flat)
        base = min(b.data_ptr() for b in flat)
        assert base % 4096 == 0  # (page-aligned, for direct reads)
        assert sorted(b.data_ptr() - base for b in flat) == [k * 4096 for k in range(2 * threads)]
        assert flat[0].untyped_storage().nbytes() - (base - storage) >= 5 * 2 * 4096


def test_a_reader_submit_that_fails_still_waits_for_the_readers_started(ram_dir, monkeypatch):
    """A submit that raises (Ctrl-C on the calling thread) after a reader started: the call
    raises only once that reader has ended, so the caller never closes a descriptor in use."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptmgr.restore.loaders import bounce

    monkeypatch.setattr(bounce, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(bounce, "THREADS", 2)
    path = os.path.join(ram_dir, "m.safetensors")
    st_save_file({"a": torch.randn(200_000)}, path)
    real = bounce.preadv_fd
    log: list[str] = []
    entered, gate, raised = threading.Event(), threading.Event(), threading.Event()

    def held_read(fd, offset, out, where):
        entered.set()
        assert gate.wait(30)
        log.append("read")
        return real(fd, offset, out, where)

    monkeypatch.setattr(bounce, "preadv_fd", held_read)

    class SecondSubmitInterrupted:
        def __init__(self):
            self.ex, self.n = ThreadPoolExecutor(2), 0

        def submit(self, *a):
            self.n += 1
            if self.n == 2:
                assert entered.wait(30)  # (the first reader is inside its read)
                raise KeyboardInterrupt
            return self.ex.submit(*a)

    def opener():  # lets the read go once the call has raised, or after 1 s where it waits as it must
        assert entered.wait(30)
        raised.wait(1.0)
        gate.set()

    side = threading.Thread(target=opener)
    side.start()
    mf, landing = _bounce_landing(path)
    pool = SecondSubmitInterrupted()
    try:
        with pytest.raises(KeyboardInterrupt):
            bounce.copy_through_bounce(mf.fd, 0, mf.size, landing, torch.device("cpu"), path, pool)
        log.append("raised")
        raised.set()
    finally:
        side.join(30)
        mf.close()
        pool.ex.shutdown(wait=True)
    assert log[:2] == ["read", "raised"]


def _skip_without_direct_reads(path: str) -> None:
    """Skip the test where the evicted file ``path`` would not be read with O_DIRECT here (no
    O_DIRECT on this filesystem, or the file still cached): decided before the load, so the
    load itself is then held to reading it directly."""
    from ckptmgr.storage.posix import direct_of

    fd = os.open(path, os.O_RDONLY)
    try:
        direct = direct_of(fd, path)
    finally:
        os.close(fd)
    if direct is None:
        pytest.skip("no O_DIRECT here")
    direct.close()


def _spy_direct_reads(monkeypatch):
    """Every direct read a :class:`DirectFile` makes: (offset, length, whether it fell back)."""
    from ckptmgr.storage.posix import DirectFile

    reads = []
    real = DirectFile.read

    def read(self, offset, view, length, *, plain=False):
        real(self, offset, view, length, plain=plain)
        reads.append((offset, length, self._fallback))
    monkeypatch.setattr(DirectFile, "read", read)
    return reads


@pytest.mark.parametrize("through", ["torch", "runtime"])
def test_a_cold_file_on_disk_is_read_by_the_bounce_readers_with_direct_reads(tmp_path, monkeypatch, through):
    """A file on disk out of the page cache: every piece of its data region read once with
    O_DIRECT into the (page-aligned) bounce buffers, the last piece ending mid-block, and the
    bytes that land are the file's."""
    from ckptmgr.restore.loaders import bounce
    from ckptmgr.storage.posix import direct_of

    monkeypatch.setattr(bounce, "PIECE_BYTES", 1 << 20)
    monkeypatch.setattr(bounce, "THREADS", 3)
    if through == "runtime":
        monkeypatch.setattr(bounce, "runtime_for", lambda landing, device: _HostRuntime())
    reads = _spy_direct_reads(monkeypatch)
    path = str(tmp_path / "m.safetensors")  # (larger than the readahead of the header's read: 8 MiB seen)
    want = {"a": torch.randn(10_000_001), "b": torch.randn(3, 1000).bfloat16(), "c": torch.arange(13, dtype=torch.int8)}
    st_save_file(want, path)
    evict(path)
    mf, landing = _bounce_landing(path)
    assert not mf.in_ram and mf.size % 4096
    direct = direct_of(mf.fd, path)
    if direct is None:
        mf.close()
        pytest.skip("no O_DIRECT here")
    first = mf.data_start - mf.data_start % 4096
    try:
        bounce.copy_through_bounce(mf.fd, first, mf.size, landing, torch.device("cpu"), path, direct=direct)
    finally:
        direct.close()
        mf.close()
    assert sorted((b, b + n) for b, n, _ in reads) == [(b, min(b + (1 << 20), mf.size))
                                                       for b in range(first, mf.size, 1 << 20)]
    assert not any(fell for _, _, fell in reads)  # (every read went through O_DIRECT)
    assert_tree_equal(dict(sorted(landing.tensors().items())), dict(sorted(want.items())))


def test_load_file_reads_a_cold_file_on_disk_directly_and_any_other_through_the_cache(root, tmp_path, monkeypatch):
    """On a GPU (faked: the landing is planned on the host), ``load_file`` of a foreign file on
    disk that is not in the page cache reads it with O_DIRECT; the same file in the cache, and a
    ckptmgr step's file (its checksums read the mapping), go through the page cache. Each load
    is bit-exact."""
    from ckptmgr.restore.loaders import bounce
    from ckptmgr.restore.loaders import mapped as mapped_mod

    monkeypatch.setattr(bounce, "PIECE_BYTES", 64 << 10)
    plan = mapped_mod.plan_landing
    monkeypatch.setattr(mapped_mod, "plan_landing", lambda e, s, n, device, dests: plan(e, s, n, torch.device("cpu"),
                                                                                        dests))
    used = []
    real = bounce.copy_through_bounce

    def spy(fd, begin, end, landing, device, path, pool=None, direct=None):
        assert device.type == "cuda"
        used.append(direct is not None)
        real(fd, begin, end, landing, torch.device("cpu"), path, pool, direct=direct)
    monkeypatch.setattr(mapped_mod, "copy_through_bounce", spy)
    reads = _spy_direct_reads(monkeypatch)
    path = str(tmp_path / "m.safetensors")  # (larger than the readahead of the header's read: 8 MiB seen)
    want = {"a": torch.randn(10_000_000), "b": torch.arange(7, dtype=torch.int16)}
    st_save_file(want, path)
    evict(path)
    assert_tree_equal(dict(sorted(ckptmgr.load_file(path).items())), dict(sorted(want.items())))
    assert used == []  # (for the host, the mapping is copied once)
    evict(path)
    _skip_without_direct_reads(path)
    got = ckptmgr.load_file(path, device="cuda")
    assert used == [True] and reads and not any(fell for _, _, fell in reads)
    assert_tree_equal(dict(sorted(got.items())), dict(sorted(want.items())))
    with open(path, "rb") as f:  # in the page cache now
        f.read()
    got = ckptmgr.load_file(path, device="cuda")
    assert used == [True, False]
    assert_tree_equal(dict(sorted(got.items())), dict(sorted(want.items())))
    state = {"w": torch.randn(200_000)}
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as m:
        m.save(1, state).result()
    step_file = next(str(p) for p in (tmp_path / "ckpt").glob("step_*/*.safetensors"))
    evict(step_file)
    n = len(reads)
    got = ckptmgr.load_file(step_file, device="cuda")
    assert used == [True, False, False] and len(reads) == n
    assert any(torch.equal(v, state["w"]) for v in got.values())


def _take_front(ends, start, front, rng):
    start.wait(10)
    at = 0
    while True:
        got = ends.front(at + rng.randint(1, 7))
        if not got:
            return
        assert got.start == at
        front.extend(got)
        at = got.stop


def _take_back(ends, start, out):
    start.wait(10)
    k = 0
    while (i := ends.back(0, k)) is not None:
        out.append(i)
        k += 1


def test_ends_give_each_piece_to_one_side_the_front_a_prefix_the_back_a_suffix():
    """One thread takes runs from the front while three take pieces from the back, all started
    together: every piece is taken once, the front's pieces come before all of the back's."""
    import random

    from ckptmgr.restore.loaders.bounce import Ends

    for seed in range(20):
        n = 500
        ends = Ends(n)
        start = threading.Barrier(4)
        front: list[int] = []
        backs: list[list[int]] = [[], [], []]
        threads = [threading.Thread(target=_take_front, args=(ends, start, front, random.Random(seed)))]
        threads += [threading.Thread(target=_take_back, args=(ends, start, b)) for b in backs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        back = sorted(i for b in backs for i in b)
        assert sorted(front + back) == list(range(n))
        assert not front or not back or max(front) < min(back)
        assert all(b == sorted(b, reverse=True) for b in backs)  # (each reader from the far end down)


def test_readers_refuse_a_piece_index_that_is_not_one(ram_dir):
    """A taker that answers something other than a piece's index (``True`` once it is done,
    an index out of range) fails the readers at once instead of reading some piece forever."""
    from ckptmgr.restore.loaders import bounce

    path = os.path.join(ram_dir, "m.safetensors")
    st_save_file({"a": torch.randn(100_000)}, path)
    for bad in (True, 5, -1):
        mf, landing = _bounce_landing(path)
        try:
            pieces = [bounce.Piece(0, 0, mf.size)]
            readers = bounce.start_readers([bounce.Source(mf.fd, path, landing)], pieces, torch.device("cpu"),
                                           take=lambda w, k, bad=bad: bad if k == 0 else None)
            with pytest.raises(ValueError, match=r"was given piece .* of 1"):
                readers.wait()
        finally:
            mf.close()
