"""Checks of a committed step before any of its data is allocated, read or copied.

Every restore runs :func:`preflight` first: each data file is a regular file (where the
files are local: checked with ``lstat``, so a FIFO or device planted as a data file is
refused without being opened), has the size the manifest records (so no allocation is ever
sized by a manifest alone), and its safetensors header lists exactly the tensors the
manifest puts in it, with the same dtypes, shapes and offsets.

A restore into a target then verifies every checksum before a byte lands in the target's
tensors (:func:`~ckptmgr.restore.verify.verify_files`, :func:`verify_images`), so a step that fails leaves the
target as it was. The loaders check every chunk again as they copy it.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # (checking files needs no torch: the images are made by the loaders)
    import torch

from ..errors import CheckpointCorruptError, CkptTimeoutError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import FileRecord, Manifest

__all__ = ["Source", "check_header", "check_regular", "drain", "header_problems", "local_path", "preflight", "run_all",
           "submit_image_checks", "verify_images", "wait_all"]


class Source(Protocol):
    """What a step is read from: a durable target or the local tier."""

    url: str
    io_pool: Any

    def file_size(self, step: int, name: str) -> int: ...

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None: ...


def local_path(source: Any, step: int, name: str) -> str | None:
    """Where file ``name`` of ``step`` lies when ``source`` keeps files on a local filesystem."""
    path_of = getattr(source, "path_of", None)
    return path_of(step, name) if path_of is not None else None


def check_regular(path: str, what: str) -> None:
    """Raise CheckpointCorruptError unless ``path`` is a regular file, or a symbolic link to one
    in the same directory. Nothing is opened (``lstat``/``stat`` only).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        real = os.path.realpath(path)
        if os.path.dirname(real) != os.path.realpath(os.path.dirname(path)):
            raise CheckpointCorruptError(f"{what} is a symbolic link out of its step directory (to {real}); "
                                         "ckptmgr reads step contents only from inside the step")
        st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorruptError(f"{what} is not a regular file (mode {stat.filemode(st.st_mode)}); "
                                     "it is not read")


def check_header(raw: bytes, fname: str, manifest: Manifest, where: str) -> None:
    """Raise the first of :func:`header_problems`, naming ``where`` and the file.

    Raises:
        CheckpointCorruptError: the header does not match the manifest.
    """
    problems = header_problems(raw, fname, manifest)
    if problems:
        raise CheckpointCorruptError(f"{where}: {fname}: {problems[0]}")


def header_problems(raw: bytes, fname: str, manifest: Manifest) -> list[str]:
    """Differences between data file ``fname``'s safetensors header (``raw``: the first
    ``header_size`` bytes of the file) and the manifest's tensor index."""
    rec = manifest.files[fname]
    n = int.from_bytes(raw[:8], "little")
    if n + 8 != rec.header_size:
        return [f"its header length {n} does not match the manifest's header_size {rec.header_size}"]
    try:
        header = json.loads(raw[8:8 + n])
    except RecursionError:
        return ["its safetensors header is nested too deeply to be one"]
    except (ValueError, UnicodeDecodeError) as exc:
        return [f"its safetensors header cannot be parsed ({exc})"]
    if not isinstance(header, dict):
        return ["its safetensors header is not a JSON object"]
    header.pop("__metadata__", None)
    expected = {k: v for k, v in manifest.tensors.items() if v.get("file") == fname}
    out = []
    for name, entry in expected.items():
        got = header.get(name)
        if not isinstance(got, dict):
            out.append(f"tensor {name!r:.100} of the manifest is missing from its header")
        elif (got.get("dtype"), got.get("shape"), got.get("data_offsets")) != (
                entry["dtype"], entry["shape"], entry["offsets"]) or len(got) != 3:
            out.append(f"tensor {name!r:.100}: its header entry {str(got)[:200]} differs from the manifest's "
                       f"{entry['dtype']}{entry['shape']} at {entry['offsets']}")
    out += [f"tensor {name!r:.100} of its header is not in the manifest" for name in header if name not in expected]
    return out


def run_all(pool: Executor, fn: Callable[..., None], items: Iterable[tuple[Any, ...]]) -> None:
    """Run ``fn(*item)`` for every item on ``pool``; once all have finished, raise the first
    failure (in item order). After a failure, items not yet started are cancelled."""
    wait_all([pool.submit(fn, *item) for item in items])


