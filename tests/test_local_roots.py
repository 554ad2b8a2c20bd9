"""Local roots shared with other processes and users (issue 37, defects 4, 5, 8 and 10).

Real processes, real permissions: a second process held at its write by a pipe; a reader
that drops to uid 65534 (tests here run as root, which file permissions do not stop); an
immutable step (``chattr +i``: EPERM even for root) for retention. A power loss cannot be
simulated: the root's durability is tested by recording, around the real ``os.fsync``,
which directories were synced and when.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest
import torch

from ckptmgr import CheckpointManager, KeepLatest, SaveError, StagingOptions, StepExistsError, StorageError
from ckptmgr.storage import open_target

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "local_root_worker.py")
NO_TIER = StagingOptions(local_tier=False)
sys.path.insert(0, HERE)
from local_root_worker import NOBODY, state_of  # noqa: E402


def mgr_of(root: str, **kw) -> CheckpointManager:
    kw.setdefault("staging", NO_TIER)
    return CheckpointManager(root, **kw)


# ------------------------------------------------------------ defect 4: a step being written


def test_a_step_another_process_writes_is_refused_before_anything_is_written(tmp_path):
    root = str(tmp_path / "ckpt")
    with mgr_of(root) as m:
        m.save(1, state_of(1, "main")).result()
    held = subprocess.Popen([sys.executable, WORKER, "hold", root, "5"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "writing", held.stderr.read()  # (EOF if it died: fails)
        before = sorted(os.listdir(root))
        assert any(n.startswith(".step_000000000005.tmp-") for n in before)  # its claim
        t = open_target(root)
        try:
            with pytest.raises(StepExistsError, match=rf"step 5 is being written by pid {held.pid} "):
                t.begin(5)
        finally:
            t.close()
        with mgr_of(root) as m:
            with pytest.raises(SaveError, match=rf"being written by pid {held.pid}") as info:
                m.save(5, state_of(5, "main")).result(timeout=60)
            assert isinstance(info.value.__cause__, StepExistsError)
            assert sorted(os.listdir(root)) == before  # nothing of ours written, nothing left
            m.save(6, state_of(6, "main")).result(timeout=60)  # other steps: as usual
        held.stdin.write("go\n")
        held.stdin.flush()
        out, err = held.communicate(timeout=120)
    finally:
        if held.poll() is None:
            held.kill()
            held.wait(30)
    assert held.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {"committed": True, "error": ""}  # the first writer wins
    with mgr_of(root, read_only=True) as m:
        assert m.steps() == [1, 5, 6]
        assert torch.equal(m.restore(5)["w"], state_of(5, "held")["w"])


def test_other_ranks_of_a_job_and_dead_writers_are_no_conflict(tmp_path):
    root = str(tmp_path / "ckpt")
    t = open_target(root)
    try:
        a = t.begin(3, "data-r00000-")
        b = t.begin(3, "data-r00001-")  # another rank of the same job: its own share
        with pytest.raises(StepExistsError, match=r"being written by pid \d+ on .* \(this process\)"):
            t.begin(3, "data-r00001-")  # the same rank twice: two jobs
        with pytest.raises(StepExistsError, match="being written"):
            t.begin(3)  # the whole step, while ranks write theirs
        a.abort()
        b.abort()
        c = t.begin(3)  # every claim released
        c.abort()
        # a writer killed mid-save leaves its claim, unlocked: no conflict
        p = subprocess.Popen([sys.executable, WORKER, "hold", root, "4"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "writing", p.stderr.read()
        finally:
            p.kill()
            p.wait(30)
        d = t.begin(4)
        d.abort()
    finally:
        t.close()


# ------------------------------------------------------ defect 5: a step this user cannot read


@pytest.fixture
def nobody_dir():
    """A directory that uid 65534 owns and reaches (pytest's tmp_path is private to root)."""
    d = tempfile.mkdtemp(prefix="ckptmgr-test-", dir="/tmp")  # (not root: permissions apply to this user)
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_one_unreadable_step_leaves_the_root_and_the_others_usable(nobody_dir):
    root = os.path.join(nobody_dir, "ckpt")
    with mgr_of(root) as m:
        for s in (1, 2, 3):
            m.save(s, state_of(s, "main")).result()
    if os.geteuid() == 0:
        for dirpath, dirs, files in os.walk(root):
            for n in [dirpath, *(os.path.join(dirpath, f) for f in dirs + files)]:
                os.chown(n, NOBODY, NOBODY)
    step3 = os.path.join(root, "step_000000000003")
    os.chmod(step3, 0)  # its owner cannot read it either (nobody has no capabilities)
    try:
        r = subprocess.run([sys.executable, WORKER, "nobody", root], capture_output=True, text=True, timeout=300)
    finally:
        os.chmod(step3, 0o755)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["uid"] == (NOBODY if os.geteuid() == 0 else os.geteuid())
    for mode in ("rw", "ro"):
        got = out[mode]
        assert got["steps"] == [1, 2]
        assert got["restored"] == {"1": True, "2": True}
        assert got["latest"] == 2
        assert list(got["skipped"]) == ["3"] and "Permission denied" in got["skipped"]["3"]
        assert got["stats"] == 1
    assert r.stderr.count("skipping step 3:") == 2  # once per manager, though each listed twice
    ls = out["ls"]
    assert ls["code"] == 0, ls
    assert [row["step"] for row in json.loads(ls["stdout"])["steps"]] == [1, 2]
    assert "skipping step 3:" in ls["stderr"] and "Permission denied" in ls["stderr"]


# ------------------------------------------------------------- defect 8: the root is synced


def test_the_directories_the_manager_creates_are_synced(tmp_path, monkeypatch):
    synced: list[tuple[int, int]] = []
    real_fsync = os.fsync

    def recording_fsync(fd):  # the real call, recorded when it syncs a directory
        st = os.fstat(fd)
        real_fsync(fd)
        if stat.S_ISDIR(st.st_mode):
            synced.append((st.st_dev, st.st_ino))

    root = tmp_path / "a" / "b" / "ckpt"
    monkeypatch.setattr(os, "fsync", recording_fsync)
    with mgr_of(str(root)) as m:
        ids = {p: (s.st_dev, s.st_ino) for p in (tmp_path, tmp_path / "a", tmp_path / "a" / "b", root)
               for s in [os.stat(p)]}
        assert all(i in synced for i in ids.values()), {str(p): i in synced for p, i in ids.items()}
        del synced[:]
        m.save(1, state_of(1, "main")).result()
    with mgr_of(str(root)) as m:  # it exists now: nothing more to sync at the start
        assert ids[tmp_path] not in synced and ids[tmp_path / "a"] not in synced


def test_the_root_is_synced_as_the_kernel_sees_it(tmp_path):
    """The same, from the system calls of a real process (strace): after the last mkdir,
    an fsync of every directory made and of the parent that existed."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    trace = tmp_path / "trace"
    code = ("import sys; from ckptmgr.storage.local import LocalTarget\n"
            "LocalTarget(sys.argv[1]).close()")
    r = subprocess.run(["strace", "-f", "-y", "-qq", "-e", "trace=mkdir,mkdirat,fsync", "-o", str(trace),
                        sys.executable, "-c", code, str(tmp_path / "a" / "b" / "ckpt")],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr[-2000:]
    calls = [line.split(None, 1)[1] for line in trace.read_text().splitlines() if str(tmp_path) in line]
    made = [c for c in calls if c.startswith("mkdir") and c.endswith("= 0")]
    assert len(made) == 3, calls
    after = calls[calls.index(made[-1]):]
    for d in (tmp_path, tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "ckpt"):
        assert any(c.startswith("fsync(") and f"<{d}>)" in c and c.endswith("= 0") for c in after), (d, calls)


def test_a_root_that_exists_and_is_not_a_directory_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    for path in (tmp_path / "f", tmp_path / "f" / "ckpt"):
        with pytest.raises(StorageError, match=r"not a directory|cannot create"):
            mgr_of(str(path))


# ---------------------------------------------------- defect 10: a step that cannot be deleted


def _chattr(flag: str, path: str) -> bool:
    return subprocess.run(["chattr", flag, path], capture_output=True).returncode == 0 if shutil.which("chattr") \
        else False


@pytest.fixture
def immutable():
    """Make paths immutable (``chattr +i``: unlink and rename fail with EPERM, for root too);
    undone at teardown."""
    made: list[str] = []

    def make(path: str) -> None:
        if not _chattr("+i", path):
            pytest.skip(f"chattr +i is not available on {path}'s filesystem or to this user")
        made.append(path)

    yield make
    for p in made:
        _chattr("-i", p)


def test_a_step_that_cannot_be_deleted_does_not_stop_retention(tmp_path, immutable, caplog):
    root = str(tmp_path / "ckpt")
    with mgr_of(root) as m:
        for s in (1, 2, 3):
            m.save(s, state_of(s, "main")).result()
    stuck = os.path.join(root, "step_000000000001")
    immutable(stuck)  # its manifest cannot be unlinked: EPERM
    caplog.set_level(logging.WARNING, logger="ckptmgr")
    with mgr_of(root, retention=KeepLatest(1)) as m:
        with pytest.raises(StorageError) as info:
            m.apply_retention()
        assert m.steps() == [1, 3]  # step 2 deleted all the same
        assert re.search("could not delete step 1 .*Operation not permitted", str(info.value))
        assert list(m.skipped_steps()) == [1] and "cannot be deleted" in m.skipped_steps()[1]
        m.save(4, state_of(4, "main")).result()
        m.save(5, state_of(5, "main")).result()
        m.wait()  # told once: later runs skip it quietly
        m.apply_retention()
        assert m.steps() == [1, 5]
        assert m.stats()["deleted"] == 3 and m.stats()["skipped_steps"] == 1
    assert sum("could not delete step 1" in r.getMessage() for r in caplog.records) == 1
    _chattr("-i", stuck)
    with mgr_of(root, retention=KeepLatest(1)) as m:  # fixed by the operator: deleted at the next run
        m.apply_retention()
        assert m.steps() == [5] and m.skipped_steps() == {}


def test_a_step_whose_manifest_cannot_be_read_is_kept_and_reported_once(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    with mgr_of(root) as m:
        for s in (1, 2, 3):
            m.save(s, state_of(s, "main")).result()
    manifest = os.path.join(root, "step_000000000001", "manifest.json")
    os.unlink(manifest)
    os.mkdir(manifest)  # damaged: a directory where the manifest was
    caplog.set_level(logging.WARNING, logger="ckptmgr")
    with mgr_of(root, retention=KeepLatest(1)) as m:
        m.apply_retention()
        m.apply_retention()
        assert m.steps() == [1, 3]
        assert sum("keeping step 1" in r.getMessage() for r in caplog.records) == 1
        assert "manifest cannot be read" in m.skipped_steps()[1]


def test_directories_another_process_made_meanwhile_are_synced_too(tmp_path, monkeypatch):
    """Two processes opening a new root at once: the one whose mkdir finds the directory made
    meanwhile still syncs it (the other may die before its own fsync)."""
    from ckptmgr.storage import posix

    synced: list[tuple[int, int]] = []
    real_fsync, real_mkdir = os.fsync, os.mkdir

    def recording_fsync(fd):
        st = os.fstat(fd)
        real_fsync(fd)
        if stat.S_ISDIR(st.st_mode):
            synced.append((st.st_dev, st.st_ino))

    def raced_mkdir(path, mode=0o777):  # the other process's mkdir lands first
        real_mkdir(path, mode)
        raise FileExistsError(17, "File exists", path)

    root = tmp_path / "a" / "ckpt"
    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "mkdir", raced_mkdir)
    assert posix.makedirs_durable(str(root)) == []  # this process created nothing...
    monkeypatch.undo()
    for p in (tmp_path, tmp_path / "a", root):  # ...and synced all it found missing
        s = os.stat(p)
        assert (s.st_dev, s.st_ino) in synced, p


def test_a_lock_file_held_elsewhere_is_waited_for_within_a_bound(tmp_path):
    """The claim's fallback (no anonymous files, as on NFS) waits for its new lock file with a
    bound: a holder that never lets go fails the claim, it does not hang the save."""
    import fcntl

    from ckptmgr.errors import CkptTimeoutError
    from ckptmgr.storage.commit.rename import _lock_within

    path = tmp_path / "lock"
    path.write_bytes(b"")
    holder = os.open(path, os.O_RDWR)
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # (another open file: flock conflicts as across processes)
        with pytest.raises(CkptTimeoutError, match="stayed locked"):
            _lock_within(fd, str(path), 0.2)
        fcntl.flock(holder, fcntl.LOCK_UN)
        _lock_within(fd, str(path), 0.2)  # free: taken at once
    finally:
        os.close(fd)
        os.close(holder)
