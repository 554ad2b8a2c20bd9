"""The torch checkpoint (zip archive) image: what ``torch.save`` writes, laid out so that the
stager can fill it like a safetensors image.

``plan_image(obj)`` runs ``torch.save`` inside ``torch.serialization.skip_data()`` into a
recorder that keeps the bytes torch writes (local headers, ``data.pkl``, the central
directory, ...) and skips the storages' bytes (torch seeks over them). The result is a
:class:`TorchZipImage`: *static* byte segments at absolute offsets, plus one
:class:`StorageSpan` per storage saying which tensor's bytes go where. Laid into a buffer and
filled by the staging copies, the buffer is byte for byte the file ``torch.save`` would
have written, plus one record:

* ``<archive>/.data/ckptmgr_checksums``: JSON with the CRC32C of every ``chunk_size`` chunk of
  the bytes before it (every other record but torch's two trailing ones, ``version`` and
  ``.data/serialization_id``). torch never reads it; :func:`~ckptmgr.format.ziprecords.verify_file` does.

The archive's own CRC-32 fields: torch's reader does not check them (torch builds miniz
without the CRC check; a file whose CRC-32 fields are all 0 loads), but Python's ``zipfile``
does, on every read of a member (``testzip()``, ``ZipFile.read``), and so do ``unzip -t`` and
scanners that read ``data.pkl`` through ``zipfile``. The records torch wrote itself carry
correct CRC-32s; the storages' records, written empty, carry the CRC-32 of nothing.
:func:`seal` computes each storage record's CRC-32 while it computes the CRC32C chunks (one
pass over the image, on the caller's threads, pieces joined with :func:`crc32_combine`) and
patches the data descriptor and the central directory, so every zip reader accepts the file.

Storages are ordered as torch numbers them (``data/0``, ``data/1``, ... in pickling order):
a second pickling pass with the same protocol records the storages in that order, and the
plan checks each record's size against its storage before it is used.
"""

from __future__ import annotations

import bisect
import json
import pickle
import struct
import zlib
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import torch

from ..errors import UnsupportedValueError
from .checksum import chunk_ranges, crc32_combine, crc32c_combine
from .ziprecords import (
    CHECKSUM_FORMAT,
    CHECKSUM_RECORD,
    HASH_PIECE,
    ZipRecord,
    locate_central_directory,
    read_records,
    verify_file,
)

__all__ = [
    "CHECKSUM_RECORD",
    "StorageSpan",
    "TorchZipImage",
    "ZipRecord",
    "crc32_combine",
    "plan_image",
    "read_records",
    "seal",
    "verify_file",
]

_ALIGN = 64  # torch aligns every record's data to 64 bytes


# ------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class StorageSpan:
    """One storage: ``source`` (a flat uint8 tensor over it, on its device) lands at
    ``[offset, offset + nbytes)`` of the image."""

    key: str
    offset: int
    nbytes: int
    source: torch.Tensor


@dataclass
class TorchZipImage:
    """A torch checkpoint file laid out in memory: static segments plus storage spans."""

    size: int
    static: list[tuple[int, bytes]]  # (offset, bytes) in ascending offset order
    spans: list[StorageSpan]
    records: list[ZipRecord]
    checksums: ZipRecord | None  # the record that holds the CRC32C chunks (None: an empty image)
    chunk_size: int

    @property
    def covered(self) -> int:
        """The CRC32C chunks cover the image's bytes ``[0, covered)``."""
        return self.checksums.header_offset if self.checksums is not None else 0

    def write_static(self, buf: np.ndarray[Any, Any]) -> None:
        """Copy the static segments into ``buf`` (a uint8 array of ``size`` bytes)."""
        for at, data in self.static:
            buf[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)


