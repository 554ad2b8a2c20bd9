"""The object-store loader (:func:`~ckptmgr.restore.loaders.store.read_tensors_store`): ranged
reads landed as the pinned ring's are, on the CPU here and on a real GPU with ``-m cuda``. The
source is a local root read through the ranged interface an object store offers (its
``read_into`` and a ``read_tuner`` over a request window), so that the landing of scratch
bytes onto a device, from the transport's threads, runs where no store does; the stores
themselves (moto, SeaweedFS) are in tests/test_s3_reads.py."""

from __future__ import annotations

import json
import os

import crc32c
import numpy as np
import pytest
import torch
from conftest import damage_last_chunk
from manifest_tools import rewrite

from ckptmgr import CheckpointCorruptError, CheckpointManager, StagingOptions, WriteOptions
from ckptmgr.format.manifest import Manifest
from ckptmgr.restore.loaders import store
from ckptmgr.restore.loaders.ring import NoDeviceRoom
from ckptmgr.restore.loaders.store import read_tensors_store
from ckptmgr.storage.throttle import AdaptiveWindow, ReadTuner

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


class RangedLocal:
    """A local root offered as an object store is: ranged reads, tuned by their answers."""

    def __init__(self, target) -> None:
        self.target = target
        self.url = target.url
        self.io_pool = target.io_pool
        self.reads: list[tuple[int, int]] = []  # (offset, length) of every ranged read

    def file_size(self, step: int, name: str, *, fresh: bool = False) -> int:
        return int(self.target.file_size(step, name))

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray]) -> None:
        self.reads.append((offset, sum(a.size for a in out)))
        self.target.read_into(step, name, offset, out)

    def read_tuner(self) -> ReadTuner:
        return ReadTuner(AdaptiveWindow(6), start_inflight=3, start_range=3 << 20, min_range=1 << 20,
                         max_range=4 << 20)


def _state(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(4096, 1024, generator=g).to(device), "b": torch.randn(1000, generator=g).to(device),
            "h": torch.randn(3, 5000, generator=g).bfloat16().to(device)}


def _saved(root: str, device: str) -> tuple[dict[str, torch.Tensor], RangedLocal, Manifest, CheckpointManager]:
    s = _state(device)
    mgr = CheckpointManager(root, staging=StagingOptions(local_tier=False),
                            write_options=WriteOptions(chunk_size=1 << 20))
    mgr.save(1, s).result(timeout=120)
    src = RangedLocal(mgr._target)
    return s, src, Manifest.from_bytes(mgr._target.read_manifest(1), where="test"), mgr


def _data_path(root: str, m: Manifest) -> str:
    [f] = m.files
    return os.path.join(root, "step_000000000001", f)


def _dev(device: str) -> torch.device:
    """The device as the restorer passes it: with its index (a target's tensors are on
    ``cuda:0``, and a bare ``cuda`` compares unequal to it, so nothing would land in them)."""
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_lands_in_fresh_device_memory_each_byte_read_once(tmp_path, device):
    s, src, m, mgr = _saved(str(tmp_path / "r"), device)
    try:
        out = read_tensors_store(src, 1, m, _dev(device))
        assert _equal(out, s) and all(t.device.type == device for t in out.values())
        [rec] = m.files.values()
        assert sum(n for _, n in src.reads) == rec.size  # each byte once
        assert len(src.reads) < len(rec.crc32c)  # in ranges longer than a chunk
    finally:
        mgr.close()


@pytest.mark.parametrize("device", DEVICES)
def test_through_device_memory_the_target_changes_only_once_every_chunk_verified(tmp_path, device):
    s, src, m, mgr = _saved(str(tmp_path / "r"), device)
    try:
        target = {k: torch.zeros_like(v) for k, v in s.items()}
        w = target["w"]
        out = read_tensors_store(src, 1, m, _dev(device), target, through_device=True)
        assert out["w"] is w and _equal(target, s)
        damage_last_chunk(_data_path(str(tmp_path / "r"), m))
        fresh = {k: torch.zeros_like(v) for k, v in s.items()}
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            read_tensors_store(src, 1, m, _dev(device), fresh, through_device=True)
        assert not any(t.any() for t in fresh.values())
    finally:
        mgr.close()


def _forge_header(root: str, m: Manifest, mgr: CheckpointManager) -> Manifest:
    """Make the header of the step's data file say I32 where the manifest says F32 (sizes
    alike) and re-sign the file's checksum chunks in the manifest; the manifest now."""
    path = _data_path(root, m)
    with open(path, "rb") as fh:
        raw = bytearray(fh.read())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["b"]["dtype"] = "I32"
    text = json.dumps(header, separators=(",", ":")).encode()
    raw[8:8 + n] = text + b" " * (n - len(text))
    with open(path, "wb") as fh:
        fh.write(raw)
    [f] = m.files
    size = m.files[f].chunk_size

    def resign(obj):
        obj["files"][f]["crc32c"] = [f"{crc32c.crc32c(bytes(raw[b:b + size])):08x}"
                                     for b in range(0, len(raw), size)]

    rewrite(root, 1, resign)
    return Manifest.from_bytes(mgr._target.read_manifest(1), where="test")


