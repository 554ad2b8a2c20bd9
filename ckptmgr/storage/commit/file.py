"""The file commit: a complete file image committed at a user's path, atomically.

A local or NFS path gets a temporary beside it (never in the system temp directory, so the
rename never crosses filesystems), written in parallel chunks (O_DIRECT for the aligned bulk
where the filesystem allows it), fsynced, renamed over the destination and the directory
fsynced: a path that exists always holds a complete file. Any other fsspec URL gets one
``pipe_file`` (an object store's PUT is atomic); S3 goes through ckptmgr's S3 target
(parallel multipart upload, retries, abort on failure).

Temporaries are named ``.ckptmgr-<pid>-<hex>.partial``: hidden, with no trace of the
destination's name (tools that parse checkpoint names, such as Lightning's, never mistake one
for a checkpoint; :data:`~ckptmgr.format.naming.FILE_TEMP_RE`), and removable once their
writer process is gone (:func:`remove_stale_temps`).

:class:`FileCommit` is this commit as a strategy of the save engine
(:class:`ckptmgr.save.engine.AsyncWriter`): one file image, replacing what the path held.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np

from ...format.checksum import chunk_ranges
from ...format.naming import FILE_TEMP_RE, file_temp_name
from ...options import S3Options
from .. import open_target
from ..posix import fsync_dir, pwrite_all
from . import dead_writers

__all__ = ["Destinations", "FileCommit", "remove_stale_temps", "write_file_atomic",
           "write_s3_object", "write_url_atomic"]

_DIRECT_ALIGN = 4096
_DIRECT_MIN = 16 << 20  # smaller files gain nothing from O_DIRECT


def remove_stale_temps(directory: str) -> list[str]:
    """Remove the temporaries that writers which no longer run left in ``directory``."""
    removed: list[str] = []
    for path, _ in dead_writers(directory, FILE_TEMP_RE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(os.path.basename(path))
    return removed


def write_file_atomic(path: str, data: np.ndarray[Any, Any], *, pool: Executor | None, chunk_size: int,
                      direct_io: bool = True) -> None:
    """Write ``data`` (contiguous uint8) to the local file ``path``, atomically and durably.

    Chunks of ``chunk_size`` bytes are written by ``pool``'s threads (one thread without a
    pool). ``path`` is replaced only once the whole file is on disk.

    Raises:
        OSError: the write failed; ``path`` is as it was and no temporary is left.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, file_temp_name())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    dfd = -1
    try:
        os.ftruncate(fd, data.size)  # chunks then overwrite in place, in any order
        direct_end = 0
        if direct_io and data.size >= _DIRECT_MIN and data.ctypes.data % _DIRECT_ALIGN == 0:
            try:  # O_DIRECT for the aligned bulk: no page-cache copy, no dirty-page flood
                dfd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0))
                direct_end = data.size // _DIRECT_ALIGN * _DIRECT_ALIGN
            except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
                dfd = -1

        def write(rng: tuple[int, int]) -> None:
            b, e = rng
            split = min(max(direct_end, b), e)
            if split > b:
                pwrite_all(dfd, data[b:split], b)
            if e > split:
                pwrite_all(fd, data[split:e], split)

        ranges = chunk_ranges(data.size, chunk_size)
        if pool is None or len(ranges) <= 1:
            for r in ranges:
                write(r)
        else:
            for _ in pool.map(write, ranges):
                pass
        os.fsync(fd)
    except BaseException:
        for f in (dfd, fd):
            if f >= 0:
                os.close(f)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if dfd >= 0:
        os.close(dfd)
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def write_url_atomic(fs: Any, path: str, data: np.ndarray[Any, Any]) -> None:
    """Write ``data`` to ``path`` on the fsspec filesystem ``fs`` in one ``pipe_file`` (an
    object store's single PUT or completed multipart upload is atomic)."""
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        with contextlib.suppress(Exception):  # object stores have no directories
            fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(path, memoryview(data).tobytes())  # type: ignore[arg-type]


