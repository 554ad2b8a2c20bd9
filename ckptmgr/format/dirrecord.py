"""The commit record of a checkpoint directory written in a library's own naming (the Hugging
Face Trainer's ``checkpoint-N/``, accelerate's ``checkpoint_N/``): ``ckptmgr.json``, with the
step, the commit time, the library version and every file's size and per-chunk CRC32C. The
integrations write it (``ckptmgr.integrations``); reading and verifying it belongs to the
format, so that ``ckptmgr verify`` checks such directories without the integrations.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError
from .checksum import chunk_ranges, crc32c_hex

__all__ = ["RECORD_NAME", "read_record", "verify_dir"]

RECORD_NAME = "ckptmgr.json"
_FORMAT = "ckptmgr-directory"
_MAX_RECORD = 16 << 20  # a record larger than this is refused before it is parsed
_MAX_FILES = 100_000


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


def verify_dir(directory: str) -> bool:
    """Check every file the record lists: present, inside the directory, of its size and
    checksums. True when verified; False when the directory has no record (not ckptmgr's).

    Raises:
        CheckpointCorruptError: naming the file and the byte range that differ.
    """
    doc = read_record(directory)
    if doc is None:
        return False
    chunk = doc["chunk_size"]
    real = os.path.realpath(directory)
    for name, rec in doc["files"].items():
        path = os.path.join(directory, *name.split("/"))
        if not os.path.realpath(path).startswith(real + os.sep):
            raise CheckpointCorruptError(f"{directory}: {name} leads outside the checkpoint")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise CheckpointCorruptError(f"{directory}: {name} is listed in {RECORD_NAME} but cannot be read "
                                         f"({exc}); the checkpoint is damaged") from None
        try:
            size = os.fstat(fd).st_size
            if size != rec["size"]:
                raise CheckpointCorruptError(f"{directory}: {name} has {size} bytes, the record says {rec['size']}")
            for (b, e), want in zip(chunk_ranges(size, chunk), rec["crc32c"], strict=True):
                data = os.pread(fd, e - b, b)
                got = crc32c_hex(np.frombuffer(data, dtype=np.uint8))
                if len(data) != e - b or got != want:
                    raise CheckpointCorruptError(f"{directory}: {name} bytes {b}-{e} fail their CRC32C "
                                                 f"(stored {want}, computed {got}); the file is damaged")
        finally:
            os.close(fd)
    return True
