"""The slots of the local tier that a restarted job adopts are verified at start-up, beside
their pinning, so that the restore that follows only copies: and a slot damaged before the
restart never reaches a target. CUDA is faked (registration only): what the pinned path does
with real copies is tested on a GPU in test_cuda.py."""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future

import pytest
import torch
from conftest import assert_tree_equal, damage_last_chunk, hold_durable_write
from test_restore_atomic import _state, _target, _untouched

import ckptmgr._cuda as cuda_shim
import ckptmgr.restore.loaders.images as images_mod
import ckptmgr.restore.restorer as restorer_mod
from ckptmgr import CheckpointCorruptError, CheckpointManager, SaveError, Schedule, StagingOptions, WriteOptions

SMALL_CHUNKS = WriteOptions(chunk_size=4096)
DURABLE_EVEN = Schedule(durable_every=2)  # odd steps stay in the local tier


@pytest.fixture
def pinned(monkeypatch):
    """CUDA's pinning faked, and the image checks the restorer starts recorded with the thread
    that started them."""
    monkeypatch.setattr(cuda_shim, "available", lambda: True)
    monkeypatch.setattr(cuda_shim, "host_register", lambda p, n, read_only=False: None)
    monkeypatch.setattr(cuda_shim, "host_unregister", lambda p: None)
    started: list[tuple[str, str]] = []
    real_submit, real_verify = restorer_mod.submit_image_checks, restorer_mod.verify_images

    def submit(images, manifest, pool, where):
        started.append(("at adoption", where))
        return real_submit(images, manifest, pool, where)

    def verify(images, manifest, pool, where):
        started.append(("at restore", where))
        return real_verify(images, manifest, pool, where)

    def beside(images, manifest, pool, where):
        started.append(("beside the copies", where))
        return real_beside(images, manifest, pool, where)

    real_beside = images_mod.submit_image_checks
    monkeypatch.setattr(restorer_mod, "submit_image_checks", submit)
    monkeypatch.setattr(restorer_mod, "verify_images", verify)
    monkeypatch.setattr(images_mod, "submit_image_checks", beside)
    return started


def _leave_step_3_in_the_tier(root: str, local: str) -> str:
    """Steps 2 (durable) and 3 (local tier only), then close: step 3 stays in the tier for the
    next start (closed with ``flush=False``). Returns the path of its first data file there."""
    mgr = CheckpointManager(root, staging=StagingOptions(slots=1, local_dir=local), write_options=SMALL_CHUNKS,
                            schedule=DURABLE_EVEN)
    mgr.save(2, _state(2)).result()
    mgr.save(3, _state(3)).result()
    assert mgr._tier.steps() == {3: 0}
    path = mgr._tier.path_of(3, "data-00000.safetensors")
    mgr.close(flush=False)
    assert os.path.exists(path)
    return path


def _open(root: str, local: str) -> CheckpointManager:
    return CheckpointManager(root, staging=StagingOptions(slots=1, local_dir=local), write_options=SMALL_CHUNKS,
                             schedule=DURABLE_EVEN)


def test_an_adopted_slot_is_verified_at_start_up_and_its_restore_only_copies(root, ram_dir, pinned):
    _leave_step_3_in_the_tier(root, ram_dir)
    with _open(root, ram_dir) as mgr:
        target = _target()
        a = target["a"]
        out = mgr.restore(3, target=target, loader="inplace")  # (waits for the adoption, started by the constructor)
        assert [when for when, _ in pinned] == ["at adoption"]
        assert "step 3" in pinned[0][1] and ram_dir in pinned[0][1]
        assert out["n"] == 3 and target["a"] is a
        for k in ("a", "b", "c"):
            assert torch.equal(target[k], _state(3)[k]), k
        assert len(pinned) == 1  # no second pass: the restore waited for the checks of the adoption
        again = _target()
        mgr.restore(3, target=again, loader="inplace")  # a later restore verifies again
        assert torch.equal(again["a"], _state(3)["a"]) and [when for when, _ in pinned][1:] == ["at restore"]
        mgr.wait(timeout=60)  # (the adopted step is written to the root meanwhile)


