"""Process lifecycle with a save pending: interpreter exit, SIGKILL and SIGTERM corrupt
nothing, and the local tier carries a staged step over a crash."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import assert_tree_equal
from pending_writer import pending_state

from ckptmgr import CheckpointManager, StagingOptions

WRITER = os.path.join(os.path.dirname(__file__), "pending_writer.py")


def start(root, local_dir, mode):
    proc = subprocess.Popen([sys.executable, WRITER, root, local_dir, mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "staged"
    assert proc.stdout.readline().strip() == "local"
    return proc


@pytest.fixture
def local_dir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


def test_exit_without_close_finishes_the_pending_save(root, local_dir):
    proc = start(root, local_dir, "slow")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert os.path.isfile(os.path.join(root, "step_000000000007", "manifest.json"))
    assert os.listdir(local_dir) == []  # closed at exit: the slot is released
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        assert mgr.steps() == [7]
        assert_tree_equal(mgr.restore(), pending_state())


def test_exit_with_a_failed_pending_save_reports_it(root, local_dir):
    proc = start(root, local_dir, "fail")
    _, err = proc.communicate(timeout=60)
    assert "ckptmgr: at exit" in err and "Input/output error" in err
    assert not os.path.exists(os.path.join(root, "step_000000000007"))
    # the step never reached the root; it stays in the local tier, and the next start writes it
    with CheckpointManager(root, staging=StagingOptions(local_dir=local_dir)) as mgr:
        assert mgr.steps() == [7]
        mgr.wait(timeout=30)
        assert_tree_equal(mgr.restore(), pending_state())
    assert os.path.isfile(os.path.join(root, "step_000000000007", "manifest.json"))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_during_a_hung_write_restores_from_the_local_tier(root, local_dir, sig):
    proc = start(root, local_dir, "hang")
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    assert not os.path.exists(os.path.join(root, "step_000000000007"))  # only in RAM
    with CheckpointManager(root, staging=StagingOptions(local_dir=local_dir)) as mgr:
        assert mgr.latest_step() == 7
        assert_tree_equal(mgr.restore(), pending_state())  # from the tier, at once
        mgr.wait(timeout=30)  # and it is written out to the root
    assert os.path.isfile(os.path.join(root, "step_000000000007", "manifest.json"))
    assert os.listdir(local_dir) == []
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        assert_tree_equal(mgr.restore(), pending_state())
