"""Restore into a target is all or nothing, on every loader: a step that fails verification
leaves every tensor of the target as it was, and the next good step lands whole."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from conftest import damage_last_chunk

import ckptmgr._cuda as cuda_shim
import ckptmgr.storage.cufile as gds
from ckptmgr import CheckpointCorruptError, CheckpointManager, StagingOptions, WriteOptions

FAKE_KVIKIO = os.path.join(os.path.dirname(__file__), "fake_kvikio")
NO_TIER = StagingOptions(local_tier=False)
SMALL_CHUNKS = WriteOptions(chunk_size=4096)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(20_000, generator=g), "b": torch.randn(3_000, generator=g).bfloat16(),
            "c": torch.randint(0, 100, (5_000,), generator=g), "n": seed}


def _target() -> dict:
    return {"a": torch.zeros(20_000), "b": torch.zeros(3_000, dtype=torch.bfloat16),
            "c": torch.zeros(5_000, dtype=torch.int64), "n": 0}


def _untouched(target: dict) -> bool:
    return not any(bool(target[k].any()) for k in ("a", "b", "c"))


@pytest.fixture
def fake_kvikio(monkeypatch):
    monkeypatch.syspath_prepend(FAKE_KVIKIO)
    monkeypatch.setenv("PYTHONPATH", FAKE_KVIKIO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(gds, "_probed", {})
    for name in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
        del sys.modules[name]


@pytest.mark.parametrize("loader", ["host", "ring", "inplace", "gds"])
def test_a_corrupt_step_leaves_the_target_as_it_was(root, loader, request):
    if loader == "gds":
        request.getfixturevalue("fake_kvikio")
    with CheckpointManager(root, staging=NO_TIER, write_options=SMALL_CHUNKS) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.save(2, _state(2)).result()
        damage_last_chunk(os.path.join(root, "step_000000000002", "data-00000.safetensors"))
        target = _target()
        a = target["a"]
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(2, target=target, loader=loader)
        assert _untouched(target), f"{loader}: the target was written before the step verified"
        with pytest.warns(RuntimeWarning, match="skipping step 2"):
            out = mgr.restore(target=target, loader=loader)
        assert out["n"] == 1 and target["a"] is a
        for k in ("a", "b", "c"):
            assert torch.equal(target[k], _state(1)[k]), k


def test_the_pinned_slot_path_verifies_before_it_lands(root, tmp_path, monkeypatch, ram_dir):
    """A step held in this process's pinned staging slot (CUDA faked: registration only), damaged
    there and on disk: neither read writes into the target."""
    monkeypatch.setattr(cuda_shim, "available", lambda: True)
    monkeypatch.setattr(cuda_shim, "host_register", lambda p, n, read_only=False: None)
    monkeypatch.setattr(cuda_shim, "host_unregister", lambda p: None)
    import ckptmgr.restore.restorer as restorer_mod

    pinned = []
    real = restorer_mod.read_tensors_pinned
    monkeypatch.setattr(restorer_mod, "read_tensors_pinned", lambda *a, **k: pinned.append(1) or real(*a, **k))
    if hasattr(restorer_mod, "verify_images"):
        real_verify = restorer_mod.verify_images
        monkeypatch.setattr(restorer_mod, "verify_images", lambda *a, **k: pinned.append(1) or real_verify(*a, **k))
    local = ram_dir  # in RAM, as a pinned tier must be
    with CheckpointManager(root, staging=StagingOptions(local_dir=local), write_options=SMALL_CHUNKS) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.wait()
        images = mgr._saver.pool.slots[0].segments
        assert images and mgr._tier.steps() == {1: 0}
        for path in (mgr._tier.path_of(1, "data-00000.safetensors"),
                     os.path.join(root, "step_000000000001", "data-00000.safetensors")):
            damage_last_chunk(path)
        target = _target()
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(1, target=target, loader="inplace")
        assert pinned  # the slot's images were read where they lie
        assert _untouched(target)


def test_a_restore_without_a_target_still_overlaps_checks_and_copies(root, monkeypatch):
    """Without a target nothing of the caller's is at stake: no checking pass before the read."""
    import ckptmgr.restore.restorer as restorer_mod

    passes = []
    monkeypatch.setattr(restorer_mod, "verify_files", lambda *a, **k: passes.append(a))
    with CheckpointManager(root, staging=NO_TIER, write_options=SMALL_CHUNKS) as mgr:
        mgr.save(1, _state(1)).result()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = mgr.restore(1, device="cpu", loader="ring")
        assert torch.equal(out["a"], _state(1)["a"]) and passes == []
        mgr.restore(1, target=_target(), loader="ring")
        assert len(passes) == 1
