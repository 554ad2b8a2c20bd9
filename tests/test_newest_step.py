"""The save engine's promises about the newest step: a Ctrl-C in close() never drops it
silently, a full disk fails its save at once and keeps the local-tier copy, its own retention
run never deletes it (after a roll-back either), a step deleted from the root is not brought
back from the tier, and steps kept local by the schedule can be made durable."""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch
import zygote
from close_interrupt_writer import interrupt_state
from conftest import assert_tree_equal

from ckptmgr import CheckpointManager, KeepLatest, SaveError, Schedule, StagingOptions
from ckptmgr.format.naming import step_name
from ckptmgr.storage.tier import read_tier

HERE = os.path.dirname(__file__)
NO_TIER = StagingOptions(local_tier=False)


def _state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "step": step}


def durable_steps(root: str) -> list[int]:
    with CheckpointManager(root, staging=NO_TIER, read_only=True) as mgr:
        return mgr.steps()


@pytest.fixture
def local_dir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


def _lines(stream) -> queue.Queue:
    """The lines of ``stream``, read on a thread (so that each wait for one has a timeout)."""
    q: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            q.put(line.strip())
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _expect(q: queue.Queue, *words: str) -> None:
    """Wait until the writer has printed each of ``words`` (in any order)."""
    left = set(words)
    while left:
        line = q.get(timeout=60)
        assert line is not None, f"the writer ended before printing {sorted(left)}"
        left.discard(line)


# ------------------------------------------------------------ 6: Ctrl-C in close()

@pytest.mark.parametrize("again", [False, True], ids=["then-wait", "ctrl-c-again"])
def test_ctrl_c_while_close_waits_for_the_newest_write_never_drops_it_silently(root, tmp_path, again):
    """No local tier: the step exists only in the process's memory. The write is held at a
    gate, close() waits for it, a real SIGINT arrives: close() names the step and what a kill
    would cost, and the exit hook waits for the write again, which then reaches the root; a
    second SIGINT there ends the process, and the loss is said again, naming the step."""
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "close_interrupt_writer.py"), root],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=HERE)
    try:
        out = _lines(proc.stdout)
        _expect(out, "writing", "closing")  # the write is held at the gate, close() waits for it
        proc.send_signal(signal.SIGINT)
        _expect(out, "interrupted")
        if again:
            _expect(out, "closing")  # the exit hook waits for it again
            proc.send_signal(signal.SIGINT)
        elif "step 5" in err_path.read_text():  # (logged before close() re-raised) it is waited for: go on
            proc.stdin.write("go" * 8)
            proc.stdin.flush()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    said = err_path.read_text()
    told = said.count("interrupted (KeyboardInterrupt) before step 5 was written")
    assert told == (2 if again else 1), said
    assert "step 5 is lost (it was only in this process's memory)" in said  # what a kill would cost
    if again:
        assert durable_steps(root) == []
        return
    assert proc.returncode == 0, said
    assert durable_steps(root) == [5]
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        assert_tree_equal(mgr.restore(), interrupt_state())


# ------------------------------------------------------------ 7: a full filesystem

@pytest.fixture
def small_fs(tmp_path):
    """A real 2 MiB filesystem (tmpfs), to fill up."""
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(d)], capture_output=True, text=True,
                       timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield str(d)
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=30)


def test_a_full_filesystem_fails_the_save_at_once_is_reported_once_and_keeps_the_tier_copy(small_fs, local_dir,
                                                                                           caplog):
    caplog.set_level(logging.INFO, logger="ckptmgr")
    root = os.path.join(small_fs, "ckpt")
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}  # 4 MiB: twice what the filesystem holds
    mgr = CheckpointManager(root, staging=StagingOptions(local_dir=local_dir, local_tier=True))
    try:
        handle = mgr.save(1, state)
        with pytest.raises(SaveError, match="No space left") as raised:
            handle.result(timeout=60)
        assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.ENOSPC
        told = [r.getMessage() for r in caplog.records if "step 1" in r.getMessage()]
        failures = [m for m in told if "failed" in m]
        assert len(failures) == 1 and "not retried" in failures[0] and "ENOSPC" in failures[0], told
        assert not [m for m in told if "tried again" in m], told
        assert mgr.steps() == [1]  # the local-tier copy stays, restorable
        assert_tree_equal(mgr.restore(), state)
    finally:
        mgr.close()  # nothing raised again (told once), no retry to wait for
    assert 1 in read_tier(local_dir, mgr.root)  # kept for the next start
    assert not os.path.exists(os.path.join(root, step_name(1)))


