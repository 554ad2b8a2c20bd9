"""The local tier on a machine shared with other users: a tier directory or symlinks planted
by another OS user are never used or followed, and a root deleted with ``rm -rf`` is never
resurrected from RAM.

The attacker is a real second user: created with ``useradd`` for the test (we run as root in
CI), its steps run in a subprocess under its uid. Skipped where that is not possible.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import uuid

import pytest
import torch
from conftest import assert_tree_equal

from ckptmgr import CheckpointManager, StagingOptions
from ckptmgr.storage.tier import tier_dir

WRITER = os.path.join(os.path.dirname(__file__), "pending_writer.py")


@pytest.fixture
def shared_dir():
    """A world-writable sticky directory, like /dev/shm."""
    path = f"/dev/shm/ckpt-shared-{uuid.uuid4().hex[:8]}"
    os.mkdir(path)
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def attacker():
    """A throwaway OS user; yields a function running Python code as that user."""
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")  # one every user may run
    if os.geteuid() != 0 or shutil.which("useradd") is None or python is None:
        pytest.skip("needs root, useradd and a system python3 to run as a second user")
    name = f"ckatk{uuid.uuid4().hex[:6]}"
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
    pw = pwd.getpwnam(name)

    def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([python, "-I", "-c", code, *args], user=pw.pw_uid, group=pw.pw_gid,
                             capture_output=True, text=True, timeout=60, cwd="/")
        assert out.returncode == 0, out.stderr
        return out

    yield run
    subprocess.run(["userdel", name], check=False, capture_output=True)


def _committed_step_files(shared_dir: str, step: int) -> str:
    """A real committed step's files (manifest + data), readable by anyone: what an attacker
    can produce with ckptmgr itself and plant as a tier slot."""
    src = os.path.join(shared_dir, "attacker-root")
    with CheckpointManager(src, staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(step, {"w": torch.full((1000,), 666.0)}).result()
    d = os.path.join(src, f"step_{step:012d}")
    for path in (src, d):
        os.chmod(path, 0o755)
    for name in os.listdir(d):
        os.chmod(os.path.join(d, name), 0o644)
    return d


PLANT_SLOT = """
import os, shutil, sys
tier, files = sys.argv[1], sys.argv[2]
os.mkdir(tier, 0o777); os.chmod(tier, 0o777)
os.mkdir(os.path.join(tier, "slot-00"), 0o777)
for name in os.listdir(files):
    shutil.copy(os.path.join(files, name), os.path.join(tier, "slot-00", name))
open(os.path.join(tier, "root"), "w").write(sys.argv[3] + "\\n")
"""


def test_a_tier_directory_planted_by_another_user_is_not_used(tmp_path, shared_dir, attacker, caplog):
    root = str(tmp_path / "victim")
    os.makedirs(root)
    url = os.path.abspath(root)
    attacker(PLANT_SLOT, tier_dir(shared_dir, url), _committed_step_files(shared_dir, 99), url)
    from ckptmgr.cli._browse import local_tier_steps

    assert local_tier_steps(shared_dir, url) == {}  # `ckptmgr ls` does not list it either
    with caplog.at_level(logging.WARNING, "ckptmgr"):
        mgr = CheckpointManager(root, staging=StagingOptions(local_dir=shared_dir))
    assert "not using the local tier" in caplog.text and "belongs to uid" in caplog.text
    assert mgr.steps() == []  # the planted "committed" step is not listed ...
    mgr.save(1, {"w": torch.zeros(1000)}).result()
    mgr.close()
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_000000000001"]  # ... nor written
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as again:
        assert_tree_equal(again.restore()["w"], torch.zeros(1000))


PLANT_LINKS = """
import os, sys
tier, victim_file = sys.argv[1], sys.argv[2]
os.mkdir(tier, 0o777); os.chmod(tier, 0o777)
os.symlink(victim_file, os.path.join(tier, "root"))
os.symlink(victim_file, os.path.join(tier, "lock"))
os.mkdir(os.path.join(tier, "slot-00"), 0o777)
os.symlink(victim_file, os.path.join(tier, "slot-00", "data-00000.safetensors"))
"""

PLANT_DIR_LINK = """
import os, sys
os.symlink(sys.argv[2], sys.argv[1])
"""


@pytest.mark.parametrize("plant", ["links inside", "the directory itself"])
def test_symlinks_planted_by_another_user_are_never_followed(tmp_path, shared_dir, attacker, plant):
    root = str(tmp_path / "victim")
    os.makedirs(root)
    precious = tmp_path / "precious"
    precious.write_bytes(b"the victim's data\n")
    victim_dir = tmp_path / "victim-dir"
    victim_dir.mkdir()
    tier = tier_dir(shared_dir, os.path.abspath(root))
    if plant == "links inside":
        attacker(PLANT_LINKS, tier, str(precious))
    else:
        attacker(PLANT_DIR_LINK, tier, str(victim_dir))
    with CheckpointManager(root, staging=StagingOptions(local_dir=shared_dir)) as mgr:
        mgr.save(1, {"w": torch.ones(100_000)}).result()
        assert os.listdir(victim_dir) == []  # nothing created through the link
        assert precious.read_bytes() == b"the victim's data\n"  # not truncated, not overwritten
    assert precious.read_bytes() == b"the victim's data\n"
    assert os.path.islink(tier) or os.lstat(tier).st_uid != os.geteuid()  # the attacker's entry, left alone


def test_the_tier_is_a_private_directory(root, tmp_path):
    local = tmp_path / "shm"
    local.mkdir()
    with CheckpointManager(root, staging=StagingOptions(local_dir=str(local))) as mgr:
        mgr.save(1, {"w": torch.ones(10)}).result()
        st = os.lstat(tier_dir(str(local), mgr.root))
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()


def test_an_own_tier_directory_that_is_not_private_is_refused(root, tmp_path, caplog):
    local = tmp_path / "shm"
    local.mkdir()
    os.makedirs(root)
    tier = tier_dir(str(local), os.path.abspath(root))
    os.mkdir(tier)
    os.chmod(tier, 0o755)  # readable by every user: its checkpoints would be too
    with caplog.at_level(logging.WARNING, "ckptmgr"), \
            CheckpointManager(root, staging=StagingOptions(local_dir=str(local))) as mgr:
        assert "must be private" in caplog.text
        assert mgr._tier is None


def test_a_deleted_root_is_not_resurrected_from_the_tier(root, tmp_path):
    local = str(tmp_path / "shm")
    os.mkdir(local)
    proc = subprocess.Popen([sys.executable, WRITER, root, local, "hang"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "staged"
    assert proc.stdout.readline().strip() == "local"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert os.listdir(local)  # step 7 is in the tier, never written to the root
    shutil.rmtree(root)  # the user starts over
    with CheckpointManager(root, staging=StagingOptions(local_dir=local)) as mgr:
        assert mgr.steps() == []
        mgr.wait(timeout=30)
    assert not os.path.exists(os.path.join(root, "step_000000000007"))


def test_a_replaced_root_is_not_resurrected_either(root, tmp_path):
    local = str(tmp_path / "shm")
    os.mkdir(local)
    proc = subprocess.Popen([sys.executable, WRITER, root, local, "hang"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "staged"
    assert proc.stdout.readline().strip() == "local"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    shutil.rmtree(root)
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as other:  # a new run, elsewhere
        other.save(1, {"w": torch.ones(3)}).result()
    with CheckpointManager(root, staging=StagingOptions(local_dir=local)) as mgr:
        assert mgr.steps() == [1]
