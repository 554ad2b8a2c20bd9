"""Private directories and small files, never through symlinks.

A directory that other users could have created first (a predictable name in /dev/shm) is
used only if lstat shows a real directory, owned by this user, with no permission for group
or others, and the directory then opened is that same one (``O_NOFOLLOW``, device and inode
compared). Files inside are reached through the directory's descriptor with ``O_NOFOLLOW``,
so a symlink planted anywhere is refused, never followed.
"""

from __future__ import annotations

import contextlib
import os
import stat

from ..errors import CheckpointCorruptError

__all__ = ["NOFOLLOW", "UnsafePathError", "check_private_dir", "empty_dir", "open_private_dir", "read_small",
           "write_small"]

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(OSError):
    """A path is not a private directory of this user (planted by someone else, or a symlink)."""


def check_private_dir(st: os.stat_result, what: str) -> None:
    """Raise UnsafePathError unless ``st`` (from lstat) is a directory of this user, mode 0700 or less."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{what} is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{what} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"{what} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
    if st.st_mode & 0o077:
        raise UnsafePathError(f"{what} has mode {stat.S_IMODE(st.st_mode):o}; it must be private (0700)")


def open_private_dir(name: str, dir_fd: int | None, what: str) -> int:
    """Create (mode 0700) or open the directory ``name``, verified before use; return its fd."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    check_private_dir(os.lstat(name, dir_fd=dir_fd), what)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW, dir_fd=dir_fd)
    try:  # the same directory that lstat saw (no swap in between)
        st, lst = os.fstat(fd), os.lstat(name, dir_fd=dir_fd)
        check_private_dir(st, what)
        if (st.st_dev, st.st_ino) != (lst.st_dev, lst.st_ino):
            raise UnsafePathError(f"{what} was replaced while it was opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(name: str, dir_fd: int, limit: int = 1 << 24) -> bytes:
    """The bytes of regular file ``name`` in ``dir_fd`` (at most ``limit``), never through a symlink."""
    fd = os.open(name, os.O_RDONLY | NOFOLLOW, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise CheckpointCorruptError(f"{name} is not a regular file of at most {limit} bytes")
        return os.read(fd, st.st_size + 1)[:limit]
    finally:
        os.close(fd)


def write_small(name: str, dir_fd: int, data: bytes) -> None:
    """Create or truncate file ``name`` in ``dir_fd`` (mode 0600, never through a symlink) with ``data``."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def empty_dir(dir_fd: int) -> None:
    """Unlink every entry of the directory open as ``dir_fd`` (a symlink is removed, never
    followed; a subdirectory, or an entry that cannot be removed, stays)."""
    for name in os.listdir(dir_fd):
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