class _Recorder:
    """A write-only stream for torch.save that keeps what is written and skips seeks."""

    def __init__(self) -> None:
        self.pos = 0
        self.parts: list[tuple[int, bytes]] = []
        self._starts: list[int] = []

    def write(self, data: Any) -> int:
        b = bytes(data)
        self.parts.append((self.pos, b))
        self.pos += len(b)
        return len(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def merge(self) -> None:
        """Join adjacent writes into segments (once everything is written)."""
        merged: list[tuple[int, bytearray]] = []
        for at, b in self.parts:
            if merged and merged[-1][0] + len(merged[-1][1]) == at:
                merged[-1][1].extend(b)
            else:
                merged.append((at, bytearray(b)))
        self.parts = [(at, bytes(b)) for at, b in merged]
        self._starts = [at for at, _ in self.parts]

    def read_at(self, offset: int, n: int) -> bytes:
        """Bytes ``[offset, offset + n)``; skipped bytes read as zeros."""
        out = bytearray(n)
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while i < len(self.parts) and self.parts[i][0] < offset + n:
            at, data = self.parts[i]
            lo, hi = max(at, offset), min(at + len(data), offset + n)
            if hi > lo:
                out[lo - offset:hi - offset] = data[lo - at:hi - at]
            i += 1
        return bytes(out)


def _with_checksum_record(rec: _Recorder, chunk_size: int) -> _Recorder:
    """The archive with the checksum record (its CRC32C list zeroed) appended after torch's
    records: the central directory and the end records are rewritten behind it."""
    n_total, cd_size, cd_offset = locate_central_directory(rec.read_at, rec.pos)
    cd = rec.read_at(cd_offset, cd_size)
    first_name = cd[46:46 + struct.unpack_from("<H", cd, 28)[0]].decode("utf-8", "replace")
    name = f"{first_name.split('/', 1)[0]}/{CHECKSUM_RECORD}".encode()
    doc = _checksum_doc(chunk_size, cd_offset, ["00000000"] * len(chunk_ranges(cd_offset, chunk_size)))
    pad = -(cd_offset + 30 + len(name) + 4) % _ALIGN  # data 64-byte aligned, as torch aligns its records
    local = (struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, 0, len(doc), len(doc), len(name), 4 + pad)
             + name + struct.pack("<HH", 0x4246, pad) + b"Z" * pad)
    lho, extra = cd_offset, b""
    version = 20
    if lho >= 0xFFFFFFFF:
        lho, extra, version = 0xFFFFFFFF, struct.pack("<HHQ", 0x0001, 8, cd_offset), 45
    entry = (struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, 0, 0, 0, 0x21, 0, len(doc), len(doc),
                         len(name),
                         len(extra), 0, 0, 0, 0, lho) + name + extra)
    out = _Recorder()
    for at, data in rec.parts:  # everything before the old central directory, as torch wrote it
        if at < cd_offset:
            out.seek(at)
            out.write(data[:cd_offset - at])
    out.seek(cd_offset)
    out.write(local)
    out.write(doc)
    new_cd = out.pos
    out.write(cd)
    out.write(entry)
    n, size = n_total + 1, cd_size + len(entry)
    if n >= 0xFFFF or size >= 0xFFFFFFFF or new_cd >= 0xFFFFFFFF:
        z64 = out.pos
        out.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, size, new_cd))
        out.write(struct.pack("<IIQI", 0x07064B50, 0, z64, 1))
        out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
    else:
        out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, size, new_cd, 0))
    out.merge()
    return out


class _Null:
    def write(self, data: Any) -> int:
        return len(data)


