"""One conformance suite for every transport of the read driver (``ckptmgr.restore.read``).

Each transport is a subclass of :class:`TransportSuite` that says how to make it over a real
committed step on the local disk; every test then runs the same plans through it: the bytes
land exactly, a checksum failure names the file and the byte range, a file that ends early
is an error, a cancelled run stops and gives back what it held, and a run that lists faults
goes on past them. A transport that lands a chunk's bytes before they verify (the direct
reads of cold files, for destinations a failed run leaves unseen) says so, and is held to
everything else.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from concurrent.futures import wait as futures_wait

import numpy as np
import pytest
import torch
from conftest import evict

from ckptmgr import CheckpointCorruptError, CheckpointManager, StagingOptions, WriteOptions
from ckptmgr.format.manifest import Manifest
from ckptmgr.restore.loaders.landing import plan_landing
from ckptmgr.restore.loaders.ring import PinnedRing, entries_by_file
from ckptmgr.restore.read import Chunk, ReadCancelledError, ReadPlan, plan_check, run
from ckptmgr.restore.transports import DirectTransport, GdsTransport, PreadTransport, RingTransport, ranged
from ckptmgr.restore.transports.direct import landing_buffers
from ckptmgr.restore.transports.ranged import RangedTransport
from ckptmgr.storage import open_target
from ckptmgr.storage.aio import open_context
from ckptmgr.storage.throttle import AdaptiveWindow, ReadTuner

CHUNK = 4096


class _Collect:
    """A destination that keeps every landed byte at its file offset (and counts landings)."""

    def __init__(self, size: int) -> None:
        self.buf = np.zeros(size, dtype=np.uint8)
        self.landed: list[int] = []
        self._mu = threading.Lock()

    def land(self, begin: int, data: torch.Tensor) -> None:
        arr = data.numpy()
        self.buf[begin:begin + arr.size] = arr
        with self._mu:
            self.landed.append(begin)


class _Scattered:
    """A destination that takes bytes straight into its own memory: each chunk into pieces
    cut at odd offsets (as the host loader's tensors cut a file)."""

    def __init__(self, size: int) -> None:
        self.buf = np.zeros(size, dtype=np.uint8)
        self.landed: list[int] = []
        self._mu = threading.Lock()

    def into(self, begin: int, end: int) -> list:
        cuts = sorted({begin, end, *range(begin + 1000, end, 1777)})
        return [self.buf[b:e] for b, e in itertools.pairwise(cuts)]

    def land(self, begin: int, data: torch.Tensor) -> None:  # a transport that read it elsewhere
        arr = data.numpy()
        self.buf[begin:begin + arr.size] = arr
        with self._mu:
            self.landed.append(begin)


class _Counting:
    """The real local target, counting the reads in flight and calling ``after_read`` after
    each (every call goes to the real storage)."""

    def __init__(self, inner, after_read=None) -> None:
        self.inner = inner
        self.after_read = after_read
        self.url = inner.url
        self.io_pool = inner.io_pool
        self.active = 0
        self.reads = 0
        self.bytes = 0
        self._mu = threading.Lock()

    def file_size(self, step: int, name: str) -> int:
        return self.inner.file_size(step, name)

    def read_into(self, step: int, name: str, offset: int, out) -> None:
        with self._mu:
            self.active += 1
            self.reads += 1
            self.bytes += sum(len(memoryview(a).cast("B")) for a in out)
        try:
            self.inner.read_into(step, name, offset, out)
        finally:
            with self._mu:
                self.active -= 1
        if self.after_read is not None:
            self.after_read()


@pytest.fixture
def step(tmp_path):
    """A committed step of several files of several checksum chunks; (root, target, manifest)."""
    root = str(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(30_000, generator=g), "b": torch.randint(0, 9, (7_000,), generator=g),
             "c": torch.randn(9_000, generator=g).bfloat16()}
    with CheckpointManager(root, write_options=WriteOptions(chunk_size=CHUNK, max_file_bytes=64 << 10),
                           staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, state, block=True)
    target = open_target(root)
    m = Manifest.from_bytes(target.read_manifest(1), where=root)
    assert len(m.files) >= 2 and all(rec.size > 2 * CHUNK for rec in m.files.values())
    yield root, target, m
    target.close()


def _file(root: str, m: Manifest, fname: str) -> str:
    return os.path.join(root, "step_1", fname) if os.path.isdir(os.path.join(root, "step_1")) else \
        next(os.path.join(d, fname) for d, _, fs in os.walk(root) if fname in fs)


class TransportSuite:
    """The tests every transport passes; a subclass says how to make one (:meth:`make`)."""

    lands_before_verified = False  # True: a chunk's bytes reach its destination before they verify
    read_per_chunk = True  # False: a request may span several chunks, or a part of one

    def make(self, source, m: Manifest, workers: int = 4):
        """The transport under test, reading ``source`` (each subclass below says how)."""
        raise NotImplementedError

    def test_every_byte_lands_exactly(self, step):
        root, target, m = step
        dests = {f: _Collect(rec.size) for f, rec in m.files.items()}
        plan = plan_check(m, root, dests=dests)
        run(plan, self.make(target, m))
        for f, d in dests.items():
            with open(_file(root, m, f), "rb") as fh:
                assert d.buf.tobytes() == fh.read()
            assert sorted(d.landed) == [c.begin for c in plan.chunks if c.file == f]

    def test_bytes_read_straight_into_a_destination_are_exact_and_verified(self, step):
        root, target, m = step
        dests = {f: _Scattered(rec.size) for f, rec in m.files.items()}
        run(plan_check(m, root, dests=dests), self.make(target, m))
        for f, d in dests.items():
            with open(_file(root, m, f), "rb") as fh:
                assert d.buf.tobytes() == fh.read()
        fname = sorted(m.files)[0]
        with open(_file(root, m, fname), "r+b") as fh:  # then one flipped byte is caught there too
            fh.seek(2 * CHUNK + 7)
            b = fh.read(1)
            fh.seek(2 * CHUNK + 7)
            fh.write(bytes([b[0] ^ 4]))
        dests = {f: _Scattered(rec.size) for f, rec in m.files.items()}
        with pytest.raises(CheckpointCorruptError, match=rf"{fname}: checksum mismatch in bytes \[{2 * CHUNK}, "):
            run(plan_check(m, root, dests=dests), self.make(target, m))

    def test_a_check_only_plan_reads_every_chunk_and_lands_nothing(self, step):
        root, target, m = step
        source = _Counting(target)
        plan = plan_check(m, root)
        assert all(c.dest is None for c in plan.chunks)
        run(plan, self.make(source, m))
        if self.read_per_chunk:
            assert source.reads == len(plan.chunks)
        else:  # (requests of several chunks: every byte once)
            assert source.bytes == sum(rec.size for rec in m.files.values())
        assert source.active == 0

    def test_a_checksum_failure_names_the_file_and_range_and_never_lands(self, step):
        root, target, m = step
        fname = sorted(m.files)[1]
        bad = m.files[fname].size - 3  # in the file's last chunk
        path = _file(root, m, fname)
        with open(path, "r+b") as fh:
            fh.seek(bad)
            b = fh.read(1)
            fh.seek(bad)
            fh.write(bytes([b[0] ^ 0x10]))
        dests = {f: _Collect(rec.size) for f, rec in m.files.items()}
        plan = plan_check(m, root, dests=dests)
        chunk = next(c for c in plan.chunks if c.file == fname and c.begin <= bad < c.end)
        with pytest.raises(CheckpointCorruptError) as err:
            run(plan, self.make(target, m, workers=1))
        assert f"{fname}: checksum mismatch in bytes [{chunk.begin}, {chunk.end})" in str(err.value)
        if not self.lands_before_verified:
            assert chunk.begin not in dests[fname].landed

    def test_a_run_that_lists_faults_goes_on_past_them(self, step):
        root, target, m = step
        names = sorted(m.files)
        for fname in names[:2]:  # one bad chunk in each of two files
            with open(_file(root, m, fname), "r+b") as fh:
                fh.seek(CHUNK + 5)
                b = fh.read(1)
                fh.seek(CHUNK + 5)
                fh.write(bytes([b[0] ^ 1]))
        dests = {f: _Collect(rec.size) for f, rec in m.files.items()}
        faults: list[tuple[str, int]] = []
        mu = threading.Lock()

        def on_fault(c: Chunk, exc: BaseException) -> None:
            with mu:
                faults.append((c.file, c.begin))

        plan = plan_check(m, root, dests=dests)
        run(plan, self.make(target, m), on_fault=on_fault)
        assert sorted(faults) == [(names[0], CHUNK), (names[1], CHUNK)]
        landed = len(plan.chunks) - (0 if self.lands_before_verified else 2)
        assert sum(len(d.landed) for d in dests.values()) == landed

    def test_a_truncated_file_is_an_error(self, step):
        root, target, m = step
        fname = sorted(m.files)[0]
        size = m.files[fname].size
        os.truncate(_file(root, m, fname), size - CHUNK - 100)
        plan = plan_check(m, root, files=[fname], dests={fname: _Collect(size)})
        with pytest.raises(CheckpointCorruptError, match=f"{fname}.*(ended early|mismatch)"):
            run(plan, self.make(target, m))

    def test_a_run_that_lists_faults_lists_a_file_that_ended_early_and_goes_on(self, step):
        root, target, m = step
        fname = sorted(m.files)[0]
        cut = m.files[fname].size - CHUNK - 100
        os.truncate(_file(root, m, fname), cut)
        dests = {f: _Collect(rec.size) for f, rec in m.files.items()}
        faults: list[tuple[str, int]] = []
        mu = threading.Lock()

        def on_fault(c: Chunk, exc: BaseException) -> None:
            assert isinstance(exc, CheckpointCorruptError)
            with mu:
                faults.append((c.file, c.begin))

        plan = plan_check(m, root, dests=dests)
        run(plan, self.make(target, m), on_fault=on_fault)
        short = [(c.file, c.begin) for c in plan.chunks if c.file == fname and c.end > cut]
        assert len(short) == 2 and sorted(faults) == short
        for f, d in dests.items():  # every other chunk landed
            assert sorted(d.landed) == [c.begin for c in plan.chunks if c.file == f and (c.file, c.begin) not in short]

    def test_a_short_chunk_in_the_plan_is_an_error(self, step):
        """A plan whose chunk runs past the end of its file (a manifest that lies about the size)."""
        root, target, m = step
        fname = sorted(m.files)[0]
        size = m.files[fname].size
        plan = ReadPlan(root, (Chunk(fname, 0, size - 100, size + 4000, "00000000"),))
        with pytest.raises(CheckpointCorruptError, match="ended early"):
            run(plan, self.make(target, m))

    def test_cancellation_stops_the_run_and_gives_back_what_it_held(self, step):
        root, target, m = step
        cancel = threading.Event()
        source = _Counting(target, after_read=cancel.set)  # cancelled as the first read ends
        dests = {f: _Collect(rec.size) for f, rec in m.files.items()}
        plan = plan_check(m, root, dests=dests)
        transport = self.make(source, m, workers=2)
        with pytest.raises(ReadCancelledError):
            run(plan, transport, cancel=cancel)
        assert source.active == 0  # every started read ended before run() returned
        if not self.lands_before_verified:
            assert sum(len(d.landed) for d in dests.values()) == 0
        assert source.reads <= 1 + 2 * 2 < len(plan.chunks)  # (the reads already started or handed to a worker)
        self.assert_released(transport)
        cancel.clear()  # the same transport serves the next run
        source.after_read = None
        fresh = {f: _Collect(rec.size) for f, rec in m.files.items()}
        run(plan_check(m, root, dests=fresh), transport)
        assert sum(len(d.landed) for d in fresh.values()) == len(plan.chunks)

    def assert_released(self, transport) -> None:
        """What the transport holds between runs is all free again."""


class TestPread(TransportSuite):
    def make(self, source, m, workers=4):
        return PreadTransport(source, 1, workers=workers)


class _Ranged:
    """A local root read as an object store is read: each ``read_into`` one ranged request,
    cut and counted by a tuner over a request window of ``workers`` (the stores themselves,
    moto and SeaweedFS, are in tests/test_s3_reads.py)."""

    def __init__(self, inner, workers: int) -> None:
        self.inner = inner
        self.url = inner.url
        self.workers = workers
        self.ranges: list[tuple[str, int, int]] = []  # (file, offset, length) of every request
        self._mu = threading.Lock()

    def read_into(self, step: int, name: str, offset: int, out) -> None:
        with self._mu:
            self.ranges.append((name, offset, sum(a.size for a in out)))
        self.inner.read_into(step, name, offset, out)

    def read_tuner(self) -> ReadTuner:
        return ReadTuner(AdaptiveWindow(self.workers), start_inflight=self.workers, start_range=2 * CHUNK,
                         min_range=CHUNK, max_range=4 * CHUNK)


class TestRanged(TransportSuite):
    """The object store's transport: requests spanning several chunks of a file, or a part
    of one, and each byte asked for once."""

    read_per_chunk = False

    def make(self, source, m, workers=4):
        return RangedTransport(_Ranged(source, workers), 1)

    def test_each_byte_is_asked_for_once_in_ranges_of_several_chunks(self, step):
        root, target, m = step
        transport = self.make(target, m)
        dests = {f: _Collect(rec.size) for f, rec in m.files.items()}
        run(plan_check(m, root, dests=dests), transport)
        ranges = transport.source.ranges
        for f, rec in m.files.items():
            mine = sorted((o, n) for g, o, n in ranges if g == f)
            assert [o for o, _ in mine] == list(itertools.accumulate([0] + [n for _, n in mine[:-1]]))
            assert sum(n for _, n in mine) == rec.size  # contiguous, no byte twice
        assert max(n for _, _, n in ranges) > CHUNK  # (requests longer than a chunk)

    @pytest.fixture
    def scratch_peak(self, monkeypatch) -> list[int]:
        """The most scratch any read held at once (as each chunk's scratch is made)."""
        peak = [0]
        real = ranged._State.memory_of

        def memory_of(st, i):
            mem = real(st, i)
            with st.mu:
                peak[0] = max(peak[0], st.scratch_used)
            return mem

        monkeypatch.setattr(ranged._State, "memory_of", memory_of)
        return peak

    @pytest.mark.parametrize("scratch_chunks", [3, 0])
    def test_scratch_stays_within_its_bound_or_one_chunk(self, step, scratch_peak, scratch_chunks):
        """Many requests in flight, each able to span several chunks: the scratch held at once
        never passes the transport's bound (one chunk where the bound is smaller)."""
        root, target, m = step
        dests = {f: _Collect(rec.size) for f, rec in m.files.items()}
        transport = RangedTransport(_Ranged(target, 16), 1, scratch_bytes=scratch_chunks * CHUNK)
        run(plan_check(m, root, dests=dests), transport)
        assert 0 < scratch_peak[0] <= max(scratch_chunks, 1) * CHUNK
        if scratch_chunks > 1:
            assert max(n for _, _, n in transport.source.ranges) > CHUNK  # (requests of several chunks)

    def test_scratch_of_chunks_whose_fetch_failed_is_given_back(self, step, scratch_peak):
        """A run that lists faults, where every request for one file fails (the store answers
        500): the failed chunks' scratch is given back, so the rest of the read keeps its
        bound and its requests in flight."""
        root, target, m = step
        bad = sorted(m.files)[0]
        class Failing:
            url = target.url

            def read_into(self, step_, name, offset, out):
                if name == bad:
                    raise OSError("the store answered 500")
                target.read_into(step_, name, offset, out)

        faults: list[tuple[str, int]] = []
        mu = threading.Lock()

        def on_fault(c: Chunk, exc: BaseException) -> None:
            with mu:
                faults.append((c.file, c.begin))

        dests = {f: _Collect(rec.size) for f, rec in m.files.items()}
        plan = plan_check(m, root, dests=dests)
        run(plan, RangedTransport(_Ranged(Failing(), 16), 1, scratch_bytes=3 * CHUNK), on_fault=on_fault)
        assert sorted(faults) == sorted((c.file, c.begin) for c in plan.chunks if c.file == bad)
        for f, d in dests.items():
            if f != bad:
                assert sorted(d.landed) == [c.begin for c in plan.chunks if c.file == f]
        assert scratch_peak[0] <= 3 * CHUNK


class TestRing(TransportSuite):
    """The pinned ring's transport, on the CPU (plain page-aligned buffers, no streams)."""

    @pytest.fixture(autouse=True)
    def _ring(self):
        self.ring = PinnedRing(2, 2 * CHUNK)
        yield
        self.ring.close()

    def make(self, source, m, workers=4):
        ring = self.ring

        def fetch_for(fname):
            def fetch(slot: int, b: int, e: int) -> torch.Tensor:
                buf = ring.buffer(slot)[:e - b]
                source.read_into(1, fname, b, [buf.numpy()])
                return buf
            return fetch

        return RingTransport(ring, {f: fetch_for(f) for f in m.files}, torch.device("cpu"))

    def assert_released(self, transport) -> None:
        with self.ring.lease_many(self.ring.slots, timeout=0):  # every buffer is back
            pass


class _CountingAio:
    """A real kernel AIO context that reports its reads to a :class:`_Counting` source (in
    flight from submission to completion; each completion a read, followed by ``after_read``),
    and reaps in lockstep with the verifier tasks: each reap first waits for every task
    submitted before it, so that what one reap brought in has landed before the next."""

    def __init__(self, source, tasks: list) -> None:
        ctx = open_context(source.depth)
        if ctx is None:
            pytest.skip("no kernel AIO context here")
        self.ctx = ctx
        self.depth = ctx.depth
        self.source = source
        self.tasks = tasks
        self.outstanding = 0
        self.closed = False

    def submit_one(self, *a) -> None:
        self.ctx.submit_one(*a)
        self.outstanding += 1
        if isinstance(self.source.inner, _Counting):
            with self.source.inner._mu:
                self.source.inner.active += 1

    def reap(self, timeout: float, at_least: int = 1):
        futures_wait(list(self.tasks), timeout=60)
        done = self.ctx.reap(timeout, at_least)
        self._ended(len(done), reads=True)
        return done

    def close(self) -> None:
        self.ctx.close()  # (the kernel waits for the reads in flight)
        self._ended(self.outstanding, reads=False)
        self.closed = True

    def _ended(self, n: int, *, reads: bool) -> None:
        self.outstanding -= n
        counting = self.source.inner
        if not isinstance(counting, _Counting) or n == 0:
            return
        with counting._mu:
            counting.active -= n
            counting.reads += n if reads else 0
        if reads and counting.after_read is not None:
            for _ in range(n):
                counting.after_read()


class _DirectSource:
    """What the direct transport reads: a step's files opened for direct reads (evicted from the
    page cache first), and the source (counting or not) its reads are reported to."""

    def __init__(self, inner, root: str, m: Manifest, depth: int) -> None:
        self.inner = inner
        self.depth = depth
        target = inner.inner if isinstance(inner, _Counting) else inner
        self.files = {}
        for fname in m.files:
            evict(_file(root, m, fname))
            f = target.open_direct(1, fname)
            if f is None:
                self.close()
                pytest.skip("this filesystem refuses O_DIRECT")
            self.files[fname] = f

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _leases(ring: PinnedRing):
    """Each read's lease of the ring buffers that hold its block slots."""
    return lambda: ring.lease_many(landing_buffers(ring.slot_bytes))


class TestDirect(TransportSuite):
    """The queue of direct reads of cold files, on this machine's disk (/dev/shm refuses
    O_DIRECT; pytest's tmp_path is on the real disk here), through a ring of plain page-aligned
    buffers, ``workers`` reads in flight."""

    lands_before_verified = True

    @pytest.fixture(autouse=True)
    def _ring(self, step):
        self.root = step[0]
        self.ring = PinnedRing(2, 1 << 20)
        self.opened: list[_DirectSource] = []
        self.contexts: list[_CountingAio] = []
        yield
        for src in self.opened:
            src.close()
        self.ring.close()

    def make(self, source, m, workers=4):
        direct = _DirectSource(source, self.root, m, workers)
        self.opened.append(direct)
        tasks: list = []
        verifiers = self.ring.verifiers

        def submit(*a):
            fut = verifiers.submit(*a)
            tasks.append(fut)
            return fut

        def context():
            ctx = _CountingAio(direct, tasks)
            self.contexts.append(ctx)
            return ctx

        return DirectTransport(direct.files, context, _leases(self.ring), self.ring.buffer, submit)

    def assert_released(self, transport) -> None:
        with self.ring.lease_many(self.ring.slots, timeout=0):  # every buffer is back
            pass
        assert self.contexts and all(ctx.closed for ctx in self.contexts)  # every kernel context destroyed

    def test_a_chunk_of_many_blocks_verifies_from_its_blocks(self, tmp_path):
        """Chunks of several 512 KiB blocks, the last chunk short: each chunk's checksum is its
        blocks' combined, and one flipped byte in a middle block is named by its chunk."""
        from ckptmgr.format.checksum import crc32c_hex
        from ckptmgr.restore.transports.direct import BLOCK
        from ckptmgr.storage.posix import open_direct

        chunk = 3 * BLOCK
        data = np.random.default_rng(2).integers(0, 256, 4 * chunk + 5000, dtype=np.uint8)
        path = tmp_path / "f.bin"
        path.write_bytes(data.tobytes())
        chunks = tuple(Chunk("f.bin", i, b, min(b + chunk, data.size), crc32c_hex(data[b:b + chunk]),
                             _Collect(data.size)) for i, b in enumerate(range(0, data.size, chunk)))
        ring = self.ring
        for flip in (None, 2 * chunk + BLOCK + 11):
            if flip is not None:
                with open(path, "r+b") as fh:
                    fh.seek(flip)
                    fh.write(bytes([data[flip] ^ 2]))
            evict(str(path))
            f = open_direct(str(path))
            if f is None:
                pytest.skip("this filesystem refuses O_DIRECT")
            ctx = open_context(4)
            if ctx is None:
                f.close()
                pytest.skip("no kernel AIO context here")
            dest = _Collect(data.size)
            plan = ReadPlan("f.bin", tuple(Chunk(c.file, c.index, c.begin, c.end, c.crc, dest) for c in chunks))
            transport = DirectTransport({"f.bin": f}, lambda ctx=ctx: ctx, _leases(ring), ring.buffer,
                                        ring.verifiers.submit)
            try:
                if flip is None:
                    run(plan, transport)
                    assert dest.buf.tobytes() == data.tobytes()
                else:
                    with pytest.raises(CheckpointCorruptError,
                                       match=rf"f.bin: checksum mismatch in bytes \[{2 * chunk}, {3 * chunk}\)"):
                        run(plan, transport)
            finally:
                f.close()
            with ring.lease_many(ring.slots, timeout=0):
                pass

    def test_chunks_with_sub_chunk_checksums_are_refused(self, step):
        root, target, m = step
        fname = sorted(m.files)[0]
        plan = ReadPlan(root, (Chunk(fname, 0, 0, CHUNK, "00000000", None, ((0, 1024, "00000000"),)),))
        with pytest.raises(ValueError, match="sub-chunk checksums"):
            run(plan, self.make(target, m))


FAKE_KVIKIO = os.path.join(os.path.dirname(__file__), "fake_kvikio")


class _CountingCuFile:
    """A file open with (the stand-in) kvikio whose reads are reported to a :class:`_Counting`
    source as its own: in flight from ``pread`` until the future's ``get()``, then a read,
    followed by ``after_read``."""

    def __init__(self, f, counting, opened: list) -> None:
        self.f = f
        self.counting = counting
        self.closed = False
        opened.append(self)

    def pread(self, buf, size, offset):
        counting = self.counting
        if counting is not None:
            with counting._mu:
                counting.active += 1
                counting.reads += 1
        return _CountedRead(self.f.pread(buf, size, offset), counting)

    def close(self) -> None:
        self.f.close()
        self.closed = True


class _CountedRead:
    def __init__(self, fut, counting) -> None:
        self.fut = fut
        self.counting = counting

    def get(self):
        try:
            return self.fut.get()
        finally:
            if self.counting is not None:
                with self.counting._mu:
                    self.counting.active -= 1
                if self.counting.after_read is not None:
                    self.counting.after_read()


class TestGds(TransportSuite):
    """kvikio reads, with the stand-in kvikio of tests/fake_kvikio (POSIX reads, as kvikio's
    compatibility mode does; test_cuda.py runs the real one on the GPU machine): into scratch
    host buffers for destinations of their own, and straight into a restore's landing, read
    back and verified (the tests below the suite's)."""

    @pytest.fixture(autouse=True)
    def _kvikio(self, monkeypatch, step):
        monkeypatch.syspath_prepend(FAKE_KVIKIO)
        monkeypatch.delenv("CKPTMGR_FAKE_KVIKIO", raising=False)
        for name in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
            monkeypatch.delitem(sys.modules, name)
        import kvikio

        self.kvikio = kvikio
        self.root = step[0]
        self.opened: list[_CountingCuFile] = []
        yield
        for name in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
            del sys.modules[name]

    def make(self, source, m, workers=4):
        counting = source if isinstance(source, _Counting) else None
        paths = {f: _file(self.root, m, f) for f in m.files}
        return GdsTransport(paths, workers=workers,
                            opener=lambda p: _CountingCuFile(self.kvikio.CuFile(p, "r"), counting, self.opened))

    def assert_released(self, transport) -> None:
        assert self.opened and all(f.closed for f in self.opened)  # every file closed

    def _landings(self, m):
        entries = entries_by_file(m, self.root)
        return {f: plan_landing(entries[f], rec.header_size, rec.size - rec.header_size, torch.device("cpu"), None)
                for f, rec in m.files.items()}

    def test_a_landing_is_read_into_whole_then_read_back_and_verified(self, step):
        root, target, m = step
        source = _Counting(target)
        landings = self._landings(m)
        plan = plan_check(m, root, dests=landings)
        run(plan, self.make(source, m))
        for f, rec in m.files.items():
            with open(_file(root, m, f), "rb") as fh:
                data = fh.read()
            landed = torch.zeros(rec.size - rec.header_size, dtype=torch.uint8)
            landings[f].gather(rec.header_size, landed)
            assert bytes(landed.numpy()) == data[rec.header_size:]
        spans = sum(len(landing.spans) for landing in landings.values())
        heads = sum(1 for c in plan.chunks if c.begin < m.files[c.file].header_size)
        assert source.reads == spans + heads and source.active == 0  # the data once, into the landing
        self.assert_released(None)

    @pytest.mark.parametrize("where", ["header", "data"])
    def test_a_flipped_byte_where_it_landed_or_in_the_header_is_named(self, step, where):
        root, target, m = step
        fname = sorted(m.files)[1]
        rec = m.files[fname]
        at = rec.header_size - 5 if where == "header" else rec.size - 7
        path = _file(root, m, fname)
        with open(path, "r+b") as fh:
            fh.seek(at)
            b = fh.read(1)
            fh.seek(at)
            fh.write(bytes([b[0] ^ 0x20]))
        plan = plan_check(m, root, dests=self._landings(m))
        chunk = next(c for c in plan.chunks if c.file == fname and c.begin <= at < c.end)
        with pytest.raises(CheckpointCorruptError,
                           match=rf"{fname}: checksum mismatch in bytes \[{chunk.begin}, {chunk.end}\)"):
            run(plan, self.make(target, m, workers=1))
        self.assert_released(None)

    def test_a_landing_of_a_file_that_ended_early_fails_or_lists_its_chunks(self, step):
        root, target, m = step
        fname = sorted(m.files)[0]
        cut = m.files[fname].size - CHUNK - 100
        os.truncate(_file(root, m, fname), cut)
        with pytest.raises(CheckpointCorruptError, match=f"{fname} ended early"):
            run(plan_check(m, root, dests=self._landings(m)), self.make(target, m))
        faults: list[tuple[str, int]] = []
        plan = plan_check(m, root, dests=self._landings(m))
        run(plan, self.make(target, m), on_fault=lambda c, exc: faults.append((c.file, c.begin)))
        short = [(b, e) for b, e, _ in next(c.dest for c in plan.chunks if c.file == fname).spans if e > cut]
        want = [(c.file, c.begin) for c in plan.chunks
                if c.file == fname and any(b < c.end and c.begin < e for b, e in short)]  # (a span read short
        assert short and sorted(faults) == want  # fails every chunk it holds bytes of)

    @pytest.mark.parametrize("into", ["scratch", "landing"])
    def test_a_kvikio_that_cannot_read_fails_the_run_and_closes_every_file(self, step, monkeypatch, into):
        """Every kvikio read fails (no NVIDIA driver): the run raises kvikio's error once every
        read started has ended, with nothing landed and every file closed."""
        root, target, m = step
        monkeypatch.setenv("CKPTMGR_FAKE_KVIKIO", "nodriver")
        source = _Counting(target)
        dests = {f: _Collect(rec.size) for f, rec in m.files.items()} if into == "scratch" else self._landings(m)
        with pytest.raises(RuntimeError, match="libcuda"):
            run(plan_check(m, root, dests=dests), self.make(source, m))
        assert source.reads >= 1 and source.active == 0
        if into == "scratch":
            assert sum(len(d.landed) for d in dests.values()) == 0
        self.assert_released(None)
