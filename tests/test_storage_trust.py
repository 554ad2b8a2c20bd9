"""Local roots on hostile or shared storage: links and FIFOs planted in a root, leftovers that
are not ours, leftovers that cannot be removed, a second manager starting while a save is in
flight, read-only roots, and the root's identity."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import zygote
from conftest import assert_tree_equal

from ckptmgr import (
    CheckpointCorruptError,
    CheckpointManager,
    ConfigError,
    KeepLatest,
    SaveError,
    StagingOptions,
    StepNotFoundError,
    StorageError,
    WriteOptions,
)
from ckptmgr.format.naming import is_temp_name, step_name
from ckptmgr.storage import local as local_mod
from ckptmgr.storage import open_target

NO_TIER = StagingOptions(local_tier=False)
HERE = os.path.dirname(os.path.abspath(__file__))


def state_of(step: int, writer: int = 0, n: int = 5000) -> dict:
    g = torch.Generator().manual_seed(step * 1000 + writer)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(64, generator=g).bfloat16(), "step": step}


def mgr_of(root: str, **kw) -> CheckpointManager:
    kw.setdefault("staging", NO_TIER)
    return CheckpointManager(root, **kw)


def saved_root(root: str, steps=(1, 2)) -> str:
    with mgr_of(root) as m:
        for s in steps:
            m.save(s, state_of(s)).result()
    return root


def data_file(root: str, step: int) -> str:
    return os.path.join(root, step_name(step), "data-00000.safetensors")


# ----------------------------------------------------------------- symbolic links


def test_a_step_directory_linked_to_another_run_is_never_listed_read_or_deleted(tmp_path, caplog):
    other = saved_root(str(tmp_path / "other"), steps=(1,))
    before = sorted(os.listdir(os.path.join(other, step_name(1))))
    root = saved_root(str(tmp_path / "run"), steps=(5,))
    os.symlink(os.path.join(other, step_name(1)), os.path.join(root, step_name(1)))
    with mgr_of(root, retention=KeepLatest(1)) as m:
        assert m.steps() == [5]
        m.save(6, state_of(6)).result()
        m.wait()
        assert m.steps() == [6]
        with pytest.raises(StepNotFoundError, match="symbolic link"):
            m.restore(1)
        with pytest.raises(StorageError, match="symbolic link"):
            m._target.delete(1)
    assert sorted(os.listdir(os.path.join(other, step_name(1)))) == before  # the other run is intact
    with mgr_of(other) as m:
        assert_tree_equal(m.restore(1), state_of(1))


def test_a_protected_marker_that_is_a_link_creates_nothing_outside_the_root(tmp_path):
    root = saved_root(str(tmp_path / "run"))
    outside = tmp_path / "outside" / "planted"
    os.makedirs(outside.parent)
    os.symlink(outside, os.path.join(root, step_name(1), "protected"))
    with mgr_of(root) as m:
        with pytest.raises(StorageError, match="not a regular file"):
            m.protect(1)
        assert not m.is_protected(1)
    assert not outside.exists()


def test_data_files_and_manifests_that_are_links_are_refused(tmp_path):
    root = saved_root(str(tmp_path / "run"))
    copy = tmp_path / "copy.safetensors"
    shutil.copy(data_file(root, 2), copy)  # the very same bytes, out of the root
    os.unlink(data_file(root, 2))
    os.symlink(copy, data_file(root, 2))
    t = open_target(root)
    try:
        with pytest.raises(CheckpointCorruptError, match=r"symbolic link|not a regular file"):
            t.file_size(2, "data-00000.safetensors")
        with pytest.raises(CheckpointCorruptError, match="symbolic link"):
            t.read_into(2, "data-00000.safetensors", 0, [torch.empty(8, dtype=torch.uint8).numpy()])
        with pytest.raises(CheckpointCorruptError):
            t.path_of(2, "data-00000.safetensors")
        manifest = os.path.join(root, step_name(1), "manifest.json")
        shutil.copy(manifest, tmp_path / "manifest.json")
        os.unlink(manifest)
        os.symlink(tmp_path / "manifest.json", manifest)
        assert t.list_steps() == [1, 2]  # listed (it is there), but never read through the link
        with pytest.raises(CheckpointCorruptError, match="symbolic link"):
            t.read_manifest(1)
        with pytest.raises(StorageError):
            t.delete(1)
        assert os.path.exists(tmp_path / "manifest.json")
    finally:
        t.close()
    with mgr_of(root) as m, pytest.raises(CheckpointCorruptError):
        m.restore(2)
    # the one link that is read: to a regular file of the same step directory
    os.unlink(data_file(root, 2))
    shutil.copy(copy, os.path.join(root, step_name(2), "renamed.bin"))
    os.symlink("renamed.bin", data_file(root, 2))
    with mgr_of(root) as m:
        assert_tree_equal(m.restore(2), state_of(2))
        m._target.delete(2)  # the link and our files go; the file we did not write stays
    assert os.listdir(os.path.join(root, step_name(2))) == ["renamed.bin"]


def test_fifos_in_a_step_are_refused_without_blocking(tmp_path):
    root = saved_root(str(tmp_path / "run"))
    os.unlink(data_file(root, 2))
    os.mkfifo(data_file(root, 2))
    manifest = os.path.join(root, step_name(1), "manifest.json")
    os.unlink(manifest)
    os.mkfifo(manifest)
    # In a child process: opening a FIFO for reading blocks until a writer comes, forever.
    code = (
        "import numpy as np\n"
        "from ckptmgr.storage import open_target\n"
        "from ckptmgr import CheckpointCorruptError\n"
        f"t = open_target({root!r})\n"
        "for call in (lambda: t.file_size(2, 'data-00000.safetensors'),\n"
        "             lambda: t.read_into(2, 'data-00000.safetensors', 0, [np.empty(8, np.uint8)]),\n"
        "             lambda: t.read_manifest(1)):\n"
        "    try:\n"
        "        call()\n"
        "        print('read')\n"
        "    except CheckpointCorruptError as exc:\n"
        "        print('refused:', exc)\n"
        "t.close()\n")
    r = zygote.run([sys.executable, "-c", code], template="torch", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("refused:") and "FIFO" in line for line in lines), r.stdout
    v = zygote.run([sys.executable, "-m", "ckptmgr", "verify", root], template="torch", capture_output=True,
                   text=True, timeout=60)
    assert v.returncode != 0 and "FIFO" in v.stdout + v.stderr


# ------------------------------------------------------------------- leftovers


def test_leftover_clean_up_removes_exactly_our_own_names(tmp_path, caplog):
    root = saved_root(str(tmp_path / "run"), steps=(1,))
    names = {
        ".step_000000000007.tmp-deadbeef": False,  # 8 hex: not our pattern
        ".step_000000000007.tmp-" + "ab" * 16: False,  # 32 hex: not our pattern
        ".step_7.tmp-0123456789abcdef": False,  # step not in 12 digits
        "step_0000000000007": False,  # 13 digits
        ".step_000000000008.tmp-0123456789abcdef": True,  # ours, its writer gone
    }
    for name in names:
        os.makedirs(os.path.join(root, name))
        with open(os.path.join(root, name, "data-00000.safetensors"), "wb") as f:
            f.write(b"x")
    theirs = os.path.join(root, ".step_000000000009.tmp-fedcba9876543210")  # ours, with a foreign file in it
    os.makedirs(theirs)
    for n in ("data-00000.safetensors", "notes.txt"):
        open(os.path.join(theirs, n), "w").close()
    with caplog.at_level(logging.WARNING, "ckptmgr"), mgr_of(root) as m:
        assert m.steps() == [1]
    for name, removed in names.items():
        assert os.path.exists(os.path.join(root, name)) != removed, name
    assert sorted(os.listdir(theirs)) == ["notes.txt"]  # our file went, theirs stayed
    assert "notes.txt" in caplog.text and "did not write" in caplog.text


def _chattr(flag: str, path: str) -> bool:
    return subprocess.run(["chattr", flag, path], capture_output=True).returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs root")
def test_an_undeletable_leftover_is_reported_not_raised(tmp_path, caplog):
    root = saved_root(str(tmp_path / "run"), steps=(1,))
    stale = os.path.join(root, ".step_000000000004.tmp-0123456789abcdef")
    half_deleted = os.path.join(root, step_name(3))  # a delete interrupted after its manifest went
    for d in (stale, half_deleted):
        os.makedirs(d)
        open(os.path.join(d, "data-00000.safetensors"), "w").close()
    if not _chattr("+i", stale):
        pytest.skip("chattr +i is not supported on this filesystem")
    _chattr("+i", half_deleted)
    try:
        with caplog.at_level(logging.WARNING, "ckptmgr"), mgr_of(root) as m:
            assert m.steps() == [1]
            m.save(2, state_of(2)).result()
        assert "could not remove the leftover" in caplog.text and stale in caplog.text
        assert half_deleted in caplog.text
    finally:
        _chattr("-i", stale)
        _chattr("-i", half_deleted)
    with mgr_of(root) as m:  # removable again: the next start removes them
        assert m.steps() == [1, 2]
    assert not os.path.exists(stale) and not os.path.exists(half_deleted)


def test_a_second_manager_starting_never_removes_a_live_writers_temporary(tmp_path):
    root = str(tmp_path / "run")
    gate, inside = threading.Event(), threading.Event()
    real = local_mod._LocalStepWriter._write_file

    def held(self, *args, **kw):
        out = real(self, *args, **kw)
        inside.set()
        assert gate.wait(30)
        return out

    local_mod._LocalStepWriter._write_file = held
    try:
        with mgr_of(root) as writer:
            h = writer.save(3, state_of(3))
            assert inside.wait(30)
            temps = [n for n in os.listdir(root) if n.startswith(".step_")]
            assert len(temps) == 2  # the temporary and its lock file
            with mgr_of(root) as second:  # an evaluator, or a restarted job, starts meanwhile
                assert second.steps() == []
            assert sorted(n for n in os.listdir(root) if n.startswith(".step_")) == sorted(temps)
            gate.set()
            h.result(timeout=30)
    finally:
        local_mod._LocalStepWriter._write_file = real
    assert [n for n in os.listdir(root) if n.startswith(".step_")] == []
    with mgr_of(root) as m:
        assert_tree_equal(m.restore(3), state_of(3))


def test_a_second_process_starting_never_removes_a_live_writers_temporary(tmp_path):
    root = str(tmp_path / "run")
    code = (
        "import sys\n"
        f"sys.path.insert(0, {HERE!r})\n"
        "from test_storage_trust import mgr_of, state_of\n"
        "from ckptmgr.storage import local\n"
        "real = local._LocalStepWriter._write_file\n"
        "def held(self, *a, **k):\n"
        "    out = real(self, *a, **k)\n"
        "    print('writing', flush=True)\n"
        "    sys.stdin.readline()  # the test's gate: a line on the pipe\n"
        "    return out\n"
        "local._LocalStepWriter._write_file = held\n"
        f"with mgr_of({root!r}) as m:\n"
        "    m.save(4, state_of(4)).result()\n"
        "print('committed', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        with mgr_of(root) as second:
            assert second.steps() == []
        proc.stdin.write("go\n")
        proc.stdin.close()  # (a later wait would see the end of the pipe at once)
        assert proc.stdout.readline().strip() == "committed"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    with mgr_of(root) as m:
        assert m.steps() == [4]
        assert_tree_equal(m.restore(4), state_of(4))


def test_a_temporary_of_a_writer_on_another_machine_lives_until_its_heartbeat_is_stale(tmp_path):
    from ckptmgr.storage.lease import LEASE_STALE_S, Lease

    root = saved_root(str(tmp_path / "run"), steps=(1,))
    name = ".step_000000000002.tmp-0123456789abcdef"
    os.makedirs(os.path.join(root, name))
    open(os.path.join(root, name, "data-00000.safetensors"), "w").close()
    lock = os.path.join(root, name + ".lock")
    with open(lock, "wb") as f:  # as an NFS client with local locks would leave it: lock free
        f.write(Lease("elsewhere", "other-boot/pid:[1]", 4242, 1, "ab" * 8, time.time()).to_bytes())
    with mgr_of(root):
        pass
    assert os.path.exists(os.path.join(root, name))  # heartbeat fresh: another machine's live writer
    old = time.time() - LEASE_STALE_S - 60
    os.utime(lock, (old, old))
    with mgr_of(root):
        pass
    assert not os.path.exists(os.path.join(root, name)) and not os.path.exists(lock)


@pytest.mark.parametrize("claim", ["whole", "named", "whole-without-proc"])
def test_a_lock_file_is_locked_and_holds_its_lease(tmp_path, monkeypatch, claim):
    import errno
    import fcntl

    from ckptmgr.storage.commit import rename as commit
    from ckptmgr.storage.lease import Lease, LeaseKeeper

    if claim == "named":
        monkeypatch.setattr(commit, "_TMPFILE", 0)
    elif not commit._TMPFILE:
        pytest.skip("no O_TMPFILE on this platform")
    if claim == "whole-without-proc":  # the anonymous file cannot be linked: claimed by name instead
        def no_proc(src, dst, **kw):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", src)
        monkeypatch.setattr(commit.os, "link", no_proc)
    claims: list[int] = []
    real_claim = commit._claim_whole
    monkeypatch.setattr(commit, "_claim_whole", lambda *a: claims.append(real_claim(*a)) or claims[-1])
    fds = len(os.listdir("/proc/self/fd"))
    root = str(tmp_path)
    writer = commit.RenameCommit(root, 5, LeaseKeeper("test", 60.0))
    # the path taken: the anonymous file linked into place, or the claim by name
    assert claims == ([writer._lock_fd] if claim == "whole" else [-1])
    try:
        lock = writer.location + ".lock"
        with open(lock, "rb") as f:
            lease = Lease.from_bytes(f.read())
        assert lease is not None and lease.pid == os.getpid()
        fd = os.open(lock, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        with pytest.raises(FileExistsError):  # a second claim of the same name fails, as O_EXCL would
            writer._claim(lease)
    finally:
        writer.abort()
    assert os.listdir(root) == []
    assert len(os.listdir("/proc/self/fd")) == fds  # no descriptor left open on any path


@pytest.mark.parametrize("claim", ["whole", "named"])
def test_a_writer_killed_while_claiming_its_step(tmp_path, claim):
    """Killed while writing its lease: a lock file claimed whole never appeared, so the next
    start finds nothing; one created by name first is empty and unlocked, which the clean-up
    cannot tell from a live writer's, so it stays until its heartbeat is stale."""
    from ckptmgr.storage.commit import rename as commit
    from ckptmgr.storage.lease import LEASE_STALE_S

    if claim == "whole" and not commit._TMPFILE:
        pytest.skip("no O_TMPFILE on this platform")
    root = saved_root(str(tmp_path / "run"), steps=(1,))
    code = (
        "import sys, time\n"
        f"sys.path.insert(0, {HERE!r})\n"
        "from test_storage_trust import mgr_of, state_of\n"
        "from ckptmgr.storage.commit import rename as commit\n"
        + ("commit._TMPFILE = 0\n" if claim == "named" else "")
        + "def stuck(*args):\n"
        "    print('claiming', flush=True)\n"
        "    time.sleep(600)\n"
        "commit.pwrite_all = stuck\n"
        f"with mgr_of({root!r}) as m:\n"
        "    m.save(2, state_of(2)).result()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "claiming"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    with mgr_of(root) as m:
        assert m.steps() == [1]
    left = [n for n in os.listdir(root) if n.startswith(".step_")]
    if claim == "whole":
        assert left == []
        return
    assert len(left) == 1 and left[0].endswith(".lock") and os.path.getsize(os.path.join(root, left[0])) == 0
    old = time.time() - LEASE_STALE_S - 60
    os.utime(os.path.join(root, left[0]), (old, old))
    with mgr_of(root):
        pass
    assert [n for n in os.listdir(root) if n.startswith(".step_")] == []


def test_the_commit_checks_every_file_is_there(tmp_path):
    root = str(tmp_path / "run")
    gate, inside = threading.Event(), threading.Event()
    real = local_mod._LocalStepWriter.commit

    def held(self, manifest):
        inside.set()
        assert gate.wait(30)
        return real(self, manifest)

    local_mod._LocalStepWriter.commit = held
    try:
        with mgr_of(root, write_options=WriteOptions(max_file_bytes=30_000, io_threads=2)) as m:
            h = m.save(1, state_of(1, n=20_000))
            assert inside.wait(30)
            temp = next(n for n in os.listdir(root) if is_temp_name(n))
            files = sorted(os.listdir(os.path.join(root, temp)))
            assert len(files) >= 2
            os.unlink(os.path.join(root, temp, files[0]))  # lost before the commit
            gate.set()
            with pytest.raises(SaveError, match="missing"):
                h.result(timeout=30)
            assert m.steps() == []
    finally:
        local_mod._LocalStepWriter.commit = real


def test_steps_out_of_the_named_range_are_refused_by_targets(tmp_path):
    t = open_target(str(tmp_path / "run"))
    try:
        for bad in (10**12, -1, True, 1.0):
            with pytest.raises(ConfigError):
                t.begin(bad)
    finally:
        t.close()


# --------------------------------------------------------------- read-only roots


def _reader_script(root: str) -> str:
    """The reading process: ckptmgr and torch only (another user may not reach the test tools)."""
    return (
        "import json, torch\n"
        "from ckptmgr import CheckpointManager, ConfigError\n"
        "def state_of(step):\n"
        "    g = torch.Generator().manual_seed(step * 1000)\n"
        "    return {'w': torch.randn(5000, generator=g), 'b': torch.randn(64, generator=g).bfloat16(), 'step': step}\n"
        f"m = CheckpointManager({root!r})\n"
        "out = {'read_only': m.read_only, 'steps': m.steps(), 'meta': m.metadata(2)}\n"
        "got, want = m.restore(), state_of(2)\n"
        "assert got['step'] == 2 and all(torch.equal(got[k], want[k]) for k in ('w', 'b'))\n"
        "refused = []\n"
        "for name, call in [('save', lambda: m.save(3, state_of(3))), ('protect', lambda: m.protect(1)),\n"
        "                   ('unprotect', lambda: m.unprotect(1)), ('retention', m.apply_retention)]:\n"
        "    try:\n"
        "        call()\n"
        "    except ConfigError as exc:\n"
        "        refused.append(name if 'read-only' in str(exc) else str(exc))\n"
        "out['refused'] = refused\n"
        "m.close()\n"
        "print(json.dumps(out))\n")


def _tree(path: str) -> list[tuple[str, int]]:
    return sorted((os.path.relpath(os.path.join(d, f), path), os.lstat(os.path.join(d, f)).st_mode)
                  for d, dirs, files in os.walk(path) for f in files + dirs)


def _check_reader(out: dict) -> None:
    assert out["read_only"] is True and out["steps"] == [1, 2] and out["meta"] == {"loss": 2}
    assert out["refused"] == ["save", "protect", "unprotect", "retention"]


def _saved_for_reading(root: str) -> None:
    with mgr_of(root) as m:
        m.save(1, state_of(1), metadata={"loss": 1}).result()
        m.save(2, state_of(2), metadata={"loss": 2}).result()
    # a leftover a writable manager would remove: a reader must not touch it
    os.makedirs(os.path.join(root, ".step_000000000003.tmp-0123456789abcdef"))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="runs the reader as another user (nobody) through setpriv, as root")