def test_a_slot_damaged_before_the_restart_never_reaches_the_target(root, ram_dir, pinned, monkeypatch):
    path = _leave_step_3_in_the_tier(root, ram_dir)
    damage_last_chunk(path)  # while no process held the tier
    restored = hold_durable_write(monkeypatch, 3)  # (that write removes the damaged step from the tier)
    with _open(root, ram_dir) as mgr:
        target = _target()
        with pytest.raises(CheckpointCorruptError, match=r"step 3.*checksum mismatch"):
            mgr.restore(3, target=target, loader="inplace")
        assert _untouched(target)
        with pytest.warns(RuntimeWarning, match="skipping step 3"):
            out = mgr.restore(target=target, loader="inplace")
        assert out["n"] == 2 and torch.equal(target["a"], _state(2)["a"])
        restored.set()
        with pytest.raises(SaveError, match=r"step 3.*no longer matches its manifest"):
            mgr.wait(timeout=60)
        # never committed to the root, where it would pass for a good step; gone from the tier
        assert not os.path.exists(os.path.join(root, "step_000000000003")) and mgr.steps() == [2]
        mgr.save(3, _state(3)).result(timeout=60)  # the job goes on: the step is free, so is the only slot
        assert_tree_equal(mgr.restore(3, device="cpu"), _state(3))
    assert next(when for when, _ in pinned) == "at adoption"


def test_a_damaged_slot_is_not_written_to_the_root_even_without_cuda(root, ram_dir, caplog):
    """The adoption writes out the steps the last run left only in the tier: their bytes are
    checksummed on the way and compared with the tier's manifest before the commit."""
    path = _leave_step_3_in_the_tier(root, ram_dir)
    with open(path, "r+b") as f:
        f.seek(-1000, 2)  # in the data, not the header
        b = f.read(1)
        f.seek(-1000, 2)
        f.write(bytes([b[0] ^ 0x04]))
    with _open(root, ram_dir) as mgr:
        with pytest.raises(SaveError, match=r"step 3.*no longer matches"):
            mgr.wait(timeout=60)
        assert not os.path.exists(os.path.join(root, "step_000000000003"))
        assert mgr.steps() == [2] and mgr.restore()["n"] == 2  # removed from the tier, not skipped
        mgr.save(3, _state(3)).result(timeout=60)  # the job goes on from step 2
        assert_tree_equal(mgr.restore(), _state(3))


def test_checks_of_an_adopted_slot_cover_only_the_step_it_held(root, ram_dir, pinned):
    """Once the slot is reused for a newer step, that step is verified by its own restore."""
    _leave_step_3_in_the_tier(root, ram_dir)
    with _open(root, ram_dir) as mgr:
        mgr.wait(timeout=60)  # step 3 written to the root: the only slot may be reused
        mgr.save(5, _state(5)).result()
        assert mgr._tier.steps() == {5: 0}
        target = _target()
        mgr.restore(5, target=target, loader="inplace")
        assert torch.equal(target["a"], _state(5)["a"])
        assert [when for when, _ in pinned] == ["at adoption", "at restore"]


def test_restores_from_several_threads_after_the_adoption_all_verify(root, ram_dir, pinned):
    _leave_step_3_in_the_tier(root, ram_dir)
    with _open(root, ram_dir) as mgr:
        gate = threading.Barrier(3, timeout=60)
        got: dict[int, dict] = {}
        errors: list[BaseException] = []

        def restore(i: int) -> None:
            try:
                gate.wait()
                got[i] = mgr.restore(3, device="cpu", loader="inplace")
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=restore, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and len(got) == 3
        for out in got.values():
            assert torch.equal(out["a"], _state(3)["a"]) and torch.equal(out["c"], _state(3)["c"])
        assert [when for when, _ in pinned].count("at adoption") == 1  # started once, used by one of them
        mgr.wait(timeout=60)


