"""The torch checkpoint image: byte for byte torch.save's records, one extra checksum record,
valid zip CRC-32s, and checksums that catch damage."""

import argparse
import dataclasses
import io
import os
import random
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import crc32c
import numpy as np
import pytest
import torch

from ckptmgr.errors import CheckpointCorruptError
from ckptmgr.format import torchzip


@dataclasses.dataclass
class Config:
    width: int
    name: str


def build(obj, chunk_size=64 << 10, pool=None):
    """The image of ``obj``, laid out and filled as the stager fills a slot, then sealed."""
    image = torchzip.plan_image(obj, chunk_size=chunk_size)
    buf = np.full(image.size, 0xAB, dtype=np.uint8)  # a reused slot holds old bytes
    image.write_static(buf)
    t = torch.from_numpy(buf)
    for s in image.spans:
        t[s.offset:s.offset + s.nbytes].copy_(s.source)
    torchzip.seal(image, buf, pool)
    return image, buf.tobytes()


def state():
    torch.manual_seed(0)
    base = torch.arange(100.0)
    lin = torch.nn.Linear(3, 4)
    return {
        "w": torch.randn(1 << 16),
        "views": [base[10:20], base[::3], base],  # one storage, three tensors
        "tied": [lin.weight, lin.weight],
        "dtypes": [torch.ones(3, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.int64), torch.tensor([True])],
        "empty": torch.empty(0),
        "scalar": torch.tensor(3.5),
        "plain": {"epoch": 3, "lr": 0.1, "name": "x", 7: None},
    }


def test_records_are_byte_for_byte_torch_saves():
    obj = state()
    _, got = build(obj, pool=ThreadPoolExecutor(3))
    ref = io.BytesIO()
    torch.save(obj, ref)
    ours, theirs = zipfile.ZipFile(io.BytesIO(got)), zipfile.ZipFile(io.BytesIO(ref.getvalue()))
    assert ours.testzip() is None  # every CRC-32 right
    names = [i.filename for i in theirs.infolist()]
    assert [i.filename for i in ours.infolist()] == [*names, "archive/" + torchzip.CHECKSUM_RECORD]
    for name in names:
        if not name.endswith("serialization_id"):  # random per save
            assert ours.read(name) == theirs.read(name), name
    # torch's own reader finds each storage where the image put it
    reader = torch._C.PyTorchFileReader(io.BytesIO(got))
    image = torchzip.plan_image(obj, chunk_size=64 << 10)
    for s in image.spans:
        assert reader.get_record_offset(f"data/{s.key}") == s.offset


def test_loads_with_weights_only_aliasing_kept(tmp_path):
    _, got = build(state())
    path = tmp_path / "x.ckpt"
    path.write_bytes(got)
    for kwargs in ({}, {"mmap": True}):
        back = torch.load(path, weights_only=True, **kwargs)
        want = state()
        assert torch.equal(back["w"], want["w"]) and torch.equal(back["views"][1], want["views"][1])
        assert back["views"][0].untyped_storage().data_ptr() == back["views"][2].untyped_storage().data_ptr()
        assert back["tied"][0] is back["tied"][1] or torch.equal(back["tied"][0], back["tied"][1])
        assert back["dtypes"][0].dtype == torch.bfloat16 and back["plain"] == want["plain"]
    with open(path, "rb") as f:
        assert torchzip.verify_file(f)


def test_python_objects_as_torch_save_pickles_them():
    obj = {"loss": torch.nn.CrossEntropyLoss(), "cfg": Config(4, "a"), "ns": argparse.Namespace(a=1),
           "arr": np.arange(4), "mod": torch.nn.Linear(2, 2)}
    _, got = build(obj)
    back = torch.load(io.BytesIO(got), weights_only=False)
    assert type(back["loss"]) is torch.nn.CrossEntropyLoss and back["cfg"] == Config(4, "a")
    assert back["ns"] == argparse.Namespace(a=1) and back["arr"].tolist() == [0, 1, 2, 3]
    assert torch.equal(back["mod"].weight, obj["mod"].weight)
    with pytest.raises(Exception, match="weights_only"):
        torch.load(io.BytesIO(got), weights_only=True)  # as for a torch.save file


