"""One-file destinations: a complete file image committed at a path, atomically.

A local or NFS path gets a temporary beside it (never in the system temp directory, so the
rename never crosses filesystems), written in parallel chunks (O_DIRECT for the aligned bulk
where the filesystem allows it), fsynced, renamed over the destination and the directory
fsynced: a path that exists always holds a complete file. Any other fsspec URL gets one
``pipe_file`` (an object store's PUT is atomic); S3 goes through ckptmgr's S3 target
(parallel multipart upload, retries, abort on failure).

Temporaries are named ``.ckptmgr-<pid>-<hex>.partial``: hidden, with no trace of the
destination's name (tools that parse checkpoint names, such as Lightning's, never mistake one
for a checkpoint), and removable once their writer process is gone (:func:`remove_stale_temps`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np

from ..format.checksum import chunk_ranges
from .lease import process_alive
from .posix import fsync_dir, pwrite_all

__all__ = ["TEMP_PATTERN", "remove_stale_temps", "write_file_atomic", "write_s3_object", "write_url_atomic"]

TEMP_PATTERN = re.compile(r"^\.ckptmgr-(\d+)-[0-9a-f]{12}\.partial$")
_DIRECT_ALIGN = 4096
_DIRECT_MIN = 16 << 20  # smaller files gain nothing from O_DIRECT


def _temp_name() -> str:
    return f".ckptmgr-{os.getpid()}-{secrets.token_hex(6)}.partial"


def remove_stale_temps(directory: str) -> list[str]:
    """Remove the temporaries that writers which no longer run left in ``directory``."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = TEMP_PATTERN.match(name)
        if m and int(m.group(1)) != os.getpid() and not process_alive(int(m.group(1)), -1):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
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
    tmp = os.path.join(directory, _temp_name())
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
