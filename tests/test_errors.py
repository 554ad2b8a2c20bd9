"""Bad input gets a clear error, raised before anything is written; nothing saved is damaged."""

import os
import stat

import pytest
import torch

import ckptmgr
from ckptmgr import (
    CheckpointManager,
    ConfigError,
    SaveError,
    StateMismatchError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    UnsupportedValueError,
    WriteOptions,
)


class Opaque:
    pass


def test_unsupported_value_names_its_path_and_writes_nothing(root):
    opt_state = {"state": {3: {"exp_avg": torch.zeros(2), "foo": Opaque()}}}
    with CheckpointManager(root) as mgr:
        with pytest.raises(UnsupportedValueError, match=r"state\['optim'\]\['state'\]\[3\]\['foo'\]") as info:
            mgr.save(1, {"optim": opt_state})
        assert isinstance(info.value, TypeError)
        assert "allow_pickle" in str(info.value)
        assert mgr.steps() == []
    assert os.listdir(root) == []


@pytest.mark.parametrize(("value", "what"), [
    ({1, 2}, "builtins.set"),
    (b"raw", "builtins.bytes"),
    (torch.zeros(2).to_sparse(), "layout"),
    (torch.empty(2, device="meta"), "meta"),
    (torch.zeros(2, dtype=torch.complex128), "complex128"),
])
def test_each_unsupported_kind_is_refused(root, value, what):
    with CheckpointManager(root) as mgr, pytest.raises(UnsupportedValueError, match=what):
        mgr.save(1, {"x": [0, value]})
    assert os.listdir(root) == []


def test_pickle_only_when_allowed(root):
    with CheckpointManager(root, allow_pickle=True) as mgr:
        mgr.save(1, {"s": {1, 2}}).result()
        assert mgr.restore()["s"] == {1, 2}
    with CheckpointManager(root) as mgr, pytest.raises(ckptmgr.CheckpointCorruptError, match="allow_pickle"):
        mgr.restore(1)


@pytest.mark.parametrize("step", [-1, 1.0, "3", True, None])
def test_bad_step(root, step):
    with CheckpointManager(root) as mgr, pytest.raises(ConfigError, match="step"):
        mgr.save(step, {})


def test_committed_step_is_never_overwritten(root):
    with CheckpointManager(root) as mgr:
        mgr.save(5, {"x": torch.ones(2)}).result()
        with pytest.raises(StepExistsError):
            mgr.save(5, {"x": torch.zeros(2)})
        assert torch.equal(mgr.restore(5)["x"], torch.ones(2))


def test_unknown_protocol_and_bad_options(tmp_path):
    with pytest.raises(ConfigError, match="nosuchproto"):
        CheckpointManager("nosuchproto://bucket/x")
    with pytest.raises(ConfigError, match="storage_options"):
        CheckpointManager(str(tmp_path), storage_options={"anon": True})
    with pytest.raises(ConfigError, match="chunk_size"):
        WriteOptions(chunk_size=1000)
    with pytest.raises(ConfigError, match="io_threads"):
        WriteOptions(io_threads=0)
    with pytest.raises(ConfigError, match="root"):
        CheckpointManager("")


def test_root_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StorageError, match="not a directory"):
        CheckpointManager(str(f))


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read anything")
def test_unreadable_root(tmp_path):
    d = tmp_path / "locked"
    d.mkdir()
    d.chmod(0)
    try:
        with pytest.raises(StorageError, match="readable"):
            CheckpointManager(str(d))
    finally:
        d.chmod(stat.S_IRWXU)


def test_root_under_a_file_cannot_be_created(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StorageError, match="cannot create"):
        CheckpointManager(str(f / "sub"))


def test_restore_missing_step(root):
    with CheckpointManager(root) as mgr:
        with pytest.raises(StepNotFoundError, match="no committed checkpoint"):
            mgr.restore()
        with pytest.raises(StepNotFoundError):
            mgr.metadata()
        mgr.save(1, {"x": 1}).result()
        with pytest.raises(StepNotFoundError, match="step 2"):
            mgr.restore(2)
        with pytest.raises(FileNotFoundError):
            mgr.metadata(7)


def test_state_mismatch_lists_everything_and_changes_nothing(root):
    model = torch.nn.Linear(3, 2)
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": model, "w": torch.zeros(4), "extra": 1, "lst": [1, 2]}).result()
        other = torch.nn.Linear(3, 4)
        before = other.weight.detach().clone()
        w = torch.ones(4, dtype=torch.float64)
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(target={"model": other, "w": w, "missing": 0, "lst": [1]})
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert len(info.value.problems) == 6, msg
    for needle in ("['model']['weight']", "['model']['bias']", "['w']", "['missing']", "['extra']", "['lst']"):
        assert needle in msg
    assert torch.equal(other.weight, before)
    assert torch.equal(w, torch.ones(4, dtype=torch.float64))


def test_bad_metadata(root):
    with CheckpointManager(root) as mgr:
        with pytest.raises(UnsupportedValueError, match=r"metadata\['t'\]"):
            mgr.save(1, {}, metadata={"t": torch.zeros(1)})
        with pytest.raises(ConfigError, match="metadata"):
            mgr.save(1, {}, metadata=[1])
        assert mgr.steps() == []


def test_closed_manager_refuses_work(root):
    mgr = CheckpointManager(root)
    mgr.close()
    mgr.close()  # idempotent
    with pytest.raises(ConfigError, match="closed"):
        mgr.save(1, {})


def test_save_error_is_a_runtime_error():
    assert issubclass(SaveError, RuntimeError)
