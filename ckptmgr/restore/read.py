"""The read driver: a plan of checksum chunks, made once, run by exactly one transport.

A :class:`ReadPlan` lists the :class:`Chunk` s of a read: which bytes of which file, the
CRC32C they must have (and the finer sub-chunk checksums of multi-rank saves, where a check
wants them), and where their bytes go once verified (a :class:`Dest`), or nowhere: a plan
with no destinations is a check (``ckptmgr verify``, the check before a restore lands in a
target's own tensors). A :class:`Transport` says how the bytes of the chunks arrive
(:mod:`~ckptmgr.restore.transports`: threaded reads into scratch buffers, the pinned ring,
direct reads of cold files block by block, GDS reads into device memory); :func:`run` is the
one driver: it hands the plan's chunks to the transport and, as each chunk's bytes come in,
verifies them and moves them to their destination. Where a transport puts the bytes in the
destination itself (a destination's own memory, direct blocks, GDS), the driver verifies
them there, and the destination holds unverified bytes until the run has returned.

Plans are made by :func:`plan_check` (every checksum chunk of a step's files, each file's to
one destination or none: the checks, the CLI's export, the CPU restore's scatter reads, the
GDS restore) and by readers that pick chunks of their own (the pinned ring's and its cold
files', the verifiable pieces a resharded restore needs); every chunk a plan holds is a whole
checksum chunk (or sub-chunk) of its file, so that each byte read is verified before it is
used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias

import numpy as np

if TYPE_CHECKING:  # (a check lands no tensor: this driver runs without torch imported)
    import torch

from ..errors import CheckpointCorruptError, CkptError
from ..format.checksum import chunk_ranges, crc32c_hex, crc32c_hex_pieces
from ..format.manifest import Manifest

__all__ = ["Bytes", "ChecksumMismatchError", "Chunk", "Dest", "Land", "Landed", "Mismatch", "ReadCancelledError",
           "ReadPlan", "Transport", "plan_check", "run", "verify"]


class Landed(NamedTuple):
    """A chunk whose bytes a transport moved to the chunk's destination itself, piece by piece
    as they came and before they verified (the direct reads of cold files), with the CRC32C
    and length it computed over them. Only for chunks without sub-chunk checksums."""

    crc: int
    size: int


# the bytes of one chunk: a uint8 host tensor, the destination's own arrays (see Dest.into), or
# what a transport that landed the bytes itself computed over them (Landed)
Bytes: TypeAlias = "torch.Tensor | list[np.ndarray[Any, Any]] | Landed"


class Dest(Protocol):
    """Where the verified bytes of a chunk go.

    A destination may also offer ``into(begin, end) -> list of numpy uint8 arrays | None``:
    memory of its own that bytes ``[begin, end)`` of the file may be read straight into, the
    arrays in file order. A transport that can skips its own buffer then, and the chunk,
    once verified there, is in place: :meth:`land` is not called for it. Such a destination
    accepts unverified bytes: it must not be used before the run has returned, and a run
    that fails leaves it holding whatever was read.

    A destination that lays the file out in device memory of its own (``spans`` and
    ``gather``: :class:`~ckptmgr.restore.transports.gds.DeviceDest`, as a restore's landing
    does) may be read straight into by GDS, and what landed read back to be verified; it
    too holds unverified bytes until the run has returned.
    """

    def land(self, begin: int, data: torch.Tensor) -> None:
        """Take the bytes at file offset ``begin`` (``data``: uint8, host memory, only valid
        during the call: copy what is kept). Called once per chunk, from a transport's
        thread; chunks of one destination may land at once from several threads."""
        ...


@dataclass(frozen=True)
class Chunk:
    """One checksum chunk to read.

    Attributes:
        file: the data file's name within its step.
        index: the chunk's number in its file.
        begin: first byte (file offset).
        end: one past the last byte.
        crc: the CRC32C (8 hex digits) the bytes must have.
        dest: where the verified bytes go; None: checked only.
        subs: (begin, end, CRC32C) of finer checksums inside the chunk, checked too.
    """

    file: str
    index: int
    begin: int
    end: int
    crc: str
    dest: Dest | None = None
    subs: tuple[tuple[int, int, str], ...] = ()

    @property
    def size(self) -> int:
        return self.end - self.begin


class Mismatch(NamedTuple):
    """A checksum that failed: bytes ``[begin, end)`` of ``file`` have ``got``, not ``want``;
    ``sub``: one of the finer sub-chunk checksums."""

    file: str
    begin: int
    end: int
    got: str
    want: str
    sub: bool


def _default_message(where: str) -> Callable[[Mismatch], str]:
    def message(m: Mismatch) -> str:
        kind = "sub-chunk checksum" if m.sub else "checksum"
        return f"{where}: {m.file}: {kind} mismatch in bytes [{m.begin}, {m.end})"
    return message


@dataclass(frozen=True)
class ReadPlan:
    """The chunks of one read, in file order, and how a failed checksum is worded.

    Attributes:
        where: how messages name what is read (a root and step, a directory).
        chunks: the chunks, each a whole checksum chunk of its file.
        message: the text of a failed checksum (default: ``"<where>: <file>: checksum
            mismatch in bytes [b, e)"``).
    """

    where: str
    chunks: tuple[Chunk, ...]
    message: Callable[[Mismatch], str] | None = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(c.size for c in self.chunks)

    def mismatch(self, m: Mismatch) -> ChecksumMismatchError:
        return ChecksumMismatchError((self.message or _default_message(self.where))(m), m)


class ChecksumMismatchError(CheckpointCorruptError):
    """Bytes that fail their checksum; ``mismatch`` says which (file, range, CRCs)."""

    def __init__(self, message: str, mismatch: Mismatch) -> None:
        super().__init__(message)
        self.mismatch = mismatch


# land(chunk, data): verify ``data`` (the chunk's bytes, uint8 host memory) and move it to the
# chunk's destination; or, ``data`` an exception, the chunk's fetch failed with it (raised again
# unless the run lists faults). Called by a transport once per chunk.
Land = Callable[[Chunk, "Bytes | Exception"], None]


class Transport(Protocol):
    """How the bytes of a plan's chunks arrive in host memory.

    The calls a transport sees, for one :func:`run`:

    1. ``read(chunks, land)``, once, on the caller's thread, with the plan's chunks in file
       order.
    2. For each chunk, on threads of the transport's choosing: the transport fetches bytes
       ``[begin, end)`` of ``chunk.file`` into host memory it owns, or, where the chunk's
       destination offers ``into`` and the transport can, straight into the arrays that
       gives (exactly ``chunk.size`` bytes, or an error: a file that ends early is a
       :class:`~ckptmgr.errors.CheckpointCorruptError` naming the file and offset), then
       calls ``land(chunk, data)`` once (``data``: a uint8 tensor, or that list of arrays;
       or, from a transport that moves the bytes to the destination itself as they come,
       :class:`Landed`: their CRC32C, which ``land`` checks against the chunk's).
       ``land`` verifies the bytes and copies a tensor to the chunk's destination; the
       transport keeps ``data`` unchanged until ``land`` returns, and may reuse it after.
       A fetch that fails (an ``Exception``) is handed to ``land(chunk, exc)`` instead,
       which raises it again unless the run lists faults and goes on (``ckptmgr verify``).
    3. ``read`` returns once every chunk has landed. When a fetch or a ``land`` raises (a
       checksum failure, a cancelled run, an interrupt), the transport starts no further
       fetch, waits for those started to end, releases what it holds, and raises the
       failure of the earliest chunk that failed.

    A transport owns its threads and buffers; one transport object may serve several runs
    at once only where it says so.
    """

    def read(self, chunks: Sequence[Chunk], land: Land) -> None: ...


class ReadCancelledError(CkptError):
    """A run was cancelled (its ``cancel`` event was set) before every chunk landed."""


def _size(data: Bytes) -> int:
    if isinstance(data, Landed):
        return data.size
    return sum(a.size for a in data) if isinstance(data, list) else data.numel()


def verify(plan: ReadPlan, chunk: Chunk, data: Bytes) -> list[ChecksumMismatchError]:
    """The checksum failures of ``chunk``'s bytes ``data`` (its CRC32C, then each sub-chunk's)."""
    out = []
    if isinstance(data, Landed):
        if chunk.subs:  # (a transport's bug: it takes no such chunks)
            raise RuntimeError(f"{plan.where}: {chunk.file}: sub-chunk checksums cannot be checked from a CRC32C")
        got = f"{data.crc:08x}"
    else:
        got = crc32c_hex_pieces(data) if isinstance(data, list) else crc32c_hex(data.numpy())
    if got != chunk.crc:
        out.append(plan.mismatch(Mismatch(chunk.file, chunk.begin, chunk.end, got, chunk.crc, False)))
    if not chunk.subs:
        return out
    assert not isinstance(data, Landed)  # (refused above)
    pieces = data if isinstance(data, list) else [data.numpy()]
    arr = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)  # (one piece is checked where it is)
    for b, e, want in chunk.subs:
        got = crc32c_hex(arr[b - chunk.begin:e - chunk.begin])
        if got != want:
            out.append(plan.mismatch(Mismatch(chunk.file, b, e, got, want, True)))
    return out


def run(plan: ReadPlan, transport: Transport, *, cancel: threading.Event | None = None,
        on_fault: Callable[[Chunk, BaseException], None] | None = None) -> None:
    """Read every chunk of ``plan`` with ``transport``, verify each as it arrives, and move
    the verified bytes to their destinations: the one driver of every read.

    Args:
        plan: what to read.
        transport: how the bytes arrive.
        cancel: when set, the chunks not landed yet fail with :class:`ReadCancelledError`
            (the transport then stops, see :class:`Transport`).
        on_fault: report each failed chunk (checksum, read error) here and go on with the
            others, instead of stopping at the first (a check that lists every fault). A
            chunk that fails never reaches its destination.

    Raises:
        CheckpointCorruptError: a chunk failed its checksum, or its file ended early.
        ReadCancelledError: ``cancel`` was set.
    """
    def land(chunk: Chunk, data: Bytes | Exception) -> None:
        if isinstance(data, Exception):
            raise data
        if cancel is not None and cancel.is_set():
            raise ReadCancelledError(f"{plan.where}: the read was cancelled")
        if _size(data) != chunk.size:  # (a transport's bug, never bad data: it raises for short files)
            raise RuntimeError(f"{plan.where}: {chunk.file}: {_size(data)} bytes came for [{chunk.begin}, "
                               f"{chunk.end})")
        faults = verify(plan, chunk, data)
        if faults:
            if on_fault is None:
                raise faults[0]
            for fault in faults:
                on_fault(chunk, fault)
            return
        if chunk.dest is not None and not isinstance(data, (list, Landed)):  # (else in place: see Dest, Landed)
            chunk.dest.land(chunk.begin, data)

    if on_fault is None:
        transport.read(plan.chunks, land)
        return

    def land_or_report(chunk: Chunk, data: Bytes | Exception) -> None:
        try:
            land(chunk, data)
        except ReadCancelledError:
            raise
        except (OSError, CkptError) as exc:
            on_fault(chunk, exc)

    transport.read(plan.chunks, land_or_report)


def plan_check(manifest: Manifest, where: str, *, files: Sequence[str] | None = None, subs: bool = False,
               dests: Mapping[str, Dest] | None = None, message: Callable[[Mismatch], str] | None = None) -> ReadPlan:
    """A plan of every checksum chunk of ``manifest``'s data files (or of ``files``), in file
    order: a check when nothing lands (``dests`` None), else each file's chunks go to
    ``dests[file]`` where there is one. ``subs``: check the finer sub-chunk checksums too."""
    chunks = []
    for fname in sorted(manifest.files) if files is None else files:
        rec = manifest.files[fname]
        dest = dests.get(fname) if dests is not None else None
        sub = rec.sub_chunk_size if subs else 0
        for i, (b, e) in enumerate(chunk_ranges(rec.size, rec.chunk_size)):
            fine = tuple((s, min(s + sub, e), rec.sub_crc(s // sub)) for s in range(b, e, sub)) if sub else ()
            chunks.append(Chunk(fname, i, b, e, rec.crc32c[i], dest, fine))
    return ReadPlan(where, tuple(chunks), message)
