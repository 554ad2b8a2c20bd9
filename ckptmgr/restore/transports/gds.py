"""GPUDirect Storage reads (:class:`GdsTransport`): kvikio reads a plan's chunks straight into
the memory of their destination, on the GPU, and what landed is read back and verified.

kvikio is imported through :mod:`ckptmgr.storage.cufile`, which also probes (in a child
process with a time limit) whether kvikio can do I/O on this machine at all.

A destination that lays the file out in memory of its own (:class:`DeviceDest`: a restore's
:class:`~ckptmgr.restore.loaders.landing.Landing`, on the GPU or the host) has its spans read
whole by kvikio, the data never passing through host memory on its way in, so the checksums
cannot be computed as it is read: once every read of the file has landed (and the device
has synchronised), each chunk is read back from where it landed (device-to-host, on the
transport's pool), the bytes no span holds (the safetensors header) read from the file
beside them, and handed to the driver as the destination's own bytes, which it verifies. A
failed step leaves unverified bytes in such a destination: the restorer verifies a step's
files before GDS reads land in a target's own tensors. Chunks of any other destination, and
those of a check, are read by kvikio into scratch host buffers, verified, then landed, as
:class:`~ckptmgr.restore.transports.pread.PreadTransport` reads them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from ...errors import CheckpointCorruptError
from ...storage.cufile import kvikio_module
from ..preflight import drain, wait_all
from ..read import Chunk, Land
from .pread import PreadTransport

__all__ = ["DeviceDest", "GdsTransport"]


class DeviceDest(Protocol):
    """A destination with memory of its own that a file's bytes are read straight into."""

    @property
    def spans(self) -> list[tuple[int, int, torch.Tensor]]:
        """``(begin, end, memory)``: bytes ``[begin, end)`` of the file land in ``memory``
        (uint8, on a GPU or the host), sorted, not overlapping."""
        ...

    def gather(self, begin: int, dst: torch.Tensor) -> None:
        """Copy what landed of bytes ``[begin, begin + dst.numel())`` into ``dst`` (host)."""
        ...


def _device_dest(dest: object) -> DeviceDest | None:
    return dest if hasattr(dest, "spans") and hasattr(dest, "gather") else None


def _buffer(t: torch.Tensor | np.ndarray[Any, Any]) -> object:
    """What kvikio accepts for ``t``: the tensor itself on a GPU, a numpy view on the host."""
    if isinstance(t, np.ndarray):
        return t
    return t if t.device.type == "cuda" else t.numpy()


class _Files:
    """The files of one read open with kvikio: opened and closed by the reading thread, read
    from any thread in between."""

    def __init__(self, paths: dict[str, str], names: set[str], opener: Callable[[str], Any]) -> None:
        self.paths = paths
        self.handles: dict[str, Any] = {}
        try:
            for name in sorted(names):
                self.handles[name] = opener(paths[name])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        while self.handles:
            self.handles.popitem()[1].close()

    def read(self, name: str, offset: int, out: torch.Tensor | np.ndarray[Any, Any], size: int) -> Any:
        """Start reading ``size`` bytes from ``offset`` into ``out``; the future's ``get()``
        is the number read."""
        return self.handles[name].pread(_buffer(out), size, offset)

    def check(self, name: str, offset: int, size: int, n: int) -> None:
        if n != size:
            raise CheckpointCorruptError(f"{self.paths[name]} ended early: read {n} of the {size} bytes at "
                                         f"offset {offset}")

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
        """Fill ``out`` (arrays in file order) with the bytes from ``offset`` (the scratch
        reads' call, :class:`~ckptmgr.restore.transports.pread.Reader`)."""
        futures: list[tuple[int, int, Any]] = []
        at = offset
        try:
            for arr in out:
                futures.append((at, arr.size, self.read(name, at, arr, arr.size)))
                at += arr.size
        finally:  # (the reads started end before anything is raised)
            got = _ends([fut for _, _, fut in futures])
        for (b, size, _), n in zip(futures, got, strict=True):
            if isinstance(n, Exception):
                raise n
            self.check(name, b, size, n)


def _ends(futures: list[Any]) -> list[int | Exception]:
    """Wait for every kvikio read of ``futures``: the bytes each read, or how it failed."""
    out: list[int | Exception] = []
    for fut in futures:
        try:
            out.append(fut.get())
        except Exception as exc:
            out.append(exc)
    return out


