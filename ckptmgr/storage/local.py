"""Local and NFS target: POSIX files, parallel pwrite, fsync, atomic directory rename.

A save writes ``.step_<n>.tmp-<hex>/`` beside the destination (never the system temp
directory, so the rename never crosses filesystems), held by its lock file while the writer
lives; it fsyncs every file and the directory, writes ``manifest.json`` inside it, and
renames the directory to ``step_<n>/`` (:class:`~ckptmgr.storage.commit.rename.RenameCommit`). A
crash at any moment leaves either the old state or the new step, plus a temporary that a
later start removes once its writer is provably gone.

Inside the root no symbolic link is followed out of a step (see :mod:`.posix`): a step
directory that is a link is not a step of this root, and data files or manifests that are
links out of their step, FIFOs or devices are refused (CheckpointCorruptError) without being
opened for reading.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np

from .._threads import DaemonPool
from ..errors import CheckpointCorruptError, ConfigError, StepNotFoundError, StorageError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import MANIFEST_NAME, read_manifest_bytes
from ..format.naming import (
    PROTECT_NAME,
    ROOT_ID_NAME,
    is_our_file,
    new_root_id,
    parse_root_id,
    parse_step_name,
    step_name,
)
from .commit.rename import RenameCommit, remove_local_leftovers
from .fsspec import check_step
from .lease import LEASE_STALE_S, LeaseKeeper
from .posix import (
    DirectFile,
    fsync_dir,
    makedirs_durable,
    open_dir,
    open_direct,
    open_regular,
    pread_chunk,
    preadv_into,
    pwrite_all,
    remove_ours,
    stat_regular,
)

__all__ = ["LocalTarget", "fsync_dir", "preadv_into"]

log = logging.getLogger("ckptmgr")

_DIRECT_ALIGN = 4096
_DIRECT_MIN = 16 << 20  # smaller files gain nothing from O_DIRECT
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class _LocalStepWriter:
    progress: Callable[[int], None] | None = None  # (see StepWriter)

    def __init__(self, target: LocalTarget, commit: RenameCommit) -> None:
        self.target = target
        self.strategy = commit
        self.step = commit.step
        self.tmp = commit.location
        self.location = commit.location

    def adopt(self, parts: list[tuple[str, list[str]]]) -> None:
        self.strategy.adopt(parts)

    def write_files(self, files: list[tuple[str, np.ndarray[Any, Any]]], chunk_size: int, *,
                    checksum: bool = True) -> list[tuple[str, ...]]:
        # One thread per file: the kernel serializes buffered writes to one file, so files in
        # parallel is what scales (the layout makes several files of a large state).
        return list(self.target.io_pool.map(lambda f: self._write_file(f[0], f[1], chunk_size, checksum), files))

    def _write_file(self, name: str, data: np.ndarray[Any, Any], chunk_size: int,
                    checksum: bool = True) -> tuple[str, ...]:
        path = os.path.join(self.tmp, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
        dfd, direct_end = -1, 0
        try:
            if self.target.direct_io and data.size >= _DIRECT_MIN and data.ctypes.data % _DIRECT_ALIGN == 0:
                try:  # O_DIRECT for the aligned bulk: no page-cache copy, no dirty-page flood
                    dfd = os.open(path, os.O_WRONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_DIRECT", 0))
                    direct_end = data.size // _DIRECT_ALIGN * _DIRECT_ALIGN
                except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
                    dfd = -1
            if self.target.gds:
                crcs = self._write_gds(path, fd, data, chunk_size, checksum)
            else:
                crcs = []
                for b, e in chunk_ranges(data.size, chunk_size):
                    chunk = data[b:e]
                    split = min(max(direct_end, b), e)
                    if split > b:
                        pwrite_all(dfd, data[b:split], b)
                        if self.progress is not None:  # (O_DIRECT: on the device; buffered bytes are not yet)
                            self.progress(split - b)
                    if e > split:
                        pwrite_all(fd, data[split:e], split)
                    if checksum:
                        crcs.append(crc32c_hex(chunk))
                os.fsync(fd)
        finally:
            if dfd >= 0:
                os.close(dfd)
            os.close(fd)
        self.strategy.wrote(name, data.size)
        return tuple(crcs)

    @staticmethod
    def _write_gds(path: str, fd: int, data: np.ndarray[Any, Any], chunk_size: int,
                   checksum: bool) -> list[str]:
        """The file's chunks written through cuFile in parallel, checksummed meanwhile."""
        from .cufile import pwrite_all as cufile_pwrite_all

        ranges = chunk_ranges(data.size, chunk_size)
        os.ftruncate(fd, data.size)
        crcs = cufile_pwrite_all(path, data, ranges, lambda: [crc32c_hex(data[b:e]) for b, e in ranges] if checksum
                                 else [])
        os.fsync(fd)
        return crcs

    def commit(self, manifest: bytes) -> None:
        self.strategy.commit(manifest)

    def abort(self) -> None:
        self.strategy.abort()

    def close(self) -> None:
        self.strategy.close()


