"""Any fsspec URL works (memory:// here; S3 has its own suite), and background errors surface."""

import threading
import time

import fsspec
import pytest
import torch
from conftest import assert_tree_equal
from fsspec.implementations.memory import MemoryFileSystem

from ckptmgr import CheckpointManager, CkptTimeoutError, SaveError, StagingOptions


class FaultyFS(MemoryFileSystem):
    """The real in-memory filesystem, with writes that fail or stall on demand."""

    protocol = "faulty"
    fail_writes = False
    gate: threading.Event | None = None

    def _open(self, path, mode="rb", **kw):
        if "w" in mode and not path.endswith("manifest.json"):
            if FaultyFS.gate is not None:
                FaultyFS.gate.wait(10)
            if FaultyFS.fail_writes:
                raise OSError(5, "Input/output error (injected)")  # (transient: retried)
        return super()._open(path, mode, **kw)


fsspec.register_implementation("faulty", FaultyFS, clobber=True)


@pytest.fixture
def faulty():
    FaultyFS.store.clear()
    FaultyFS.pseudo_dirs.clear()
    FaultyFS.pseudo_dirs.append("")
    yield FaultyFS
    FaultyFS.fail_writes = False
    FaultyFS.gate = None


def test_memory_round_trip_and_discovery(faulty):
    state = {"w": torch.randn(3, 3), "n": (1, {"a": 2.5})}
    with CheckpointManager("faulty://run1") as mgr:
        mgr.save(3, state).result()
        mgr.save(7, state).result()
        assert mgr.steps() == [3, 7]
        assert_tree_equal(mgr.restore(), state)
    # a half-written step (no manifest) is invisible and cleaned at the next start
    fs = FaultyFS()
    fs.pipe_file("faulty://run1/step_000000000009/data-00000.safetensors", b"partial")
    with CheckpointManager("faulty://run1") as mgr:
        assert mgr.steps() == [3, 7]
        assert not fs.exists("faulty://run1/step_000000000009")


def test_error_surfaces_on_the_handle(faulty):
    with CheckpointManager("faulty://run2") as mgr:
        faulty.fail_writes = True
        h = mgr.save(1, {"x": torch.ones(2)})
        with pytest.raises(SaveError, match="Input/output error") as info:
            h.result(timeout=10)
        assert isinstance(info.value.__cause__, OSError)
        assert h.done()
        faulty.fail_writes = False
        mgr.save(2, {"x": torch.ones(2)}).result()  # told once: the next save goes ahead
        # step 1's write was tried again while its slot held it (the only copy of the newest step)
        assert mgr.steps() == [1, 2]


@pytest.mark.parametrize("local_tier", [False, True])
def test_unobserved_error_surfaces_at_next_save_then_wait_then_close(faulty, local_tier):
    # (two slots: with one, a save waits while the slot holds the newest step, not yet durable)
    mgr = CheckpointManager("faulty://run3", staging=StagingOptions(local_tier=local_tier, slots=2))
    faulty.fail_writes = True
    h = mgr.save(1, {"x": torch.ones(2)})
    deadline = time.monotonic() + 10
    while not h.done() and time.monotonic() < deadline:  # finished, but nobody asked
        time.sleep(0.01)
    faulty.fail_writes = False
    with pytest.raises(SaveError, match="step 1"):
        mgr.save(2, {"x": torch.ones(2)})
    faulty.fail_writes = True
    mgr.save(3, {"x": torch.ones(2)})
    with pytest.raises(SaveError, match="step 3"):
        mgr.wait(timeout=10)
    mgr.save(4, {"x": torch.ones(2)})
    with pytest.raises(SaveError, match="step 4"):
        mgr.close(timeout=10)
    faulty.fail_writes = False
    with CheckpointManager("faulty://run3", staging=StagingOptions(local_tier=local_tier)) as again:
        again.wait(timeout=10)
        if local_tier:
            # step 4 never reached the target but its slot stayed committed in the local
            # tier; the next manager on this root restores from it and writes it out
            assert again.steps() == [4]
            assert FaultyFS().exists("faulty://run3/step_000000000004/manifest.json")
        else:
            assert again.steps() == []


def test_wait_and_close_time_out_then_finish(faulty):
    faulty.gate = threading.Event()
    mgr = CheckpointManager("faulty://run4")
    h = mgr.save(1, {"x": torch.ones(2)})
    with pytest.raises(CkptTimeoutError):
        h.result(timeout=0.05)
    with pytest.raises(CkptTimeoutError):
        mgr.wait(timeout=0.05)
    with pytest.raises(CkptTimeoutError, match=r"step 1 is (kept in the local tier|lost)"):
        mgr.close(timeout=0.05)  # bounded: the manager is closed, the write goes on
    assert not h.done()
    mgr.close(timeout=10)  # closed already: nothing to do
    faulty.gate.set()
    assert h.result(timeout=10).step == 1
    assert CheckpointManager("faulty://run4").steps() == [1]


