"""With CUDA, the local tier's files are the pinned staging buffers, and Linux refuses to pin a
disk file's pages (cudaHostRegister fails with "invalid argument"): a ``local_dir`` that is not in
RAM is refused when asked for, and left out with a warning otherwise, before any save."""

from __future__ import annotations

import logging
import os

import pytest

import ckptmgr._cuda as cuda_shim
from ckptmgr import CheckpointManager, ConfigError, StagingOptions
from ckptmgr.storage.tier import open_local_tier, ram_filesystem

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm") or ram_filesystem("/dev/shm") is not True,
                                reason="needs Linux with /dev/shm on tmpfs")


@pytest.fixture
def disk_dir(tmp_path):
    if ram_filesystem(str(tmp_path)) is not False:
        pytest.skip("the temporary directory is in RAM here")
    return str(tmp_path)


@pytest.fixture
def with_cuda(monkeypatch):
    """What open_local_tier sees on a GPU machine (the real check runs there: test_cuda.py)."""
    monkeypatch.setattr(cuda_shim, "available", lambda: True)  # (the tier imports it where it opens one)


def test_filesystems_are_told_apart(disk_dir, tmp_path):
    assert ram_filesystem("/dev/shm") is True
    assert ram_filesystem(disk_dir) is False
    assert ram_filesystem(str(tmp_path / "missing")) is None


def test_a_disk_local_dir_asked_for_is_refused_with_cuda(disk_dir, with_cuda, tmp_path):
    with pytest.raises(ConfigError, match=r"not in RAM.*pin"):
        open_local_tier(StagingOptions(local_tier=True, local_dir=disk_dir), str(tmp_path / "root"))
    assert os.listdir(disk_dir) == []  # refused before anything was created there


def test_a_disk_local_dir_by_default_is_left_out_with_a_warning(disk_dir, with_cuda, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ckptmgr"):
        assert open_local_tier(StagingOptions(local_dir=disk_dir), str(tmp_path / "root")) is None
    assert any("not in RAM" in r.getMessage() for r in caplog.records)


def test_dev_shm_is_used_with_cuda(with_cuda, tmp_path):
    tier = open_local_tier(StagingOptions(local_tier=True), str(tmp_path / "root"))
    assert tier is not None
    tier.close(remove=True)


def test_without_cuda_a_disk_local_dir_still_serves_as_the_tier(disk_dir, tmp_path):
    with CheckpointManager(str(tmp_path / "root"), staging=StagingOptions(local_tier=True, local_dir=disk_dir)) as m:
        m.save(1, {"x": 1}).result()
        assert m.steps() == [1]


@pytest.mark.cuda
def test_on_a_gpu_a_disk_local_dir_is_refused_before_any_save(disk_dir, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with pytest.raises(ConfigError, match="not in RAM"):
        CheckpointManager(str(tmp_path / "root"), staging=StagingOptions(local_tier=True, local_dir=disk_dir))
    with CheckpointManager(str(tmp_path / "root2"), staging=StagingOptions(local_dir=disk_dir)) as m:
        m.save(1, {"w": torch.randn(1000, device="cuda")}).result()  # no tier: straight to the root
        assert m.steps() == [1]
