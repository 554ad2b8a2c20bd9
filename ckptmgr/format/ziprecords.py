"""Reading a torch checkpoint (zip archive) without torch: its records, from the central
directory, and the check of its bytes against ckptmgr's checksum record.

:func:`read_records` says where each record's bytes and CRC-32 fields are (the writer,
:mod:`ckptmgr.format.torchzip`, patches those fields; ``ckptmgr ls`` counts the storages).
:func:`verify_file` checks a file against the record ``<archive>/.data/ckptmgr_checksums``
that :func:`ckptmgr.format.torchzip.seal` writes: JSON with the CRC32C of every
``chunk_size`` chunk of the bytes before it. Only ``struct`` and ``crc32c`` are used, so
``ckptmgr verify`` checks a file without importing torch or unpickling anything.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import crc32c

from ..errors import CheckpointCorruptError
from .checksum import chunk_ranges

__all__ = ["CHECKSUM_FORMAT", "CHECKSUM_RECORD", "HASH_PIECE", "ZipRecord", "locate_central_directory", "read_records",
           "verify_file"]

CHECKSUM_RECORD = ".data/ckptmgr_checksums"
CHECKSUM_FORMAT = "ckptmgr.torchzip.checksums"
HASH_PIECE = 4 << 20  # bytes hashed at a time: both CRCs of a piece run while it is in cache
_MAX_RECORDS = 1 << 20  # a central directory claiming more entries is refused before reading it


@dataclass(frozen=True)
class ZipRecord:
    """One record of the archive: where its bytes are and where its CRC-32 is stored."""

    name: str  # without the archive's top directory ("data/0", "data.pkl")
    header_offset: int
    data_offset: int
    size: int
    crc32: int
    crc_fields: tuple[int, ...]  # absolute offsets of the 4-byte CRC-32 fields to patch


def _u(fmt: str, buf: bytes, at: int) -> tuple[Any, ...]:
    size = struct.calcsize(fmt)
    if at < 0 or at + size > len(buf):
        raise CheckpointCorruptError(f"zip structure ends early (need {size} bytes at {at})")
    return struct.unpack_from(fmt, buf, at)


def locate_central_directory(read_at: Callable[[int, int], bytes], file_size: int) -> tuple[int, int, int]:
    """``(records, size, offset)`` of the central directory, from the end records."""
    tail_len = min(file_size, 22 + 0xFFFF)
    tail = read_at(file_size - tail_len, tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0:
        raise CheckpointCorruptError("not a zip archive (no end of central directory record)")
    eocd = file_size - tail_len + at
    _, _, _, _, n_total, cd_size, cd_offset = _u("<IHHHHII", tail, at)
    if n_total == 0xFFFF or 0xFFFFFFFF in (cd_size, cd_offset):
        loc = read_at(eocd - 20, 20)
        sig, _, z64_at, _ = _u("<IIQI", loc, 0)
        if sig != 0x07064B50:
            raise CheckpointCorruptError("zip64 end of central directory locator missing")
        rec = read_at(z64_at, 56)
        sig, _, _, _, _, _, _, n_total, cd_size, cd_offset = _u("<IQHHIIQQQQ", rec, 0)
        if sig != 0x06064B50:
            raise CheckpointCorruptError("zip64 end of central directory record missing")
    if n_total > _MAX_RECORDS or cd_offset + cd_size > file_size:
        raise CheckpointCorruptError(f"central directory of {n_total} records at {cd_offset}+{cd_size} "
                                     f"does not fit a {file_size}-byte archive")
    return n_total, cd_size, cd_offset


def read_records(read_at: Callable[[int, int], bytes], file_size: int) -> list[ZipRecord]:
    """Parse the central directory of a zip archive of ``file_size`` bytes.

    Args:
        read_at: ``read_at(offset, n)`` returns the archive's bytes ``[offset, offset + n)``.
        file_size: the archive's size.

    Raises:
        CheckpointCorruptError: not a zip archive, or one whose structure points outside it.
    """
    n_total, cd_size, cd_offset = locate_central_directory(read_at, file_size)
    cd = read_at(cd_offset, cd_size)
    out, pos = [], 0
    for _ in range(n_total):
        (sig, _, _, _, method, _, _, crc, csize, usize, nlen, elen, clen, _, _, _,
         lho) = _u("<IHHHHHHIIIHHHHHII", cd, pos)
        if sig != 0x02014B50:
            raise CheckpointCorruptError(f"bad central directory entry at {cd_offset + pos}")
        name = bytes(cd[pos + 46:pos + 46 + nlen]).decode("utf-8", "replace")
        extra = bytes(cd[pos + 46 + nlen:pos + 46 + nlen + elen])
        usize, csize, lho = _zip64_fields(extra, usize, csize, lho)
        if method != 0 or csize != usize:
            raise CheckpointCorruptError(f"record {name!r} is compressed; torch checkpoints store records as they are")
        local = read_at(lho, 30)
        lsig, _, lflags, _, _, _, _, _, _, lnlen, lelen = _u("<IHHHHHIIIHH", local, 0)
        if lsig != 0x04034B50:
            raise CheckpointCorruptError(f"record {name!r}: no local header at {lho}")
        data = lho + 30 + lnlen + lelen
        if data + usize > file_size:
            raise CheckpointCorruptError(f"record {name!r} ({usize} bytes at {data}) runs past the end of the file")
        fields = [cd_offset + pos + 16]
        if lflags & 0x8:  # a data descriptor follows the data: [signature] crc sizes
            desc = read_at(data + usize, 4)
            fields.append(data + usize + (4 if desc == b"PK\x07\x08" else 0))
        else:
            fields.append(lho + 14)
        short = name.split("/", 1)[1] if "/" in name else name
        out.append(ZipRecord(short, lho, data, usize, crc, tuple(fields)))
        pos += 46 + nlen + elen + clen
    return out


def _zip64_fields(extra: bytes, usize: int, csize: int, lho: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            if pos + 4 + n > len(extra):
                raise CheckpointCorruptError("zip64 extra field runs past its entry")
            vals = list(struct.unpack_from(f"<{n // 8}Q", extra, pos + 4))
            if usize == 0xFFFFFFFF and vals:
                usize = vals.pop(0)
            if csize == 0xFFFFFFFF and vals:
                csize = vals.pop(0)
            if lho == 0xFFFFFFFF and vals:
                lho = vals.pop(0)
        pos += 4 + n
    return usize, csize, lho


def verify_file(f: IO[bytes], *, what: str = "checkpoint") -> bool:
    """Check a torch checkpoint file against its ckptmgr checksum record.

    Returns:
        True when the file has a checksum record and every chunk matches; False when it has
        none (a file written by ``torch.save``: nothing to check).

    Raises:
        CheckpointCorruptError: a chunk's CRC32C differs, or the record or the archive's
            structure is damaged.
    """
    f.seek(0, io.SEEK_END)
    size = f.tell()

    def read_at(offset: int, n: int) -> bytes:
        f.seek(offset)
        data = f.read(n)
        if len(data) != n:
            raise CheckpointCorruptError(f"{what}: ends early ({size} bytes, needed {offset + n})")
        return data

    try:
        records = read_records(read_at, size)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"{what}: {exc}") from None
    rec = next((r for r in records if r.name == CHECKSUM_RECORD), None)
    if rec is None:
        return False
    try:
        doc = json.loads(read_at(rec.data_offset, rec.size))
        ok = (doc.get("format") == CHECKSUM_FORMAT and doc.get("version") == 1 and doc.get("algorithm") == "crc32c")
        chunk, covered, crcs = int(doc["chunk_size"]), int(doc["covered_bytes"]), list(doc["chunks"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointCorruptError(f"{what}: unreadable checksum record ({exc})") from None
    ranges = chunk_ranges(covered, chunk) if ok and chunk > 0 and 0 <= covered <= rec.header_offset else None
    if ranges is None or len(ranges) != len(crcs):
        raise CheckpointCorruptError(f"{what}: the checksum record does not describe this file")
    for r in records:
        if r.name != CHECKSUM_RECORD and r.header_offset < covered and r.data_offset + r.size > covered:
            raise CheckpointCorruptError(f"{what}: record {r.name!r} runs past the checksummed bytes")
    for (b, e), want in zip(ranges, crcs, strict=True):
        got = 0
        for at in range(b, e, HASH_PIECE):
            got = crc32c.crc32c(read_at(at, min(HASH_PIECE, e - at)), got, 1)
        if f"{got:08x}" != want:
            raise CheckpointCorruptError(f"{what}: bytes {b}-{e} fail their CRC32C (stored {want}, computed "
                                         f"{got:08x}); the file is damaged")
    return True