def test_checks_of_an_adopted_slot_that_do_not_end_in_time_are_done_again_by_the_restore(root, ram_dir, pinned,
                                                                                          monkeypatch, caplog):
    _leave_step_3_in_the_tier(root, ram_dir)
    stuck: list[Future[None]] = []
    monkeypatch.setattr(restorer_mod, "submit_image_checks",
                        lambda *a: stuck.append(Future()) or stuck)  # checks that never end
    monkeypatch.setattr(restorer_mod, "_ADOPTED_CHECK_WAIT", 0.2)
    with _open(root, ram_dir) as mgr:
        target = _target()
        with caplog.at_level(logging.WARNING, logger="ckptmgr"):
            mgr.restore(3, target=target, loader="inplace")  # (after the adoption, which started the checks)
        assert len(stuck) == 1
        assert "did not end within 0.2 s; verifying again" in caplog.text
        assert [when for when, _ in pinned] == ["at restore"] and stuck[0].cancelled()
        for k in ("a", "b", "c"):
            assert torch.equal(target[k], _state(3)[k]), k
        mgr.wait(timeout=60)


def test_a_slot_the_dead_job_never_committed_is_removed_at_the_next_start(root, ram_dir):
    """A job killed with a spare slot made, or a save cut short, leaves a slot with data files
    and no manifest: the next start removes it (its memory goes back at once) and keeps the
    committed one."""
    path = _leave_step_3_in_the_tier(root, ram_dir)
    tier_dir = os.path.dirname(os.path.dirname(path))
    spare = os.path.join(tier_dir, "slot-01")
    os.mkdir(spare, 0o700)
    with open(os.path.join(spare, "data-00000.safetensors"), "wb") as f:
        f.write(b"\0" * (1 << 20))  # as a dead job's spare slot or unfinished save leaves it
    with CheckpointManager(root, staging=StagingOptions(local_dir=ram_dir), write_options=SMALL_CHUNKS,
                           schedule=DURABLE_EVEN) as mgr:
        assert not os.path.exists(spare)
        assert mgr._tier.steps() == {3: 0}
        assert_tree_equal(mgr.restore(3), _state(3))
        assert mgr._tier.wait_sweep(timeout=60)
        assert sorted(n for n in os.listdir(tier_dir) if n.startswith(("slot-", "gone-"))) == ["slot-00"]


def test_the_start_does_not_wait_while_a_never_committed_slot_is_deleted(root, ram_dir, monkeypatch):
    """Freeing a dead job's spare (gigabytes of tmpfs pages) is off the restart's path: the slot
    is renamed aside at once and deleted by the sweeper thread, held here at a gate while the
    manager opens and restores; a set-aside slot a crash left is swept at the next start."""
    from ckptmgr.storage.tier_scan import TierScan

    path = _leave_step_3_in_the_tier(root, ram_dir)
    tier_dir = os.path.dirname(os.path.dirname(path))
    os.mkdir(os.path.join(tier_dir, "slot-01"), 0o700)
    with open(os.path.join(tier_dir, "slot-01", "data-00000.safetensors"), "wb") as f:
        f.write(b"\0" * (1 << 20))
    os.mkdir(os.path.join(tier_dir, "gone-01-1-0"), 0o700)  # as a start cut short during its sweep leaves it
    entered, go, swept_on = threading.Event(), threading.Event(), []
    real = TierScan._sweep

    def sweep(self, fd, names):
        swept_on.append((threading.current_thread().name, sorted(names)))
        entered.set()
        assert go.wait(60)
        return real(self, fd, names)

    monkeypatch.setattr(TierScan, "_sweep", sweep)
    with CheckpointManager(root, staging=StagingOptions(local_dir=ram_dir), write_options=SMALL_CHUNKS,
                           schedule=DURABLE_EVEN) as mgr:
        assert entered.wait(60)
        assert not os.path.exists(os.path.join(tier_dir, "slot-01"))  # set aside before the open returned
        assert_tree_equal(mgr.restore(3), _state(3))  # while the sweeper is held
        aside = sorted(n for n in os.listdir(tier_dir) if n.startswith("gone-"))
        assert len(aside) == 2, aside
        go.set()
        assert mgr._tier.wait_sweep(timeout=60)
        assert not [n for n in os.listdir(tier_dir) if n.startswith("gone-")]
    assert swept_on == [("ckptmgr-tier-sweep", aside)]


