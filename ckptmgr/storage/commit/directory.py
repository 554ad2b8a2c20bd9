"""The directory commit: a checkpoint directory in a library's own naming (``checkpoint-500/``,
``step-500/``) put under its final name, complete, also over an existing one.

A save (:class:`DirectoryCommit`, a save engine strategy) writes its files into a temporary
directory ``.ckptmgr-<pid>-<hex>.partial`` (:func:`~ckptmgr.format.naming.dir_temp_name`),
checksums the files the library wrote there itself, writes the record ``ckptmgr.json`` last
(:mod:`ckptmgr.format.dirrecord`), and installs the directory with :func:`replace_dir`:

* ``final`` absent: one ``rename``;
* ``final`` present (the same step saved again): an atomic exchange of the two names
  (Linux ``renameat2(RENAME_EXCHANGE)``), after which the temporary name holds the old copy,
  which is then deleted. A crash at any point leaves the old or the new directory under
  ``final``; what is left under a temporary name is swept at the next start;
* where the exchange is not available (another OS, a file system without it): the old copy
  is renamed away to ``.ckptmgr-<pid>-<hex>.old-<final, quoted>``, the new one renamed in,
  then the old one deleted: never deleted first. Until the second rename ``final`` is
  missing; :func:`recover`, run at start-up and before discovery, renames the old copy back
  when its writer is gone and ``final`` is still missing (and deletes it when ``final`` is
  there).

In a multi-rank job each rank writes its own files into the shared temporary directory, the
ranks agree over the coordinator's commit group that all are durable, and rank 0 alone
writes the record and renames; a failure or a dead rank commits nothing.

Temporaries (saves being written, old copies, directories being deleted) go into a
*scratch* directory on the same file system: the checkpoints' own directory where the
library's discovery matches names by a fixed prefix (the Trainer's ``checkpoint-<n>``), or
the directory above it where discovery takes every entry (accelerate's automatic naming sorts
all of ``checkpoints/`` by the first number in each name): :func:`scratch_dir`. A temporary
whose writer process is gone is removed at the next start (:func:`remove_stale_temps`).
Deletion (:func:`delete_dir`) renames the directory to such a name first: a crash mid-delete
never leaves a partly deleted checkpoint under its final name.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import urllib.parse
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np

from ...errors import SaveError
from ...format.checksum import chunk_ranges, crc32c_hex
from ...format.dirrecord import FileRecord, write_record
from ...format.naming import DIR_OLD_RE as OLD_RE
from ...format.naming import DIR_TEMP_RE, dir_old_name, dir_temp_name
from ..posix import fsync_dir
from . import dead_writers

__all__ = ["OLD_RE", "DirectoryCommit", "delete_dir", "exchange", "hash_file", "old_name", "recover",
           "remove_stale_temps", "replace_dir", "scratch_dir"]

log = logging.getLogger("ckptmgr")

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_NAME_MAX = 255
_exchange_fn: object = None  # the libc function once looked up; False where there is none


class DirectoryCommit:
    """One checkpoint directory as a save engine commit (see the module docstring).

    Args:
        temp: the temporary directory the save is written into (made by the caller).
        final: the directory's final path.
        step: the step the record names.
        metadata: the record's metadata.
        chunk_size: bytes per CRC32C chunk of the record.
        write: writes this rank's files into ``temp`` from the staged buffers, with the I/O
            pool, and returns their records.
        coordinator: the ranks' agreement in a multi-rank job (None: a single process).
        library: who writes the record (``ckptmgr <version>``).
        done: called when the commit is over, whatever happened.
    """

    def __init__(self, temp: str, final: str, *, step: int, metadata: dict[str, Any], chunk_size: int,
                 write: Callable[[list[np.ndarray[Any, Any]], Executor], dict[str, FileRecord]],
                 coordinator: Any = None, library: str = "ckptmgr", done: Callable[[], None] | None = None) -> None:
        self.temp = temp
        self.final = final
        self._step = step
        self._metadata = metadata
        self._chunk_size = chunk_size
        self._write = write
        self._coordinator = coordinator
        self._library = library
        self._done = done
        self._records: dict[str, FileRecord] = {}

    @property
    def _leader(self) -> bool:
        return self._coordinator is None or self._coordinator.is_leader

    def write(self, buffers: list[np.ndarray[Any, Any]], io: Executor) -> None:
        self._records = self._write(buffers, io)

    def commit(self, error: BaseException | None) -> str:
        tmp, final, records = self.temp, self.final, self._records
        coord = self._coordinator
        if coord is not None:  # every rank reports; rank 0 commits only if all succeeded
            reports = coord.all_gather((None if error is None else repr(error), records),
                                       f"commit of {final}", group=coord.commit)
            failed = [(r, e) for r, (e, _) in enumerate(reports) if e is not None]
            if error is None and failed:
                error = SaveError(f"rank {failed[0][0]} failed to write its files of {final}: {failed[0][1]}")
            for _, recs in reports:
                records.update(recs)
        if error is not None:
            if self._leader:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error
        if not self._leader:
            return final
        try:
            for dirpath, dirnames, filenames in os.walk(tmp):  # files the library wrote itself
                for fname in filenames:
                    rel = os.path.relpath(os.path.join(dirpath, fname), tmp).replace(os.sep, "/")
                    if rel not in records:
                        records[rel] = hash_file(os.path.join(dirpath, fname), self._chunk_size)
                for d in dirnames:
                    fsync_dir(os.path.join(dirpath, d))
            write_record(tmp, step=self._step, files=records, chunk_size=self._chunk_size, metadata=self._metadata,
                         library=self._library)
            fsync_dir(tmp)
            replace_dir(tmp, final)  # the same step saved again: never leaves final missing
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def close(self) -> None:
        if self._done is not None:
            self._done()


def hash_file(path: str, chunk_size: int) -> FileRecord:
    """Checksum (and fsync) a file the library wrote itself."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        crcs = []
        for b, e in chunk_ranges(size, chunk_size):
            data = os.pread(fd, e - b, b)
            if len(data) != e - b:
                raise OSError(f"{path} shrank while it was checksummed")
            crcs.append(crc32c_hex(np.frombuffer(data, dtype=np.uint8)))
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileRecord(size, tuple(crcs))


