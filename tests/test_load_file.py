"""ckptmgr.load_file and the in-place loader, on CPU: any safetensors file, header checks,
checksums verified beside the copy, read-only pinning of the mapping (pinning faked here; the
GPU machine runs it for real in test_cuda.py)."""

import os

import pytest
import torch
from conftest import assert_tree_equal
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
    import json

    header = json.dumps({k: {"dtype": d, "shape": s, "data_offsets": o} for k, (d, s, o) in entries.items()}).encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + data)


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
