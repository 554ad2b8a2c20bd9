"""An oversized manifest is refused by its size before it is read, on every storage: the peak
resident memory of a fresh process that is asked for it grows by a small fraction of its size
(measured with ``getrusage(RUSAGE_SELF).ru_maxrss`` before and after, in a subprocess, so the
test's own memory is not counted). The local and fsspec manifests are sparse files: cheap on
disk, and read back as real bytes by a reader that reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ckptmgr import CheckpointManager, StagingOptions
from ckptmgr.format.schema import MAX_MANIFEST_BYTES

NO_TIER = StagingOptions(local_tier=False)
STEP2 = "step_000000000002/manifest.json"

# Reads step 1 (a real manifest: every import made, every connection open), then step 2 (the
# oversized one); prints the growth of the peak RSS across the second read and what it raised.
READER = r"""
import json, resource, sys
root, so, limit = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
import ckptmgr.format.manifest as manifest_mod
if limit:
    manifest_mod.MAX_MANIFEST_BYTES = limit
from ckptmgr import CheckpointManager, CkptError, StagingOptions

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

with CheckpointManager(root, storage_options=so, read_only=True, staging=StagingOptions(local_tier=False)) as mgr:
    assert mgr.metadata(1) == {"step": 1}
    before = peak()
    try:
        mgr.metadata(2)
        error = None
    except CkptError as exc:
        error = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"growth": peak() - before, "error": error}))
"""


# Linux keeps a process's peak RSS across exec, and a child made by fork starts with its parent's
# pages counted: a reader started by pytest would start with pytest's peak, which can hide the
# growth measured. A small intermediate Python starts it, so its peak starts small.
LAUNCH = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def _read_in_a_fresh_process(root: str, so: dict | None = None, limit: int = 0) -> dict:
    out = subprocess.run([sys.executable, "-c", LAUNCH, sys.executable, "-c", READER, root, json.dumps(so),
                          str(limit)], capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _save_step_1(root: str, so: dict | None = None) -> None:
    with CheckpointManager(root, storage_options=so, staging=NO_TIER) as mgr:
        mgr.save(1, {"w": torch.ones(4)}, metadata={"step": 1}).result(timeout=60)


def _sparse(path: str, size: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"{")
        f.truncate(size)


def _check_refused_unread(result: dict, size: int) -> None:
    assert result["error"] is not None and result["error"].startswith("CheckpointCorruptError"), result
    assert f"the manifest has {size} bytes, more than the" in result["error"]
    assert result["growth"] < size // 8, f"peak RSS grew by {result['growth'] >> 20} MiB reading a " \
                                         f"{size >> 20} MiB manifest"


SIZE = 512 << 20  # over the limit (256 MiB), under the 1 GiB the local reader allowed before


def test_the_limit_is_the_one_docs_format_states():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "FORMAT.md")) as f:
        doc = f.read()
    assert MAX_MANIFEST_BYTES == 256 << 20 and "The manifest is at most 256 MiB" in doc


def test_an_oversized_local_manifest_is_refused_before_it_is_read(tmp_path):
    root = str(tmp_path / "ckpt")
    _save_step_1(root)
    _sparse(os.path.join(root, STEP2), SIZE)
    _check_refused_unread(_read_in_a_fresh_process(root), SIZE)


def test_an_oversized_fsspec_manifest_is_refused_before_it_is_read(tmp_path):
    """A generic fsspec filesystem (DirFileSystem over local files): its size, then a bounded read."""
    so = {"path": str(tmp_path), "target_protocol": "file", "target_options": {"auto_mkdir": True}}
    _save_step_1("dir://ckpt", so)
    _sparse(str(tmp_path / "ckpt" / STEP2), SIZE)
    _check_refused_unread(_read_in_a_fresh_process("dir://ckpt", so), SIZE)


def test_an_oversized_s3_manifest_is_refused_by_its_content_length(s3_bucket):
    """One GET, its body left unread. Here the limit is lowered to 1 MiB in the reading process,
    so that a 48 MiB object shows it (the same code reads 256 MiB as 1 MiB)."""
    import s3fs

    bucket, so = s3_bucket
    root = f"s3://{bucket}/run"
    _save_step_1(root, so)
    size = 48 << 20
    s3fs.S3FileSystem(**so).pipe_file(f"{bucket}/run/{STEP2}", b"{" + bytes(size - 1))
    result = _read_in_a_fresh_process(root, so, limit=1 << 20)
    _check_refused_unread(result, size)


@pytest.mark.parametrize("extra", [0, 1])
def test_a_manifest_at_the_limit_is_read_and_one_byte_more_is_not(tmp_path, monkeypatch, extra):
    """The bound is exact: limit bytes are parsed (here: not JSON), limit + 1 refused by size."""
    import ckptmgr.format.manifest as manifest_mod
    from ckptmgr import CheckpointCorruptError

    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 4096)
    root = str(tmp_path / "ckpt")
    _save_step_1(root)
    os.makedirs(os.path.join(root, os.path.dirname(STEP2)))
    with open(os.path.join(root, STEP2), "wb") as f:
        f.write(b" " * (4096 + extra))
    with CheckpointManager(root, read_only=True, staging=NO_TIER) as mgr:
        match = "more than the 4096" if extra else "not valid JSON"
        with pytest.raises(CheckpointCorruptError, match=match):
            mgr.metadata(2)