class LocalTarget:
    """A checkpoint root on a local or network (NFS) filesystem.

    Args:
        read_only: never create, write or delete anything; the root must exist. Write
            operations raise ConfigError.
    """

    lease_stale_s = LEASE_STALE_S  # a writer on another machine is gone once its heartbeat is this old

    def __init__(self, path: str, *, io_threads: int = 8, direct_io: bool = True, read_only: bool = False) -> None:
        self.gds = False  # write through cuFile (see ckptmgr.storage.cufile.enable_writer)
        self.path = os.path.abspath(path)
        self.url = self.path
        self.read_only = read_only
        if read_only:
            if not os.path.isdir(self.path):
                raise StepNotFoundError(f"no checkpoint root at {self.path!r} (not a directory)")
        else:
            try:
                makedirs_durable(self.path)  # (synced: a power loss after the first saves keeps the root)
            except FileExistsError:
                if os.path.lexists(self.path):
                    raise StorageError(f"checkpoint root {self.path!r} exists and is not a directory") from None
                raise StorageError(f"cannot create checkpoint root {self.path!r}: a parent exists and is not "
                                   "a directory") from None
            except OSError as exc:
                raise StorageError(f"cannot create checkpoint root {self.path!r}: {exc.strerror}") from exc
            if not os.access(self.path, os.R_OK | os.W_OK | os.X_OK):
                raise StorageError(f"checkpoint root {self.path!r} is not readable and writable by this process "
                                   "(open it with read_only=True to restore from it)")
        self.io_pool: Executor = DaemonPool(io_threads, thread_name_prefix="ckptmgr-io")
        self.direct_io = direct_io
        self.keeper = LeaseKeeper(self.path, self.lease_stale_s / 5)
        self._mu = threading.Lock()  # guards _root_id, _skipped
        self._root_id: str | None = None
        self._skipped: dict[int, str] = {}  # step -> why the last listing left it out

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ConfigError(f"cannot {what}: the checkpoint root {self.path} is open read-only")

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.path, step_name(check_step(step)))

    @contextlib.contextmanager
    def _open_step(self, step: int) -> Any:
        """The directory fd of committed-or-not ``step``. Raises StepNotFoundError when there
        is no such directory, or it is a link (not a step of this root)."""
        d = self._step_dir(step)
        opened = contextlib.ExitStack()
        try:
            dfd = opened.enter_context(open_dir(d))
        except FileNotFoundError:
            raise StepNotFoundError(f"step {step} is not committed under {self.path}") from None
        except NotADirectoryError:
            raise StepNotFoundError(f"{d} is a symbolic link or not a directory: not a step of this root "
                                    "(ckptmgr never reads or deletes through links)") from None
        with opened:  # what the body raises (a file missing from the step) passes as it is
            yield dfd

    def list_steps(self) -> list[int]:
        """Committed steps, ascending. A step directory this process cannot search (another
        user's, mode 000, an I/O error) is left out and reported (see :attr:`skipped`): one
        such step never makes the root or the other steps unusable.

        Raises:
            StorageError: the root itself cannot be listed.
        """
        skipped: dict[int, str] = {}
        try:
            with open_dir(self.path) as root:
                steps = []
                for name in os.listdir(root):
                    step = parse_step_name(name)
                    if step is None:
                        continue
                    try:
                        st = os.stat(name, dir_fd=root, follow_symlinks=False)
                        if stat.S_ISDIR(st.st_mode):
                            os.stat(f"{name}/{MANIFEST_NAME}", dir_fd=root, follow_symlinks=False)
                            steps.append(step)
                    except (FileNotFoundError, NotADirectoryError):
                        continue
                    except OSError as exc:  # this step only
                        skipped[step] = f"{os.path.join(self.path, name)} cannot be read: {exc.strerror}"
        except OSError as exc:
            raise StorageError(f"cannot list checkpoint root {self.path!r}: {exc.strerror}") from exc
        with self._mu:
            new = {s: why for s, why in skipped.items() if self._skipped.get(s) != why}
            self._skipped = skipped
        for s, why in sorted(new.items()):
            log.warning("skipping step %d: %s; the other steps are listed, restored and deleted as usual", s, why)
        return sorted(steps)

    @property
    def skipped(self) -> dict[int, str]:
        """Steps the last :meth:`list_steps` left out because they cannot be read, with why
        (each is logged once, as a warning, when first seen)."""
        with self._mu:
            return dict(self._skipped)

    def cleanup(self) -> list[str]:
        if self.read_only:
            return []
        return remove_local_leftovers(self.path, self.lease_stale_s)

    def root_id(self, create: bool = False) -> str | None:
        """The root's identity (written once, with the first commit); None when it has none."""
        with self._mu:
            if self._root_id is not None:
                return self._root_id
        found = self._read_root_id()
        if found is None and create and not self.read_only:
            found = self._write_root_id()
        with self._mu:
            self._root_id = found
        return found

    def _read_root_id(self) -> str | None:
        try:
            with open_dir(self.path) as root:
                fd = open_regular(ROOT_ID_NAME, dir_fd=root, where=os.path.join(self.path, ROOT_ID_NAME))
        except (FileNotFoundError, CheckpointCorruptError):
            return None
        try:
            return parse_root_id(os.pread(fd, 65, 0))
        finally:
            os.close(fd)

    def _write_root_id(self) -> str | None:
        """Write a new identity once (a temporary file linked into place: never overwritten,
        never seen half-written); the one already there if another process was first."""
        new = new_root_id()
        tmp = f"{ROOT_ID_NAME}.tmp-{secrets.token_hex(8)}"
        with open_dir(self.path) as root:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644, dir_fd=root)
            try:
                pwrite_all(fd, np.frombuffer(new.encode("ascii") + b"\n", dtype=np.uint8), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, ROOT_ID_NAME, src_dir_fd=root, dst_dir_fd=root, follow_symlinks=False)
            except FileExistsError:
                return self._read_root_id()
            finally:
                os.unlink(tmp, dir_fd=root)
            os.fsync(root)
        return new

    def begin(self, step: int, prefix: str = "") -> _LocalStepWriter:
        # A directory of its own; the prefix tells another rank of this job (which writes the
        # same step beside us) from another job (refused: see RenameCommit).
        check_step(step)
        self._check_writable(f"save step {step}")
        return _LocalStepWriter(self, RenameCommit(self.path, step, self.keeper, prefix=prefix,
                                                   on_commit=lambda: self.root_id(create=True)))

    def read_manifest(self, step: int) -> bytes:
        with self._open_step(step) as d:
            where = os.path.join(self._step_dir(step), MANIFEST_NAME)
            try:
                fd = open_regular(MANIFEST_NAME, dir_fd=d, where=where)
            except FileNotFoundError:
                raise StepNotFoundError(f"step {step} is not committed under {self.path}") from None
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                return read_manifest_bytes(os.fstat(fd).st_size, f.read, where)
        finally:
            os.close(fd)

    def file_size(self, step: int, name: str, *, fresh: bool = False) -> int:  # (always fresh)
        with self._open_step(step) as d:
            return stat_regular(_plain(name), dir_fd=d, where=os.path.join(self._step_dir(step), name)).st_size

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
        with self._open_step(step) as d:
            preadv_into(_plain(name), offset, out, dir_fd=d)

    def read_chunk(self, step: int, name: str, offset: int, buf: np.ndarray[Any, Any], length: int) -> str:
        """``read_into`` for one buffer, reading what the page cache lacks with O_DIRECT when
        ``offset`` and ``buf`` allow it (see :func:`~ckptmgr.storage.posix.pread_chunk`);
        ``buf`` may be written up to ``length`` rounded up to 4096 bytes."""
        with self._open_step(step) as d:
            return pread_chunk(_plain(name), offset, buf, length, dir_fd=d)

    def open_direct(self, step: int, name: str) -> DirectFile | None:
        """Data file ``name`` of committed ``step`` open for direct reads of aligned blocks, or
        ``None`` where it is in the page cache or the filesystem refuses ``O_DIRECT`` (see
        :func:`~ckptmgr.storage.posix.open_direct`). The caller closes it."""
        with self._open_step(step) as d:
            return open_direct(_plain(name), dir_fd=d, where=os.path.join(self._step_dir(step), name))

    def path_of(self, step: int, name: str) -> str:
        """Where data file ``name`` of committed ``step`` lies (for the in-place loader),
        checked to be a regular file in a real step directory.

        Raises:
            StepNotFoundError: no such step directory (or it is a link).
            CheckpointCorruptError: the file is a link, FIFO, device or directory.
        """
        path = os.path.join(self._step_dir(step), _plain(name))
        with self._open_step(step) as d:
            stat_regular(_plain(name), dir_fd=d, where=path)
        return path

    def delete(self, step: int) -> None:
        self._check_writable(f"delete step {step}")
        d = self._step_dir(step)
        try:
            with open_dir(d) as dfd:
                try:
                    stat_regular(MANIFEST_NAME, dir_fd=dfd, where=os.path.join(d, MANIFEST_NAME))
                    os.unlink(MANIFEST_NAME, dir_fd=dfd)  # first: from here on the step is gone
                except FileNotFoundError:
                    pass
                except CheckpointCorruptError as exc:
                    raise StorageError(f"not deleting step {step}: {exc}") from None
                os.fsync(dfd)
        except FileNotFoundError:
            return
        except NotADirectoryError:
            raise StorageError(f"not deleting {d}: it is a symbolic link or not a directory, and ckptmgr "
                               "deletes only directories it created") from None
        left = remove_ours(d, is_our_file)
        if left:
            log.warning("left %s in place: it holds files ckptmgr did not write (%s)", d, left)
        fsync_dir(self.path)

    def set_protected(self, step: int, protected: bool) -> None:
        self._check_writable(f"change the protection of step {step}")
        with self._open_step(step) as d:
            try:
                stat_regular(MANIFEST_NAME, dir_fd=d)
            except (FileNotFoundError, CheckpointCorruptError):
                raise StepNotFoundError(f"step {step} is not committed under {self.path}") from None
            marker = os.path.join(self._step_dir(step), PROTECT_NAME)
            if protected:
                try:
                    fd = os.open(PROTECT_NAME, os.O_WRONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK, 0o644,
                                 dir_fd=d)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                        raise StorageError(f"cannot protect step {step}: {marker} exists and is not a regular file "
                                           "(a link, directory or FIFO); remove it and try again") from None
                    raise
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise StorageError(f"cannot protect step {step}: {marker} is not a regular file; remove it")
                    os.fsync(fd)
                finally:
                    os.close(fd)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(PROTECT_NAME, dir_fd=d)  # (a link is removed, never followed)
            os.fsync(d)

    def is_protected(self, step: int) -> bool:
        try:
            with self._open_step(step) as d:
                return stat.S_ISREG(os.stat(PROTECT_NAME, dir_fd=d, follow_symlinks=False).st_mode)
        except (FileNotFoundError, StepNotFoundError):
            return False

    def close(self) -> None:
        self.keeper.close()
        self.io_pool.shutdown(wait=True)


def _plain(name: str) -> str:
    """A file name inside a step directory: no separators, no ``..``."""
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise CheckpointCorruptError(f"{name!r} is not a file name inside a step directory")
    return name
