"""Verified reads of parts of a step's data files.

A rank that restores at another layout needs byte ranges of files other ranks wrote. Each
file it reads is checked first like in every restore
(:func:`~ckptmgr.restore.preflight.preflight`: a regular file, of its recorded size, its
safetensors header the index's). Every byte it hands out has been checked against the
checksum of a piece of the file that it read whole: the file's *sub-chunks* (1 MiB,
recorded by multi-rank saves, see :func:`sub_chunk_size`) or, for files without them, its
checksum chunks (16 MiB by default). So a range costs at most one such piece more at each
end (ranges that share a piece share the read). Measured on the layout of a Llama-7B FSDP2
state restored at other world sizes (benchmarks/reshard_reads.py), 16 MiB pieces made a rank
read 1.6-7.3x the bytes of its new shards, 1 MiB pieces 1.1-1.6x. Runs of adjacent pieces
are read in requests of up to 16 MiB on the source's I/O threads, straight into a buffer per
run, and each piece is verified there.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError
from ..format.checksum import crc32c_hex
from ..format.manifest import FileRecord, Manifest
from ..restore.preflight import Source, preflight

__all__ = ["RangedReads", "sub_chunk_size"]

_REQUEST = 16 << 20  # bytes per read request (a run of pieces is split into requests of this size)


def sub_chunk_size(chunk_size: int) -> int:
    """The granularity of the finer checksums a multi-rank save records: 1 MiB for the default
    16 MiB chunks, a sixteenth of smaller chunks (never below 256 bytes; 0: none)."""
    sub = min(1 << 20, chunk_size // 16)
    return sub if sub >= 256 and chunk_size % sub == 0 else 0


def _pieces(rec: FileRecord) -> tuple[int, Callable[[int], str]]:
    """The verifiable pieces of a file: their size and each one's checksum."""
    if rec.sub_chunk_size:
        return rec.sub_chunk_size, rec.sub_crc
    return rec.chunk_size, rec.crc32c.__getitem__


class RangedReads:
    """Byte ranges of one step's files: registered with :meth:`want`, fetched and verified
    by :meth:`read`, then handed out by :meth:`get`. Used by one thread at a time (the read
    tasks write only their own slices of the buffers, and ``bytes_read`` under a lock)."""

    def __init__(self, source: Source, step: int, manifest: Manifest) -> None:
        self.source = source
        self.step = step
        self.manifest = manifest
        self._chunks: dict[str, set[int]] = {}  # file -> indices of the verifiable pieces wanted
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
        unit, _ = _pieces(rec)
        self._chunks.setdefault(fname, set()).update(range(begin // unit, (end - 1) // unit + 1))

    def read(self) -> None:
        """Read and verify every registered piece.

        Raises:
            CheckpointCorruptError: a file is not a regular file, has another size or header
                than the manifest records, or a piece fails its checksum.
            FileNotFoundError: a file is missing.
        """
        files = {f: self.manifest.files[f] for f in self._chunks}
        # every file to be read: regular, of its size, its header the index's; before any allocation
        preflight(self.source, self.step, dataclasses.replace(self.manifest, files=files), self._where_step())
        tasks: list[tuple[str, int, np.ndarray[Any, Any], int, int, Callable[[int], str]]] = []
        for fname, idx in sorted(self._chunks.items()):
            rec = self.manifest.files[fname]
            unit, crc = _pieces(rec)
            per_request = max(1, _REQUEST // unit)
            spans: list[tuple[int, np.ndarray[Any, Any]]] = []
            for first, last in _runs(sorted(idx)):
                begin, end = first * unit, min((last + 1) * unit, rec.size)
                buf = np.empty(end - begin, dtype=np.uint8)
                spans.append((begin, buf))
                for i in range(first, last + 1, per_request):
                    j = min(i + per_request, last + 1)
                    b, e = i * unit, min(j * unit, rec.size)
                    tasks.append((fname, b, buf[b - begin:e - begin], i, unit, crc))
            self._spans[fname] = spans
            self._begins[fname] = [b for b, _ in spans]
        lock = threading.Lock()

        def task(fname: str, b: int, out: np.ndarray[Any, Any], first: int, unit: int,
                 crc: Callable[[int], str]) -> None:
            self.source.read_into(self.step, fname, b, [out])
            for k in range(0, out.size, unit):
                got = crc32c_hex(out[k:k + unit])
                want = crc(first + k // unit)
                if got != want:
                    raise CheckpointCorruptError(
                        f"{self._where(fname)}: bytes [{b + k}, {b + min(k + unit, out.size)}) fail their checksum "
                        f"(CRC32C {got}, manifest {want})")
            with lock:
                self.bytes_read += out.size

        futures = [self.source.io_pool.submit(task, *t) for t in tasks]
        errors = [f.exception() for f in futures]
        first_error = next((x for x in errors if x is not None), None)
        if first_error is not None:
            self._spans.clear()
            self._begins.clear()
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

    def _where_step(self) -> str:
        return f"{self.source.url}: step {self.step}"


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted ints -> ``(first, last)`` of each run of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out
