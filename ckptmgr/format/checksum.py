"""Per-chunk CRC32C checksums.

Files are checksummed in fixed-size chunks so that hashing runs in parallel with the I/O
(each write or read task hashes the chunk it moves) and a mismatch names the byte range.
CRC32C is hardware-accelerated (SSE4.2 / ARMv8) and is the checksum that object stores
such as S3 verify natively. The ``crc32c`` package computes it with the GIL released, so
checksum threads run in parallel with each other and never stall the training thread
(google-crc32c, measured, holds the GIL: 16 threads ran no faster than one, and the main
thread got 4% of its time while they ran).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import crc32c
import numpy as np

__all__ = ["chunk_ranges", "crc32_combine", "crc32c_combine", "crc32c_hex", "crc32c_hex_pieces", "crc32c_value"]

_RELEASE_GIL = 1  # crc32c's gil_release_mode: always release


def crc32c_hex(data: np.ndarray[Any, Any]) -> str:
    """CRC32C of a contiguous uint8 numpy array, as 8 hex digits. Releases the GIL."""
    return f"{crc32c_value(data):08x}"


def crc32c_value(data: np.ndarray[Any, Any]) -> int:
    """CRC32C of a contiguous uint8 numpy array, as an integer. Releases the GIL."""
    return int(crc32c.crc32c(data, 0, _RELEASE_GIL))  # type: ignore[arg-type]


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of the bytes ``A + B`` from the CRC32C of ``A``, that of ``B`` and ``B``'s length
    (zlib's ``crc32_combine``, for CRC32C), so that the pieces of one chunk can be checksummed
    in any order, on any thread.

    Example:
        >>> a, b = np.frombuffer(b"check", np.uint8), np.frombuffer(b"sum", np.uint8)
        >>> crc32c_combine(crc32c_value(a), crc32c_value(b), 3) == crc32c_value(np.frombuffer(b"checksum", np.uint8))
        True
    """
    return _combine(crc_a, crc_b, len_b, _CRC32C_POLY)


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC-32 (zip's, ``zlib.crc32``) of ``A + B`` from that of ``A``, that of ``B`` and
    ``B``'s length: zlib's ``crc32_combine``."""
    return _combine(crc_a, crc_b, len_b, _CRC32_POLY)


_CRC32C_POLY = 0x82F63B78  # CRC32C (Castagnoli), bit-reflected
_CRC32_POLY = 0xEDB88320  # CRC-32 (zip, zlib), bit-reflected
_TABLE_GRAIN = 64 << 10  # lengths that are multiples of this get a lookup table (each 4 x 256 entries)


def _combine(crc_a: int, crc_b: int, len_b: int, poly: int) -> int:
    """``crc_a`` shifted over ``len_b`` zero bytes, plus ``crc_b``: the CRC of ``A + B`` (the
    pre- and post-inversions of both cancel out)."""
    if len_b == 0:
        return crc_a
    if len_b % _TABLE_GRAIN == 0:  # the lengths of whole read blocks: one table lookup per byte of the CRC
        t = _shift_table(len_b, poly)
        return t[0][crc_a & 255] ^ t[1][(crc_a >> 8) & 255] ^ t[2][(crc_a >> 16) & 255] ^ t[3][crc_a >> 24] ^ crc_b
    return _shift(crc_a, len_b, poly) ^ crc_b


def _times(matrix: list[int], vector: int) -> int:
    """The GF(2) matrix (32 columns) applied to a 32-bit vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


@lru_cache(maxsize=2)
def _zero_powers(poly: int) -> tuple[list[int], ...]:
    """``[k]``: the operator that appends ``2**k`` zero bytes to a message, on its CRC."""
    op = [poly] + [1 << (i - 1) for i in range(1, 32)]  # one zero bit
    for _ in range(3):  # squared three times: one zero byte
        op = [_times(op, op[j]) for j in range(32)]
    out = [op]
    for _ in range(47):  # up to 2**47 bytes
        out.append([_times(out[-1], out[-1][j]) for j in range(32)])
    return tuple(out)


def _shift(crc: int, nbytes: int, poly: int) -> int:
    """``crc`` with ``nbytes`` zero bytes appended (without the pre- and post-inversion)."""
    powers, k = _zero_powers(poly), 0
    while nbytes:
        if nbytes & 1:
            crc = _times(powers[k], crc)
        nbytes >>= 1
        k += 1
    return crc


@lru_cache(maxsize=32)  # (the run lengths of one step: whole blocks, and runs of up to 8 of them)
def _shift_table(nbytes: int, poly: int) -> tuple[list[int], ...]:
    """:func:`_shift` by ``nbytes`` as four byte-indexed tables (it is linear)."""
    cols = [_shift(1 << j, nbytes, poly) for j in range(32)]
    return tuple([_times(cols[8 * k:8 * k + 8], b) for b in range(256)] for k in range(4))


def crc32c_hex_pieces(pieces: list[np.ndarray[Any, Any]]) -> str:
    """CRC32C of the concatenation of several contiguous uint8 arrays."""
    crc = 0
    for p in pieces:
        crc = crc32c.crc32c(p, crc, _RELEASE_GIL)  # type: ignore[arg-type]
    return f"{crc:08x}"


def chunk_ranges(size: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[begin, end)`` of each checksum chunk of a file of ``size`` bytes."""
    return [(b, min(b + chunk_size, size)) for b in range(0, size, chunk_size)]
