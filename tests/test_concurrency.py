"""One manager, many threads: each invariant of the save path held at its racy window by
gates and events (never by sleeping), with real threads, real files and real subprocesses.

* the newest committed step is never invalidated before a newer one commits;
* ``result()`` lets an interruption through, and the save's failure is still told;
* ``protect()`` returning means the step survives retention;
* no storage I/O under a lock the training thread takes; a failure after a commit cannot
  wedge ``wait()``;
* ``save()`` does no storage round trip, and ``SaveInfo.blocked_s`` is all it took;
* ``prepare()`` is a reservation that the next save uses, never skips, and ``wait()`` waits for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from test_fsspec_target import FaultyFS, faulty  # noqa: F401  (fixture)

from ckptmgr import (
    CheckpointManager,
    CkptTimeoutError,
    KeepLatest,
    SaveError,
    StagingOptions,
    StepNotFoundError,
    StorageError,
)
from ckptmgr.retention.deleter import Deleter
from ckptmgr.save.slots import SlotPool
from ckptmgr.storage.local import LocalTarget
from ckptmgr.storage.tier import LocalTier


def state(seed: int = 0, n: int = 200_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "step": seed}


@pytest.fixture
def local_dir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


@pytest.fixture
def quick_retries(monkeypatch):
    try:
        import ckptmgr.save.coalesce as saver_module
    except ImportError:  # (a version without retries)
        return
    monkeypatch.setattr(saver_module, "RETRY_FIRST_S", 0.05)


def wait_until(predicate, timeout: float = 30.0) -> bool:
    """Poll a condition that another thread makes true (bounded)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# ----------------------------------------------------------------- never lose the newest


def test_a_failed_write_never_leaves_steps_empty(faulty, local_dir, monkeypatch, quick_retries):  # noqa: F811
    """One slot, its durable write failed: the slot holds the only copy of the newest step.
    The next save must not reuse it (that would unlist step 1 while step 2 is copied)."""
    mgr = CheckpointManager("faulty://never-empty", staging=StagingOptions(slots=1, on_busy="skip",
                                                                           local_dir=local_dir))
    faulty.fail_writes = True
    with pytest.raises(SaveError, match="Input/output error"):
        mgr.save(1, state(1)).result(timeout=30)
    assert mgr.steps() == [1]  # in the local tier
    entered, gate = threading.Event(), threading.Event()
    real = LocalTier.commit

    def held_commit(self, *args):  # a local commit of another step, held open
        entered.set()
        gate.wait(30)
        return real(self, *args)

    monkeypatch.setattr(LocalTier, "commit", held_commit)
    handle = mgr.save(2, state(2))  # the slot may not be taken: skipped
    try:
        assert mgr.steps() == [1], "the newest committed step was invalidated before a newer one committed"
        assert handle.skipped and not entered.is_set()
    finally:
        gate.set()
    # the write of step 1 is retried while the slot holds it; once the target is back, it lands
    faulty.fail_writes = False
    assert wait_until(lambda: FaultyFS().exists("faulty://never-empty/step_000000000001/manifest.json"))
    # (the manifest is the commit's last write; the slot is released just after it)
    assert wait_until(lambda: not any(s.busy for s in mgr._saver.pool.slots))
    mgr.save(3, state(3)).result(timeout=30)  # the slot is free again
    assert mgr.steps() == [1, 3]
    mgr.close(timeout=30)


def test_a_waiting_save_goes_on_once_the_retried_write_lands(faulty, local_dir, quick_retries):  # noqa: F811
    mgr = CheckpointManager("faulty://wait-retry", staging=StagingOptions(slots=1, local_dir=local_dir))
    faulty.fail_writes = True
    with pytest.raises(SaveError):
        mgr.save(1, state(1)).result(timeout=30)
    done = threading.Event()
    seen: list[list[int]] = []

    def second():
        mgr.save(2, state(2))
        done.set()

    t = threading.Thread(target=second)
    t.start()
    try:
        # the save waits: step 1 is the only copy of the newest step and still retried
        assert not done.wait(0.3)
        seen.append(mgr.steps())
    finally:
        faulty.fail_writes = False
    t.join(30)
    assert done.is_set() and seen == [[1]]
    mgr.wait(timeout=30)
    assert mgr.steps() == [1, 2]
    mgr.close(timeout=30)  # step 1's failure was told by result(): not again


