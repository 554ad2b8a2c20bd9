"""The storage target interface.

A :class:`Target` is used by the manager in this order:

1. ``list_steps()`` and ``cleanup()`` at start-up, from the caller's thread;
2. per save, on the persist thread: ``begin(step)`` claims the step and returns a
   :class:`StepWriter`, then ``write_files(...)`` once with every data file (the target writes
   them in parallel on its I/O threads), then ``commit(manifest)``; on any failure
   ``abort()``. The buffers passed to ``write_files`` belong to the caller and must not be
   used after it returns. A writer that neither commits nor aborts (a multi-rank writer whose
   files another rank committed) calls ``close()``;
3. ``read_manifest``/``file_size``/``read_into`` for restore, from any thread;
4. ``delete(step)``, ``set_protected``/``is_protected`` from the deleter's thread or the
   caller's, never for a step being written or read;
5. ``close()`` once, after everything else.

``commit`` is the only operation that makes a step visible to ``list_steps``; how it does so
is the writer's commit strategy (:mod:`ckptmgr.storage.commit`). A target opened read-only
creates, writes and deletes nothing, and its write operations raise ConfigError.

Symbolic links (local and NFS roots): a step directory that is a link is not a step of this
root; a manifest or data file is read through a link only to a regular file of the same step
directory, and one that is a FIFO or device is refused with CheckpointCorruptError without
being opened for reading; deleting and marking never act through a link.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol

import numpy as np

__all__ = ["StepWriter", "Target"]


class StepWriter(Protocol):
    """Writes the files of one step, then commits or aborts it.

    In a multi-rank save every rank has a writer for the step, made with its own file
    prefix; only the leader commits, after :meth:`adopt` has gathered the other ranks'
    files (their ``location``) into its step.
    """

    location: str  # where this writer's files are before the commit ("" where they are in place)
    # set by the caller before write_files: told the bytes that reached the storage itself as
    # they do (not a cache that flushes later), from the I/O threads; a writer that cannot tell
    # leaves it uncalled (a hint for pacing, never for correctness)
    progress: Callable[[int], None] | None

    def adopt(self, parts: list[tuple[str, list[str]]]) -> None:
        """Take other writers' files of this step, given as ``(location, names)``."""

    def write_files(self, files: list[tuple[str, np.ndarray[Any, Any]]], chunk_size: int, *,
                    checksum: bool = True) -> list[tuple[str, ...]]:
        """Write each ``(name, data)`` (contiguous uint8); return each file's per-chunk CRC32C hex
        (empty tuples with ``checksum=False``, when the caller has them already)."""

    def commit(self, manifest: bytes) -> None:
        """Check that every file of ``manifest`` is there with its size, then make the step
        visible, atomically. Raises StepExistsError if it already is, StorageError when a
        file is missing (nothing is committed then)."""

    def abort(self) -> None:
        """Remove what this writer wrote, never what another writer committed. Never raises."""

    def close(self) -> None:
        """Release the writer's claim on the step (commit and abort do it themselves)."""


class Target(Protocol):
    """A checkpoint root on some storage."""

    url: str
    read_only: bool  # opened read-only: nothing is created, written or deleted
    io_pool: Executor  # shared I/O threads; never submit to it from its own tasks

    def list_steps(self) -> list[int]:
        """Committed steps, ascending, read fresh from the storage (no stale cache)."""

    def cleanup(self) -> list[str]:
        """Remove our own leftovers of interrupted saves and deletes whose writer is provably
        gone (never a live writer's); return what was removed. What cannot be removed is
        logged and left. Nothing in read-only mode."""

    def root_id(self, create: bool = False) -> str | None:
        """The root's identity: a random id stored once in the root (``.ckptmgr-root-id``),
        written with the first save and never overwritten; None when the root has none.
        ``create`` writes one if there is none (never in read-only mode)."""

    def begin(self, step: int, prefix: str = "") -> StepWriter:
        """Claim ``step`` for a new writer; with ``prefix``, the writer's claim and abort cover
        only files whose names start with it (one rank's share of a multi-rank save).
        Raises StepExistsError when the step is committed or another live writer has it."""

    def read_manifest(self, step: int) -> bytes:
        """The manifest of a committed step. Raises StepNotFoundError."""

    def file_size(self, step: int, name: str, *, fresh: bool = False) -> int:
        """Size of a data file of ``step`` (``fresh``: asked of the storage now, never as an
        earlier listing had it). Raises FileNotFoundError."""

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
        """Fill the uint8 buffers in ``out``, in order, with the file's bytes from ``offset``
        (a scatter read). Raises CheckpointCorruptError on a short read."""

    def delete(self, step: int) -> None:
        """Delete a committed step: the manifest first, then the other files ckptmgr wrote;
        anything else in the step's directory stays (and the directory with it)."""

    def set_protected(self, step: int, protected: bool) -> None:
        """Record durably, beside the step, that retention must keep it (or no longer).
        Raises StepNotFoundError when the step is not committed."""

    def is_protected(self, step: int) -> bool:
        """Whether ``step`` carries the protection marker."""

    def close(self) -> None:
        """Release threads and connections."""
