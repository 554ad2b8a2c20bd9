"""Checkpoint directories in a library's own naming (``checkpoint-500/``, ``step-500/``): the
commit record inside each, discovery, verification, temporaries and deletion.

A directory ckptmgr commits holds, besides the library's files, ``ckptmgr.json``: the step,
the commit time, the library version, and every file's size and per-chunk CRC32C. It is
written last into the temporary directory, which is then renamed to its final name, so a
directory under a final name is complete. Directories without a record (written by the
library's own code) are listed and loaded as the library would, unverified.

Temporary names are ``.ckptmgr-<pid>-<hex>.partial``: hidden, and matching no library's
checkpoint pattern (the Trainer's ``checkpoint-*`` glob, torchtitan's ``step-<n>``); where a
library takes every entry of the checkpoints' directory (accelerate's automatic naming) they
live in the directory above (see :mod:`._dirreplace`). A temporary whose writer process is
gone is removed at the next start. Deletion renames the directory to such a name first: a
crash mid-delete never leaves a partly deleted checkpoint under its final name.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from typing import Any

from ckptmgr import __version__
from ckptmgr.errors import CheckpointCorruptError
from ckptmgr.format.dirrecord import _FORMAT, RECORD_NAME, read_record, verify_dir
from ckptmgr.storage.lease import process_alive
from ckptmgr.storage.posix import fsync_dir

from ._fileset import FileRecord

__all__ = ["RECORD_NAME", "TEMP_RE", "committed_dirs", "delete_dir", "fsync_dir", "newest_verified", "read_record",
           "remove_stale_temps", "temp_name", "verify_dir", "write_record"]

TEMP_RE = re.compile(r"^\.ckptmgr-(\d+)-([0-9a-f]{8,40})\.partial$")


def temp_name(pid: int | None = None, token: str | None = None) -> str:
    """A fresh temporary directory name (``pid`` and ``token`` fixed for multi-rank saves)."""
    return f".ckptmgr-{os.getpid() if pid is None else pid}-{token or secrets.token_hex(8)}.partial"


def remove_stale_temps(parent: str) -> list[str]:
    """Remove the temporaries in ``parent`` whose writer process no longer runs."""
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = TEMP_RE.match(name)
        if m is None or int(m.group(1)) == os.getpid() or process_alive(int(m.group(1)), -1):
            continue
        path = os.path.join(parent, name)
        if os.path.islink(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


def committed_dirs(parent: str, pattern: re.Pattern[str]) -> dict[int, str]:
    """``{step: path}`` of the directories in ``parent`` whose names ``pattern`` matches
    (its first group is the step); symlinks are not followed."""
    out: dict[int, str] = {}
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return out
    for name in names:
        m = pattern.fullmatch(name)
        path = os.path.join(parent, name)
        if m is not None and os.path.isdir(path) and not os.path.islink(path):
            out[int(m.group(1))] = path
    return out


def delete_dir(path: str, scratch: str | None = None) -> None:
    """Delete a committed directory: renamed away first (to a temporary name in ``scratch``,
    by default its own directory), then removed, so that no torn directory is ever left
    under its final name."""
    parent = os.path.dirname(path)
    scratch = parent if scratch is None else scratch
    away = os.path.join(scratch, temp_name())
    try:
        os.rename(path, away)
    except FileNotFoundError:
        return
    fsync_dir(parent)
    if scratch != parent:
        fsync_dir(scratch)
    shutil.rmtree(away, ignore_errors=True)


def write_record(directory: str, *, step: int, files: dict[str, FileRecord], chunk_size: int,
                 metadata: dict[str, Any] | None = None) -> None:
    """Write the commit record into ``directory`` (fsynced)."""
    doc = {"format": _FORMAT, "version": 1, "step": step, "time": time.time(), "library": f"ckptmgr {__version__}",
           "chunk_size": chunk_size, "metadata": metadata or {},
           "files": {name: {"size": r.size, "crc32c": list(r.crc32c)} for name, r in sorted(files.items())}}
    path = os.path.join(directory, RECORD_NAME)
    with open(path, "x", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def newest_verified(candidates: dict[int, str], log: Any) -> tuple[int, str] | None:
    """The newest ``(step, path)`` of ``candidates`` that verifies (or has no record)."""
    for step in sorted(candidates, reverse=True):
        try:
            verify_dir(candidates[step])
        except CheckpointCorruptError as exc:
            log.warning("skipping damaged checkpoint %s: %s", candidates[step], exc)
            continue
        return step, candidates[step]
    return None

