"""Host loader: scatter reads straight into each tensor's own memory, verified as they land.

Every stored tensor gets its own host allocation, and each checksum chunk of a file is read
by one task on the target's I/O threads with a scatter read (``preadv``) into the pieces of
the tensors it covers; the task then checks the chunk's CRC32C over those pieces (a plan of
the file's chunks, read straight into those pieces, run by the read driver
:mod:`ckptmgr.restore.read`). So the
bytes are copied once, verification runs in parallel with the reads, and a restored tensor
owns its storage (it does not pin a whole file image in memory). Aliased tensors come back
aliased: views are rebuilt on top of their (moved) bases.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...errors import CheckpointCorruptError
from ...format.layout import ST_TO_DTYPE
from ...format.manifest import Manifest
from ..preflight import Source, check_header
from ..read import Mismatch, plan_check, run
from ..transports.pread import PreadTransport
from .landing import Entry, checked_dests, usable_dest

__all__ = ["Source", "read_tensors", "view_of"]

_CPU = torch.device("cpu")
_Region = tuple[int, np.ndarray[Any, Any]]  # (offset in the file, uint8 destination)


def _dtype(code: Any, where: str) -> torch.dtype:
    try:
        return ST_TO_DTYPE[code]
    except (KeyError, TypeError):
        raise CheckpointCorruptError(f"{where}: unknown dtype {code!r}") from None


def _as_bytes(t: torch.Tensor) -> np.ndarray[Any, Any]:
    return t.reshape(-1).view(torch.uint8).numpy()


def _pieces(regions: list[_Region], b: int, e: int) -> list[np.ndarray[Any, Any]]:
    """Slices of the regions (sorted, tiling the file) that cover ``[b, e)``."""
    out = []
    for off, arr in regions:
        lo, hi = max(b, off), min(e, off + arr.size)
        if lo < hi:
            out.append(arr[lo - off:hi - off])
    return out


class _Scatter:
    """A file's bytes read straight into its tensors' memory (``regions``, tiling the file):
    each chunk a scatter read into the pieces it covers, verified there."""

    def __init__(self, regions: list[_Region]) -> None:
        self.regions = regions

    def into(self, begin: int, end: int) -> list[np.ndarray[Any, Any]]:
        return _pieces(self.regions, begin, end)

    def land(self, begin: int, data: torch.Tensor) -> None:
        """(A transport that read the chunk elsewhere.)"""
        arr, pos = data.numpy(), 0
        for piece in _pieces(self.regions, begin, begin + arr.size):
            piece[:] = arr[pos:pos + piece.size]
            pos += piece.size


def _regions(manifest: Manifest, fname: str, entries: list[tuple[str, dict[str, Any]]],
             out: dict[str, torch.Tensor], dests: dict[str, torch.Tensor] | None, where: str) -> list[_Region]:
    """Allocate (or take from ``dests``) every tensor of file ``fname`` into ``out``; returns
    the file's regions (its header's buffer, then each tensor's bytes), tiling the file."""
    rec = manifest.files[fname]
    header = np.empty(rec.header_size, dtype=np.uint8)
    regions: list[_Region] = [(0, header)]
    pos = rec.header_size
    checked = checked_dests(dests, _CPU)
    for name, e in sorted(entries, key=lambda item: int(item[1]["offsets"][0])):
        begin, end = (int(x) for x in e["offsets"])
        dtype, shape = _dtype(e["dtype"], where), [int(s) for s in e["shape"]]
        if rec.header_size + begin != pos or end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointCorruptError(f"{where}: tensor {name!r} has bad offsets {[begin, end]}")
        t = dests.get(name) if dests is not None else None
        if t is None or not (checked or usable_dest(t, Entry(name, dtype, tuple(shape), begin, end), _CPU)):
            t = torch.empty(shape, dtype=dtype)
        out[name] = t
        regions.append((pos, _as_bytes(t)))
        pos += end - begin
    if pos != rec.size:
        raise CheckpointCorruptError(f"{where}: the tensors do not fill the file ({pos} of {rec.size} bytes)")
    return regions


def _build_views(manifest: Manifest, out: dict[str, torch.Tensor], where: str) -> None:
    views = {name: e for name, e in manifest.tensors.items() if "file" not in e}
    for name, e in views.items():
        base = out.get(e["view_of"])
        if base is None:
            raise CheckpointCorruptError(f"{where}: view {name!r} of a tensor that is not stored")
        out[name] = view_of(base, name, e, where)


def view_of(base: torch.Tensor, name: str, e: dict[str, Any], where: str) -> torch.Tensor:
    """The view ``name`` (index entry ``e``) into the stored tensor ``base``, checked to lie
    inside it and to be aligned (it shares ``base``'s storage).

    Raises:
        CheckpointCorruptError: the entry does not describe a view inside ``base``.
    """
    dtype = _dtype(e["dtype"], where)
    shape, stride, offset = list(e["shape"]), list(e["stride"]), int(e["byte_offset"])
    if len(shape) != len(stride) or min(stride, default=0) < 0:
        raise CheckpointCorruptError(f"{where}: view {name!r} has a bad shape or stride")
    extent = 0 if 0 in shape else 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    if offset < 0 or offset + extent * dtype.itemsize > base.numel() * base.element_size():
        raise CheckpointCorruptError(f"{where}: view {name!r} reaches outside its base")
    start = base.storage_offset() * base.element_size() + offset  # the base may itself sit inside a buffer
    if start % dtype.itemsize:
        raise CheckpointCorruptError(f"{where}: view {name!r} is not aligned to its dtype")
    view = torch.empty(0, dtype=dtype, device=base.device)
    view.set_(base.untyped_storage(), start // dtype.itemsize, shape, stride)
    return view


def read_tensors(target: Source, step: int, manifest: Manifest, *,
                 device: torch.device | None = None, dests: dict[str, torch.Tensor] | None = None
                 ) -> dict[str, torch.Tensor]:
    """Read, verify and assemble every tensor of a committed step; a tensor of ``dests`` in
    host memory with the stored dtype and shape is read into directly.

    Every file's chunks are one plan, run once (an object store's ranges span the step, not
    one file at a time). The files have passed the preflight checks (regular, sized, and,
    unless ``preflight(headers=False)`` left it to this read, headers matching); each file's
    safetensors header, read and verified with its first chunks, is checked against the
    manifest here too, once the step has been read and before it is returned.

    Raises:
        CheckpointCorruptError: a chunk fails its checksum, or a header does not match the
            manifest.
    """
    where = f"{target.url}: step {step}"
    by_file: dict[str, list[tuple[str, dict[str, Any]]]] = {name: [] for name in manifest.files}
    for name, e in manifest.tensors.items():
        if "file" in e:
            by_file[e["file"]].append((name, e))
    out: dict[str, torch.Tensor] = {}
    regions = {fname: _regions(manifest, fname, entries, out, dests, f"{where}, file {fname}")
               for fname, entries in by_file.items()}

    def message(m: Mismatch) -> str:
        return f"{where}, file {m.file}: checksum mismatch in bytes [{m.begin}, {m.end})"

    scatter: dict[str, Any] = {fname: _Scatter(r) for fname, r in regions.items()}
    plan = plan_check(manifest, where, files=list(by_file), dests=scatter, message=message)
    run(plan, PreadTransport(target, step, pool=target.io_pool, request_bytes=0))  # (one read per chunk)
    for fname, r in regions.items():
        check_header(r[0][1].tobytes(), fname, manifest, where)
    if device is not None and device.type != "cpu":
        out = {k: v.to(device) for k, v in out.items()}
    _build_views(manifest, out, where)
    return out
