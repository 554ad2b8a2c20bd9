"""POSIX file access that never follows a symbolic link out of a step directory.

Everything below the root (step directories, their files, temporaries, markers) is reached
relative to a directory file descriptor opened with ``O_NOFOLLOW``, so a link planted in
place of a directory is refused, never followed, whichever moment it appears. Files are
opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` before a byte is read: a
FIFO, socket or device is refused without blocking on it. The one link that is read is a
file's link to another regular file of the same directory (one hop, by plain name); deleting
and marking follow none. The root itself may be a link (the user named it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import posixpath
import stat
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError

__all__ = ["DIRECT_ALIGN", "NOT_REGULAR", "DirectFile", "direct_of", "fsync_dir", "makedirs_durable", "open_dir",
           "open_direct", "open_regular", "populate", "pread_address", "pread_chunk", "preadv_fd", "preadv_into",
           "pwrite_all", "remove_ours", "sibling", "stat_regular"]

log = logging.getLogger("ckptmgr")

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_DIRECT = getattr(os, "O_DIRECT", 0)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024  # buffers per readv call
DIRECT_ALIGN = 4096  # offset, length and address alignment this module uses for O_DIRECT reads
NOT_REGULAR = "is not a regular file (a symbolic link, directory, FIFO or device); ckptmgr reads only regular files"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a regular file"


@contextlib.contextmanager
def open_dir(path: str, name: str | None = None, *, dir_fd: int | None = None) -> Iterator[int]:
    """A file descriptor of directory ``path`` (or of entry ``name`` of the directory
    ``dir_fd``), refusing a symbolic link in the last component.

    Raises:
        FileNotFoundError: it does not exist.
        NotADirectoryError: it is a link or not a directory.
    """
    target = path if name is None else name
    try:
        fd = os.open(target, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotADirectoryError(errno.ENOTDIR, "is a symbolic link or not a directory", path) from None
        raise
    try:
        yield fd
    finally:
        os.close(fd)


def sibling(name: str, *, dir_fd: int | None, where: str) -> str:
    """The file that link ``name`` points to, which must be another plain name in the same
    directory (a link out of the directory, or to a link, is refused).

    Raises:
        CheckpointCorruptError: the link leaves the directory.
    """
    target = posixpath.normpath(os.readlink(name, dir_fd=dir_fd))
    if "/" in target or target in (".", "..") or "\0" in target:
        raise CheckpointCorruptError(f"{where} is a symbolic link out of its step directory (to {target!r}); "
                                     "ckptmgr reads step contents only from inside the step")
    return target


def open_regular(name: str, *, dir_fd: int | None = None, where: str | None = None) -> int:
    """Open regular file ``name`` (relative to ``dir_fd``) for reading without blocking on a
    FIFO; a link is followed only to a regular file of the same directory (one hop);
    ``where`` names it in errors.

    Raises:
        FileNotFoundError: it (or the file its link names) does not exist.
        CheckpointCorruptError: it is a link out of the directory, a FIFO, a device, a directory.
    """
    where = where or name
    for hop in (0, 1):
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP and hop == 0:
                name = sibling(name, dir_fd=dir_fd, where=where)
                continue
            if exc.errno == errno.ELOOP:
                raise CheckpointCorruptError(f"{where} is a link to a link; ckptmgr follows one link, to a "
                                             "regular file of the same step") from None
            if exc.errno in (errno.ENXIO, errno.EISDIR):  # a socket, a directory
                raise CheckpointCorruptError(f"{where} {NOT_REGULAR}") from None
            raise
        break
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(f"{where} is {_kind(st.st_mode)}, not a regular file; "
                                         "ckptmgr reads only regular files")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def stat_regular(name: str, *, dir_fd: int | None = None, where: str | None = None) -> os.stat_result:
    """``lstat`` of regular file ``name``, or of the regular file of the same directory that its
    link names (one hop). Nothing is opened.

    Raises:
        FileNotFoundError: it does not exist.
        CheckpointCorruptError: it is not a regular file, or a link out of its directory.
    """
    where = where or name
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        st = os.stat(sibling(name, dir_fd=dir_fd, where=where), dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorruptError(f"{where} is {_kind(st.st_mode)}, not a regular file; "
                                     "ckptmgr reads only regular files (or a link to one in the same step)")
    return st


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str, mode: int = 0o777) -> list[str]:
    """Create directory ``path`` and its missing parents (as ``os.makedirs(exist_ok=True)``),
    then make them survive a power loss: fsync each directory created and the directory
    holding it, up to the first parent that existed (a new directory's entry lives only in
    its parent's dirty metadata until the parent is synced). Returns the directories
    created, outermost first; ``[]`` when ``path`` existed (nothing is synced then).

    Raises:
        FileExistsError: ``path`` or a parent exists and is not a directory.
        OSError: a directory cannot be created or synced (permissions, I/O).
    """
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        if os.path.lexists(p):
            if os.path.isdir(p):  # another process made it between the two checks
                break
            raise FileExistsError(errno.EEXIST, "exists and is not a directory", p)
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    created = []
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
            created.append(d)
        except FileExistsError:  # another process was first; it may die before its fsync, so
            if not os.path.isdir(d):  # this call syncs what it found missing all the same
                raise
    found = missing  # (those another process made meanwhile too)
    for d in sorted({*found, *(os.path.dirname(c) for c in found)}, key=len, reverse=True):
        fsync_dir(d)  # (innermost first; each is durable once its fsync returns)
    return created


def pwrite_all(fd: int, data: np.ndarray[Any, Any], offset: int) -> None:
    """Write all of ``data`` (contiguous) at ``offset``; OSError if a write makes no progress."""
    view = memoryview(data)  # type: ignore[arg-type]
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"a write of {len(view)} bytes at {offset} wrote nothing")
        view, offset = view[n:], offset + n


def preadv_into(path: str, offset: int, out: list[np.ndarray[Any, Any]], *, dir_fd: int | None = None) -> None:
    """Fill the uint8 arrays in ``out``, in order, with the regular file ``path``'s bytes from
    ``offset`` (a link or FIFO is refused, see :func:`open_regular`).

    Raises:
        CheckpointCorruptError: the file ended early, or it is not a regular file.
    """
    fd = open_regular(path, dir_fd=dir_fd, where=path)
    try:
        preadv_fd(fd, offset, out, path)
    finally:
        os.close(fd)


def preadv_fd(fd: int, offset: int, out: list[np.ndarray[Any, Any]], where: str) -> None:
    """:func:`preadv_into` on an open descriptor (``where`` names the file in errors).

    Raises:
        CheckpointCorruptError: the file ended early.
    """
    views = [memoryview(a) for a in out if a.size]  # type: ignore[arg-type]
    while views:
        n = os.preadv(fd, views[:_IOV_MAX], offset)  # (more buffers than IOV_MAX is EINVAL; releases the GIL)
        if n == 0:
            raise CheckpointCorruptError(f"{where} ended early, at byte {offset}")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]


_PREAD: list[Any] = []  # [libc's pread through ctypes], made once (a race makes it twice, alike)


_MADVISE: list[Any] = []  # [libc's madvise through ctypes], made once
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # (Linux 5.14): fault pages in, as reads / writes would


def populate(address: int, nbytes: int, *, write: bool = True) -> bool:
    """Fault in the pages of host memory ``[address, address + nbytes)`` in one call
    (``madvise(MADV_POPULATE_WRITE)``, or ``MADV_POPULATE_READ`` for a mapping only read;
    the whole pages inside the range), the GIL released: a thread ahead of the writes into
    fresh memory, or of the reads of a file mapped afresh, takes their page faults on itself.
    Contents are unchanged. False where the kernel cannot (before Linux 5.14, or not Linux):
    the accesses then fault the pages in themselves."""
    if not _MADVISE:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return False
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _MADVISE.append(fn)
    page = mmap.PAGESIZE
    begin, end = -(-address // page) * page, (address + nbytes) // page * page
    if end <= begin:
        return True
    for _ in range(3):  # (interrupted: again, a few times; pages already in are not faulted twice)
        if _MADVISE[0](begin, end - begin, _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ) == 0:
            return True
        if ctypes.get_errno() not in (errno.EINTR, errno.EAGAIN):
            return False
    return False


def pread_address(fd: int, address: int, nbytes: int, offset: int, where: str) -> None:
    """Read ``nbytes`` of the open file ``fd`` from ``offset`` into host memory at ``address``
    (``where`` names the file in errors). libc's ``pread`` through ctypes: the GIL is released
    for each call and no Python object is made for the buffer, for loops that read many pieces
    on several threads (:mod:`ckptmgr.restore.loaders.bounce`).

    Raises:
        CheckpointCorruptError: the file ended early.
        OSError: the read failed.
        ValueError: the range is negative or past what a file offset can name.
    """
    if not _PREAD:
        fn = ctypes.CDLL(None, use_errno=True).pread
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]  # (off_t: 64 bits)
        fn.restype = ctypes.c_ssize_t
        _PREAD.append(fn)
    pread = _PREAD[0]
    if offset < 0 or nbytes < 0 or offset + nbytes >= 1 << 63:  # (ctypes would wrap it silently)
        raise ValueError(f"reading {where}: {nbytes} bytes at byte {offset} is outside any file")
    while nbytes > 0:
        n = pread(fd, address, nbytes, offset)
        if n < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise OSError(err, f"reading {where} at byte {offset}: {os.strerror(err)}")
        if n == 0:
            raise CheckpointCorruptError(f"{where} ended early, at byte {offset}")
        address, offset, nbytes = address + n, offset + n, nbytes - n


def pread_chunk(path: str, offset: int, buf: np.ndarray[Any, Any], length: int, *, dir_fd: int | None = None) -> str:
    """Fill ``buf[:length]`` with the regular file ``path``'s bytes from ``offset``: a chunk
    mostly in the page cache is copied from it (``"cached"``), any other is read
    with ``O_DIRECT`` straight into ``buf`` (``"direct"``: no page-cache copy and no cache
    pollution, as fast readers of cold files do), with plain reads where the filesystem
    refuses it (tmpfs, some NFS) or the alignment does not allow it (``"buffered"``).
    Returns which it was.

    Direct reads need ``offset`` and ``buf``'s address aligned to :data:`DIRECT_ALIGN` and
    room in ``buf`` for ``length`` rounded up to it (``buf`` may be written past ``length``
    up to that bound); otherwise the read is plain.

    Raises:
        CheckpointCorruptError: the file ended early, or it is not a regular file.
    """
    fd = open_regular(path, dir_fd=dir_fd, where=path)
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
        done = 0
        how = "buffered"
        if (_DIRECT and length and offset % DIRECT_ALIGN == 0 and buf.ctypes.data % DIRECT_ALIGN == 0
                and buf.size >= -(-length // DIRECT_ALIGN) * DIRECT_ALIGN):
            how = "cached" if _mostly_cached(fd, offset, length) else "direct"
        if how == "direct":
            done, how = _read_direct(fd, view, offset, length)
        while done < length:
            n = os.preadv(fd, [view[done:length]], offset + done)
            if n == 0:
                raise CheckpointCorruptError(f"{path} ended early, at byte {offset + done}")
            done += n
        return how
    finally:
        os.close(fd)


class DirectFile:
    """A regular file open for ``O_DIRECT`` reads of aligned blocks (see :func:`open_direct`),
    read from any number of threads at once. Falls back to plain reads, for good, where the
    filesystem refuses a direct read after accepting the open."""

    def __init__(self, plain: int, direct: int, where: str) -> None:
        self.where = where
        self._plain = plain  # both descriptors are owned by this object until close()
        self._direct = direct
        self._fallback = False  # set once, by the first refused read; a stale read of it costs one retry

    @property
    def direct_fd(self) -> int:
        """The ``O_DIRECT`` descriptor, for reads submitted elsewhere (:mod:`.aio`)."""
        return self._direct

    def read(self, offset: int, view: memoryview, length: int, *, plain: bool = False) -> None:
        """Fill ``view[:length]`` with the bytes from ``offset`` (a multiple of
        :data:`DIRECT_ALIGN`, as is ``view``'s address); ``view`` may be written up to
        ``length`` rounded up to :data:`DIRECT_ALIGN`. ``plain``: through the page cache,
        for good (the filesystem refused a direct read).

        Raises:
            CheckpointCorruptError: the file ended before ``offset + length``.
        """
        done = 0
        self._fallback = self._fallback or plain
        if not self._fallback:
            end = -(-length // DIRECT_ALIGN) * DIRECT_ALIGN
            try:
                while done < length:
                    n = os.preadv(self._direct, [view[done:end]], offset + done)
                    if n <= 0 or (n % DIRECT_ALIGN and done + n < length):
                        raise CheckpointCorruptError(f"{self.where} ended early, at byte {offset + done + max(n, 0)}")
                    done += n
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._fallback = True  # refused here: plain reads from where it stopped
        while done < length:
            n = os.preadv(self._plain, [view[done:length]], offset + done)
            if n == 0:
                raise CheckpointCorruptError(f"{self.where} ended early, at byte {offset + done}")
            done += n

    def close(self) -> None:
        os.close(self._direct)
        os.close(self._plain)


def open_direct(path: str, *, dir_fd: int | None = None, where: str | None = None) -> DirectFile | None:
    """Regular file ``path`` (checked as :func:`open_regular` does) open for direct reads; or
    ``None`` where most of it is in the page cache (copying from there is faster than reading
    the device again) or the filesystem refuses ``O_DIRECT`` (tmpfs, some network
    filesystems).

    Raises:
        FileNotFoundError: it does not exist.
        CheckpointCorruptError: it is not a regular file, or a link out of its directory.
    """
    where = where or path
    if not _DIRECT:
        return None
    fd = open_regular(path, dir_fd=dir_fd, where=where)
    try:
        return direct_of(fd, where)
    finally:
        os.close(fd)


def direct_of(fd: int, where: str) -> DirectFile | None:
    """The regular file open as ``fd`` (which stays the caller's) open again for direct reads,
    as :func:`open_direct` decides: ``None`` where most of it is in the page cache or the
    filesystem refuses ``O_DIRECT``. The result's :meth:`DirectFile.close` closes its own
    descriptors only."""
    if not _DIRECT:
        return None
    own = os.dup(fd)
    try:
        size = os.fstat(own).st_size
        if size > 0 and not _mostly_cached(own, 0, size):
            direct = os.open(f"/proc/self/fd/{own}", os.O_RDONLY | _DIRECT | _CLOEXEC)  # the file just checked
            return DirectFile(own, direct, where)
    except OSError:  # O_DIRECT refused (or no /proc): the caller reads through the page cache
        pass
    except BaseException:
        os.close(own)
        raise
    os.close(own)
    return None


def _libc_mincore() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_MINCORE = _libc_mincore()


def _mostly_cached(fd: int, offset: int, length: int, samples: int = 8) -> bool:
    """Whether at least half of ``samples`` pages spread evenly over bytes ``[offset, offset +
    length)`` (``offset`` a multiple of the page size) are in the page cache, as ``mincore``
    tells of a mapping of them: nothing is read, so asking never brings a page in (a
    non-waiting read that misses starts readahead, and the next ask would find the pages it
    brought), and a sample costs the same for a file of any size. False where it cannot be
    told."""
    if _MINCORE is None or length <= 0 or offset % mmap.PAGESIZE:
        return False
    try:
        with mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset) as mapped:
            view = np.frombuffer(mapped, dtype=np.uint8)
            address = view.ctypes.data
            del view  # (the mapping closes only once nothing exports it)
            pages = -(-length // mmap.PAGESIZE)
            n = min(samples, pages)
            picked = {i * pages // n for i in range(n)}  # (spread over all of them, also when few)
            state = ctypes.c_ubyte(0)
            where = ctypes.addressof(state)
            resident = 0
            for page in picked:
                if _MINCORE(address + page * mmap.PAGESIZE, 1, where) != 0:
                    return False
                resident += state.value & 1
            return resident * 2 >= len(picked)
    except (OSError, ValueError):  # a file shorter than the range, an unmappable file
        return False


def _read_direct(fd: int, view: memoryview, offset: int, length: int) -> tuple[int, str]:
    """Read ``length`` bytes (rounded up to the alignment) at aligned ``offset`` into ``view``
    through an O_DIRECT descriptor of the same open file; returns the bytes read (fewer at
    the end of the file) and ``"direct"``, or ``0, "buffered"`` where O_DIRECT is refused."""
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | _DIRECT | _CLOEXEC)  # the file already checked
    except OSError:  # refused here (tmpfs, some network filesystems)
        return 0, "buffered"
    try:
        pos, end = 0, -(-length // DIRECT_ALIGN) * DIRECT_ALIGN
        while pos < length:
            n = os.preadv(dfd, [view[pos:end]], offset + pos)
            if n <= 0:
                break
            pos += n
            if n % DIRECT_ALIGN:  # the end of the file
                break
        return min(pos, length), "direct"
    except OSError:  # refused at the read: plain reads from the start
        return 0, "buffered"
    finally:
        os.close(dfd)


def remove_ours(path: str, is_ours: Any, *, keep_dir: bool = False) -> list[str]:
    """Remove the entries of directory ``path`` whose names ``is_ours`` accepts (files, or links
    themselves: never what they point to; never a directory), then the directory itself when
    it is empty (unless ``keep_dir``). Returns the names left behind; ``[]`` when ``path`` is
    gone.

    Raises:
        NotADirectoryError: ``path`` is a link or not a directory.
        OSError: a removal failed (permissions, I/O).
    """
    try:
        with open_dir(path) as dfd:
            left = []
            for name in os.listdir(dfd):
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if is_ours(name) and not stat.S_ISDIR(st.st_mode):  # (unlink never follows a link)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dfd)
                else:
                    left.append(name)
            if not left:
                os.fsync(dfd)
    except FileNotFoundError:
        return []
    if not left and not keep_dir:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:  # (something appeared meanwhile: reported below)
                raise
            return sorted(os.listdir(path))
    return sorted(left)
