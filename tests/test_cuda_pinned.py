"""The in-place loader and pinned weights on a real GPU (``pytest -m cuda``); skipped elsewhere."""

import os

import pytest
import torch
from safetensors.torch import save_file as st_save_file
from test_pinned_weights import assert_same, every_dtype, mapped_paths

import ckptmgr
from ckptmgr import StateMismatchError
from ckptmgr.restore.loaders import bounce, pieces

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(pieces, "PIECE_BYTES", 64 << 10)  # many pieces, several streams, in a small file
    monkeypatch.setattr(bounce, "PIECE_BYTES", 64 << 10)  # (and many reads through the bounce buffers)


def on_host(tensors):
    return {k: v.cpu() for k, v in tensors.items()}


def test_load_file_from_ram_in_pieces_is_bit_exact_for_every_dtype(ram_dir, small_pieces):
    path = os.path.join(ram_dir, "w.safetensors")
    want = every_dtype() | {"big": torch.randn(300_000)}
    st_save_file(want, path)
    got = ckptmgr.load_file(path, device="cuda")
    assert all(v.device.type == "cuda" for v in got.values())
    assert_same(on_host(got), want)


def test_load_file_from_disk_onto_the_gpu(tmp_path):
    path = str(tmp_path / "w.safetensors")
    want = every_dtype(2)
    st_save_file(want, path)
    assert_same(on_host(ckptmgr.load_file(path, device="cuda")), want)


def test_load_file_of_a_cold_file_on_disk_reads_it_directly_into_pinned_buffers(tmp_path, small_pieces, monkeypatch):
    """Out of the page cache, the pieces are read with O_DIRECT into the pinned bounce block
    (page-aligned: no read falls back) and land bit-exact; the file stays out of the cache."""
    from conftest import evict
    from test_load_file import _skip_without_direct_reads

    from ckptmgr.storage.posix import DirectFile, _mostly_cached

    reads = []
    real = DirectFile.read

    def read(self, offset, view, length, *, plain=False):
        real(self, offset, view, length, plain=plain)
        reads.append(self._fallback)
    monkeypatch.setattr(DirectFile, "read", read)
    path = str(tmp_path / "w.safetensors")  # (larger than the readahead of the header's read)
    want = every_dtype(4) | {"big": torch.randn(12_000_001)}
    st_save_file(want, path)
    evict(path)
    _skip_without_direct_reads(path)
    got = ckptmgr.load_file(path, device="cuda")
    assert_same(on_host(got), want)
    assert len(reads) > 100 and not any(reads)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert not _mostly_cached(fd, 0, os.path.getsize(path))
    finally:
        os.close(fd)


def test_pinned_weights_unlinked_rewritten_and_into_existing_tensors(ram_dir, small_pieces):
    path = os.path.join(ram_dir, "w.safetensors")
    want = every_dtype(3) | {"big": torch.randn(300_000)}
    st_save_file(want, path)
    with ckptmgr.pin_file(path) as weights:
        os.unlink(path)
        first = weights.load("cuda")
        assert_same(on_host(first), want)
        first["big"].zero_()
        again = weights.load("cuda", out=first)
        assert all(again[k] is first[k] for k in first)
        assert_same(on_host(again), want)
        new = {"big": torch.randn(300_000), "x": torch.arange(7)}
        st_save_file(new, path + ".tmp")
        os.replace(path + ".tmp", path)
        assert_same(on_host(weights.load("cuda")), new)
        with pytest.raises(StateMismatchError, match="on cpu, but the load is to cuda"):
            weights.load("cuda", out={"big": torch.empty(300_000)})
    assert path not in mapped_paths() and path + " (deleted)" not in mapped_paths()


def test_loads_are_ordered_after_work_queued_on_the_target(ram_dir):
    """A load into ``out=`` comes after the kernels the caller already queued on those tensors."""
    path = os.path.join(ram_dir, "w.safetensors")
    want = {"w": torch.randn(4_000_000)}
    st_save_file(want, path)
    with ckptmgr.pin_file(path) as weights:
        out = {"w": torch.zeros(4_000_000, device="cuda")}
        torch.cuda._sleep(50_000_000)  # the current stream busy for a while
        out["w"].fill_(3.0)  # queued behind it: the load must land after this
        weights.load("cuda", out=out)
        assert torch.equal(out["w"].cpu(), want["w"])


def test_the_bounce_readers_queue_through_the_runtime_after_work_on_the_target(ram_dir, small_pieces):
    """On a GPU the readers' copies go through the CUDA runtime library (no GIL held); into a
    target's own tensor they land after the kernels the caller queued on it, bit-exact."""
    from ckptmgr import _cuda
    from ckptmgr.restore.loaders.landing import plan_landing
    from ckptmgr.restore.loaders.mapped import open_mapped

    assert _cuda.runtime() is not None  # (PyTorch's wheels load libcudart: the fast path runs here)
    path = os.path.join(ram_dir, "w.safetensors")
    want = {"w": torch.randn(4_000_000), "b": torch.arange(10), "h": torch.randn(999).half()}
    st_save_file(want, path)
    device = torch.device("cuda", torch.cuda.current_device())
    dests = {"w": torch.zeros(4_000_000, device=device)}
    mf = open_mapped(path)
    try:
        landing = plan_landing(mf.entries, mf.data_start, mf.size - mf.data_start, device, dests)
        assert bounce.runtime_for(landing, device) is not None
        torch.cuda._sleep(50_000_000)  # the current stream busy for a while
        dests["w"].fill_(3.0)  # queued behind it: the load must land after this
        bounce.copy_through_bounce(mf.fd, 0, mf.size, landing, device, path)
        got = landing.tensors()
    finally:
        mf.close()
    assert got["w"] is dests["w"]
    assert_same(on_host(got), want)


def test_load_file_to_cuda_without_an_index_takes_the_runtime_path(ram_dir, small_pieces, monkeypatch):
    """``device="cuda"`` is the current device: the readers queue through the runtime there too."""
    real = bounce.runtime_for
    seen = []

    def spy(landing, device):
        seen.append((device, real(landing, device)))
        return seen[-1][1]

    monkeypatch.setattr(bounce, "runtime_for", spy)
    path = os.path.join(ram_dir, "w.safetensors")
    want = every_dtype(4) | {"big": torch.randn(300_000)}
    st_save_file(want, path)
    got = ckptmgr.load_file(path, device="cuda")
    assert seen and all(d.index == torch.cuda.current_device() and rt is not None for d, rt in seen)
    assert_same(on_host(got), want)
