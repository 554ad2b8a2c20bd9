"""The directory replace's pieces in-process: exchange, the fallback's old copy and its
recovery at start-up, and where temporaries go (the kill tests are test_dir_replace_crash.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptmgr.storage.commit import directory as _dirreplace
from ckptmgr.storage.commit.directory import OLD_RE, old_name, recover, replace_dir, scratch_dir


def _dir(path, content):
    os.makedirs(path)
    with open(os.path.join(path, "f"), "w") as f:
        f.write(content)


def _content(path):
    with open(os.path.join(path, "f")) as f:
        return f.read()


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=60)
    return p.pid


@pytest.mark.parametrize("use_exchange", [True, False])
def test_replace_dir_over_an_existing_directory(tmp_path, use_exchange):
    _dir(tmp_path / "step-1", "old")
    _dir(tmp_path / ".tmp", "new")
    replace_dir(str(tmp_path / ".tmp"), str(tmp_path / "step-1"), use_exchange=use_exchange)
    assert _content(tmp_path / "step-1") == "new"
    assert os.listdir(tmp_path) == ["step-1"]


def test_replace_dir_onto_a_free_name(tmp_path):
    _dir(tmp_path / ".tmp", "new")
    replace_dir(str(tmp_path / ".tmp"), str(tmp_path / "step-1"))
    assert os.listdir(tmp_path) == ["step-1"] and _content(tmp_path / "step-1") == "new"


def test_exchange_swaps_two_directories(tmp_path):
    _dir(tmp_path / "a", "a")
    _dir(tmp_path / "b", "b")
    if not _dirreplace.exchange(str(tmp_path / "a"), str(tmp_path / "b")):
        pytest.skip("this file system has no RENAME_EXCHANGE")
    assert _content(tmp_path / "a") == "b" and _content(tmp_path / "b") == "a"


def test_recover_restores_a_missing_final_and_drops_a_superseded_old_copy(tmp_path):
    pid = _dead_pid()
    _dir(old_name(str(tmp_path), str(tmp_path / "checkpoints" / "checkpoint_3"), pid), "old3")
    os.makedirs(tmp_path / "checkpoints")
    _dir(tmp_path / "checkpoints" / "checkpoint_4", "new4")
    _dir(old_name(str(tmp_path), str(tmp_path / "checkpoints" / "checkpoint_4"), pid), "old4")
    alive = old_name(str(tmp_path), str(tmp_path / "checkpoints" / "checkpoint_5"))  # this process: in use
    _dir(alive, "old5")
    assert recover(str(tmp_path)) == [str(tmp_path / "checkpoints" / "checkpoint_3")]
    assert _content(tmp_path / "checkpoints" / "checkpoint_3") == "old3"
    assert _content(tmp_path / "checkpoints" / "checkpoint_4") == "new4"
    assert sorted(os.listdir(tmp_path)) == sorted(["checkpoints", os.path.basename(alive)])


def test_recover_ignores_names_that_lead_elsewhere(tmp_path):
    pid = _dead_pid()
    (tmp_path / "s").mkdir()
    for rel in ("..%2Fescaped", "%2Fabs", "a%2F%2Fb", "."):
        name = f".ckptmgr-{pid}-0123456789abcdef.old-{rel}"
        assert OLD_RE.match(name)
        _dir(tmp_path / "s" / name, "x")
    assert recover(str(tmp_path / "s")) == []
    assert not (tmp_path / "escaped").exists() and not os.path.exists("/abs")
    assert len(os.listdir(tmp_path / "s")) == 4


def test_old_name_refuses_a_final_outside_the_scratch(tmp_path):
    with pytest.raises(OSError, match="not under"):
        old_name(str(tmp_path / "a"), str(tmp_path / "b" / "c"))


def test_scratch_dir_is_the_parent_or_the_directory_above(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert scratch_dir(str(tmp_path / "checkpoints")) == str(tmp_path / "checkpoints")
    assert scratch_dir(str(tmp_path / "checkpoints"), outside=True) == str(tmp_path)


def test_a_failure_between_the_renames_puts_the_old_copy_back(tmp_path, monkeypatch):
    """Without the exchange, the old copy is renamed away first: when the sync of the scratch
    directory fails then, the old copy goes back under the final name before the error is raised
    (else the name stays empty for the rest of the process: recover() skips its own pid)."""
    _dir(tmp_path / "step-1", "old")
    _dir(tmp_path / ".tmp", "new")

    def failing_sync(path):
        raise OSError(5, "Input/output error (injected)", path)

    monkeypatch.setattr(_dirreplace, "fsync_dir", failing_sync)
    with pytest.raises(OSError, match="injected"):
        replace_dir(str(tmp_path / ".tmp"), str(tmp_path / "step-1"), use_exchange=False)
    assert _content(tmp_path / "step-1") == "old"
