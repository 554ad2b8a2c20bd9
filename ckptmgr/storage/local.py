"""Local and NFS target: POSIX files, parallel pwrite, fsync, atomic directory rename.

A save writes ``.step_<n>.tmp-<hex>/`` beside the destination (never the system temp
directory, so the rename never crosses filesystems), fsyncs every file and the directory,
writes ``manifest.json`` inside it, and renames the directory to ``step_<n>/``. A crash at
any moment leaves either the old state or the new step, plus a temporary that the next
start removes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from concurrent.futures import Executor
from typing import Any

import numpy as np

from .._threads import DaemonPool
from ..errors import CheckpointCorruptError, StepExistsError, StepNotFoundError, StorageError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import MANIFEST_NAME
from ..format.naming import PROTECT_NAME, ROOT_ID_NAME, is_our_file, is_temp_name, parse_step_name, step_name, temp_name

__all__ = ["LocalTarget", "fsync_dir", "preadv_into"]

log = logging.getLogger("ckptmgr")

_DIRECT_ALIGN = 4096
_DIRECT_MIN = 16 << 20  # smaller files gain nothing from O_DIRECT


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: np.ndarray[Any, Any], offset: int) -> None:
    view = memoryview(data)  # type: ignore[arg-type]
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def preadv_into(path: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
    """Fill the uint8 arrays in ``out``, in order, with ``path``'s bytes from ``offset``."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        views = [memoryview(a) for a in out if a.size]  # type: ignore[arg-type]
        while views:
            n = os.preadv(fd, views, offset)
            if n == 0:
                raise CheckpointCorruptError(f"{path} ended early, at byte {offset}")
            offset += n
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]
    finally:
        os.close(fd)