def test_damage_anywhere_in_the_checksummed_bytes_is_caught():
    image, got = build(state(), chunk_size=4096)
    rng = random.Random(0)
    spots = [s.offset + rng.randrange(s.nbytes) for s in image.spans]
    spots += [rng.randrange(image.covered) for _ in range(20)]
    for at in spots:
        bad = bytearray(got)
        bad[at] ^= 0x10
        with pytest.raises(CheckpointCorruptError, match=r"CRC32C|zip|record"):
            torchzip.verify_file(io.BytesIO(bytes(bad)))
    with pytest.raises(CheckpointCorruptError):
        torchzip.verify_file(io.BytesIO(got[:-100]))  # truncated
    assert torchzip.verify_file(io.BytesIO(got))


def test_a_torch_save_file_has_nothing_to_verify():
    ref = io.BytesIO()
    torch.save(state(), ref)
    assert torchzip.verify_file(ref) is False
    with pytest.raises(CheckpointCorruptError, match="not a zip"):
        torchzip.verify_file(io.BytesIO(b"\x80\x02legacy pickle" * 10))


def test_crafted_central_directory_is_refused():
    image, got = build({"w": torch.ones(4)})
    rec = next(r for r in image.records if r.name == "data/0")
    bad = bytearray(got)
    at = rec.crc_fields[0] - 16 + 42  # the central directory entry's local header offset
    bad[at:at + 4] = struct.pack("<I", len(got) - 10)
    with pytest.raises(CheckpointCorruptError):
        torchzip.verify_file(io.BytesIO(bytes(bad)))


def test_crc_combination_matches_zlib_and_crc32c():
    rng = random.Random(1)
    for _ in range(100):
        a, b = os.urandom(rng.randrange(0, 5000)), os.urandom(rng.randrange(0, 5000))
        assert torchzip.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        assert torchzip.crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_storages_split_across_chunks_get_their_crc32():
    obj = {"a": torch.randn(10_000), "b": torch.randn(3), "c": torch.randn(30_000)}
    _, got = build(obj, chunk_size=4096, pool=ThreadPoolExecutor(4))  # every storage spans many chunks
    assert zipfile.ZipFile(io.BytesIO(got)).testzip() is None


def test_zip64_archive_over_4_gib(tmp_path):
    big = torch.empty(4 << 30 | 123, dtype=torch.uint8)  # never touched: no memory is used for it
    obj = {"small": torch.arange(5.0), "big": big, "after": torch.ones(7)}
    image = torchzip.plan_image(obj)
    assert image.size > 1 << 32
    path = tmp_path / "big.ckpt"
    with open(path, "wb") as f:  # sparse: only the static bytes are written
        f.truncate(image.size)
        for at, data in image.static:
            f.seek(at)
            f.write(data)
    with open(path, "rb") as f:
        records = torchzip.read_records(lambda o, n: (f.seek(o), f.read(n))[1], image.size)
    reader = torch._C.PyTorchFileReader(str(path))
    for r in records:
        if r.name.startswith("data/"):
            assert reader.get_record_offset(r.name) == r.data_offset
    names = zipfile.ZipFile(path).namelist()
    assert names[-1].endswith(torchzip.CHECKSUM_RECORD) and len(names) == len(records)
    back = torch.load(path, weights_only=True, mmap=True)
    assert back["big"].shape == big.shape and back["after"].shape == (7,)


def test_a_replaced_torch_save_writes_an_empty_file():
    with mock.patch("torch.save") as save:
        image = torchzip.plan_image({"w": torch.ones(2)})
    assert save.call_count == 1 and image.size == 0 and not image.spans


def test_fuzzed_archive_structure_gives_a_clear_error_or_passes():
    image, got = build({"w": torch.arange(64.0), "b": torch.ones(3)})
    tail = image.covered  # the checksum record, the central directory and the end records
    rng = random.Random(2)
    for _ in range(300):
        bad = bytearray(got)
        for _ in range(rng.randrange(1, 4)):
            bad[rng.randrange(tail, len(bad))] = rng.randrange(256)
        try:
            torchzip.verify_file(io.BytesIO(bytes(bad)))
        except CheckpointCorruptError:
            pass