@pytest.mark.parametrize("loader", ["ring", "host"])
def test_a_step_the_caller_verified_still_has_its_headers_checked_before_it_lands_in_place(tmp_path, loader):
    """A caller that verified the step's checksums (a multi-rank restore at the saved layout)
    has the bytes land straight in its target: the headers are read and checked first, so a
    header that disagrees with the manifest leaves the target unchanged."""
    root = str(tmp_path / "r")
    s, src, m, mgr = _saved(root, "cpu")
    try:
        m = _forge_header(root, m, mgr)
        target = {k: torch.zeros_like(v) for k, v in s.items()}
        with pytest.raises(CheckpointCorruptError, match=r"its header entry .* differs"):
            mgr._restorer.read(src, 1, m, torch.device("cpu"), loader, None, dict(target), verified=True)
        assert not any(t.any() for t in target.values())
    finally:
        mgr.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_header_that_disagrees_with_the_manifest_is_refused_before_the_target_changes(tmp_path, device):
    """The header says I32 where the manifest says F32 (sizes alike, the chunk's checksum in the
    manifest re-signed): the header, read with the first range, fails the read by name before
    the spare memory moves into the target."""
    root = str(tmp_path / "r")
    s, src, m, mgr = _saved(root, device)
    try:
        m = _forge_header(root, m, mgr)
        target = {k: torch.zeros_like(v) for k, v in s.items()}
        with pytest.raises(CheckpointCorruptError, match=r"its header entry .* differs"):
            read_tensors_store(src, 1, m, _dev(device), target, through_device=True)
        assert not any(t.any() for t in target.values())
    finally:
        mgr.close()


@pytest.mark.parametrize("device", DEVICES)
def test_into_a_target_without_room_beside_it_the_step_is_checked_first_then_lands_in_place(tmp_path, device,
                                                                                        monkeypatch):
    """The restorer's path for an object store when the step cannot land beside the target
    (on the CPU: always; on a GPU: no room, here injected): headers and checksums first, then
    the bytes straight into the target's tensors; a damaged chunk leaves the target as it was."""
    root = str(tmp_path / "r")
    s, src, m, mgr = _saved(root, device)
    real = store.plan_landings

    def no_room(manifest, dev, where, dests, through_device, entries):
        if through_device:
            raise NoDeviceRoom("injected: no room beside the target")
        return real(manifest, dev, where, dests, through_device, entries)

    monkeypatch.setattr(store, "plan_landings", no_room)
    try:
        target = {k: torch.zeros_like(v) for k, v in s.items()}
        w = target["w"]
        out = mgr._restorer.read(src, 1, m, _dev(device), "ring", None, dict(target))
        assert out["w"] is w and _equal(target, s)
        [rec] = m.files.values()
        assert sum(n for _, n in src.reads) == 2 * rec.size + rec.header_size  # checked, then landed
        damage_last_chunk(_data_path(root, m))
        fresh = {k: torch.zeros_like(v) for k, v in s.items()}
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr._restorer.read(src, 1, m, _dev(device), "ring", None, dict(fresh))
        assert not any(t.any() for t in fresh.values())
    finally:
        mgr.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_verified_step_lands_in_place_after_the_work_queued_on_the_callers_stream(tmp_path):
    """A caller on a side stream with a write to the target still queued behind a long kernel:
    the landing (from the transport's threads) comes after that write, not before it."""
    s, src, m, mgr = _saved(str(tmp_path / "r"), "cuda")
    try:
        target = {k: torch.zeros_like(v) for k, v in s.items()}
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # (hundreds of milliseconds of GPU time)
            target["w"].fill_(7.0)
            read_tensors_store(src, 1, m, _dev("cuda"), target)  # (the caller verified: in place)
        torch.cuda.synchronize()
        assert _equal(target, s)
    finally:
        mgr.close()


def test_chunks_larger_than_the_rings_buffers_are_still_read_by_ranges(tmp_path, monkeypatch):
    """A step written with chunks larger than the reader's ring buffers: an object store's
    reads do not go through the ring, so they stay ranged (memory bounded by the transport's
    scratch), where the ring falls back to whole files in host memory."""
    from ckptmgr.restore import restorer as restorer_mod

    root = str(tmp_path / "r")
    s = _state("cpu")
    with CheckpointManager(root, staging=StagingOptions(local_tier=False),
                           write_options=WriteOptions(chunk_size=32 << 20)) as w:
        w.save(1, s).result(timeout=120)
    used: list[str] = []
    real = restorer_mod.read_tensors_store
    monkeypatch.setattr(restorer_mod, "read_tensors_store", lambda *a, **k: used.append("store") or real(*a, **k))
    with CheckpointManager(root, staging=StagingOptions(local_tier=False),
                           write_options=WriteOptions(chunk_size=1 << 20)) as mgr:
        assert mgr._ring.slot_bytes < 32 << 20
        src = RangedLocal(mgr._target)
        m = Manifest.from_bytes(mgr._target.read_manifest(1), where="test")
        out = mgr._restorer.read(src, 1, m, torch.device("cpu"), "ring", None, None)
    assert used == ["store"] and _equal(out, s)