class _LocalStepWriter:
    def __init__(self, target: LocalTarget, step: int) -> None:
        self.target = target
        self.step = step
        self.final = os.path.join(target.path, step_name(step))
        self.tmp = os.path.join(target.path, temp_name(step))
        if os.path.exists(self.final):
            raise StepExistsError(f"step {step} is already committed at {self.final}")
        os.mkdir(self.tmp)
        self.location = self.tmp

    def adopt(self, parts: list[tuple[str, list[str]]]) -> None:
        for where, names in parts:
            if os.path.dirname(os.path.abspath(where)) != self.target.path:
                raise StorageError(f"{where} is not under {self.target.path}: a rank writes to another root")
            for name in names:
                os.rename(os.path.join(where, name), os.path.join(self.tmp, name))
            with contextlib.suppress(OSError):
                os.rmdir(where)

    def write_files(self, files: list[tuple[str, np.ndarray[Any, Any]]], chunk_size: int, *,
                    checksum: bool = True) -> list[tuple[str, ...]]:
        # One thread per file: the kernel serializes buffered writes to one file, so files in
        # parallel is what scales (the layout makes several files of a large state).
        return list(self.target.io_pool.map(lambda f: self._write_file(f[0], f[1], chunk_size, checksum), files))

    def _write_file(self, name: str, data: np.ndarray[Any, Any], chunk_size: int,
                    checksum: bool = True) -> tuple[str, ...]:
        path = os.path.join(self.tmp, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        dfd, direct_end = -1, 0
        try:
            if self.target.direct_io and data.size >= _DIRECT_MIN and data.ctypes.data % _DIRECT_ALIGN == 0:
                try:  # O_DIRECT for the aligned bulk: no page-cache copy, no dirty-page flood
                    dfd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0))
                    direct_end = data.size // _DIRECT_ALIGN * _DIRECT_ALIGN
                except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
                    dfd = -1
            if self.target.gds:
                return self._write_gds(path, fd, data, chunk_size, checksum)
            crcs = []
            for b, e in chunk_ranges(data.size, chunk_size):
                chunk = data[b:e]
                split = min(max(direct_end, b), e)
                if split > b:
                    _pwrite_all(dfd, data[b:split], b)
                if e > split:
                    _pwrite_all(fd, data[split:e], split)
                if checksum:
                    crcs.append(crc32c_hex(chunk))
            os.fsync(fd)
        finally:
            if dfd >= 0:
                os.close(dfd)
            os.close(fd)
        return tuple(crcs)

    @staticmethod
    def _write_gds(path: str, fd: int, data: np.ndarray[Any, Any], chunk_size: int,
                   checksum: bool) -> tuple[str, ...]:
        """The file's chunks written through cuFile in parallel, checksummed meanwhile."""
        from .cufile import pwrite_all

        ranges = chunk_ranges(data.size, chunk_size)
        os.ftruncate(fd, data.size)
        crcs = pwrite_all(path, data, ranges, lambda: tuple(crc32c_hex(data[b:e]) for b, e in ranges) if checksum
                          else ())
        os.fsync(fd)
        return crcs

    def commit(self, manifest: bytes) -> None:
        path = os.path.join(self.tmp, MANIFEST_NAME)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _pwrite_all(fd, np.frombuffer(manifest, dtype=np.uint8), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.tmp)
        if os.path.exists(self.final):
            raise StepExistsError(f"step {self.step} is already committed at {self.final}")
        os.rename(self.tmp, self.final)
        fsync_dir(self.target.path)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class LocalTarget:
    """A checkpoint root on a local or network (NFS) filesystem."""

    def __init__(self, path: str, *, io_threads: int = 8, direct_io: bool = True) -> None:
        self.gds = False  # write through cuFile (see ckptmgr.storage.cufile.enable_writer)
        self.path = os.path.abspath(path)
        self.url = self.path
        try:
            os.makedirs(self.path, exist_ok=True)
        except FileExistsError:
            raise StorageError(f"checkpoint root {self.path!r} exists and is not a directory") from None
        except OSError as exc:
            raise StorageError(f"cannot create checkpoint root {self.path!r}: {exc.strerror}") from exc
        if not os.access(self.path, os.R_OK | os.W_OK | os.X_OK):
            raise StorageError(f"checkpoint root {self.path!r} is not readable and writable by this process")
        self.io_pool: Executor = DaemonPool(io_threads, thread_name_prefix="ckptmgr-io")
        self.direct_io = direct_io

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.path, step_name(step))

    def list_steps(self) -> list[int]:
        try:
            names = os.listdir(self.path)
        except OSError as exc:
            raise StorageError(f"cannot list checkpoint root {self.path!r}: {exc.strerror}") from exc
        steps = []
        for name in names:
            step = parse_step_name(name)
            if step is not None and os.path.isfile(os.path.join(self.path, name, MANIFEST_NAME)):
                steps.append(step)
        return sorted(steps)

    def cleanup(self) -> list[str]:
        removed = []
        for name in os.listdir(self.path):
            full = os.path.join(self.path, name)
            if not os.path.isdir(full) or os.path.islink(full):
                continue
            if is_temp_name(name):  # a save in progress when the last run stopped: all ours
                shutil.rmtree(full, ignore_errors=True)
                removed.append(full)
            elif (parse_step_name(name) is not None and not os.path.exists(os.path.join(full, MANIFEST_NAME))
                  and self._remove_ours(full)):  # a delete interrupted after its manifest went
                removed.append(full)
        return removed

    def _remove_ours(self, d: str) -> bool:
        """Remove our files from step directory ``d``, then ``d`` if nothing else is left."""
        for name in os.listdir(d):
            if is_our_file(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(d, name))
        try:
            os.rmdir(d)
        except OSError:
            log.warning("left %s in place: it holds files ckptmgr did not write (%s)", d, sorted(os.listdir(d)))
            return False
        return True

    def root_id(self, create: bool = False) -> str | None:
        """The root's identity (written once, never overwritten); None when it has none."""
        path = os.path.join(self.path, ROOT_ID_NAME)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                return None
            new = secrets.token_hex(16)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except FileExistsError:  # written by another process meanwhile
                return self.root_id()
            try:
                _pwrite_all(fd, np.frombuffer(new.encode("ascii") + b"\n", dtype=np.uint8), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(self.path)
            return new
        try:
            text = os.read(fd, 256).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        return text or None

    def begin(self, step: int, prefix: str = "") -> _LocalStepWriter:
        return _LocalStepWriter(self, step)  # a directory of its own: a prefix changes nothing

    def read_manifest(self, step: int) -> bytes:
        path = os.path.join(self._step_dir(step), MANIFEST_NAME)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise StepNotFoundError(f"step {step} is not committed under {self.path}") from None

    def file_size(self, step: int, name: str) -> int:
        return os.stat(os.path.join(self._step_dir(step), name)).st_size

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
        preadv_into(os.path.join(self._step_dir(step), name), offset, out)

    def path_of(self, step: int, name: str) -> str:
        """Where data file ``name`` of committed ``step`` lies (for the in-place loader)."""
        return os.path.join(self._step_dir(step), name)

    def delete(self, step: int) -> None:
        d = self._step_dir(step)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(d, MANIFEST_NAME))  # first: from here on the step is gone
        fsync_dir(d)
        self._remove_ours(d)
        fsync_dir(self.path)

    def set_protected(self, step: int, protected: bool) -> None:
        d = self._step_dir(step)
        if not os.path.isfile(os.path.join(d, MANIFEST_NAME)):
            raise StepNotFoundError(f"step {step} is not committed under {self.path}")
        marker = os.path.join(d, PROTECT_NAME)
        if protected:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            os.fsync(fd)
            os.close(fd)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)
        fsync_dir(d)

    def is_protected(self, step: int) -> bool:
        return os.path.exists(os.path.join(self._step_dir(step), PROTECT_NAME))

    def close(self) -> None:
        self.io_pool.shutdown(wait=True)