def test_a_step_whose_write_failed_for_good_does_not_hold_the_only_slot(small_fs, local_dir):
    """With one slot, a later save takes the slot of a step whose durable write failed for good
    (the newer step is then the one in the tier): it neither waits for a retry that never comes
    nor forever."""
    root = os.path.join(small_fs, "ckpt")
    state = {"w": torch.arange(1 << 20, dtype=torch.float32)}  # 4 MiB: twice what the filesystem holds
    mgr = CheckpointManager(root, staging=StagingOptions(slots=1, local_dir=local_dir, local_tier=True))
    try:
        with pytest.raises(SaveError, match="No space left"):
            mgr.save(1, state).result(timeout=60)
        outcome: queue.Queue[object] = queue.Queue()

        def second() -> None:
            try:
                outcome.put(mgr.save(2, state))
            except BaseException as exc:  # (reported to the test thread)
                outcome.put(exc)

        threading.Thread(target=second, daemon=True).start()
        got = outcome.get(timeout=120)  # before the fix: save(2) waited for the slot forever
        assert not isinstance(got, BaseException), got
        with pytest.raises(SaveError, match="No space left"):
            got.result(timeout=60)  # type: ignore[attr-defined]
        assert mgr.steps() == [2]  # the newest step is the one the tier keeps
    finally:
        mgr.close()


def _refuse_writes(how: str, small_fs: str, root: str) -> tuple[int, list[str]]:
    """Make the root refuse writes for real: the filesystem remounted read-only (EROFS), or the
    root directory made immutable (``chattr +i``: EPERM, for root too). Returns the errno a
    write then gets and the command that undoes it."""
    if how == "read-only":
        cmd, undo, code = ["mount", "-o", "remount,ro", small_fs], ["mount", "-o", "remount,rw", small_fs], errno.EROFS
    else:
        if shutil.which("chattr") is None:
            pytest.skip("chattr is not installed")
        cmd, undo, code = ["chattr", "+i", root], ["chattr", "-i", root], errno.EPERM
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"{' '.join(cmd)} failed here: {r.stderr.strip()}")
    return code, undo


@pytest.mark.parametrize("how", ["read-only", "immutable"])
def test_a_root_that_refuses_writes_fails_the_save_at_once_is_reported_once_and_keeps_the_tier_copy(
        small_fs, local_dir, caplog, how):
    """A read-only filesystem (EROFS) and a root this process may not change (EPERM) are not
    transient either: the save's handle raises SaveError at once, the failure is logged once,
    never tried again, and the step stays restorable from the local tier, which keeps it for
    the next start."""
    caplog.set_level(logging.INFO, logger="ckptmgr")
    root = os.path.join(small_fs, "ckpt")
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    mgr = CheckpointManager(root, staging=StagingOptions(local_dir=local_dir, local_tier=True))
    code, undo = _refuse_writes(how, small_fs, root)
    try:
        handle = mgr.save(1, state)
        with pytest.raises(SaveError, match=os.strerror(code)) as raised:
            handle.result(timeout=60)
        assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == code
        told = [r.getMessage() for r in caplog.records if "step 1" in r.getMessage()]
        failures = [m for m in told if "failed" in m]
        assert len(failures) == 1 and "not retried" in failures[0] and errno.errorcode[code] in failures[0], told
        assert not [m for m in told if "tried again" in m], told
        assert mgr.steps() == [1]  # the local-tier copy stays, restorable
        assert_tree_equal(mgr.restore(), state)
    finally:
        try:
            mgr.close()  # nothing raised again (told once), no retry to wait for
        finally:
            subprocess.run(undo, capture_output=True, timeout=30)
    assert 1 in read_tier(local_dir, mgr.root)  # kept for the next start
    assert not os.path.exists(os.path.join(root, step_name(1)))


