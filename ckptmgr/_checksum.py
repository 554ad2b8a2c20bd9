"""Per-chunk CRC32C checksums.

Files are checksummed in fixed-size chunks so that hashing runs in parallel with the I/O
(each write or read task hashes the chunk it moves) and a mismatch names the byte range.
CRC32C is hardware-accelerated (SSE4.2 / ARMv8), releases the GIL, and is the checksum
that object stores such as S3 verify natively.
"""

from __future__ import annotations

from typing import Any

import google_crc32c
import numpy as np

__all__ = ["chunk_ranges", "crc32c_hex", "crc32c_hex_pieces"]


def crc32c_hex(data: np.ndarray[Any, Any]) -> str:
    """CRC32C of a contiguous uint8 numpy array, as 8 hex digits. Releases the GIL."""
    return f"{google_crc32c.value(data):08x}"


def crc32c_hex_pieces(pieces: list[np.ndarray[Any, Any]]) -> str:
    """CRC32C of the concatenation of several contiguous uint8 arrays."""
    crc = 0
    for p in pieces:
        crc = google_crc32c.extend(crc, p)
    return f"{crc:08x}"


def chunk_ranges(size: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[begin, end)`` of each checksum chunk of a file of ``size`` bytes."""
    return [(b, min(b + chunk_size, size)) for b in range(0, size, chunk_size)]
