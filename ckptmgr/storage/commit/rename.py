"""The rename commit (local and NFS roots, where a directory rename is atomic).

Files go to a fresh temporary directory ``.step_<n>.tmp-<hex>/`` beside the destination,
claimed by its lock file (``flock()``ed, with the writer's lease); the commit writes
``manifest.json`` inside, fsyncs, and renames the directory to ``step_<n>/``. An abort removes
only what this writer created; the claim is released after the commit or abort (``close()``).
:func:`remove_local_leftovers` removes what gone writers left. :class:`CommitStrategy` is the
protocol every step commit follows (see :mod:`ckptmgr.storage.commit`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from ...errors import CkptTimeoutError, StepExistsError, StorageError
from ...format.manifest import MANIFEST_NAME
from ...format.naming import (
    is_our_file,
    is_root_id_temp,
    is_temp_lock_name,
    is_temp_name,
    parse_step_name,
    step_name,
    temp_lock_name,
    temp_name,
)
from ..lease import Lease, LeaseKeeper, current, process_alive, release, writer_gone
from ..posix import fsync_dir, open_dir, pwrite_all, remove_ours

__all__ = ["CommitStrategy", "RenameCommit", "manifest_sizes", "remove_local_leftovers"]

log = logging.getLogger("ckptmgr")

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_TMPFILE = getattr(os, "O_TMPFILE", 0)  # Linux: lock files claimed whole (see _claim_whole)


class CommitStrategy(Protocol):
    """One step's way from written files to a visible checkpoint.

    Made by the target's ``begin()`` (which claims the step for this writer); then, on the
    writer's thread: :meth:`wrote` after each file, :meth:`commit` once, or :meth:`abort`;
    :meth:`close` releases the claim (commit and abort call it themselves).
    """

    location: str  # where the writer puts its files ("" when they go straight to the step)

    def wrote(self, name: str, size: int, etag: str | None = None) -> None:
        """Record a file this writer has written (what an abort removes, what the commit checks)."""

    def commit(self, manifest: bytes) -> None:
        """Check every file of ``manifest`` is there with its size, then make the step visible.
        Raises StepExistsError when another writer committed it first."""

    def abort(self) -> None:
        """Remove what this writer wrote, never anything another writer committed. Never raises."""

    def close(self) -> None:
        """Release the claim on the step (idempotent)."""


def manifest_sizes(manifest: bytes) -> dict[str, int]:
    """File name -> size, from the manifest this process has just built."""
    files = json.loads(manifest).get("files", {})
    return {name: int(rec["size"]) for name, rec in files.items()}


class RenameCommit:
    """Local and NFS roots: a locked temporary directory, renamed to the step at the commit.

    The lock file ``.step_<n>.tmp-<hex>.lock`` is created (and ``flock()``ed) before the
    directory and removed after it is renamed or removed, so a temporary directory without
    its lock file never belongs to a live writer. The lock file holds the writer's lease and
    its file ``prefix``; its mtime is the heartbeat, renewed by ``keeper``.

    A step that another live writer is writing (its lock file held) is refused with
    StepExistsError before anything is written, unless that writer is another rank of this
    job (another non-empty ``prefix``): the root is looked at before the claim and again
    once the claim is visible, so of two writers that start the same step, at least one
    sees the other (both are refused when they start within the same instant).
    """

    def __init__(self, root: str, step: int, keeper: LeaseKeeper,
                 on_commit: Callable[[], object] | None = None, prefix: str = "") -> None:
        self.root = root
        self.step = step
        self._on_commit = on_commit  # run once the files are checked, before the step becomes visible
        self.final = os.path.join(root, step_name(step))
        if os.path.lexists(self.final):
            raise StepExistsError(f"step {step} is already committed at {self.final}")
        self._mu = threading.Lock()  # guards _lock_fd and _written
        self._written: dict[str, int] = {}
        self._keeper = keeper
        name = temp_name(step)
        self.location = os.path.join(root, name)
        self._lock_path = os.path.join(root, temp_lock_name(name))
        _refuse_if_written(root, step, prefix, "")
        self._lease = current()
        try:
            self._lock_fd = self._claim(self._lease, prefix)
        except BaseException:
            release(self._lease)
            raise
        try:
            _refuse_if_written(root, step, prefix, os.path.basename(self._lock_path))
            os.mkdir(self.location, 0o755)
        except BaseException:
            self.close()
            raise
        keeper.add(self)

    def _claim(self, lease: Lease, prefix: str = "") -> int:
        record = _claim_record(lease, prefix)
        fd = _claim_whole(self.root, self._lock_path, record)
        if fd >= 0:
            return fd
        # No anonymous files here (NFS, old kernels, no /proc): create, then lock and write.
        # A writer killed in between leaves an empty lock file that the clean-up keeps until
        # its heartbeat is stale, as it must for a writer it cannot tell from a live one.
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
        try:
            # (waits: a clean-up or another writer's look at the root may hold it for a moment)
            _lock_within(fd, self._lock_path, CLAIM_LOCK_WAIT_S)
            st, now = os.fstat(fd), os.stat(self._lock_path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):  # (a clean-up took it meanwhile)
                raise StorageError(f"the lock file {self._lock_path} was removed while it was being created")
            pwrite_all(fd, np.frombuffer(record, dtype=np.uint8), 0)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self._lock_path)
            raise
        return fd

    def refresh(self) -> None:
        with self._mu:
            if self._lock_fd >= 0:
                os.utime(self._lock_fd)

    def wrote(self, name: str, size: int, etag: str | None = None) -> None:
        with self._mu:
            self._written[name] = size

    def adopt(self, parts: list[tuple[str, list[str]]]) -> None:
        """Move other writers' files of this step (``(their location, names)``) into ours."""
        for where, names in parts:
            if os.path.dirname(os.path.abspath(where)) != self.root or not is_temp_name(os.path.basename(where)):
                raise StorageError(f"{where} is not a temporary directory under {self.root}: "
                                   "a rank writes to another root")
            with open_dir(where) as src, open_dir(self.location) as dst:
                for name in names:
                    os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
            with contextlib.suppress(OSError):
                os.rmdir(where)

    def check(self, sizes: dict[str, int]) -> None:
        """Every file of the manifest is in the temporary directory, a regular file of its size."""
        with open_dir(self.location) as dfd:
            for name, size in sizes.items():
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    raise StorageError(f"{self.location}/{name} is missing: step {self.step} not committed") from None
                if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                    raise StorageError(f"{self.location}/{name} is not the {size}-byte file written: "
                                       f"step {self.step} not committed")

    def commit(self, manifest: bytes) -> None:
        self.check(manifest_sizes(manifest))
        if self._on_commit is not None:
            self._on_commit()
        with open_dir(self.location) as dfd:
            fd = os.open(MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644,
                         dir_fd=dfd)
            try:
                pwrite_all(fd, np.frombuffer(manifest, dtype=np.uint8), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.fsync(dfd)
        if os.path.lexists(self.final):
            raise StepExistsError(f"step {self.step} is already committed at {self.final}")
        try:
            os.rename(self.location, self.final)  # replaces nothing but an empty directory
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise StepExistsError(f"step {self.step} is already committed at {self.final}") from None
            raise
        fsync_dir(self.root)
        self.close()

    def abort(self) -> None:
        try:
            left = remove_ours(self.location, is_our_file)
            if left:
                log.warning("left %s in place: it holds files ckptmgr did not write (%s)", self.location, left)
        except OSError as exc:
            log.warning("could not remove %s after a failed save (%s); the next start retries", self.location, exc)
        finally:
            self.close()

    def close(self) -> None:
        self._keeper.remove(self)
        release(self._lease)
        with self._mu:
            fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self._lock_path)
            os.close(fd)

    def __del__(self) -> None:  # a writer dropped without commit/abort: let the lock go with it
        if hasattr(self, "_lease"):
            release(self._lease)
        fd = getattr(self, "_lock_fd", -1)
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _claim_record(lease: Lease, prefix: str) -> bytes:
    """What a lock file holds: the writer's lease (which :meth:`Lease.from_bytes` reads) and
    the prefix of the files it writes (``""``: the whole step)."""
    return json.dumps({**json.loads(lease.to_bytes()), "prefix": prefix}, sort_keys=True).encode("utf-8")


