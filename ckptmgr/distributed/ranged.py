"""Verified reads of parts of a step's data files.

A rank that restores at another layout needs byte ranges of files other ranks wrote. Each
file's checksums cover fixed chunks (``FileRecord.chunk_size``, 16 MiB by default), so a
range is read as the whole chunks that cover it: every byte handed out has been checked
against its chunk's CRC32C, at the cost of at most one chunk more at each end of a range
(ranges that share a chunk share the read). Chunks are read in parallel on the source's I/O
threads, each straight into its place in a buffer per run of adjacent chunks.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError
from ..format.checksum import crc32c_hex
from ..format.manifest import Manifest
from ..restore.loaders.host import Source, check_file_size

__all__ = ["RangedReads"]


class RangedReads:
    """Byte ranges of one step's files: registered with :meth:`want`, fetched and verified
    by :meth:`read`, then handed out by :meth:`get`. Used by one thread at a time."""

    def __init__(self, source: Source, step: int, manifest: Manifest) -> None:
        self.source = source
        self.step = step
        self.manifest = manifest
        self._chunks: dict[str, set[int]] = {}  # file -> indices of the checksum chunks wanted
        self._spans: dict[str, list[tuple[int, np.ndarray[Any, Any]]]] = {}  # file -> (begin, buffer), sorted
        self._begins: dict[str, list[int]] = {}  # file -> the begin of each span, for bisection
        self.bytes_read = 0
        self.requested = 0

    def want(self, fname: str, begin: int, end: int) -> None:
        """Register ``[begin, end)`` of data file ``fname`` (offsets in the whole file)."""
        if end <= begin:
            return
        rec = self.manifest.files[fname]
        if begin < 0 or end > rec.size:
            raise CheckpointCorruptError(f"{self._where(fname)}: bytes [{begin}, {end}) lie outside its "
                                         f"{rec.size} bytes")
        self.requested += end - begin
        self._chunks.setdefault(fname, set()).update(range(begin // rec.chunk_size, (end - 1) // rec.chunk_size + 1))

    def wants(self, fname: str, begin: int, end: int) -> bool:
        """True when every byte of ``[begin, end)`` lies in chunks already registered."""
        rec = self.manifest.files[fname]
        got = self._chunks.get(fname, set())
        return all(i in got for i in range(begin // rec.chunk_size, (end - 1) // rec.chunk_size + 1))

    def read(self) -> None:
        """Read and verify every registered chunk.

        Raises:
            CheckpointCorruptError: a file is missing, has another size than the manifest
                records, or a chunk fails its checksum.
        """
        tasks: list[tuple[str, int, int, np.ndarray[Any, Any], str]] = []
        for fname, idx in sorted(self._chunks.items()):
            rec = self.manifest.files[fname]
            check_file_size(self.source, self.step, fname, rec.size)
            spans: list[tuple[int, np.ndarray[Any, Any]]] = []
            for first, last in _runs(sorted(idx)):
                begin, end = first * rec.chunk_size, min((last + 1) * rec.chunk_size, rec.size)
                buf = np.empty(end - begin, dtype=np.uint8)
                spans.append((begin, buf))
                for i in range(first, last + 1):
                    b, e = i * rec.chunk_size, min((i + 1) * rec.chunk_size, rec.size)
                    tasks.append((fname, b, e, buf[b - begin:e - begin], rec.crc32c[i]))
            self._spans[fname] = spans
            self._begins[fname] = [b for b, _ in spans]
        lock = threading.Lock()

        def task(fname: str, b: int, e: int, out: np.ndarray[Any, Any], crc: str) -> None:
            self.source.read_into(self.step, fname, b, [out])
            got = crc32c_hex(out)
            if got != crc:
                raise CheckpointCorruptError(
                    f"{self._where(fname)}: bytes [{b}, {e}) fail their checksum (CRC32C {got}, manifest {crc})")
            with lock:
                self.bytes_read += e - b

        futures = [self.source.io_pool.submit(task, *t) for t in tasks]
        errors = [f.exception() for f in futures]
        first_error = next((x for x in errors if x is not None), None)
        if first_error is not None:
            self._spans.clear()
            raise first_error

    def get(self, fname: str, begin: int, end: int) -> np.ndarray[Any, Any] | None:
        """The verified bytes ``[begin, end)`` of ``fname``, or None when they are not all in
        one run of chunks read."""
        i = bisect.bisect_right(self._begins.get(fname, []), begin) - 1
        if i < 0:
            return None
        b, buf = self._spans[fname][i]
        if end - b > buf.size:
            return None
        return buf[begin - b:end - b]

    def _where(self, fname: str) -> str:
        return f"{self.source.url}: step {self.step}, file {fname}"


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted ints -> ``(first, last)`` of each run of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out
