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
run, and each piece is verified there: a plan of the pieces, run by the read driver
(:mod:`ckptmgr.restore.read`) over threaded reads
(:class:`~ckptmgr.restore.transports.pread.PreadTransport`).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointCorruptError, CkptError, StepNotFoundError
from ..format.manifest import FileRecord, Manifest
from ..restore.preflight import Source, preflight
from ..restore.read import Chunk, Mismatch, ReadPlan, run
from ..restore.transports.pread import PreadTransport

__all__ = ["RangedReads", "read_errors", "sub_chunk_size"]

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
        chunks: list[Chunk] = []
        for fname, idx in sorted(self._chunks.items()):
            rec = self.manifest.files[fname]
            unit, crc = _pieces(rec)
            spans: list[tuple[int, np.ndarray[Any, Any]]] = []
            for first, last in _runs(sorted(idx)):
                begin, end = first * unit, min((last + 1) * unit, rec.size)
                run_of = _Run(begin, np.empty(end - begin, dtype=np.uint8))
                spans.append((begin, run_of.buf))
                chunks += [Chunk(fname, i, i * unit, min((i + 1) * unit, rec.size), crc(i), run_of)
                           for i in range(first, last + 1)]
            self._spans[fname] = spans
            self._begins[fname] = [b for b, _ in spans]
        try:
            run(ReadPlan(self._where_step(), tuple(chunks), self._message), PreadTransport(
                self.source, self.step, pool=self.source.io_pool, request_bytes=_REQUEST))
        except BaseException:
            self._spans.clear()
            self._begins.clear()
            raise
        self.bytes_read += sum(c.size for c in chunks)

    def _message(self, m: Mismatch) -> str:
        return f"{self._where(m.file)}: bytes [{m.begin}, {m.end}) fail their checksum (CRC32C {m.got}, " \
               f"manifest {m.want})"

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


class _Run:
    """A run of adjacent pieces of one file: read straight into ``buf`` (file offset ``begin``
    at its start), each piece verified there."""

    def __init__(self, begin: int, buf: np.ndarray[Any, Any]) -> None:
        self.begin, self.buf = begin, buf

    def into(self, begin: int, end: int) -> list[np.ndarray[Any, Any]]:
        return [self.buf[begin - self.begin:end - self.begin]]

    def land(self, begin: int, data: torch.Tensor) -> None:
        """(A transport that read the piece elsewhere.)"""
        arr = data.numpy()
        self.buf[begin - self.begin:begin - self.begin + arr.size] = arr


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted ints -> ``(first, last)`` of each run of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def _vanished(source: Source, step: int, where: str, exc: FileNotFoundError) -> CkptError:
    """A file of the step is missing: the step was deleted while it was read, or is damaged."""
    try:
        steps = source.steps() if hasattr(source, "steps") else source.list_steps()  # type: ignore[attr-defined]
    except Exception:  # the listing failed too: call it gone
        steps = []
    if step in steps:
        return CheckpointCorruptError(f"{where}: {exc.filename or exc} is missing")
    return StepNotFoundError(f"{where} was deleted while it was read")


@contextlib.contextmanager
def read_errors(source: Source, step: int, where: str) -> Iterator[None]:
    """Turn a storage failure during a read into one of our errors (so that every rank can
    agree on it): a vanished file is a deleted or a damaged step."""
    try:
        yield
    except FileNotFoundError as exc:
        raise _vanished(source, step, where, exc) from exc
    except OSError as exc:
        raise CheckpointCorruptError(f"{where} cannot be read: {exc}") from exc