# ------------------------------------------------------------ 9: retention after a roll-back

def test_a_step_saved_after_a_roll_back_survives_its_own_retention_run(root):
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, _state(s)).result(timeout=60)
    with CheckpointManager(root, staging=NO_TIER, retention=KeepLatest(1)) as mgr:
        assert_tree_equal(mgr.restore(20), _state(20))  # roll back to 20, train on from there
        info = mgr.save(25, _state(25)).result(timeout=60)
        assert info.durable
        mgr.wait(timeout=60)  # its own retention run is done
        assert mgr.steps() == [25, 30]  # 30, of the abandoned run, stays until the new run passes it
        assert_tree_equal(mgr.restore(25), _state(25))
        mgr.save(35, _state(35)).result(timeout=60)
        mgr.wait(timeout=60)
        assert mgr.steps() == [35]


# ------------------------------------------------------------ 11: a step the user deleted

CRASH_AFTER_TWO = """
import os, signal, sys, torch
from ckptmgr import CheckpointManager, StagingOptions
mgr = CheckpointManager(sys.argv[1], staging=StagingOptions(local_dir=sys.argv[2]))
for s in (1, 2):
    assert mgr.save(s, {"w": torch.full((64,), float(s)), "step": s}).result(timeout=60).durable
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_step_deleted_from_the_root_is_not_written_back_from_the_tier(root, local_dir):
    r = zygote.run([sys.executable, "-c", CRASH_AFTER_TWO, root, local_dir], template="torch", capture_output=True,
                   text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    with CheckpointManager(root, staging=NO_TIER, read_only=True) as reader:
        assert reader.steps() == [1, 2] and 2 in read_tier(local_dir, reader.root)  # durable, and in the tier
    subprocess.run(["rm", "-rf", os.path.join(root, step_name(2))], check=True, timeout=30)  # the user's deletion
    with CheckpointManager(root, staging=StagingOptions(local_dir=local_dir)) as mgr:
        mgr.wait(timeout=60)
        assert mgr.steps() == [1]
        assert_tree_equal(mgr.restore(), _state(1))
    assert durable_steps(root) == [1]
    assert not os.path.exists(os.path.join(root, step_name(2)))


# ------------------------------------------------------------ issue 38.2: steps the schedule keeps local

EVERY_10 = Schedule(durable_every=10)  # 10, 20, ... go durable; the steps between stay in the local tier


def test_close_makes_the_newest_step_durable_by_default(root, local_dir):
    with CheckpointManager(root, staging=StagingOptions(slots=2, local_dir=local_dir), schedule=EVERY_10) as mgr:
        infos = [mgr.save(s, _state(s)).result(timeout=60) for s in (10, 11, 12)]
        assert [i.durable for i in infos] == [True, False, False]
        assert durable_steps(root) == [10]
    assert durable_steps(root) == [10, 12]  # the newest, written at close; 11 stays superseded
    assert os.listdir(local_dir) == []  # nothing left only in RAM
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        assert_tree_equal(mgr.restore(), _state(12))


def test_flush_and_save_durable_write_a_step_the_schedule_keeps_local(root, local_dir):
    with CheckpointManager(root, staging=StagingOptions(slots=2, local_dir=local_dir), schedule=EVERY_10) as mgr:
        assert not mgr.save(11, _state(11)).result(timeout=60).durable
        assert mgr.flush(timeout=60) == 11
        assert durable_steps(root) == [11]
        assert mgr.flush(timeout=60) is None  # durable already
        assert mgr.save(13, _state(13), durable=True).result(timeout=60).durable  # overrides the schedule
        assert not mgr.save(14, _state(14)).result(timeout=60).durable
        assert durable_steps(root) == [11, 13]
        handle = mgr.save(15, _state(15), block=False)  # flushed while its local commit may still run
        assert mgr.flush(timeout=60) == 15
        # the handle tells durable=True when the flush caught the save in flight; when its local
        # commit had already resolved it (local only), the flush wrote the step from the tier
        handle.result(timeout=60)
        assert durable_steps(root) == [11, 13, 15]


def test_close_without_flush_says_once_what_stays_only_in_ram_and_how_to_keep_it(root, local_dir, caplog):
    caplog.set_level(logging.WARNING, logger="ckptmgr")
    mgr = CheckpointManager(root, staging=StagingOptions(local_dir=local_dir), schedule=EVERY_10)
    mgr.save(7, _state(7)).result(timeout=60)
    mgr.close(flush=False)
    said = [r.getMessage() for r in caplog.records if "[7]" in r.getMessage()]
    assert len(said) == 1 and "reboot" in said[0] and "ckptmgr flush" in said[0] and "mgr.flush()" in said[0]
    assert durable_steps(root) == []
    assert 7 in read_tier(local_dir, mgr.root)


CRASH_WITH_LOCAL_STEPS = """
import os, signal, sys, torch
from ckptmgr import CheckpointManager, Schedule, StagingOptions
mgr = CheckpointManager(sys.argv[1], staging=StagingOptions(slots=3, local_dir=sys.argv[2]),
                        schedule=Schedule(durable_every=10))