def test_a_sweep_that_outlasts_close_still_deletes_only_what_was_set_aside(root, ram_dir, monkeypatch):
    """``close()`` waits for the sweeper only so long (here: not at all), then closes the tier's
    directory: the sweeper works on a descriptor of its own, so once let go it still deletes the
    slot it set aside, and nothing else, though the tier's descriptor number may be reused."""
    import ckptmgr.storage.tier_scan as scan_mod
    from ckptmgr.storage.tier_scan import TierScan

    path = _leave_step_3_in_the_tier(root, ram_dir)
    tier_dir = os.path.dirname(os.path.dirname(path))
    os.mkdir(os.path.join(tier_dir, "slot-01"), 0o700)
    with open(os.path.join(tier_dir, "slot-01", "data-00000.safetensors"), "wb") as f:
        f.write(b"\0" * 4096)
    entered, go, done = threading.Event(), threading.Event(), threading.Event()
    real = TierScan._sweep

    def sweep(self, fd, names):
        entered.set()
        assert go.wait(60)
        try:
            return real(self, fd, names)
        finally:
            done.set()

    monkeypatch.setattr(TierScan, "_sweep", sweep)
    monkeypatch.setattr(scan_mod, "SWEEP_WAIT_S", 0.0)
    mgr = CheckpointManager(root, staging=StagingOptions(local_dir=ram_dir), write_options=SMALL_CHUNKS,
                            schedule=DURABLE_EVEN)
    assert entered.wait(60)
    mgr.close()  # does not wait for the held sweeper; the tier's descriptors are closed
    decoy = os.path.join(os.path.dirname(tier_dir), "decoy")
    os.mkdir(decoy)
    fds = [os.open(decoy, os.O_RDONLY | os.O_DIRECTORY) for _ in range(8)]  # (likely to reuse the numbers)
    try:
        with open(os.path.join(decoy, "keep"), "wb") as f:
            f.write(b"x")
        go.set()
        assert done.wait(60)
    finally:
        for fd in fds:
            os.close(fd)
    assert os.listdir(decoy) == ["keep"]
    assert not [n for n in os.listdir(tier_dir) if n.startswith(("gone-", "slot-01"))]


def test_the_sweeper_starts_only_once_the_adopted_slot_is_pinned(root, ram_dir, pinned, monkeypatch):
    """Freeing the pages of a slot set aside and pinning an adopted slot's pages contend in the
    kernel, and the restart's first restore waits for the pinning: the sweeper starts only once
    the adoption ends. The adoption is held here at a gate in its first registration."""
    from ckptmgr.storage.tier_scan import TierScan

    path = _leave_step_3_in_the_tier(root, ram_dir)
    tier_dir = os.path.dirname(os.path.dirname(path))
    os.mkdir(os.path.join(tier_dir, "slot-01"), 0o700)
    with open(os.path.join(tier_dir, "slot-01", "data-00000.safetensors"), "wb") as f:
        f.write(b"\0" * (1 << 20))
    registering, go, swept = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def register(p, n, read_only=False):
        registering.set()
        assert go.wait(60)
        order.append("pinned")

    real = TierScan._sweep

    def sweep(self, fd, names):
        order.append("sweep")
        swept.set()
        return real(self, fd, names)

    monkeypatch.setattr(cuda_shim, "host_register", register)
    monkeypatch.setattr(TierScan, "_sweep", sweep)
    with _open(root, ram_dir) as mgr:
        try:
            assert registering.wait(60)  # the adoption is pinning (held)
            assert mgr._tier._sweeper is None and not swept.is_set()
            assert [n for n in os.listdir(tier_dir) if n.startswith("gone-")]  # set aside, not freed yet
        finally:
            go.set()
        assert swept.wait(60)
        assert mgr._tier.wait_sweep(timeout=60)
        assert order[-1] == "sweep" and "pinned" in order
        assert not [n for n in os.listdir(tier_dir) if n.startswith("gone-")]
        assert_tree_equal(mgr.restore(3), _state(3))