def test_a_root_with_its_write_bits_removed_is_opened_read_only(tmp_path):
    base = tempfile.mkdtemp(prefix="ckptmgr-ro-")  # reachable by another user
    try:
        os.chmod(base, 0o755)
        root = os.path.join(base, "ckpt")
        _saved_for_reading(root)
        for d, _dirs, files in os.walk(root):
            for f in files:
                os.chmod(os.path.join(d, f), 0o444)
            os.chmod(d, 0o555)
        before = _tree(root)
        shm_before = set(os.listdir("/dev/shm"))
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c"]
        probe = subprocess.run([*nobody, "import ckptmgr, torch"], capture_output=True, text=True, timeout=120)
        if probe.returncode:
            pytest.skip(f"this Python environment is not readable by another user: {probe.stderr.strip()[-200:]}")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                            _reader_script(root)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "HOME": base})
        assert r.returncode == 0, r.stderr
        _check_reader(json.loads(r.stdout.splitlines()[-1]))
        assert _tree(root) == before
        assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("ckptmgr-65534-")]
    finally:
        for d, _, _ in os.walk(base):
            os.chmod(d, 0o755)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i needs root")
def test_an_immutable_root_is_opened_read_only(tmp_path):
    root = str(tmp_path / "ckpt")
    _saved_for_reading(root)
    dirs = [d for d, _, _ in os.walk(root)]
    if not _chattr("+i", root):
        pytest.skip("chattr +i is not supported on this filesystem")
    for d in dirs[1:]:
        _chattr("+i", d)
    try:
        before = _tree(root)
        r = zygote.run([sys.executable, "-c", _reader_script(root)], template="torch", capture_output=True, text=True,
                       timeout=120)
        assert r.returncode == 0, r.stderr
        _check_reader(json.loads(r.stdout.splitlines()[-1]))
        assert _tree(root) == before
    finally:
        for d in dirs:
            _chattr("-i", d)


