"""Cold local files read as one queue of direct reads in file order, kept in flight with Linux
AIO: exact results through a few shared buffers, every chunk verified, the earliest bad chunk
named, every buffer back after a failure, several restores at once, and the chunk-by-chunk
reads where no AIO context can be had. Real files, evicted from the page cache."""

from __future__ import annotations

import errno
import glob
import os
import threading

import numpy as np
import pytest
import torch
from conftest import evict

import ckptmgr.restore.restorer as restorer_mod
from ckptmgr import CheckpointCorruptError, CheckpointManager, CkptTimeoutError, StagingOptions, WriteOptions
from ckptmgr.restore.loaders import PinnedRing
from ckptmgr.restore.loaders import pieces as pieces_mod
from ckptmgr.restore.loaders import ring as ring_mod
from ckptmgr.restore.transports.direct import BLOCK, _check_read
from ckptmgr.storage.posix import DIRECT_ALIGN, open_direct

NO_TIER = StagingOptions(local_tier=False)
CHUNK = 2 * BLOCK + 3 * DIRECT_ALIGN  # three reads per chunk, the last a short one
SMALL = WriteOptions(chunk_size=CHUNK, max_file_bytes=6 << 20)  # several files of several chunks


def _evict(root: str, step: str = "*") -> None:
    for path in glob.glob(os.path.join(root, f"step_{step}")):
        evict(path)


def _direct_ok(root: str) -> bool:
    path = glob.glob(os.path.join(root, "step_*", "data-*"))[0]
    try:
        os.close(os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
    except OSError:
        return False
    return hasattr(os, "O_DIRECT")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"w{i}": torch.randn(700_000 + 997 * i, generator=g) for i in range(6)}
    out["half"] = torch.randn(3, 5001, generator=g).bfloat16()
    out["ids"] = torch.arange(12_345, dtype=torch.int64)
    return out


def _cold_round_trip(tmp_path) -> str:
    """Save a state, evict it, restore it through the ring on the CPU and check every tensor;
    the root."""
    root = str(tmp_path / "ckpt")
    state = _state(4)
    with CheckpointManager(root, staging=NO_TIER, write_options=SMALL) as mgr:
        mgr.save(1, state).result()
        _evict(root)
        out = mgr.restore(1, device="cpu", loader="ring")
    for k, v in state.items():
        assert torch.equal(out[k], v), k
    return root


def _cold_file_and_aio(tmp_path, data: bytes, depth: int):
    """``f.bin`` holding ``data``, evicted and opened for direct reads, and an AIO context of
    ``depth``; skips the test where the filesystem or the kernel gives neither."""
    from ckptmgr.storage.aio import open_context

    path = tmp_path / "f.bin"
    path.write_bytes(data)
    evict(str(path))
    f = open_direct(str(path))
    aio = open_context(depth)
    if f is None or aio is None:
        for opened in (f, aio):
            if opened is not None:
                opened.close()
        pytest.skip("no O_DIRECT or no AIO context here")
    return f, aio


def _all_buffers_back(ring: PinnedRing) -> None:
    with ring.lease_many(ring.slots, timeout=5):
        pass


@pytest.fixture
def windowed(monkeypatch):
    """How many files each restore read through the queue of direct reads."""
    counts: list[int] = []
    real = restorer_mod.read_tensors_ring.__globals__["_open_cold"]

    def counted(*a, **k):
        cold = real(*a, **k)
        counts.append(len(cold.files) if cold is not None else 0)
        return cold
    monkeypatch.setitem(restorer_mod.read_tensors_ring.__globals__, "_open_cold", counted)
    return counts


def test_a_cold_step_of_many_chunks_restores_exactly_through_few_buffers(tmp_path, windowed):
    root = str(tmp_path / "ckpt")
    state = _state(1)
    with CheckpointManager(root, staging=NO_TIER, write_options=SMALL) as mgr:
        mgr.save(1, state).result()
        files = glob.glob(os.path.join(root, "step_*", "data-*"))
        assert len(files) >= 3 and all(os.path.getsize(p) > 3 * CHUNK for p in files)
        for into_target in (False, True):
            _evict(root)
            if into_target:
                target = {k: torch.zeros_like(v) for k, v in state.items()}
                mgr.restore(1, target=target, loader="ring")
                out = target
            else:
                out = mgr.restore(1, device="cpu", loader="ring")
            for k, v in state.items():
                assert torch.equal(out[k], v), k
        _all_buffers_back(mgr._ring)
    assert windowed[0] == (len(files) if _direct_ok(root) else 0)  # (into a target: read once to check first)


