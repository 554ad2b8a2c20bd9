"""The on-disk format: standard safetensors, aligned, JSON only, and every kind of damage detected."""

import itertools
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from manifest_tools import rewrite
from safetensors import safe_open

from ckptmgr import CheckpointCorruptError, CheckpointManager, FormatVersionError, StepNotFoundError


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g).bfloat16()},
            "step": seed, "ids": torch.arange(10)}


def _data(root, step):
    return os.path.join(root, f"step_{step:012d}", "data-00000.safetensors")


def test_files_are_standard_safetensors_with_aligned_data(root):
    state = _state()
    with CheckpointManager(root) as mgr:
        mgr.save(1, state).result()
    path = _data(root, 1)
    with safe_open(path, "pt") as f:
        assert set(f.keys()) == {"model/w", "model/b", "ids"}
        assert torch.equal(f.get_tensor("model/w"), state["model"]["w"])
        assert torch.equal(f.get_tensor("model/b"), state["model"]["b"])
        assert f.metadata()["format"] == "pt"
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    assert (8 + n) % 4096 == 0
    offsets = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    itemsize = {"F32": 4, "BF16": 2, "I64": 8}
    for k, v in header.items():
        if k != "__metadata__":
            assert (8 + n + v["data_offsets"][0]) % itemsize[v["dtype"]] == 0, k
    assert offsets[0][0] == 0
    assert all(a[1] == b[0] for a, b in itertools.pairwise(offsets))  # no gaps
    assert os.path.getsize(path) == 8 + n + offsets[-1][1]  # no trailing bytes


def test_no_pickle_anywhere(root):
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"a": _state(), "t": (1, 2.0, None), "d": {3: "x"}}).result()
    step_dir = os.path.join(root, "step_000000000001")
    assert sorted(os.listdir(step_dir)) == ["data-00000.safetensors", "manifest.json"]
    json.loads(Path(step_dir, "manifest.json").read_bytes())  # strict JSON
    for name in os.listdir(step_dir):
        blob = Path(step_dir, name).read_bytes()
        assert b"$pickle" not in blob
        assert b"\x80\x04\x95" not in blob and b"\x80\x05\x95" not in blob  # pickle protocol 4/5 frames


@pytest.fixture
def two_steps(root):
    with CheckpointManager(root) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.save(2, _state(2)).result()
    return root


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _expect_fallback(root, match):
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointCorruptError, match=match):
            mgr.restore(2)
        with pytest.warns(RuntimeWarning, match="skipping step 2"):
            out = mgr.restore()
    assert out["step"] == 1
    assert torch.equal(out["model"]["w"], _state(1)["model"]["w"])


def test_flipped_data_byte(two_steps):
    _flip(_data(two_steps, 2), 4096 + 1000)
    _expect_fallback(two_steps, r"checksum mismatch in bytes \[0, ")


def test_truncated_file(two_steps):
    path = _data(two_steps, 2)
    os.truncate(path, os.path.getsize(path) - 10)
    _expect_fallback(two_steps, "truncated")


def test_garbage_header(two_steps):
    with open(_data(two_steps, 2), "r+b") as f:
        f.write(b"\xff" * 64)
    _expect_fallback(two_steps, "header length")


def test_missing_data_file(two_steps):
    os.unlink(_data(two_steps, 2))
    _expect_fallback(two_steps, "missing")


def test_garbage_manifest(two_steps):
    with open(os.path.join(two_steps, "step_000000000002", "manifest.json"), "wb") as f:
        f.write(b'{"format": "ckptmgr", "format_ver')
    _expect_fallback(two_steps, "not valid JSON")


def test_manifest_with_bad_fields(two_steps):
    rewrite(two_steps, 2, lambda m: m["tensors"]["model/w"].update(offsets=[0, 12]))
    _expect_fallback(two_steps, r"tensors\['model/w'\].offsets: \[0, 12\] span 12 bytes")


def test_an_edited_manifest_fails_its_checksum(two_steps):
    p = os.path.join(two_steps, "step_000000000002", "manifest.json")
    m = json.loads(Path(p).read_text())
    m["tensors"]["model/w"]["offsets"] = [0, 12]
    Path(p).write_text(json.dumps(m))
    _expect_fallback(two_steps, "manifest_crc32c")


def test_missing_manifest_hides_the_step(two_steps):
    os.unlink(os.path.join(two_steps, "step_000000000002", "manifest.json"))
    with CheckpointManager(two_steps) as mgr:
        assert mgr.steps() == [1]
        assert mgr.restore()["step"] == 1
        with pytest.raises(StepNotFoundError):
            mgr.restore(2)
    assert not os.path.exists(os.path.join(two_steps, "step_000000000002"))  # cleaned as garbage


def test_newer_format_is_refused_not_skipped(two_steps):
    rewrite(two_steps, 2, lambda m: m.update(format_version=99))
    with CheckpointManager(two_steps) as mgr, pytest.raises(FormatVersionError, match="Upgrade ckptmgr"):
        mgr.restore()


def test_every_step_corrupt(two_steps):
    for s in (1, 2):
        _flip(_data(two_steps, s), 5000)
    with CheckpointManager(two_steps) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(StepNotFoundError, match="verifies"):
            mgr.restore()


def test_foreign_files_are_left_alone(root):
    os.makedirs(os.path.join(root, "step_12"))  # not our naming (not 12 digits)
    os.makedirs(os.path.join(root, "notes"))
    open(os.path.join(root, ".step_x.tmp-zz"), "w").close()
    os.makedirs(os.path.join(root, ".step_000000000003.tmp-0123456789abcdef"))  # ours: stale temp
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == []
    assert sorted(os.listdir(root)) == [".step_x.tmp-zz", "notes", "step_12"]


def test_crc32c_combine_matches_the_checksum_of_the_joined_bytes():
    """A chunk's CRC32C built from its pieces' (the cold-read queue checksums blocks apart):
    for lengths with a lookup table (multiples of 64 KiB) and without, empty pieces included."""
    import numpy as np

    from ckptmgr.format.checksum import crc32c_combine, crc32c_value

    rng = np.random.default_rng(11)
    for la, lb in [(0, 0), (7, 0), (0, 9), (1, 1), (4096, 65536), (3, 512 << 10), (100_001, 131_072 + 4096),
                   (512 << 10, 12_345)]:
        a = rng.integers(0, 256, la, dtype=np.uint8)
        b = rng.integers(0, 256, lb, dtype=np.uint8)
        joined = crc32c_value(np.concatenate([a, b]))
        assert crc32c_combine(crc32c_value(a), crc32c_value(b), lb) == joined, (la, lb)
    pieces = np.array_split(rng.integers(0, 256, 3 << 20, dtype=np.uint8), [1 << 19, 1 << 20, (2 << 20) + 5])
    value = crc32c_value(pieces[0])
    for p in pieces[1:]:
        value = crc32c_combine(value, crc32c_value(p), p.size)
    assert value == crc32c_value(np.concatenate(pieces))