# ------------------------------------------------------------------ interruptions pass through

INTERRUPTED = textwrap.dedent("""
    import os, signal, sys, threading, time
    import torch
    from ckptmgr import CheckpointManager, SaveError, StagingOptions
    from ckptmgr.storage import local

    signal.signal(signal.SIGINT, signal.default_int_handler)  # (a suite started with SIGINT ignored)
    gate, fail = threading.Event(), threading.Event()
    real = local._LocalStepWriter._write_file

    def held(self, *args):
        gate.wait(60)
        if fail.is_set():
            raise OSError(5, "Input/output error (injected)")
        return real(self, *args)

    local._LocalStepWriter._write_file = held
    mgr = CheckpointManager(sys.argv[1], staging=StagingOptions(local_tier=False))
    h = mgr.save(1, {"w": torch.ones(1000)})
    main = threading.main_thread().ident

    def interrupt_when_waiting():
        while True:  # until the main thread waits inside the handle's result()
            frame = sys._current_frames().get(main)
            names = []
            while frame is not None:
                names.append(frame.f_code.co_name)
                frame = frame.f_back
            if "result" in names and ("wait" in names or "__get_result" in names):
                break
            time.sleep(0.005)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_when_waiting, daemon=True).start()
    try:
        h.result(timeout=60)
        print("RETURNED")
    except KeyboardInterrupt:
        print("INTERRUPTED")
    except SaveError as exc:
        print("SAVEERROR", exc)
    fail.set()
    gate.set()
    try:
        mgr.close(timeout=60)
        print("CLOSED-QUIETLY")
    except SaveError as exc:
        print("CLOSE-RAISED", exc)
""")