def test_the_earliest_bad_chunk_is_named_and_every_buffer_comes_back(tmp_path, windowed):
    root = str(tmp_path / "ckpt")
    with CheckpointManager(root, staging=NO_TIER, write_options=SMALL) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.save(2, _state(2)).result()
        path = sorted(glob.glob(os.path.join(root, "step_000000000002", "data-*")))[0]
        fd = os.open(path, os.O_RDWR)
        try:
            for chunk in (4, 2):  # the later one first: which fails first must not matter
                at = chunk * CHUNK + BLOCK + 100  # in the chunk's second read
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x40]), at)
        finally:
            os.close(fd)
        _evict(root)
        with pytest.raises(CheckpointCorruptError, match=rf"{os.path.basename(path)}: checksum mismatch in bytes "
                                                         rf"\[{2 * CHUNK}, {3 * CHUNK}\)"):
            mgr.restore(2, device="cpu", loader="ring")
        _all_buffers_back(mgr._ring)
        out = mgr.restore(1, device="cpu", loader="ring")  # the step before is intact
        for k, v in _state(1).items():
            assert torch.equal(out[k], v), k
    assert windowed[0] >= 1 or not _direct_ok(root)


def test_a_file_cut_short_after_the_checks_stops_the_reads(tmp_path, monkeypatch):
    """Another process truncates a data file between the size check and the reads: the
    restore fails naming the file, and no buffer stays leased."""
    root = str(tmp_path / "ckpt")
    real = restorer_mod.preflight

    def then_truncate(source, step, manifest, where, images=None, **kw):
        real(source, step, manifest, where, images, **kw)
        path = sorted(glob.glob(os.path.join(root, "step_*", "data-*")))[-1]
        os.truncate(path, os.path.getsize(path) - CHUNK - 5000)
    monkeypatch.setattr(restorer_mod, "preflight", then_truncate)
    with CheckpointManager(root, staging=NO_TIER, write_options=SMALL) as mgr:
        mgr.save(1, _state(1)).result()
        _evict(root)
        with pytest.raises(CheckpointCorruptError, match="ended early"):
            mgr.restore(1, device="cpu", loader="ring")
        _all_buffers_back(mgr._ring)


def test_restores_at_once_share_the_ring(tmp_path):
    """Three threads restore at once (two cold steps read as queues of direct reads, one
    cached step read chunk by chunk) through one manager's ring, ten times each; each
    result is exact and every buffer is back at the end."""
    root = str(tmp_path / "ckpt")
    states = {s: _state(s) for s in (1, 2, 3)}
    with CheckpointManager(root, staging=NO_TIER, write_options=SMALL) as mgr:
        for s, st in states.items():
            mgr.save(s, st).result()
        start = threading.Barrier(3, timeout=60)
        wrong: list[str] = []

        def run(step: int) -> None:
            try:
                start.wait()
                for _ in range(10):
                    if step == 3:
                        for path in glob.glob(os.path.join(root, "step_000000000003", "*")):
                            with open(path, "rb") as f:
                                f.read()
                    else:
                        _evict(root, f"{step:09d}")
                    out = mgr.restore(step, device="cpu", loader="ring")
                    wrong.extend(f"{step}:{k}" for k, v in states[step].items() if not torch.equal(out[k], v))
            except BaseException as exc:  # reported below
                wrong.append(f"{step}: {exc!r}")

        threads = [threading.Thread(target=run, args=(s,)) for s in states]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads)
        assert wrong == []
        _all_buffers_back(mgr._ring)


def test_without_an_aio_context_cold_chunks_are_read_one_by_one(tmp_path, monkeypatch, windowed):
    """Where the kernel gives no AIO context (another OS, a container refusing io_setup,
    fs.aio-max-nr reached), each cold chunk is one direct read on the ring's threads."""
    from ckptmgr.storage.local import LocalTarget

    hows: list[str] = []
    real = LocalTarget.read_chunk
    monkeypatch.setattr(LocalTarget, "read_chunk", lambda *a: hows.append(real(*a)) or hows[-1])
    monkeypatch.setattr(ring_mod, "open_context", lambda depth: None)
    root = _cold_round_trip(tmp_path)
    assert windowed == [0] and set(hows) == ({"direct"} if _direct_ok(root) else {"buffered"})