class LostAnswerFS(MemoryFileSystem):
    """The real in-memory filesystem whose first write of a writer's lease after a manifest
    landed times out (the write of the manifest went through; the renewal's answer is lost)."""

    protocol = "lostanswer"
    armed = False

    def _open(self, path, mode="rb", **kw):
        if "w" in mode and path.endswith("manifest.json"):
            LostAnswerFS.armed = True
        elif "w" in mode and path.endswith("writer.lease") and LostAnswerFS.armed:
            LostAnswerFS.armed = False
            raise TimeoutError("the renewal's answer was lost (injected)")
        return super()._open(path, mode, **kw)


fsspec.register_implementation("lostanswer", LostAnswerFS, clobber=True)


def test_a_failure_after_the_manifest_landed_never_leaves_it_naming_deleted_data():
    LostAnswerFS.store.clear()
    LostAnswerFS.pseudo_dirs.clear()
    LostAnswerFS.pseudo_dirs.append("")
    state = {"w": torch.arange(64, dtype=torch.float32)}
    with CheckpointManager("lostanswer://run", staging=StagingOptions(local_tier=False)) as mgr:
        try:
            mgr.save(1, state).result(timeout=60)
        except SaveError:
            pass  # (refused or failed: either way nothing committed may lose its data)
    with CheckpointManager("lostanswer://run", read_only=True) as mgr:
        for step in mgr.steps():  # every step that looks committed restores with its bytes
            assert_tree_equal(mgr.restore(step), state)


class LostOnceFS(MemoryFileSystem):
    """The real in-memory filesystem whose first lease write after the first manifest landed
    fails (the manifest went through; the renewal's answer is lost), once."""

    protocol = "lostonce"
    state = "idle"  # idle -> armed (a manifest landed) -> fired

    def _open(self, path, mode="rb", **kw):
        if "w" in mode and path.endswith("manifest.json") and LostOnceFS.state == "idle":
            LostOnceFS.state = "armed"
        elif "w" in mode and path.endswith("writer.lease") and LostOnceFS.state == "armed":
            LostOnceFS.state = "fired"
            raise TimeoutError("the renewal's answer was lost (injected)")
        return super()._open(path, mode, **kw)


fsspec.register_implementation("lostonce", LostOnceFS, clobber=True)


def test_a_retry_that_finds_its_own_earlier_commit_in_place_is_durable_and_saving_goes_on(caplog):
    """The first attempt's manifest landed and the lease renewal after it failed: the retry
    finds the step committed with exactly its own bytes and settles it as durable. (It gave
    the step up as "already committed" while the local tier's one slot kept it as never
    written: the next save waited for that slot for ever.)"""
    LostOnceFS.store.clear()
    LostOnceFS.pseudo_dirs.clear()
    LostOnceFS.pseudo_dirs.append("")
    LostOnceFS.state = "idle"
    state = {"w": torch.arange(64, dtype=torch.float32)}
    with CheckpointManager("lostonce://own", staging=StagingOptions(slots=1, busy_timeout=10)) as mgr:
        with pytest.raises(SaveError, match="renewal's answer was lost"):  # (attempt 1, told at once)
            mgr.save(1, state).result(timeout=60)
        mgr.save(2, {"w": state["w"] + 1}).result(timeout=60)  # (the slot, once the retry settled step 1)
        assert mgr.steps() == [1, 2] and mgr._saver.is_durable(1)
    assert LostOnceFS.state == "fired" and "never written" not in caplog.text
    with CheckpointManager("lostonce://own", read_only=True) as mgr:
        assert_tree_equal(mgr.restore(1), state)


def test_a_retry_counts_only_its_own_bytes_in_place_as_its_earlier_commit():
    """What a retry that finds its step committed takes for its own earlier commit: the same
    manifest (object names apart) with every object in place at its size; a manifest that
    differs in one checksum, or one object gone, is another writer's or incomplete."""
    import dataclasses

    from ckptmgr.format.manifest import Manifest
    from ckptmgr.format.naming import plain_name
    from ckptmgr.save.persist import _committed_before

    with CheckpointManager("memory://own-check", staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, {"w": torch.arange(64, dtype=torch.float32)}).result(timeout=60)
        target = mgr._target
        there = Manifest.from_bytes(target.read_manifest(1), where="test")
        assert all(plain_name(n) != n for n in there.files)  # (object names carry the claim's token)
        ours = dataclasses.replace(
            there, files={plain_name(n): r for n, r in there.files.items()},
            tensors={k: {**e, "file": plain_name(e["file"])} if "file" in e else e for k, e in there.tensors.items()})
        assert _committed_before(target, ours)
        [(name, rec)] = ours.files.items()
        other = dataclasses.replace(rec, crc32c=("00000000", *rec.crc32c[1:]))
        assert not _committed_before(target, dataclasses.replace(ours, files={name: other}))
        [obj] = there.files
        fsspec.filesystem("memory").rm(f"memory://own-check/step_000000000001/{obj}")
        assert not _committed_before(target, ours)
