"""Checkpoints written by earlier format versions must stay readable, forever."""

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import assert_tree_equal
from golden.make_golden import GOLDEN_METADATA, golden_state

from ckptmgr import CheckpointManager

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


@pytest.mark.parametrize("version", sorted(d for d in os.listdir(GOLDEN) if d.startswith("v")))
def test_golden_checkpoint_reads(version, tmp_path):
    root = tmp_path / version
    shutil.copytree(os.path.join(GOLDEN, version), root)  # never write into the repository
    with CheckpointManager(str(root)) as mgr:
        assert mgr.steps() == [42]
        assert mgr.metadata() == GOLDEN_METADATA
        out = mgr.restore()
    expected = golden_state()
    assert_tree_equal(out, expected)
    assert out["model"]._metadata == expected["model"]._metadata
    assert out["tied"].data_ptr() == out["model"]["weight"].data_ptr()
    assert out["rows"].untyped_storage().data_ptr() == out["tied"].untyped_storage().data_ptr()


def test_current_writer_reproduces_golden_v1_bytes(tmp_path):
    """Format drift check: the same state must give the same file bytes and index."""
    root = tmp_path / "now"
    with CheckpointManager(str(root)) as mgr:
        mgr.save(42, golden_state(), metadata=GOLDEN_METADATA).result()
    new_dir, old_dir = root / "step_000000000042", os.path.join(GOLDEN, "v1", "step_000000000042")
    old = json.loads(Path(old_dir, "manifest.json").read_bytes())
    new = json.loads((new_dir / "manifest.json").read_bytes())
    for key in ("time", "library_version"):
        old.pop(key)
        new.pop(key)
    assert "manifest_crc32c" not in old  # written before the manifest had a checksum: still read
    assert len(new.pop("manifest_crc32c")) == 8
    assert new == old
    for name in old["files"]:
        assert (new_dir / name).read_bytes() == Path(old_dir, name).read_bytes()