def test_a_read_refused_direct_after_the_open_is_read_plainly(tmp_path):
    data = np.random.default_rng(5).integers(0, 256, 3 * DIRECT_ALIGN, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    evict(str(path))
    f = open_direct(str(path))
    if f is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    try:
        landed = torch.zeros(2 * DIRECT_ALIGN, dtype=torch.uint8)
        _check_read(f, -errno.EINVAL, DIRECT_ALIGN, 3 * DIRECT_ALIGN, landed)
        assert bytes(landed.numpy()) == data[DIRECT_ALIGN:].tobytes()
        with pytest.raises(CheckpointCorruptError, match="ended early, at byte 5096"):
            _check_read(f, 1000, 4096, 8192, landed)
        with pytest.raises(OSError, match="reading bytes"):
            _check_read(f, -errno.EIO, 4096, 8192, landed)
    finally:
        f.close()


def test_lease_many_takes_all_at_once_or_waits_for_them():
    ring = PinnedRing(3, 4096)
    with ring.lease() as one:
        with pytest.raises(CkptTimeoutError, match="no 3 restore buffers"), ring.lease_many(3, timeout=0.05):
            pass
        with ring.lease_many(2) as two:  # what is free is taken at once
            assert sorted([one, *two]) == [0, 1, 2]
        got: list[list[int]] = []
        waiter = threading.Thread(target=lambda: got.append(_hold_all(ring)))
        waiter.start()
        _until(lambda: len(ring._returned._waiters) == 1)  # waiting for the held one  # type: ignore[attr-defined]
        assert got == []
    waiter.join(timeout=30)
    assert got == [[0, 1, 2]]
    ring.close()


def _hold_all(ring: PinnedRing) -> list[int]:
    with ring.lease_many(ring.slots, timeout=30) as held:
        return sorted(held)


def _until(cond, timeout: float = 30.0) -> None:
    ev = threading.Event()
    for _ in range(int(timeout * 1000)):
        if cond():
            return
        ev.wait(0.001)
    raise AssertionError("condition not reached")


def test_a_direct_file_reads_exact_bytes_and_falls_back_where_refused(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 3 * DIRECT_ALIGN + 77, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    assert open_direct(str(path)) is None  # all of it in the page cache: read from there
    evict(str(path))
    f = open_direct(str(path))
    if f is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    try:
        raw = bytearray(8 * DIRECT_ALIGN)
        base = -np.frombuffer(raw, np.uint8).ctypes.data % DIRECT_ALIGN
        aligned = memoryview(raw)[base:base + 4 * DIRECT_ALIGN]
        f.read(0, aligned, data.size)  # the short end of the file
        assert bytes(aligned[:data.size]) == data.tobytes()
        with pytest.raises(CheckpointCorruptError, match="ended early"):
            f.read(DIRECT_ALIGN, aligned, data.size)
        unaligned = memoryview(raw)[base + 1:base + 1 + 4 * DIRECT_ALIGN]  # refused direct: read plainly
        f.read(DIRECT_ALIGN, unaligned, 2 * DIRECT_ALIGN)
        assert bytes(unaligned[:2 * DIRECT_ALIGN]) == data[DIRECT_ALIGN:3 * DIRECT_ALIGN].tobytes()
    finally:
        f.close()


def test_open_direct_refuses_a_link_and_skips_memory_filesystems(tmp_path):
    (tmp_path / "step").mkdir()
    (tmp_path / "real.bin").write_bytes(b"x" * 10_000)
    os.symlink(tmp_path / "real.bin", tmp_path / "step" / "data")
    fd = os.open(tmp_path / "step", os.O_RDONLY)
    try:
        with pytest.raises(CheckpointCorruptError):
            open_direct("data", dir_fd=fd)
    finally:
        os.close(fd)
    if os.path.isdir("/dev/shm"):
        shm = f"/dev/shm/ckptmgr-test-{os.getpid()}"
        with open(shm, "wb") as f:
            f.write(b"y" * 10_000)
        try:
            assert open_direct(shm) is None  # its pages are the page cache
        finally:
            os.unlink(shm)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cold_step_lands_exactly_on_the_gpu_and_a_bad_one_leaves_the_target(tmp_path, windowed):
    """Onto a GPU: fresh device memory, and a target through spare device memory; a step
    with a bad chunk fails with the target as it was."""
    root = str(tmp_path / "ckpt")
    state = _state(1)
    with CheckpointManager(root, staging=NO_TIER, write_options=SMALL) as mgr:
        mgr.save(1, state).result()
        mgr.save(2, _state(2)).result()
        _evict(root)
        out = mgr.restore(1, device="cuda")
        target = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
        _evict(root)
        mgr.restore(1, target=target)
        torch.cuda.synchronize()
        for k, v in state.items():
            assert torch.equal(out[k].cpu(), v) and torch.equal(target[k].cpu(), v), k
        path = sorted(glob.glob(os.path.join(root, "step_000000000002", "data-*")))[-1]
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, CHUNK + 7)[0] ^ 1]), CHUNK + 7)
        finally:
            os.close(fd)
        _evict(root)
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(2, target=target)
        torch.cuda.synchronize()
        for k, v in state.items():
            assert torch.equal(target[k].cpu(), v), k
        _all_buffers_back(mgr._ring)
    if _direct_ok(root):
        assert windowed[:2] == [windowed[0]] * 2 and windowed[0] >= 3