def test_read_only_never_creates_the_root(tmp_path):
    missing = tmp_path / "nothing-here"
    with pytest.raises(StepNotFoundError):
        CheckpointManager(str(missing), read_only=True)
    assert not missing.exists()
    root = saved_root(str(tmp_path / "run"), steps=(1,))
    with CheckpointManager(root, read_only=True) as m:  # writable, but asked to only read
        assert m.steps() == [1] and m.read_only
        with pytest.raises(ConfigError, match="read-only"):
            m.save(2, state_of(2))
    with pytest.raises(ConfigError, match="read_only"):
        CheckpointManager(root, read_only="yes")


# ----------------------------------------------------------------- root identity


def test_the_root_identity_is_written_once_with_the_first_save(tmp_path):
    root = str(tmp_path / "run")
    t = open_target(root)
    assert t.root_id() is None
    t.close()
    with mgr_of(root) as m:
        assert m._target.root_id() is None  # nothing committed yet
        m.save(1, state_of(1)).result()
        first = m._target.root_id()
    assert first is not None and len(first) == 32
    with open(os.path.join(root, ".ckptmgr-root-id")) as f:
        assert f.read().strip() == first
    with mgr_of(root) as m:
        m.save(2, state_of(2)).result()
        assert m._target.root_id() == first  # never overwritten
    ids = []
    fresh = str(tmp_path / "fresh")
    targets = [open_target(fresh) for _ in range(4)]
    barrier = threading.Barrier(4)

    def make(t):
        barrier.wait(10)
        ids.append(t.root_id(create=True))

    threads = [threading.Thread(target=make, args=(t,)) for t in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    for t in targets:
        t.close()
    assert len(ids) == 4 and len(set(ids)) == 1  # one identity, whoever won
    assert sorted(os.listdir(fresh)) == [".ckptmgr-root-id"]  # no temporaries left
    with open(os.path.join(fresh, ".ckptmgr-root-id"), "w") as f:
        f.write("not an id\n")
    t = open_target(fresh, read_only=True)
    assert t.root_id(create=True) is None  # garbage is no identity; a reader writes none
    t.close()


# --------------------------------------------------------- several processes, one root


def test_two_processes_share_a_local_root(tmp_path):
    root = str(tmp_path / "shared")
    bdir = tmp_path / "barrier"
    bdir.mkdir()
    procs = [zygote.Popen([sys.executable, os.path.join(HERE, "root_sharer.py"), root, str(w), "8", str(w),
                           str(bdir), "2"], template="torch", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
             for w in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"{out}\n{err[-3000:]}"
    from root_sharer import same, shared_state

    reports = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    assert sum(r["collided"] for r in reports) > 0  # both saved the same step at least once
    with mgr_of(root) as m:
        steps = m.steps()
        assert steps
        for step in steps:
            got = m.restore(step)
            assert same(got, shared_state(step, got["writer"])), step
    assert sorted(n for n in os.listdir(root) if not n.startswith("step_")) == [".ckptmgr-root-id"]


class GatedFS:
    """An in-memory fsspec filesystem whose writes of ``data-00001`` files wait for a gate."""

    gate: threading.Event | None = None
    inside = threading.Event()


def _gated_fs():
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class _FS(MemoryFileSystem):
        protocol = "gated"

        def _open(self, path, mode="rb", **kw):
            if "w" in mode and "data-00001" in path and GatedFS.gate is not None:
                GatedFS.inside.set()
                assert GatedFS.gate.wait(30)
            return super()._open(path, mode, **kw)

    fsspec.register_implementation("gated", _FS, clobber=True)
    _FS.store.clear()
    _FS.pseudo_dirs.clear()
    _FS.pseudo_dirs.append("")
    return _FS()


def test_fsspec_a_second_manager_keeps_a_save_in_flight_and_the_commit_checks_files():
    fs = _gated_fs()
    two_files = WriteOptions(max_file_bytes=30_000, io_threads=2)
    GatedFS.gate, GatedFS.inside = threading.Event(), threading.Event()
    try:
        with mgr_of("gated://run", write_options=two_files) as writer:
            h = writer.save(1, state_of(1, n=20_000))
            assert GatedFS.inside.wait(30)
            deadline = time.monotonic() + 30
            while not fs.glob("gated://run/step_000000000001/data-00000.*.safetensors"):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with mgr_of("gated://run") as evaluator:  # its start-up must leave the save alone
                assert evaluator.steps() == []
            assert fs.glob("gated://run/step_000000000001/data-00000.*.safetensors")  # (named with its claim)
            assert fs.exists("gated://run/step_000000000001/writer.lease")
            GatedFS.gate.set()
            h.result(timeout=30)
            assert_tree_equal(writer.restore(1), state_of(1, n=20_000))
        # now lose a file between its write and the commit: nothing is committed
        GatedFS.gate, GatedFS.inside = threading.Event(), threading.Event()
        with mgr_of("gated://run", write_options=two_files) as writer:
            h = writer.save(2, state_of(2, n=20_000))
            assert GatedFS.inside.wait(30)
            deadline = time.monotonic() + 30
            while not (written := fs.glob("gated://run/step_000000000002/data-00000.*.safetensors")):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            fs.rm_file(written[0])
            GatedFS.gate.set()
            with pytest.raises(SaveError, match="missing"):
                h.result(timeout=30)
            assert writer.steps() == [1]
    finally:
        GatedFS.gate = None


@pytest.mark.parametrize("form", ["plain", "file:", "file://", "relative", "tilde"])
def test_local_roots_resolve_to_the_same_directory_in_every_form(tmp_path, monkeypatch, form):
    """A plain path opens without fsspec; "file:" forms go through it; all name one directory."""
    from ckptmgr.storage import open_target

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    want = tmp_path / "ckpt"
    root = {"plain": str(want), "file:": f"file:{want}", "file://": f"file://{want}", "relative": "ckpt",
            "tilde": "~/ckpt"}[form]
    target = open_target(root)
    try:
        assert os.path.realpath(target.path) == os.path.realpath(want)
        assert want.is_dir() and not (tmp_path / "file:").exists()
    finally:
        target.io_pool.shutdown()
