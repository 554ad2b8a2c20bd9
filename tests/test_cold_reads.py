"""Chunk reads of a cold file: what the page cache holds is copied from it, the rest read
with O_DIRECT straight into the (aligned) buffer, plain reads where that cannot be; the
bytes are the file's whichever way they came. Real files on this machine's filesystem."""

import glob
import mmap
import os

import numpy as np
import pytest
import torch
from conftest import evict

from ckptmgr import CheckpointManager, StagingOptions
from ckptmgr.errors import CheckpointCorruptError
from ckptmgr.storage.posix import DIRECT_ALIGN, pread_chunk

SIZE = 3 * (1 << 20) + 1234  # not a multiple of the alignment: the last read is short


def _aligned(nbytes: int) -> np.ndarray:
    m = mmap.mmap(-1, -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN)  # page-aligned, as pinned buffers are
    return np.frombuffer(m, dtype=np.uint8)


def _direct_ok(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
    except OSError:
        return False
    return hasattr(os, "O_DIRECT")


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    return str(path), data


def test_a_cached_file_is_copied_from_the_cache(data_file):
    path, data = data_file
    buf = _aligned(SIZE)
    with open(path, "rb") as f:
        f.read()  # every page cached
    assert pread_chunk(path, 0, buf, SIZE) == "cached"
    assert np.array_equal(buf[:SIZE], data)


@pytest.mark.parametrize("offset", [0, 1 << 20, 2 * (1 << 20)])
def test_a_cold_file_is_read_direct_up_to_its_short_end(data_file, offset):
    path, data = data_file
    evict(path)
    length = SIZE - offset
    buf = _aligned(length)
    how = pread_chunk(path, offset, buf, length)
    assert how == ("direct" if _direct_ok(path) else "buffered")
    assert np.array_equal(buf[:length], data[offset:])


def test_unaligned_reads_and_buffers_fall_back_to_plain_reads(data_file):
    path, data = data_file
    evict(path)
    buf = _aligned(SIZE + DIRECT_ALIGN)
    assert pread_chunk(path, 100, buf, 5000) in ("buffered", "cached")
    assert np.array_equal(buf[:5000], data[100:5100])
    evict(path)
    off = buf[1:]  # an unaligned address
    assert pread_chunk(path, 0, off, 8192) in ("buffered", "cached")
    assert np.array_equal(off[:8192], data[:8192])
    evict(path)
    tight = _aligned(SIZE)[:SIZE - 10]  # no room for the rounded-up length
    assert pread_chunk(path, 0, tight, SIZE - 10) in ("buffered", "cached")
    assert np.array_equal(tight, data[:SIZE - 10])


def test_a_file_shorter_than_asked_is_corrupt(data_file):
    path, _ = data_file
    evict(path)
    buf = _aligned(SIZE + (1 << 20))
    with pytest.raises(CheckpointCorruptError, match="ended early"):
        pread_chunk(path, 0, buf, SIZE + 100)


def test_a_link_out_of_the_directory_is_refused(tmp_path, data_file):
    path, _ = data_file
    d = tmp_path / "step"
    d.mkdir()
    os.symlink(path, d / "x")
    fd = os.open(d, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointCorruptError):
            pread_chunk("x", 0, _aligned(4096), 4096, dir_fd=fd)
    finally:
        os.close(fd)


def test_a_ring_restore_of_an_evicted_step_is_exact(tmp_path, monkeypatch):
    """The ring reads a step whose files left the page cache as one queue of direct reads
    (plain chunk reads where O_DIRECT is refused) and gives the saved tensors."""
    from ckptmgr.storage.local import LocalTarget

    opened, hows = [], []
    real_open, real_chunk = LocalTarget.open_direct, LocalTarget.read_chunk
    monkeypatch.setattr(LocalTarget, "open_direct", lambda *a: opened.append(real_open(*a)) or opened[-1])
    monkeypatch.setattr(LocalTarget, "read_chunk", lambda *a: hows.append(real_chunk(*a)) or hows[-1])
    root = str(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(300_000 + i, generator=g) for i in range(4)}
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, state).result()
        direct = _direct_ok(glob.glob(f"{root}/step_*/data-*")[0])
        evict(root)
        for cached in (False, False, True):  # direct reads leave the page cache as it was: cold twice
            if cached:
                for path in glob.glob(f"{root}/step_*/data-*"):
                    with open(path, "rb") as f:
                        f.read()
            opened.clear()
            hows.clear()
            out = mgr.restore(1, device="cpu", loader="ring")
            for k, v in state.items():
                assert torch.equal(out[k], v), k
            if cached:  # copied from the page cache, chunk by chunk
                assert opened and opened == [None] * len(opened) and set(hows) == {"cached"}
            elif direct:
                assert opened and all(f is not None for f in opened) and hows == []
            else:
                assert opened == [None] * len(opened) and set(hows) == {"buffered"}


@pytest.mark.parametrize("loader", ["host", "ring"])
def test_more_tensors_in_a_chunk_than_one_readv_takes(tmp_path, loader):
    """Thousands of small tensors in one checksum chunk: more buffers than one readv call
    accepts (IOV_MAX), read in several calls."""
    g = torch.Generator().manual_seed(2)
    state = {f"t{i}": torch.randn(1 + i % 7, generator=g) for i in range(3000)}
    with CheckpointManager(str(tmp_path / "ckpt"), staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, state).result()
        out = mgr.restore(1, device="cpu", loader=loader)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        mgr.restore(1, target=target, loader=loader)
    for k, v in state.items():
        assert torch.equal(out[k], v) and torch.equal(target[k], v), k