def test_a_refused_submit_closes_the_aio_context(tmp_path):
    """Where the verifier threads refuse work (their pool shut down by a closing manager),
    the queue reads nothing, and the kernel AIO context is still given back."""
    from ckptmgr.restore.transports.direct import Span, read_window

    f, aio = _cold_file_and_aio(tmp_path, bytes(4 * DIRECT_ALIGN), 4)
    closed: list[bool] = []
    real_close = aio.close
    aio.close = lambda: closed.append(True) or real_close()  # type: ignore[method-assign]

    def refuse(*a, **k):
        raise RuntimeError("cannot schedule new futures after shutdown")
    try:
        with pytest.raises(RuntimeError, match="after shutdown"):
            read_window([Span("f.bin", 0, 4 * DIRECT_ALIGN, "00000000")], {"f.bin": f}, [0], lambda i: torch.empty(0),
                        lambda *a: None, refuse, aio, "f.bin")
    finally:
        f.close()
    assert closed == [True]


def test_a_read_the_kernel_refuses_to_queue_fails_the_restore_and_frees_the_buffers(tmp_path, monkeypatch, windowed):
    """io_submit refuses a read midway (EAGAIN: the kernel's AIO limit): the restore fails
    naming the step and the refusal, after the reads already queued have ended, every buffer
    is back, and the next restore of the same step is exact."""
    from ckptmgr.storage.aio import AioContext

    real = AioContext.submit_one
    calls: list[int] = []

    def refuse_the_fifth(self, *a):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(errno.EAGAIN, "io_submit: Resource temporarily unavailable")
        return real(self, *a)
    root = str(tmp_path / "ckpt")
    state = _state(6)
    with CheckpointManager(root, staging=NO_TIER, write_options=SMALL) as mgr:
        mgr.save(1, state).result()
        _evict(root)
        monkeypatch.setattr(AioContext, "submit_one", refuse_the_fifth)
        if not _direct_ok(root):
            pytest.skip("this filesystem refuses O_DIRECT")
        with pytest.raises(CheckpointCorruptError, match=r"step 1 cannot be read: .*io_submit"):
            mgr.restore(1, device="cpu", loader="ring")
        _all_buffers_back(mgr._ring)
        monkeypatch.setattr(AioContext, "submit_one", real)
        _evict(root)
        out = mgr.restore(1, device="cpu", loader="ring")
    for k, v in state.items():
        assert torch.equal(out[k], v), k
    assert windowed[0] >= 1 and len(calls) == 5


