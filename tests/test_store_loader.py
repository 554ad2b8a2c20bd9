"""The object-store loader (:func:`~ckptmgr.restore.loaders.store.read_tensors_store`): ranged
reads landed as the pinned ring's are, on the CPU here and on a real GPU with ``-m cuda``. The
source is a local root read through the ranged interface an object store offers (its
``read_into`` and a ``read_tuner`` over a request window), so that the landing of scratch
bytes onto a device, from the transport's threads, runs where no store does; the stores
themselves (moto, SeaweedFS) are in tests/test_s3_reads.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ckptmgr import CheckpointCorruptError, CheckpointManager, StagingOptions, WriteOptions
from ckptmgr.format.manifest import Manifest
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


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_lands_in_fresh_device_memory_each_byte_read_once(tmp_path, device):
    s, src, m, mgr = _saved(str(tmp_path / "r"), device)
    try:
        out = read_tensors_store(src, 1, m, torch.device(device))
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
        out = read_tensors_store(src, 1, m, torch.device(device), target, through_device=True)
        assert out["w"] is w and _equal(target, s)
        [f] = m.files
        path = os.path.join(str(tmp_path / "r"), "step_000000000001", f)
        with open(path, "r+b") as fh:  # the last chunk: every other lands first
            fh.seek(-3, 2)
            b = fh.read(1)
            fh.seek(-3, 2)
            fh.write(bytes([b[0] ^ 0x10]))
        fresh = {k: torch.zeros_like(v) for k, v in s.items()}
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            read_tensors_store(src, 1, m, torch.device(device), fresh, through_device=True)
        assert not any(t.any() for t in fresh.values())
    finally:
        mgr.close()
