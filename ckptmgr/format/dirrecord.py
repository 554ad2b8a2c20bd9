"""The commit record of a checkpoint directory written in a library's own naming (the Hugging
Face Trainer's ``checkpoint-N/``, accelerate's ``checkpoint_N/``): ``ckptmgr.json``, with the
step, the commit time, the library version and every file's size and per-chunk CRC32C. The
directory commit writes it (:mod:`ckptmgr.storage.commit.directory`); reading and verifying
it belongs to the format, so that ``ckptmgr verify`` checks such directories without the
integrations. Also here: finding a library's committed directories, newest verified first.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointCorruptError
from .checksum import chunk_ranges

__all__ = ["RECORD_NAME", "FileRecord", "committed_dirs", "read_record", "write_record"]

RECORD_NAME = "ckptmgr.json"
_FORMAT = "ckptmgr-directory"
_MAX_RECORD = 16 << 20  # a record larger than this is refused before it is parsed
_MAX_FILES = 100_000


@dataclass(frozen=True)
class FileRecord:
    """A written file: its size and the CRC32C of each ``chunk_size`` chunk."""

    size: int
    crc32c: tuple[str, ...]


def _safe_name(name: Any) -> bool:
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or "\0" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def read_record(directory: str) -> dict[str, Any] | None:
    """The validated record of ``directory``; None when it has none.

    Raises:
        CheckpointCorruptError: the record is damaged or names files outside the directory.
    """
    path = os.path.join(directory, RECORD_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointCorruptError(f"{path}: cannot be opened ({exc})") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MAX_RECORD + 1)
    if len(raw) > _MAX_RECORD:
        raise CheckpointCorruptError(f"{path}: larger than {_MAX_RECORD} bytes; not a ckptmgr record")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise CheckpointCorruptError(f"{path}: not JSON ({exc})") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    chunk = doc.get("chunk_size") if isinstance(doc, dict) else None
    if (not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("version") != 1
            or type(doc.get("step")) is not int or type(chunk) is not int or chunk <= 0
            or not isinstance(files, dict) or len(files) > _MAX_FILES):
        raise CheckpointCorruptError(f"{path}: not a ckptmgr directory record of version 1")
    for name, rec in files.items():
        if not _safe_name(name) or not isinstance(rec, dict) or type(rec.get("size")) is not int \
                or rec["size"] < 0 or not isinstance(rec.get("crc32c"), list) \
                or len(rec["crc32c"]) != len(chunk_ranges(rec["size"], chunk)) \
                or not all(isinstance(c, str) and re.fullmatch(r"[0-9a-f]{8}", c) for c in rec["crc32c"]):
            raise CheckpointCorruptError(f"{path}: bad entry for file {name!r}")
    return doc


def write_record(directory: str, *, step: int, files: dict[str, FileRecord], chunk_size: int,
                 metadata: dict[str, Any] | None = None, library: str = "ckptmgr") -> None:
    """Write the commit record into ``directory`` (fsynced); ``library``: who wrote it
    (``ckptmgr <version>``)."""
    doc = {"format": _FORMAT, "version": 1, "step": step, "time": time.time(), "library": library,
           "chunk_size": chunk_size, "metadata": metadata or {},
           "files": {name: {"size": r.size, "crc32c": list(r.crc32c)} for name, r in sorted(files.items())}}
    path = os.path.join(directory, RECORD_NAME)
    with open(path, "x", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


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