def write_s3_object(target: Any, key: str, data: np.ndarray[Any, Any]) -> None:
    """Upload ``data`` as the object ``key`` through an :class:`~ckptmgr.storage.s3.S3Target`:
    one PUT, or a multipart upload whose parts go in parallel on the target's upload threads,
    every request under its retry policy. The object appears whole when the upload completes;
    a failed upload is aborted (no orphaned parts)."""
    part = target.part_size(data.size)
    if data.size <= part:
        target.call("put_object", Key=key, Body=memoryview(data).tobytes())  # type: ignore[arg-type]
        return
    upload_id = target.call("create_multipart_upload", Key=key)["UploadId"]
    futures: list[Future[str]] = []
    try:
        def send(n: int, begin: int) -> str:
            body = memoryview(data[begin:begin + part]).tobytes()  # type: ignore[arg-type]
            return str(target.call("upload_part", Key=key, UploadId=upload_id, PartNumber=n, Body=body)["ETag"])

        futures = [target.upload_pool.submit(send, i + 1, b) for i, b in enumerate(range(0, data.size, part))]
        etags = [f.result() for f in futures]
        target.call("complete_multipart_upload", Key=key, UploadId=upload_id,
                    MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]})
    except BaseException:
        for f in futures:
            f.cancel()
        with contextlib.suppress(Exception):
            target.call("abort_multipart_upload", Key=key, UploadId=upload_id)
        raise


class Destinations:
    """What the file commits of one writer share: the local directories whose stale
    temporaries were swept (once each), and the S3 targets opened per directory.

    Owned by the engine's worker thread (the commits run there); :meth:`close` runs once the
    worker has stopped.

    Args:
        storage_options: fsspec options of remote paths (credentials, endpoints).
        s3_options: multipart upload and retries of ``s3://`` paths.
        io_threads: upload threads of each S3 target.
    """

    def __init__(self, storage_options: dict[str, Any] | None = None, s3_options: S3Options | None = None, *,
                 io_threads: int = 8) -> None:
        self._storage_options = storage_options
        self._s3_options = s3_options
        self._io_threads = io_threads
        self._mu = threading.Lock()  # guards the two fields below (close() may run on another thread)
        self._swept: set[str] = set()
        self._s3: dict[str, Any] = {}  # directory URL -> S3Target

    def sweep(self, directory: str) -> None:
        """Remove the temporaries dead writers left in ``directory``, the first time only."""
        with self._mu:
            if directory in self._swept:
                return
            self._swept.add(directory)
        remove_stale_temps(directory)

    def s3_target(self, directory: str) -> Any:
        with self._mu:
            target = self._s3.get(directory)
        if target is None:
            target = open_target(directory, self._storage_options, io_threads=self._io_threads,
                                 s3_options=self._s3_options)
            with self._mu:
                self._s3[directory] = target
        return target

    def close(self) -> None:
        with self._mu:
            targets, self._s3 = self._s3, {}
        for t in targets.values():
            t.close()


class FileCommit:
    """Commit one file image at ``path``, replacing what it held (a save engine strategy).

    Args:
        path: the destination (local, or a path on ``fs``).
        fs: an fsspec filesystem; None for a local path.
        dests: the writer's shared destination state.
        chunk_size: bytes per write task of a local file.
        direct_io: O_DIRECT for the aligned bulk of local files where the filesystem allows it.
        done: called when the commit is over, whatever happened (the engine's ``close``).
    """

    def __init__(self, path: str, fs: Any, dests: Destinations, *, chunk_size: int, direct_io: bool,
                 done: Callable[[], None] | None = None) -> None:
        self.path = path
        self.fs = fs
        self._dests = dests
        self._chunk_size = chunk_size
        self._direct_io = direct_io
        self._done = done

    def write(self, buffers: list[np.ndarray[Any, Any]], io: Executor) -> None:
        # (an image of no bytes takes no slot: torch.save replaced by one that writes nothing, as
        # Lightning's tests do, gives an empty file, as Lightning's own plugin writes then)
        (buf,) = buffers or [np.empty(0, dtype=np.uint8)]
        if self.fs is None:
            directory = os.path.dirname(self.path)
            os.makedirs(directory, exist_ok=True)
            self._dests.sweep(directory)
            write_file_atomic(self.path, buf, pool=io, chunk_size=self._chunk_size, direct_io=self._direct_io)
        elif "s3" in _protocols(self.fs):
            directory, name = self.path.rsplit("/", 1)
            target = self._dests.s3_target(directory)
            prefix = getattr(target, "prefix", "")  # an S3Target
            write_s3_object(target, f"{prefix}/{name}" if prefix else name, buf)
        else:
            write_url_atomic(self.fs, self.path, buf)

    def commit(self, error: BaseException | None) -> None:
        if error is not None:
            raise error

    def close(self) -> None:
        if self._done is not None:
            self._done()


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)
