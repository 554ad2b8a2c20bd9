"""Checking a checkpoint directory in a library's own naming against its commit record.

The Hugging Face Trainer's ``checkpoint-N/`` and accelerate's ``checkpoint_N/``, as the
integrations write them, carry ``ckptmgr.json`` (:mod:`ckptmgr.format.dirrecord`): every file's
size and per-chunk CRC32C. :func:`verify_dir` checks each file the record lists (inside the
directory, not a link, of its size) and then every chunk of every file, as a check plan of
the read driver (:func:`~ckptmgr.restore.read.run` on a
:class:`~ckptmgr.restore.transports.pread.PreadTransport`: several files and chunks read at
once, nothing landed). Of several faults, the one of the first file in the record's order
(and, in a file, the first chunk) is raised, whatever its kind.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError
from ..format.checksum import chunk_ranges
from ..format.dirrecord import RECORD_NAME, read_record
from ..storage.posix import preadv_into
from .read import Chunk, Mismatch, ReadPlan, run
from .transports.pread import PreadTransport

__all__ = ["newest_verified", "verify_dir"]

_WORKERS = 4  # files and chunks read at once


class _DirFiles:
    """The files of one checkpoint directory, each read by its name in the record (a link or
    anything but a regular file is refused at every open)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
        preadv_into(os.path.join(self.directory, *name.split("/")), offset, out)


def _file_fault(directory: str, real: str, name: str, size: int) -> str | None:
    """What is wrong with file ``name`` before its bytes are read (None: nothing)."""
    path = os.path.join(directory, *name.split("/"))
    if not os.path.realpath(path).startswith(real + os.sep):
        return f"{directory}: {name} leads outside the checkpoint"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return f"{directory}: {name} is listed in {RECORD_NAME} but cannot be read ({exc}); the checkpoint is damaged"
    try:
        have = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if have != size:
        return f"{directory}: {name} has {have} bytes, the record says {size}"
    return None


def verify_dir(directory: str) -> bool:
    """Check every file the record of ``directory`` lists: present, inside the directory, of
    its size and checksums. True when verified; False when the directory has no record (not
    ckptmgr's).

    Raises:
        CheckpointCorruptError: naming the file and the byte range that differ (the first
            fault in the record's order).

    Example:
        >>> verify_dir("out/checkpoint-500")  # doctest: +SKIP
        True
    """
    doc = read_record(directory)
    if doc is None:
        return False
    chunk_size = doc["chunk_size"]
    real = os.path.realpath(directory)
    faults: dict[tuple[int, int], BaseException] = {}  # (file's place in the record, chunk) -> fault (mu)
    mu = threading.Lock()
    chunks: list[Chunk] = []
    order: dict[str, int] = {}
    for k, (name, rec) in enumerate(doc["files"].items()):
        order[name] = k
        fault = _file_fault(directory, real, name, rec["size"])
        if fault is not None:
            faults[(k, -1)] = CheckpointCorruptError(fault)
            continue
        chunks += [Chunk(name, i, b, e, want)
                   for i, ((b, e), want) in enumerate(zip(chunk_ranges(rec["size"], chunk_size), rec["crc32c"],
                                                          strict=True))]

    def message(m: Mismatch) -> str:
        return (f"{directory}: {m.file} bytes {m.begin}-{m.end} fail their CRC32C (stored {m.want}, computed "
                f"{m.got}); the file is damaged")

    def on_fault(c: Chunk, exc: BaseException) -> None:  # (from the transport's threads)
        with mu:
            faults.setdefault((order[c.file], c.index), exc)

    if chunks:
        run(ReadPlan(directory, tuple(chunks), message), PreadTransport(_DirFiles(directory), 0, workers=_WORKERS),
            on_fault=on_fault)
    if faults:
        raise faults[min(faults)]
    return True


def newest_verified(candidates: dict[int, str], log: Any) -> tuple[int, str] | None:
    """The newest ``(step, path)`` of ``candidates`` that verifies (or has no record); the
    damaged ones newer than it are logged on ``log`` as skipped, with why."""
    for step in sorted(candidates, reverse=True):
        try:
            verify_dir(candidates[step])
        except CheckpointCorruptError as exc:
            log.warning("skipping damaged checkpoint %s: %s", candidates[step], exc)
            continue
        return step, candidates[step]
    return None
