"""One conformance suite for every transport of the read driver (``ckptmgr.restore.read``).

Each transport is a subclass of :class:`TransportSuite` that says how to make it over a real
committed step on the local disk; every test then runs the same plans through it: the bytes
land exactly, a checksum failure names the file and the byte range, a file that ends early
is an error, a cancelled run stops and gives back what it held, and a run that lists faults
goes on past them.
"""

from __future__ import annotations

import itertools
import os
import threading

import numpy as np
import pytest
import torch

from ckptmgr import CheckpointCorruptError, CheckpointManager, StagingOptions, WriteOptions
from ckptmgr.format.manifest import Manifest
from ckptmgr.restore.loaders.ring import PinnedRing
from ckptmgr.restore.read import Chunk, ReadCancelledError, ReadPlan, plan_check, run
from ckptmgr.restore.transports import PreadTransport, RingTransport
from ckptmgr.storage import open_target

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
        self._mu = threading.Lock()

    def file_size(self, step: int, name: str) -> int:
        return self.inner.file_size(step, name)

    def read_into(self, step: int, name: str, offset: int, out) -> None:
        with self._mu:
            self.active += 1
            self.reads += 1
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
        assert source.reads == len(plan.chunks) and source.active == 0

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
        assert sum(len(d.landed) for d in dests.values()) == len(plan.chunks) - 2

    def test_a_truncated_file_is_an_error(self, step):
        root, target, m = step
        fname = sorted(m.files)[0]
        size = m.files[fname].size
        os.truncate(_file(root, m, fname), size - CHUNK - 100)
        plan = plan_check(m, root, files=[fname], dests={fname: _Collect(size)})
        with pytest.raises(CheckpointCorruptError, match=f"{fname}.*(ended early|mismatch)"):
            run(plan, self.make(target, m))

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