for s in (10, 11, 12):
    mgr.save(s, {"w": torch.full((64,), float(s)), "step": s}).result(timeout=60)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("drop", [False, True])
def test_cli_flush_writes_or_drops_the_steps_only_the_local_tier_holds(root, local_dir, drop, capsys):
    from ckptmgr.cli import main as cli_main

    r = zygote.run([sys.executable, "-c", CRASH_WITH_LOCAL_STEPS, root, local_dir], template="torch",
                   capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert durable_steps(root) == [10]
    with CheckpointManager(root, staging=NO_TIER, read_only=True) as reader:
        url = reader.root
    assert {11, 12} <= set(read_tier(local_dir, url))
    assert cli_main(["flush", root, "--local-dir", local_dir, *(["--drop"] if drop else [])]) == 0
    out = capsys.readouterr().out
    if drop:
        assert "dropped step(s) 11, 12" in out
        assert durable_steps(root) == [10]
    else:
        assert "wrote step 12" in out and "11" in out
        assert durable_steps(root) == [10, 12]
        with CheckpointManager(root, staging=NO_TIER) as mgr:
            assert_tree_equal(mgr.restore(), _state(12))
    assert read_tier(local_dir, url) == {}
    assert cli_main(["flush", root, "--local-dir", local_dir]) == 0
    assert "nothing to flush" in capsys.readouterr().out


CRASH_AFTER_A_DURABLE_STEP = """
import os, signal, sys, torch
from ckptmgr import CheckpointManager, StagingOptions
mgr = CheckpointManager(sys.argv[1], staging=StagingOptions(slots=1, local_dir=sys.argv[2]))
mgr.save(10, {"w": torch.full((64,), 10.0), "step": 10}).result(timeout=60)
mgr.wait(timeout=60)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_cli_flush_leaves_a_tier_step_deleted_from_the_root_after_it_was_written(root, local_dir, capsys):
    """A step the tier holds that was written to the root and deleted there since (by hand, or
    retention) is neither flushed again nor a failure: there is nothing to flush."""
    from ckptmgr.cli import main as cli_main
    from ckptmgr.format.naming import step_name

    r = zygote.run([sys.executable, "-c", CRASH_AFTER_A_DURABLE_STEP, root, local_dir], template="torch",
                   capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    with CheckpointManager(root, staging=NO_TIER, read_only=True) as reader:
        url = reader.root
    assert 10 in read_tier(local_dir, url)  # the tier keeps it, marked written out
    shutil.rmtree(os.path.join(root, step_name(10)))
    assert cli_main(["flush", root, "--local-dir", local_dir]) == 0
    assert "nothing to flush" in capsys.readouterr().out
    assert durable_steps(root) == []