def drain(futures: list[Future[Any]], timeout: float = 600.0) -> None:
    """Cancel what of ``futures`` has not started and wait for every started one to end, also
    through an interrupt (raised once they have ended): they may read memory the caller is
    about to release. Their own failures are left to :func:`wait_all`.

    Raises:
        CkptTimeoutError: started ones still running after ``timeout`` seconds.
    """
    for fut in futures:
        fut.cancel()
    interrupted: BaseException | None = None
    pending = [f for f in futures if not f.cancelled()]
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        try:
            futures_wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        except BaseException as exc:  # re-raised below
            interrupted = interrupted or exc
        pending = [f for f in pending if not f.done()]
    if interrupted is not None:
        raise interrupted
    if pending:
        raise CkptTimeoutError(f"{len(pending)} started checks did not end within {timeout} s")


def wait_all(futures: list[Future[None]]) -> None:
    """Wait for every one of ``futures``; once all have finished, raise the first failure (in
    list order). After a failure, those not yet started are cancelled."""
    first: BaseException | None = None
    for fut in futures:
        if first is None and not fut.cancelled() and fut.exception() is not None:
            first = fut.exception()
            for other in futures:
                other.cancel()
    for fut in futures:  # every started task is done before anything is returned or raised
        if not fut.cancelled():
            fut.exception()
    if first is not None:
        raise first


def preflight(source: Source, step: int, manifest: Manifest, where: str,
              images: dict[str, torch.Tensor] | None = None, *, headers: bool = True) -> None:
    """Check every data file of ``step`` before anything is allocated: regular, of the
    recorded size, with a header that matches the index. With ``images`` (file images
    already in this process's memory), those are checked instead of the files.
    ``headers=False`` leaves the headers to a read that lands in fresh or spare memory: each
    header comes with its file's first chunks and is checked once the step has been read,
    before anything reaches a target (an object store's restore: one request fewer per file
    before the data).

    Raises:
        CheckpointCorruptError: naming the file and what is wrong.
        FileNotFoundError: a file is missing (the caller tells a deleted step from a damaged one).
    """
    def check(fname: str, rec: FileRecord) -> None:
        what = f"{where}: {fname}"
        if images is not None:
            image = images.get(fname)
            if image is None or image.numel() != rec.size:
                raise CheckpointCorruptError(f"{what}: the staged image does not match the manifest")
            head = image[:rec.header_size].numpy().tobytes()
        else:
            path = local_path(source, step, fname)
            if path is not None:
                check_regular(path, what)
            size = source.file_size(step, fname)
            if size != rec.size:
                raise CheckpointCorruptError(f"{what} has {size} bytes; the manifest says {rec.size} "
                                             "(truncated or replaced)")
            if not headers:
                return
            buf = np.empty(rec.header_size, dtype=np.uint8)
            source.read_into(step, fname, 0, [buf])
            head = buf.tobytes()
        check_header(head, fname, manifest, where)

    items = sorted(manifest.files.items())
    if len(items) == 1 or images is not None:
        for fname, rec in items:
            check(fname, rec)
        return
    run_all(source.io_pool, check, items)


def _chunks(manifest: Manifest) -> list[tuple[str, FileRecord, int, int, int]]:
    return [(fname, rec, i, b, e) for fname, rec in sorted(manifest.files.items())
            for i, (b, e) in enumerate(chunk_ranges(rec.size, rec.chunk_size))]


def _mismatch(where: str, fname: str, b: int, e: int) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{where}: {fname}: checksum mismatch in bytes [{b}, {e})")


def verify_images(images: dict[str, torch.Tensor], manifest: Manifest, pool: Executor, where: str) -> None:
    """Check every checksum chunk of file images already in memory, where they lie.

    Raises:
        CheckpointCorruptError: the first chunk (in file order) that fails.
    """
    wait_all(submit_image_checks(images, manifest, pool, where))


def submit_image_checks(images: dict[str, torch.Tensor], manifest: Manifest, pool: Executor,
                        where: str) -> list[Future[None]]:
    """Start checking every checksum chunk of file images in memory on ``pool``, one task per
    chunk in file order; each raises CheckpointCorruptError if its chunk fails. The caller
    waits for them (:func:`wait_all`, :func:`drain`) before the images may go."""
    arrays = {fname: images[fname].numpy() for fname in manifest.files}

    def task(fname: str, rec: FileRecord, i: int, b: int, e: int) -> None:
        if crc32c_hex(arrays[fname][b:e]) != rec.crc32c[i]:
            raise _mismatch(where, fname, b, e)

    futures: list[Future[None]] = []
    try:
        for c in _chunks(manifest):
            futures.append(pool.submit(task, *c))
    except BaseException:  # (a pool shut down meanwhile) those queued end before this raises
        drain(futures)
        raise
    return futures