def remove_stale_temps(parent: str) -> list[str]:
    """Remove the temporary directories in ``parent`` whose writer process no longer runs."""
    removed: list[str] = []
    for path, _ in dead_writers(parent, DIR_TEMP_RE):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(os.path.basename(path))
    return removed


def delete_dir(path: str, scratch: str | None = None) -> None:
    """Delete a committed directory: renamed away first (to a temporary name in ``scratch``,
    by default its own directory), then removed, so that no torn directory is ever left
    under its final name."""
    parent = os.path.dirname(path)
    scratch = parent if scratch is None else scratch
    away = os.path.join(scratch, dir_temp_name())
    try:
        os.rename(path, away)
    except FileNotFoundError:
        return
    fsync_dir(parent)
    if scratch != parent:
        fsync_dir(scratch)
    shutil.rmtree(away, ignore_errors=True)


def _renameat2() -> object:
    global _exchange_fn
    if _exchange_fn is None:
        fn: object = False
        if hasattr(os, "uname") and os.uname().sysname == "Linux":
            try:
                f = ctypes.CDLL(None, use_errno=True).renameat2
                f.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                f.restype = ctypes.c_int
                fn = f
            except (OSError, AttributeError):  # glibc < 2.28, musl without it
                fn = False
        _exchange_fn = fn
    return _exchange_fn