def test_the_slots_set_aside_are_swept_when_the_adoption_fails_at_start(root, ram_dir, monkeypatch):
    """The adopted slot's file is cut short between the scan and its adoption (another process
    truncated it): the manager's start fails, and the slot the scan set aside is still swept
    then, not left holding its pages until the process exits."""
    from ckptmgr.storage.tier import LocalTier

    path = _leave_step_3_in_the_tier(root, ram_dir)
    tier_dir = os.path.dirname(os.path.dirname(path))
    os.mkdir(os.path.join(tier_dir, "slot-01"), 0o700)
    with open(os.path.join(tier_dir, "slot-01", "data-00000.safetensors"), "wb") as f:
        f.write(b"\0" * (1 << 20))
    tiers: list[LocalTier] = []
    real_scan = LocalTier.scan

    def scan(self, *args, **kwargs):
        found = real_scan(self, *args, **kwargs)
        tiers.append(self)
        os.truncate(path, 100)  # (after the scan checked it, before its adoption maps it)
        return found

    monkeypatch.setattr(LocalTier, "scan", scan)
    with pytest.raises(OSError, match="is not a file of"):
        _open(root, ram_dir)
    [tier] = tiers
    try:
        assert tier.wait_sweep(timeout=60)
        assert not [n for n in os.listdir(tier_dir) if n.startswith("gone-")]
    finally:  # (the manager whose start failed is closed at exit: here, now)
        from ckptmgr import _lifecycle

        for mgr in [m for m in list(_lifecycle._open.values()) if m._tier is tier]:
            mgr.close(flush=False)


def test_close_while_an_adoption_s_end_starts_the_sweeper_does_not_fail(ram_dir, monkeypatch):
    """The last adoption ends (its thread takes the slots set aside and is about to start the
    sweeper, held here at a gate) while the tier closes: close() neither fails on the sweeper
    not started yet nor waits past its bound, and the sweeper, once started, still sweeps."""
    import ckptmgr.storage.tier_scan as scan_mod
    from ckptmgr.storage.tier import LocalTier

    tier = LocalTier(ram_dir, "file:///nowhere/root")
    tier_dir = tier.path
    os.mkdir(os.path.join(tier_dir, "slot-00"), 0o700)
    with open(os.path.join(tier_dir, "slot-00", "data-00000.safetensors"), "wb") as f:
        f.write(b"\0" * 4096)
    assert tier.scan(1, root_id=None) == {}  # (no manifest: set aside)
    starting, go, swept = threading.Event(), threading.Event(), threading.Event()

    class Gated(threading.Thread):
        def start(self) -> None:
            starting.set()
            assert go.wait(60)
            super().start()

    real_sweep = scan_mod.TierScan._sweep

    def sweep(self, fd, names):
        try:
            return real_sweep(self, fd, names)
        finally:
            swept.set()

    monkeypatch.setattr(scan_mod.TierScan, "_sweep", sweep)
    monkeypatch.setattr(scan_mod, "threading", type("T", (), {"Thread": Gated, "Event": threading.Event}))
    monkeypatch.setattr(scan_mod, "SWEEP_WAIT_S", 0.0)
    ender = threading.Thread(target=tier.sweep_after_adoptions)  # (as the last adoption's end does)
    ender.start()
    try:
        assert starting.wait(60)
        tier.close(remove=False)  # the sweeper is made, not started
    finally:
        go.set()
        ender.join(60)
    assert swept.wait(60)
    assert not [n for n in os.listdir(tier_dir) if n.startswith("gone-")]