def _read_claim(data: bytes) -> tuple[Lease | None, str | None]:
    """The lease and file prefix in a lock file's bytes (untrusted); None for what is not there."""
    lease = Lease.from_bytes(data)
    try:
        prefix = json.loads(data).get("prefix") if lease is not None else None
    except (ValueError, AttributeError):
        prefix = None
    return lease, prefix if isinstance(prefix, str) else None


def _refuse_if_written(root: str, step: int, prefix: str, mine: str) -> None:
    """Raise StepExistsError when a live writer other than lock file ``mine`` holds a claim on
    ``step`` under ``root`` that conflicts with one for ``prefix`` (the same prefix, or either
    is the whole step). A claim whose lock is free, whose writer is provably gone (a clean-up
    holds its lock) or whose prefix cannot be read yet (a claim being created) is no
    conflict: the commit still refuses to replace a committed step."""
    try:
        names = os.listdir(root)
    except OSError as exc:
        raise StorageError(f"cannot list checkpoint root {root!r}: {exc.strerror}") from exc
    for name in names:
        if name == mine or not is_temp_lock_name(name) or parse_step_name(name.split(".")[1]) != step:
            continue
        try:
            fd = os.open(os.path.join(root, name), os.O_RDONLY | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK)
        except OSError:  # gone meanwhile, a link, unreadable: not a claim this writer can judge
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                continue  # free: its writer is gone
            except BlockingIOError:
                pass
            lease, theirs = _read_claim(os.pread(fd, 4097, 0))
        finally:
            os.close(fd)
        if lease is None or theirs is None or (theirs and prefix and theirs != prefix):
            continue
        if lease.on_this_machine() and not process_alive(lease.pid, lease.start):
            continue  # a clean-up holds a dead writer's lock while it removes its files
        where = f"pid {lease.pid} on {lease.host}" + (
            " (this process)" if lease.pid == os.getpid() and lease.on_this_machine() else "")
        raise StepExistsError(f"step {step} is being written by {where} (its claim {os.path.join(root, name)}); "
                              "a step is saved by one writer at a time")


