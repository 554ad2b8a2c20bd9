"""Where each saved shard of a DTensor lies in the global tensor, and which bytes of it a new
shard needs. Pure arithmetic on shapes: no I/O, no ``torch.distributed``.

A shard is a *box*: its global offset and its shape, one entry per dimension. DTensor
``Shard(d)`` placements split a dimension the way ``torch.chunk`` does (every part
``ceil(n / parts)`` long but the last ones, which may be shorter or empty), one mesh
dimension after the other; ``Replicate()`` leaves it whole. Checkpoints record each rank's
box as ``offsets`` in the DTensor's skeleton node; for checkpoints written before that field
existed, :func:`derive_offsets` recomputes it from the placements, the mesh shape and the
rank (which assumes the mesh lists the ranks in row-major order, as ``init_device_mesh``
builds it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = ["Box", "byte_runs", "chunk_extent", "derive_offsets", "intersect", "parse_placement", "volume"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, shape) of a shard
_SHARD = re.compile(r"(?:S|Shard)\((?:dim=)?(\d+)\)")  # str(Shard(1)) is "S(1)" in torch 2.13, "Shard(dim=1)" before
_REPLICATE = ("R", "Replicate()")


def parse_placement(text: str) -> int | None:
    """The dimension of a saved ``Shard(d)`` placement, -1 for ``Replicate()``, None for a
    placement whose shards are not boxes (``Partial``, ``_StridedShard``)."""
    if text in _REPLICATE:
        return -1
    found = _SHARD.fullmatch(text)
    return int(found.group(1)) if found else None


def chunk_extent(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of part ``index`` of ``n`` items split in ``parts`` like ``torch.chunk``."""
    full = -(-n // parts)
    start = min(full * index, n)
    return start, max(0, min(n, start + full) - start)


def derive_offsets(shape: Sequence[int], placements: Sequence[str], mesh: Sequence[int],
                   rank: int) -> Box | None:
    """The box of ``rank``'s shard of a DTensor of global ``shape``, for meshes that list the
    ranks in row-major order; None when a placement is not ``Shard``/``Replicate`` or the mesh
    does not fit."""
    if len(placements) != len(mesh) or rank < 0 or rank >= math.prod(mesh):
        return None
    coord, rest = [], rank
    for size in reversed(mesh):
        coord.append(rest % size)
        rest //= size
    coord.reverse()
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_dim, text in enumerate(placements):
        dim = parse_placement(text)
        if dim is None or dim >= len(shape):
            return None
        if dim >= 0:
            start, length = chunk_extent(sizes[dim], mesh[mesh_dim], coord[mesh_dim])
            offsets[dim] += start
            sizes[dim] = length
    return tuple(offsets), tuple(sizes)


def volume(shape: Sequence[int]) -> int:
    return math.prod(shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap (or it is empty)."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(top <= bottom for bottom, top in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(top - bottom for bottom, top in zip(lo, hi, strict=True))


def byte_runs(shape: Sequence[int], itemsize: int, lo: Sequence[int], size: Sequence[int],
              max_runs: int = 4096) -> list[tuple[int, int]]:
    """The contiguous byte ranges ``[begin, end)`` that the sub-box ``(lo, size)`` occupies in
    a C-contiguous tensor of ``shape``; one range covering them all when there would be more
    than ``max_runs`` (reads are rounded to checksum chunks anyway)."""
    if any(s <= 0 for s in size):
        return []
    nd = len(shape)
    k = nd - 1  # the dims after k are taken whole: one run spans them
    while k > 0 and lo[k] == 0 and size[k] == shape[k]:
        k -= 1
    strides = [itemsize * math.prod(shape[j + 1:]) for j in range(nd)]
    if nd == 0:
        return [(0, itemsize)]
    run = size[k] * strides[k]
    outer = [range(lo[j], lo[j] + size[j]) for j in range(k)]
    count = math.prod(size[:k])
    first = sum(lo[j] * strides[j] for j in range(nd))
    if count > max_runs:
        last = sum((lo[j] + size[j] - 1) * strides[j] for j in range(k)) + lo[k] * strides[k]
        return [(first, last + run)]
    runs: list[tuple[int, int]] = []
    base = lo[k] * strides[k] + sum(lo[j] * strides[j] for j in range(k + 1, nd))
    for idx in _product(outer):
        b = base + sum(i * strides[j] for j, i in enumerate(idx))
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + run)
        else:
            runs.append((b, b + run))
    return runs


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*o, i) for o in out for i in r]
    return out