def test_a_restore_that_fails_before_its_reads_start_closes_its_aio_context(tmp_path, monkeypatch):
    """A cold step whose landing cannot be planned (no memory for it) fails before its queue of
    direct reads starts: the AIO context opened for it is destroyed all the same."""
    from ckptmgr.storage.aio import AioContext

    contexts: list[AioContext] = []
    closed: list[AioContext] = []
    real_open, real_close = ring_mod.open_context, AioContext.close

    def opening(depth):
        ctx = real_open(depth)
        if ctx is not None:
            contexts.append(ctx)
        return ctx

    def closing(self):
        closed.append(self)
        real_close(self)

    def no_memory(*a, **k):
        raise torch.OutOfMemoryError("no memory to land the step")
    root = str(tmp_path / "ckpt")
    with CheckpointManager(root, staging=NO_TIER, write_options=SMALL) as mgr:
        mgr.save(1, _state(7)).result()
        if not _direct_ok(root):
            pytest.skip("this filesystem refuses O_DIRECT")
        _evict(root)
        monkeypatch.setattr(ring_mod, "open_context", opening)
        monkeypatch.setattr(AioContext, "close", closing)
        monkeypatch.setattr(ring_mod, "plan_landing", no_memory)
        with pytest.raises(torch.OutOfMemoryError):
            mgr.restore(1, device="cpu", loader="ring")
    if not contexts:
        pytest.skip("no AIO context on this system")
    assert all(ctx in closed for ctx in contexts)


def test_blocks_in_slots_of_abutting_buffers_are_checked_apart(tmp_path, monkeypatch):
    """The landing slots of two ring buffers that lie side by side in memory: a run of blocks
    read into the last slot of one and the first of the next is not one run (each buffer's
    slots are checksummed and copied as that buffer's), and every chunk verifies exactly."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptmgr.format.checksum import crc32c_hex
    from ckptmgr.restore.transports import direct as window_mod

    chunk = 4 * BLOCK
    data = np.random.default_rng(9).integers(0, 256, 6 * chunk + 3 * DIRECT_ALIGN, dtype=np.uint8)
    f, aio = _cold_file_and_aio(tmp_path, data.tobytes(), 16)
    monkeypatch.setattr(window_mod, "LANDING_SLOTS", 4)
    whole = torch.zeros(4 * BLOCK + DIRECT_ALIGN, dtype=torch.uint8)
    skip = -whole.data_ptr() % DIRECT_ALIGN
    halves = [whole[skip:skip + 2 * BLOCK], whole[skip + 2 * BLOCK:skip + 4 * BLOCK]]  # two buffers, abutting
    out = torch.zeros(data.size, dtype=torch.uint8)
    runs: list[int] = []

    def copy(blocks, key):
        for _, begin, src in blocks:
            runs.append(src.numel())
            out[begin:begin + src.numel()].copy_(src)
    spans = [window_mod.Span("f.bin", b, min(b + chunk, data.size), crc32c_hex(data[b:b + chunk]))
             for b in range(0, data.size, chunk)]
    with ThreadPoolExecutor(2) as pool:
        try:
            window_mod.read_window(spans, {"f.bin": f}, [0, 1], lambda i: halves[i], copy, pool.submit, aio, "f.bin")
        finally:
            f.close()
    assert bytes(out.numpy()) == data.tobytes()
    assert max(runs) <= 2 * BLOCK  # no run crossed from one buffer into the other


def test_an_interrupt_while_the_reads_end_still_waits_for_the_verifiers(tmp_path, monkeypatch):
    """An interrupt that arrives while the kernel ends the reads in flight (``io_destroy``)
    is raised only once the verifier tasks have been waited for, since they read the slots the
    caller gives back next."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptmgr.format.checksum import crc32c_hex
    from ckptmgr.restore.transports import direct as window_mod

    data = np.random.default_rng(12).integers(0, 256, 4 * BLOCK, dtype=np.uint8)
    f, aio = _cold_file_and_aio(tmp_path, data.tobytes(), 4)
    real_close, real_drain = aio.close, window_mod.drain
    drained: list[int] = []

    def close_then_interrupt():
        real_close()
        raise KeyboardInterrupt

    aio.close = close_then_interrupt  # type: ignore[method-assign]
    monkeypatch.setattr(window_mod, "drain",
                        lambda futures, *a: drained.append(len(futures)) or real_drain(futures, *a))
    buf = torch.zeros(2 * BLOCK + DIRECT_ALIGN, dtype=torch.uint8)
    skip = -buf.data_ptr() % DIRECT_ALIGN
    out = torch.zeros(data.size, dtype=torch.uint8)

    def copy(blocks, key):
        for _, begin, src in blocks:
            out[begin:begin + src.numel()].copy_(src)
    with ThreadPoolExecutor(2) as pool:
        try:
            with pytest.raises(KeyboardInterrupt):
                window_mod.read_window([window_mod.Span("f.bin", 0, data.size, crc32c_hex(data))], {"f.bin": f}, [0],
                                       lambda i: buf[skip:skip + 2 * BLOCK], copy, pool.submit, aio, "f.bin")
        finally:
            f.close()
            real_close()
    assert drained == [1]  # the one buffer's making, and no verifier task left pending
    assert bytes(out.numpy()) == data.tobytes()