def test_ctrl_c_in_result_passes_through_and_the_failure_is_still_told(root):
    out = subprocess.run([sys.executable, "-c", INTERRUPTED, root], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[0] == "INTERRUPTED", out.stdout + out.stderr
    assert "CLOSE-RAISED save of step 1 failed" in out.stdout, out.stdout + out.stderr


# ------------------------------------------------------------------------- protect vs retention


def test_protect_during_a_retention_run_over_200_steps(root, monkeypatch):
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        for step in range(200):
            mgr.save(step, {"x": torch.full((4,), float(step))}, block=True)
        mgr.wait(timeout=60)
    started, go = threading.Event(), threading.Event()
    real = LocalTarget.delete

    def held_delete(self, step):
        started.set()
        go.wait(60)  # the run has decided; protect() calls come in now
        return real(self, step)

    monkeypatch.setattr(LocalTarget, "delete", held_delete)
    mgr = CheckpointManager(root, retention=KeepLatest(1), staging=StagingOptions(local_tier=False))
    runner = threading.Thread(target=mgr.apply_retention)
    runner.start()
    assert started.wait(30)
    protected, refused = [], []
    for step in range(198, -1, -1):
        try:
            mgr.protect(step)
            protected.append(step)
        except StepNotFoundError:  # being deleted (or gone): protect says so
            refused.append(step)
    go.set()
    runner.join(60)
    assert not runner.is_alive()
    left = set(mgr.steps())
    lost = [s for s in protected if s not in left]
    assert not lost, f"protect() returned for steps {lost[:10]} ..., which retention then deleted"
    assert len(refused) <= 1 and len(protected) >= 198
    mgr.close(timeout=30)


# --------------------------------------------------------- no I/O under the training thread's lock


def test_a_slow_protection_marker_does_not_block_save(root, monkeypatch):
    entered, gate = threading.Event(), threading.Event()
    real_begin, real_mark = LocalTarget.begin, LocalTarget.set_protected
    begin_gate = threading.Event()

    def held_begin(self, step, prefix=""):
        if step == 1:
            begin_gate.wait(30)
        return real_begin(self, step, prefix)

    def slow_marker(self, step, protected):  # a protection PUT retried for minutes on S3
        entered.set()
        gate.wait(30)
        return real_mark(self, step, protected)

    monkeypatch.setattr(LocalTarget, "begin", held_begin)
    monkeypatch.setattr(LocalTarget, "set_protected", slow_marker)
    mgr = CheckpointManager(root, staging=StagingOptions(slots=2, local_tier=False))
    mgr.save(1, state(1))
    mgr.protect(1)  # still being saved: written when it commits
    begin_gate.set()
    assert entered.wait(30)  # the commit of step 1 is writing the marker now
    returned = threading.Event()
    t = threading.Thread(target=lambda: (mgr.save(2, state(2)), returned.set()))
    t.start()
    try:
        assert returned.wait(10), "save() waited for a storage write it has nothing to do with"
    finally:
        gate.set()
        t.join(30)
    mgr.close(timeout=30)
    assert CheckpointManager(root).is_protected(1)


def test_a_failure_after_the_commit_cannot_wedge_wait(root, monkeypatch):
    def broken(self):
        raise RuntimeError("retention scheduling failed (injected)")

    monkeypatch.setattr(Deleter, "schedule", broken)
    mgr = CheckpointManager(root, retention=KeepLatest(1), staging=StagingOptions(local_tier=False))
    mgr.save(1, state(1))
    with pytest.raises(StorageError, match="injected"):  # reported, not lost and not hanging
        mgr.wait(timeout=10)
    mgr.wait(timeout=10)  # told once
    assert mgr.steps() == [1]
    monkeypatch.undo()
    mgr.close(timeout=30)


# ------------------------------------------------------------------- save() and the storage


SLOW = 0.2


def test_save_does_no_storage_round_trip_and_blocked_s_is_all_of_it(root, monkeypatch):
    mgr = CheckpointManager(root, staging=StagingOptions(local_tier=False))
    mgr.save(1, state(1)).result(timeout=30)
    calls: list[str] = []
    main = threading.current_thread()

    def counted(name):
        real = getattr(LocalTarget, name)

        def call(self, *args, **kwargs):
            if threading.current_thread() is main:
                calls.append(name)
                time.sleep(SLOW)  # a slow listing (S3 pages): the cost save() must not pay
            return real(self, *args, **kwargs)
        return call

    for name in ("list_steps", "read_manifest", "file_size", "is_protected", "root_id"):
        monkeypatch.setattr(LocalTarget, name, counted(name))
    t = time.perf_counter()
    h = mgr.save(2, state(2))
    wall = time.perf_counter() - t
    assert calls == [], f"save() made storage round trips on the training thread: {calls}"
    info = h.result(timeout=30)
    assert wall - SLOW / 2 < info.blocked_s <= wall  # all of save(), not just the part after a listing
    monkeypatch.undo()
    with pytest.raises(Exception, match="already committed"):  # known without listing
        mgr.save(2, state(2))
    mgr.close(timeout=30)


# -------------------------------------------------------------------------------- prepare()


def _hold_prepare(monkeypatch):
    """Hold the prepare thread inside its slot fitting until the returned gate opens."""
    entered, gate = threading.Event(), threading.Event()
    real = SlotPool.fit

    def held(self, slot, sizes, *args, **kwargs):
        if threading.current_thread().name == "ckptmgr-prepare":
            entered.set()
            gate.wait(30)
        return real(self, slot, sizes, *args, **kwargs)

    monkeypatch.setattr(SlotPool, "fit", held)
    return entered, gate


def test_prepare_is_a_reservation_the_next_save_uses_and_never_skips(root, monkeypatch):
    entered, gate = _hold_prepare(monkeypatch)
    mgr = CheckpointManager(root, staging=StagingOptions(slots=1, on_busy="skip", local_tier=False))
    s = state(1)
    mgr.prepare(s)
    assert entered.wait(30)
    out: list = []
    t = threading.Thread(target=lambda: out.append(mgr.save(1, s)))
    t.start()
    hurry = getattr(mgr, "_saver", None) and mgr._saver.pool.hurry
    # the save either returned (skipped) or waits for the slot being prepared
    wait_until(lambda: not t.is_alive() or (hurry is not None and hurry.is_set()))
    gate.set()
    t.join(30)
    assert not out[0].skipped, "the save was skipped because prepare() was making the slot"
    out[0].result(timeout=30)
    assert mgr.stats()["slot_allocations"] == 1 and mgr.stats()["skips"] == 0
    mgr.close(timeout=30)


def test_wait_waits_for_prepare(root, monkeypatch):
    entered, gate = _hold_prepare(monkeypatch)
    mgr = CheckpointManager(root, staging=StagingOptions(slots=2, local_tier=False))
    mgr.prepare(state(1))
    assert entered.wait(30)
    try:
        with pytest.raises(CkptTimeoutError):
            mgr.wait(timeout=0.2)
    finally:
        gate.set()
    mgr.wait(timeout=30)
    assert mgr.stats()["slot_allocations"] == 2  # both made: the save makes none
    mgr.save(1, state(1)).result(timeout=30)
    assert mgr.stats()["slot_allocations"] == 2
    mgr.close(timeout=30)


# ---------------------------------------------------------------------------- bounded shutdown


def test_close_with_a_hung_deleter_is_bounded(root, monkeypatch):
    gate = threading.Event()
    entered = threading.Event()
    real = LocalTarget.delete

    def hung(self, step):
        entered.set()
        gate.wait(20)  # a deletion stuck on a dead NFS server
        return real(self, step)

    monkeypatch.setattr(LocalTarget, "delete", hung)
    mgr = CheckpointManager(root, retention=KeepLatest(1), staging=StagingOptions(local_tier=False))
    mgr.save(1, state(1)).result(timeout=30)
    mgr.save(2, state(2)).result(timeout=30)
    assert entered.wait(30)
    t = time.monotonic()
    try:
        with pytest.raises(CkptTimeoutError, match="retention deletion"):
            mgr.close(timeout=2)
        assert time.monotonic() - t < 5
    finally:
        gate.set()


def test_leaving_a_with_block_with_a_hung_writer_is_bounded(root, local_dir, monkeypatch, caplog):
    gate = threading.Event()
    real = LocalTarget.begin

    def hung(self, step, prefix=""):
        gate.wait(20)  # a write stuck on a dead server
        return real(self, step, prefix)

    monkeypatch.setattr(LocalTarget, "begin", hung)
    t = time.monotonic()
    try:
        def train():
            with CheckpointManager(root, staging=StagingOptions(local_dir=local_dir), close_timeout=2) as mgr:
                mgr.save(5, state(5))
                assert wait_until(lambda: mgr.steps() == [5])  # in the local tier
            return mgr

        with pytest.raises(CkptTimeoutError, match="step 5"):
            train()
        assert time.monotonic() - t < 5 + 2
        assert "step 5" in caplog.text and "local tier" in caplog.text  # what is lost, or kept, is said
    finally:
        gate.set()


HUNG_AT_EXIT = textwrap.dedent("""
    import sys, time
    import torch
    from ckptmgr import CheckpointManager, StagingOptions
    from ckptmgr.storage import local

    def hung(self, *args):
        time.sleep(3600)  # a write that never ends

    local._LocalStepWriter._write_file = hung
    how = sys.argv[3]
    if how == "close":
        mgr = CheckpointManager(sys.argv[1], staging=StagingOptions(local_dir=sys.argv[2]))
    else:
        mgr = CheckpointManager(sys.argv[1], staging=StagingOptions(local_dir=sys.argv[2]), close_timeout=2)
    mgr.save(7, {"w": torch.ones(1000)})
    while 7 not in mgr.steps():
        time.sleep(0.01)
    print("local", flush=True)
    if how == "close":
        try:
            mgr.close(timeout=2)
        except Exception as exc:
            print("close:", type(exc).__name__, flush=True)
    # main() returns with a write still hung
""")


@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_hung_writer_never_keeps_the_process_alive(root, local_dir, how):
    t = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", HUNG_AT_EXIT, root, local_dir, how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process was still alive 30 s after main() returned: {out} {err[-2000:]}")
    assert time.monotonic() - t < 30
    assert "local" in out, err
    if how == "close":
        assert "close: CkptTimeoutError" in out
    assert "step 7" in err and "kept in the local tier" in err, err[-2000:]
    # the step is not lost: the next start finds it in the local tier and writes it out
    with CheckpointManager(root, staging=StagingOptions(local_dir=local_dir)) as mgr:
        assert mgr.latest_step() == 7
        mgr.wait(timeout=30)
    assert os.path.isfile(os.path.join(root, "step_000000000007", "manifest.json"))