CLAIM_LOCK_WAIT_S = 30.0  # the longest a new claim waits for another process's look at its lock file


def _lock_within(fd: int, path: str, timeout_s: float) -> None:
    """flock(LOCK_EX) on ``fd``, waiting at most ``timeout_s`` (a look at the lock by another
    process lasts moments; a holder hung on NFS must not hang the save). Raises
    CkptTimeoutError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise CkptTimeoutError(f"the lock file {path} stayed locked by another process for "
                                       f"{timeout_s:.0f} s") from None
            time.sleep(0.01)


def _claim_whole(root: str, path: str, record: bytes) -> int:
    """Make the lock file ``path`` appear whole: an anonymous file in ``root``
    (``O_TMPFILE``), ``flock()``ed and holding ``record``, linked into place, so no one ever
    sees it unlocked or empty, and a writer killed before the link leaves nothing behind.
    Returns its descriptor, or -1 where the file system or kernel has no anonymous files.
    Raises ``FileExistsError`` when ``path`` exists, as ``O_EXCL`` would."""
    if not _TMPFILE:
        return -1
    try:
        fd = os.open(root, os.O_RDWR | _TMPFILE | _CLOEXEC, 0o644)
    except OSError:  # EOPNOTSUPP, EISDIR (kernels before 3.11), EINVAL, ...
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        pwrite_all(fd, np.frombuffer(record, dtype=np.uint8), 0)
        try:
            # linkat(AT_SYMLINK_FOLLOW) links the open file itself; os.link only calls linkat,
            # not link() (which links the /proc entry and fails with EXDEV), given a dir_fd
            with open_dir(os.path.dirname(path)) as dfd:
                os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=dfd, follow_symlinks=True)
        except FileExistsError:
            raise
        except OSError:  # no /proc: fall back to a named claim
            os.close(fd)
            return -1
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return fd


def _temp_gone(root: str, temp: str, stale_after_s: float) -> tuple[bool, int]:
    """Whether the writer of temporary directory ``temp`` is gone; when it is, also the
    ``flock()``ed descriptor of its lock file (-1 when it has none), to be closed once the
    temporary is removed."""
    lock = os.path.join(root, temp_lock_name(temp))
    try:
        fd = os.open(lock, os.O_RDWR | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return True, -1  # a live writer creates its lock file first and removes it last
    except OSError as exc:  # a link, or another user's: cannot tell, so not ours to remove
        log.warning("left %s in place: its lock file cannot be checked (%s)", os.path.join(root, temp), exc.strerror)
        return False, -1
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return False, -1
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: the writer lives
            os.close(fd)
            return False, -1
        lease = Lease.from_bytes(os.pread(fd, 4097, 0))
        # The lock is free. On this machine that proves the writer gone; a lease from another
        # machine is trusted to its heartbeat too (an NFS mount with local locks cannot tell).
        if (lease is None or not lease.on_this_machine()) and not writer_gone(
                lease, time.time() - st.st_mtime, stale_after_s):
            os.close(fd)
            return False, -1
        return True, fd
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def remove_local_leftovers(root: str, stale_after_s: float) -> list[str]:
    """Remove, under ``root``, the temporaries of saves whose writer is gone, their orphaned
    lock files, and the step directories of interrupted deletes (no manifest): only names of
    ours, only regular files with our names inside, never through a link. Returns what was
    removed; what cannot be removed is logged and left."""
    removed: list[str] = []
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        raise StorageError(f"cannot list checkpoint root {root!r}: {exc.strerror}") from exc
    for name in names:
        full = os.path.join(root, name)
        try:
            st = os.stat(full, follow_symlinks=False)
        except FileNotFoundError:
            continue
        try:
            if is_temp_name(name) and stat.S_ISDIR(st.st_mode):
                gone, fd = _temp_gone(root, name, stale_after_s)
                if not gone:
                    continue
                try:
                    left = remove_ours(full, is_our_file)
                    if left:
                        log.warning("left %s in place: it holds files ckptmgr did not write (%s)", full, left)
                        continue
                    removed.append(full)
                    if fd >= 0:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(root, temp_lock_name(name)))
                finally:
                    if fd >= 0:
                        os.close(fd)
            elif is_temp_lock_name(name) and stat.S_ISREG(st.st_mode) and not os.path.lexists(full[:-5]):
                gone, fd = _temp_gone(root, name[:-5], stale_after_s)
                if gone and fd >= 0:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(full)
                    os.close(fd)
                    removed.append(full)
            elif is_root_id_temp(name) and stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime > 60:
                os.unlink(full)  # (a writer of the identity links it into place within microseconds)
                removed.append(full)
            elif parse_step_name(name) is not None and stat.S_ISDIR(st.st_mode):
                try:
                    with open_dir(full) as dfd:
                        try:
                            os.stat(MANIFEST_NAME, dir_fd=dfd, follow_symlinks=False)
                            continue  # committed
                        except FileNotFoundError:
                            pass
                except PermissionError:
                    continue  # not ours to judge: the listing skips and reports it
                left = remove_ours(full, is_our_file)  # a delete interrupted after its manifest went
                if left:
                    log.warning("left %s in place: it holds files ckptmgr did not write (%s)", full, left)
                else:
                    removed.append(full)
        except OSError as exc:
            log.warning("could not remove the leftover %s (%s: %s); remove it by hand or give this process "
                        "write access", full, type(exc).__name__, exc.strerror or exc)
    return removed