class GdsTransport:
    """Reads a plan's chunks from ``paths`` (data file name -> local path) with kvikio, the
    read-backs and checks on ``pool`` (or, without one, on ``workers`` threads of its own,
    made for each :meth:`read`); ``opener(path)``: a file open for kvikio reads (default
    ``kvikio.CuFile(path, "r")``). Serves several reads at once.

    Raises:
        ConfigError: kvikio is not installed (from the constructor, before anything is read).
    """

    def __init__(self, paths: dict[str, str], *, pool: Executor | None = None, workers: int = 8,
                 opener: Callable[[str], Any] | None = None) -> None:
        if opener is None:
            kvikio = kvikio_module()
            opener = lambda path: kvikio.CuFile(path, "r")  # noqa: E731
        self.paths = paths
        self.pool = pool
        self.workers = max(1, workers)
        self.opener = opener

    def read(self, chunks: Sequence[Chunk], land: Land) -> None:
        """Fetch and land every chunk (see :class:`~ckptmgr.restore.read.Transport`), one file
        after the other; nothing of a file is read once a chunk before it has failed."""
        if not chunks:
            return
        missing = {c.file for c in chunks} - self.paths.keys()
        if missing:
            raise ValueError(f"no path for {sorted(missing)}: GDS reads local files by path")
        files = _Files(self.paths, {c.file for c in chunks}, self.opener)
        with contextlib.ExitStack() as stack:
            stack.callback(files.close)  # (after the pool below has ended its tasks)
            pool = self.pool
            if pool is None:
                pool = stack.enter_context(ThreadPoolExecutor(self.workers, thread_name_prefix="ckptmgr-gds"))
            host = PreadTransport(files, 0, pool=pool, workers=self.workers)
            for group in _groups(chunks):
                dest = _device_dest(group[0].dest)
                if dest is None:
                    host.read(group, land)
                else:
                    _read_device(files, group, dest, land, pool)


def _groups(chunks: Sequence[Chunk]) -> list[list[Chunk]]:
    """``chunks`` in runs of one file and one destination."""
    out: list[list[Chunk]] = []
    for c in chunks:
        if out and (out[-1][-1].file, out[-1][-1].dest) == (c.file, c.dest):
            out[-1].append(c)
        else:
            out.append([c])
    return out


def _read_device(files: _Files, chunks: list[Chunk], dest: DeviceDest, land: Land, pool: Executor) -> None:
    """Read every span of ``dest`` with kvikio, wait for them, then read each chunk back (the
    bytes no span holds from the file) and hand it to ``land`` on ``pool``."""
    name = chunks[0].file
    reads: list[tuple[int, int, Any]] = []
    short: list[tuple[int, int, Exception]] = []  # the spans read short or not at all, and why
    try:
        for b, e, dst in dest.spans:
            reads.append((b, e, files.read(name, b, dst, e - b)))
    finally:  # every read started ends before anything is handed on or raised
        for (b, e, _), n in zip(reads, _ends([fut for _, _, fut in reads]), strict=True):
            try:
                if isinstance(n, Exception):
                    raise n
                files.check(name, b, e - b, n)
            except Exception as exc:
                short.append((b, e, exc))
    devices = {dst.device for _, _, dst in dest.spans if dst.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)
    stop = threading.Event()  # set at the first failure: no chunk is read back after it

    def check(c: Chunk) -> None:
        if stop.is_set():
            return
        try:
            failure = next((exc for b, e, exc in short if b < c.end and c.begin < e), None)
            land(c, failure if failure is not None else [_read_back(files, c, dest).numpy()])
        except BaseException:
            stop.set()
            raise

    futures: list[Future[None]] = []
    try:
        futures.extend(pool.submit(check, c) for c in chunks)
        wait_all(futures)
    except BaseException:  # (an interrupt too) nothing more starts; the started end first
        drain(futures)
        raise


def _read_back(files: _Files, c: Chunk, dest: DeviceDest) -> torch.Tensor:
    """Chunk ``c``'s bytes as they landed in ``dest``, those no span holds read from the file."""
    host = torch.empty(c.size, dtype=torch.uint8)
    at = c.begin
    for b, e, _ in dest.spans:
        if e <= c.begin or b >= c.end:
            continue
        if b > at:
            _read_file(files, c.file, at, host[at - c.begin:b - c.begin])
        lo, hi = max(b, c.begin), min(e, c.end)
        dest.gather(lo, host[lo - c.begin:hi - c.begin])
        at = hi
    if at < c.end:
        _read_file(files, c.file, at, host[at - c.begin:])
    return host


def _read_file(files: _Files, name: str, offset: int, out: torch.Tensor) -> None:
    files.check(name, offset, out.numel(), files.read(name, offset, out, out.numel()).get())