def exchange(a: str, b: str) -> bool:
    """Swap the directory entries ``a`` and ``b`` atomically (both must exist, on one file
    system). False where the OS or the file system cannot, with nothing changed.

    Raises:
        OSError: any other failure of the exchange.
    """
    fn = _renameat2()
    if not fn:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:  # type: ignore[operator]
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def old_name(scratch: str, final: str, pid: int | None = None) -> str:
    """The name ``final``'s old copy takes in ``scratch`` while a replacement is renamed in.

    Raises:
        OSError: ``final`` is not under ``scratch``, or the name would be too long.
    """
    rel = os.path.relpath(final, scratch)
    if rel.startswith(".." + os.sep) or rel in (".", "..") or os.path.isabs(rel):
        raise OSError(errno.EXDEV, f"{final} is not under the scratch directory {scratch}")
    name = dir_old_name(rel, pid)
    if len(os.fsencode(name)) > _NAME_MAX:
        raise OSError(errno.ENAMETOOLONG, f"{final}: name too long to be replaced safely")
    return os.path.join(scratch, name)


def replace_dir(temp: str, final: str, *, scratch: str | None = None, use_exchange: bool = True) -> None:
    """Install the complete directory ``temp`` as ``final`` (fsynced), replacing any
    directory there without ever leaving ``final`` missing but for a state :func:`recover`
    repairs (see the module docstring). ``scratch`` (default: ``temp``'s directory) receives
    the old copy when the exchange is not available; ``final`` must lie under it.

    Raises:
        OSError: a rename failed; ``final`` then still holds the old directory.
    """
    temp, final = os.path.abspath(temp), os.path.abspath(final)
    scratch = os.path.abspath(scratch) if scratch is not None else os.path.dirname(temp)
    parent = os.path.dirname(final)
    dirs = {parent, os.path.dirname(temp)}
    if not os.path.lexists(final):
        os.rename(temp, final)
        for d in dirs:
            fsync_dir(d)
        return
    log.warning("checkpoint %s exists; replacing it with the new save", final)
    if use_exchange and exchange(temp, final):  # temp now holds the old copy
        for d in dirs:
            fsync_dir(d)
        shutil.rmtree(temp, ignore_errors=True)
        return
    away = old_name(scratch, final)
    os.rename(final, away)
    try:
        fsync_dir(scratch)
        os.rename(temp, final)
    except BaseException:  # (final is missing until the new copy is in: put the old one back)
        os.rename(away, final)
        raise
    for d in dirs:
        fsync_dir(d)
    shutil.rmtree(away, ignore_errors=True)


def recover(scratch: str) -> list[str]:
    """Finish the replacements in ``scratch`` that a crash interrupted: an old copy whose
    writer process is gone goes back under its final name if that name is missing, and is
    deleted otherwise. Returns the final paths restored."""
    restored: list[str] = []
    for path, m in dead_writers(scratch, OLD_RE):
        rel = urllib.parse.unquote(m.group(3))
        parts = rel.split("/")
        if os.path.isabs(rel) or any(p in ("", ".", "..") for p in parts):
            continue  # not a name this module made
        final = os.path.join(scratch, *parts)
        if os.path.lexists(final):  # the new copy got in: the old one is garbage
            shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            os.rename(path, final)
        except OSError as exc:  # another process restored it first, or the parent went away
            log.warning("could not restore %s as %s: %s", path, final, exc)
            continue
        fsync_dir(os.path.dirname(final))
        log.warning("restored %s, left missing by a save that was interrupted while replacing it", final)
        restored.append(final)
    return restored


def scratch_dir(parent: str, *, outside: bool = False) -> str:
    """Where the temporaries for checkpoints in ``parent`` go: ``parent`` itself, or with
    ``outside`` (a library whose discovery takes every entry of ``parent``) the directory
    above it, when that is on the same file system (else ``parent``, with a warning)."""
    parent = os.path.abspath(parent)
    if not outside:
        return parent
    above = os.path.dirname(parent)
    try:
        same = os.stat(above).st_dev == os.stat(parent).st_dev
    except OSError:
        same = False
    if not same:
        log.warning("%s is a mount point: temporaries go inside it, where the library's own discovery may "
                    "see them", parent)
        return parent
    return above