class _StorageOrder(pickle.Pickler):
    """Records the storages in the order torch.save numbers them (first reached first)."""

    def __init__(self) -> None:
        super().__init__(_Null(), protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.storages: dict[int, torch.UntypedStorage] = {}

    def persistent_id(self, obj: Any) -> Any:
        s: Any
        if isinstance(obj, torch.storage.TypedStorage):
            s = obj._untyped_storage
        elif torch.is_storage(obj):
            s = obj
        else:
            return None
        self.storages.setdefault(s._cdata, s)
        return "storage"


def _checksum_doc(chunk_size: int, covered: int, crcs: Iterable[str]) -> bytes:
    return json.dumps({"format": CHECKSUM_FORMAT, "version": 1, "algorithm": "crc32c", "chunk_size": chunk_size,
                       "covered_bytes": covered, "chunks": list(crcs)}, separators=(",", ":")).encode()


def plan_image(obj: Any, *, chunk_size: int = 64 << 20) -> TorchZipImage:
    """Lay out the file ``torch.save(obj, f)`` would write, without copying any storage.

    Args:
        obj: anything ``torch.save`` accepts.
        chunk_size: bytes per CRC32C chunk of the checksum record.

    Raises:
        UnsupportedValueError: ``obj`` cannot be pickled, or its storages could not be matched
            with the archive's records.
    """
    order = _StorageOrder()
    try:
        order.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise UnsupportedValueError("checkpoint", f"torch.save cannot pickle it: {exc}") from exc
    rec = _Recorder()
    with torch.serialization.skip_data():
        torch.save(obj, rec)  # type: ignore[arg-type]  # a write/seek stream is all torch.save needs
    rec.merge()
    if rec.pos == 0:  # torch.save wrote nothing (replaced, as tests do): an empty file, as Lightning writes then
        return TorchZipImage(0, [], [], [], None, chunk_size)
    rec = _with_checksum_record(rec, chunk_size)
    records = read_records(rec.read_at, rec.pos)
    by_name = {r.name: r for r in records}
    storages = list(order.storages.values())
    data_records = [r for r in records if r.name.startswith("data/")]
    if len(data_records) != len(storages):
        raise UnsupportedValueError("checkpoint", f"torch.save wrote {len(data_records)} storages, the pickling pass "
                                    f"found {len(storages)}; save it with torch.save instead")
    spans = []
    for key, s in enumerate(storages):
        r = by_name.get(f"data/{key}")
        if r is None or r.size != s.nbytes():
            raise UnsupportedValueError("checkpoint", f"storage {key} ({s.nbytes()} bytes) does not match the "
                                        f"archive's record {r}; save it with torch.save instead")
        if r.size:
            flat = torch.empty(0, dtype=torch.uint8, device=s.device)
            flat.set_(s, 0, (s.nbytes(),), (1,))
            spans.append(StorageSpan(str(key), r.data_offset, r.size, flat))
    return TorchZipImage(rec.pos, rec.parts, spans, records, by_name[CHECKSUM_RECORD], chunk_size)


# ------------------------------------------------------------------------------------ seal


_Piece = tuple[int, int, int]  # (crc, length, hole start or -1): a hashed run, or a hole hashed after patching


def _hash_chunk(buf: np.ndarray[Any, Any], begin: int, end: int, spans: list[tuple[int, int]],
                holes: list[tuple[int, int]]) -> tuple[list[_Piece], list[tuple[int, int, int]]]:
    """One pass over ``buf[begin:end]``: the CRC32C of the runs between ``holes`` (the CRC-32
    fields patched afterwards), and the CRC-32 of each span's piece inside the chunk."""
    runs: list[_Piece] = []
    pieces: list[tuple[int, int, int]] = []  # (span index, piece length, crc32)
    first = max(0, bisect.bisect_right([s[0] for s in spans], begin) - 1)
    cuts = [(max(lo, begin), min(hi, end)) for lo, hi in holes if lo < end and hi > begin]
    pos = begin
    for h_lo, h_hi in [*cuts, (end, end)]:
        for at in range(pos, h_lo, HASH_PIECE):
            hi = min(at + HASH_PIECE, h_lo)
            block = buf[at:hi]
            c = crc32c.crc32c(block, 0, 1)  # type: ignore[arg-type]
            runs.append((c, hi - at, -1))
            for i in range(first, len(spans)):
                s_lo, s_hi = spans[i]
                if s_lo >= hi:
                    break
                lo2, hi2 = max(s_lo, at), min(s_hi, hi)
                if hi2 > lo2:
                    pieces.append((i, hi2 - lo2, zlib.crc32(buf[lo2:hi2])))  # type: ignore[arg-type]
        if h_hi > h_lo:
            runs.append((0, h_hi - h_lo, h_lo))
        pos = h_hi
    return runs, pieces


def seal(image: TorchZipImage, buf: np.ndarray[Any, Any], pool: Executor | None = None) -> list[str]:
    """Finish a filled image in place: CRC-32 of every storage record and the CRC32C chunks.

    Run once the staging copies have landed, before the image is written anywhere. Hashes
    ``chunk_size`` chunks on ``pool``'s threads (both hashes release the GIL).

    Returns:
        The CRC32C (hex) of each chunk of ``[0, image.covered)``.
    """
    spans = [(s.offset, s.offset + s.nbytes) for s in image.spans]
    # the storages' CRC-32 fields inside the checksummed bytes (their data descriptors)
    holes = sorted((at, at + 4) for r in image.records if r.name.startswith("data/")
                   for at in r.crc_fields if at < image.covered)
    chunks = chunk_ranges(image.covered, image.chunk_size)

    def work(c: tuple[int, int]) -> tuple[list[_Piece], list[tuple[int, int, int]]]:
        return _hash_chunk(buf, c[0], c[1], spans, holes)

    results = list(pool.map(work, chunks)) if pool is not None else [work(c) for c in chunks]
    crc: list[int | None] = [None] * len(spans)
    for _, pieces in results:  # chunks and the pieces in them are in file order
        for i, n, piece_crc in pieces:
            prev = crc[i]
            crc[i] = piece_crc if prev is None else crc32_combine(prev, piece_crc, n)
    by_key = {s.key: c or 0 for s, c in zip(image.spans, crc, strict=True)}
    patches: dict[str, int] = {}
    for r in image.records:
        if r.name.startswith("data/"):
            patches[r.name] = by_key.get(r.name[5:], 0)  # 0: an empty storage
    _patch(image, buf, patches)
    hexes = []
    for runs, _ in results:
        total: int | None = None
        for c, n, hole in runs:
            if hole >= 0:
                c = crc32c.crc32c(buf[hole:hole + n], 0, 1)  # type: ignore[arg-type]
            total = c if total is None else crc32c_combine(total, c, n)
        hexes.append(f"{total or 0:08x}")
    doc = _checksum_doc(image.chunk_size, image.covered, hexes)
    rec = image.checksums
    if rec is None:
        return hexes
    if len(doc) != rec.size:
        raise AssertionError(f"checksum record size changed: {len(doc)} != {rec.size}")
    buf[rec.data_offset:rec.data_offset + rec.size] = np.frombuffer(doc, dtype=np.uint8)
    _patch(image, buf, {rec.name: zlib.crc32(doc)})
    return hexes


def _patch(image: TorchZipImage, buf: np.ndarray[Any, Any], crcs: dict[str, int]) -> None:
    for r in image.records:
        if r.name in crcs:
            value = np.frombuffer(struct.pack("<I", crcs[r.name]), dtype=np.uint8)
            for at in r.crc_fields:
                buf[at:at + 4] = value
