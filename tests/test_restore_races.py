"""Restores racing other restores and other processes: concurrent restores through the one
pinned ring of a manager, and a step deleted by another process while it is read."""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

import pytest
import torch
import zygote

import ckptmgr.restore.restorer as restorer_mod
from ckptmgr import CheckpointCorruptError, CheckpointManager, StagingOptions, StepNotFoundError, WriteOptions

NO_TIER = StagingOptions(local_tier=False)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(150_000, generator=g), "b": torch.randn(4_000, generator=g).bfloat16()}


def test_two_threads_restoring_through_the_ring_never_share_a_buffer(root, monkeypatch):
    """Each chunk's buffer is leased by one task from its read to the end of its copy: two
    threads restoring different steps 100 times each always get bit-exact results. On the CPU
    the ring runs with plain buffers; the path (fetch, checksum, land) is the GPU's."""
    used: list[int] = []
    real = restorer_mod.read_tensors_ring
    monkeypatch.setattr(restorer_mod, "read_tensors_ring", lambda *a, **k: used.append(1) or real(*a, **k))
    states = {1: _state(1), 2: _state(2)}
    with CheckpointManager(root, staging=NO_TIER, write_options=WriteOptions(chunk_size=4096)) as mgr:
        for step, state in states.items():
            mgr.save(step, state).result()
        start = threading.Barrier(2, timeout=30)
        wrong: list[str] = []

        def run(step: int) -> None:
            start.wait()
            for i in range(100):
                try:
                    out = mgr.restore(step, device="cpu", loader="ring")
                except Exception as exc:
                    wrong.append(f"step {step} #{i}: {exc!r}")
                    continue
                for k, v in states[step].items():
                    if not torch.equal(out[k], v):
                        wrong.append(f"step {step} #{i}: {k} differs")

        threads = [threading.Thread(target=run, args=(s,)) for s in states]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads)
    assert wrong == []
    assert len(used) == 200  # every restore went through the ring


def _delete_in_another_process(root: str, step: int) -> None:
    code = ("import sys; from ckptmgr.storage.local import LocalTarget; "
            "t = LocalTarget(sys.argv[1]); t.delete(int(sys.argv[2])); t.close()")
    zygote.run([sys.executable, "-c", code, root, str(step)], template="torch", check=True, timeout=120)


def _gate_reads_of(mgr: CheckpointManager, step: int, monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[threading.Event, threading.Event]:
    """Hold the first read of ``step``'s data until ``release`` is set; ``reached`` says it is held."""
    reached, release = threading.Event(), threading.Event()
    real = mgr._target.read_into

    def read_into(s, name, offset, out):
        if s == step and not reached.is_set():
            reached.set()
            assert release.wait(timeout=60)
        return real(s, name, offset, out)

    monkeypatch.setattr(mgr._target, "read_into", read_into)
    return reached, release


def test_a_step_deleted_by_another_process_mid_read_falls_back_with_one_warning(root, monkeypatch, caplog):
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.save(2, _state(2)).result()
        reached, release = _gate_reads_of(mgr, 2, monkeypatch)

        def other_process() -> None:
            assert reached.wait(timeout=60)
            _delete_in_another_process(root, 2)  # its retention ran while we held the read
            release.set()

        t = threading.Thread(target=other_process)
        t.start()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = mgr.restore()
        t.join(timeout=120)
        assert [str(w.message) for w in caught if "skipping" in str(w.message)] == [
            f"skipping step 2: step 2 under {mgr.root} was deleted while it was read"]
        assert len(caught) == 1
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []  # the warning is the one message
        assert torch.equal(out["w"], _state(1)["w"])
        with pytest.raises(StepNotFoundError):
            mgr.restore(2)


def test_an_explicit_step_deleted_mid_read_is_not_found_and_a_missing_file_is_corrupt(root, monkeypatch):
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.save(2, _state(2)).result()
        reached, release = _gate_reads_of(mgr, 2, monkeypatch)
        t = threading.Thread(target=lambda: (reached.wait(60), _delete_in_another_process(root, 2), release.set()))
        t.start()
        with pytest.raises(StepNotFoundError, match="deleted while it was read"):
            mgr.restore(2)
        t.join(timeout=120)
        # a data file missing from a step that is still committed is damage, not a deletion
        os.unlink(os.path.join(root, "step_000000000001", "data-00000.safetensors"))
        with pytest.raises(CheckpointCorruptError, match=r"step 1.*data-00000.safetensors.*missing"):
            mgr.restore(1)


def test_a_damaged_local_tier_copy_and_durable_copy_give_one_warning(root, tmp_path, caplog):
    """The newest step damaged in both tiers: restore() skips it with one warning, not two."""
    local = str(tmp_path / "shm")
    os.makedirs(local)
    with CheckpointManager(root, staging=StagingOptions(local_dir=local, slots=2)) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.save(2, _state(2)).result()
        mgr.wait()
        tier_file = mgr._tier.path_of(2, "data-00000.safetensors")
        durable = os.path.join(root, "step_000000000002", "data-00000.safetensors")
        for path in (tier_file, durable):
            with open(path, "r+b") as f:
                f.seek(-5, 2)
                f.write(b"\xff\x00\xff\x00\xff")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = mgr.restore()
        assert torch.equal(out["w"], _state(1)["w"])
        assert len(caught) == 1 and "skipping step 2" in str(caught[0].message)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_damaged_local_tier_copy_is_logged_once_when_the_durable_copy_serves(root, tmp_path, caplog):
    local = str(tmp_path / "shm")
    os.makedirs(local)
    with CheckpointManager(root, staging=StagingOptions(local_dir=local, slots=2)) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.wait()
        with open(mgr._tier.path_of(1, "data-00000.safetensors"), "r+b") as f:
            f.seek(-5, 2)
            f.write(b"\xff\x00\xff\x00\xff")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = mgr.restore()
        assert torch.equal(out["w"], _state(1)["w"]) and caught == []
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(logged) == 1 and "local tier copy of step 1 does not verify" in logged[0]