def test_a_reap_asks_the_kernel_for_at_least_as_many_reads_as_asked(tmp_path):
    """``reap(timeout, at_least)`` hands ``at_least`` to ``io_getevents`` as its minimum (at
    most the depth, at least one: the queue keeps its reads in bunches so), and returns every
    read that is in, each exact; with fewer in flight, what is in at the timeout."""
    data = np.random.default_rng(3).integers(0, 256, 8 * DIRECT_ALIGN, dtype=np.uint8).tobytes()
    f, aio = _cold_file_and_aio(tmp_path, data, 4)
    asked: list[int] = []
    real = aio._syscall

    def recorded(number, *args):
        if number == aio._getevents:
            asked.append(args[1])  # (ctx, min_nr, nr, events, timeout)
        return real(number, *args)
    aio._syscall = recorded  # type: ignore[method-assign]
    try:
        memory = pieces_mod.page_aligned(4 * DIRECT_ALIGN)
        for tag in range(4):
            aio.submit_one(tag, f.direct_fd, 2 * tag * DIRECT_ALIGN, DIRECT_ALIGN,
                           memory.data_ptr() + tag * DIRECT_ALIGN)
        done = aio.reap(30.0, at_least=4)
        assert asked == [4]
        assert sorted(done) == [(tag, DIRECT_ALIGN) for tag in range(4)]
        read = b"".join(data[2 * t * DIRECT_ALIGN:(2 * t + 1) * DIRECT_ALIGN] for t in range(4))
        assert bytes(memory.numpy()) == read
        aio.submit_one(1, f.direct_fd, DIRECT_ALIGN, DIRECT_ALIGN, memory.data_ptr())
        done = aio.reap(0.2, at_least=3)  # one read in flight: it comes back at the timeout
        while not done:  # (a slow disk: not in yet at the timeout)
            done = aio.reap(30.0)
        assert done == [(1, DIRECT_ALIGN)]
        assert bytes(memory[:DIRECT_ALIGN].numpy()) == data[DIRECT_ALIGN:2 * DIRECT_ALIGN]
        asked.clear()
        assert aio.reap(0.0, at_least=99) == [] and aio.reap(0.0, at_least=0) == []  # none in flight
        assert asked == [4, 1]  # (more than the depth is refused by the kernel; less than one means one)
    finally:
        aio.close()
        f.close()


def test_the_queue_reaps_half_its_reads_at_a_time_or_all_in_flight(tmp_path, monkeypatch):
    """Every reap of a cold step's queue waits for :data:`_REAP_AT_LEAST` reads, or for all
    those in flight where fewer are, never more; and the step restores exactly."""
    from ckptmgr.restore.transports import direct as window_mod
    from ckptmgr.storage.aio import AioContext

    asks: list[tuple[int, int]] = []  # (at_least, reads in flight)
    real_submit, real_reap = AioContext.submit_one, AioContext.reap
    flight = [0]

    def submit_one(self, *a):
        real_submit(self, *a)
        flight[0] += 1

    def reap(self, timeout, at_least=1):
        asks.append((at_least, flight[0]))
        done = real_reap(self, timeout, at_least)
        flight[0] -= len(done)
        return done
    monkeypatch.setattr(AioContext, "submit_one", submit_one)
    monkeypatch.setattr(AioContext, "reap", reap)
    _cold_round_trip(tmp_path)
    if not asks:
        pytest.skip("no O_DIRECT or no AIO context here")
    assert all(at_least == min(window_mod._REAP_AT_LEAST, in_flight) for at_least, in_flight in asks), asks
    assert any(in_flight > window_mod._REAP_AT_LEAST for _, in_flight in asks)  # (the queue did fill)