def test_a_manager_dropped_without_close_leaves_no_tier_directory(root, local_dir):
    code = ("import sys; from ckptmgr import CheckpointManager, StagingOptions; "
            "CheckpointManager(sys.argv[1], staging=StagingOptions(local_dir=sys.argv[2])).steps()")
    subprocess.run([sys.executable, "-c", code, root, local_dir], check=True, timeout=60)
    assert os.listdir(local_dir) == []


def test_a_restore_holds_its_slot_and_a_waiting_save_goes_on_after(root, local_dir, monkeypatch):
    """The local tier's read lease: a slot being restored is not reused under the reader,
    and the save that waits for it is woken when the read ends."""
    mgr = CheckpointManager(root, staging=StagingOptions(slots=1, local_dir=local_dir))
    first = state(1)
    mgr.save(1, first).result(timeout=30)
    entered, gate = threading.Event(), threading.Event()
    real = LocalTier.read_into

    def held(self, *args):
        entered.set()
        gate.wait(30)
        return real(self, *args)

    monkeypatch.setattr(LocalTier, "read_into", held)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(mgr.restore(1)))
    reader.start()
    assert entered.wait(30)
    saved = threading.Event()
    writer = threading.Thread(target=lambda: (mgr.save(2, state(2)), saved.set()))
    writer.start()
    try:
        assert not saved.wait(0.5), "the slot was taken while a restore read it"
    finally:
        gate.set()
    reader.join(30)
    writer.join(30)
    assert saved.is_set()
    assert torch.equal(got[0]["w"], first["w"])
    mgr.close(timeout=30)


def test_the_collector_is_held_off_while_any_restore_runs_and_then_restored(root):
    """Two restores at once from two threads: the cyclic collector is off while either runs,
    on again after the last has left, and left off when the caller had turned it off."""
    import gc

    inside, leave = threading.Barrier(3, timeout=60), threading.Barrier(3, timeout=60)
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, {"w": torch.arange(10)}).result()
        real = mgr._restorer.restore_step
        seen: list[bool] = []

        def gated(*args, **kwargs):
            seen.append(gc.isenabled())
            inside.wait()
            leave.wait()
            return real(*args, **kwargs)

        was = gc.isenabled()
        gc.enable()
        try:
            mgr._restorer.restore_step = gated
            out: list[dict] = []
            workers = [threading.Thread(target=lambda: out.append(mgr.restore(1))) for _ in range(2)]
            for t in workers:
                t.start()
            inside.wait()  # both restores are running
            assert seen == [False, False] and not gc.isenabled()
            leave.wait()
            for t in workers:
                t.join(timeout=60)
            assert len(out) == 2 and all(torch.equal(o["w"], torch.arange(10)) for o in out)
            assert gc.isenabled()  # back on after the last
            mgr._restorer.restore_step = real
            gc.disable()
            mgr.restore(1)
            assert not gc.isenabled()  # the caller's choice stands
        finally:
            (gc.enable if was else gc.disable)()
