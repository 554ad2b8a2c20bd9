"""A DTensor of the checkpoint, assembled for the layout it is restored into.

For every DTensor of the saved state, :func:`plan_dtensor` decides what the restoring rank
holds (its *destination*: the box of the global tensor that the target's DTensor places on
this rank, or the whole tensor for a plain target or a single process) and which parts of
which saved shards fill it (*pieces*). Each saved shard is a box of the global tensor (see
:mod:`.shards`); a shard that several ranks saved (a ``Replicate`` mesh dimension) is read
from one of them, spread over the restoring ranks. Everything read from the manifest is
checked before it is used to size or place anything: the shards lie inside the global
shape, their bytes inside their files, and the boxes tile the destination exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointCorruptError, ConfigError
from ..format.layout import ST_TO_DTYPE, contiguous_stride
from ..format.manifest import Manifest
from ..restore.loaders.host import view_of
from ..restore.values import local_tensor
from .ranged import RangedReads
from .shards import Box, byte_runs, derive_offsets, intersect, parse_placement, volume
from .skeletons import SavedDTensor

__all__ = ["Dest", "Piece", "Stored", "box_for", "box_of", "fill", "parse_placements", "plan_dtensor", "saved_boxes",
           "stored", "whole"]

_MAX_DIMS = 64
_CHECK_PAIRS = 256  # shards overlapping one destination checked pairwise for overlaps up to this many


@dataclass(frozen=True)
class Stored:
    """Where the bytes of one stored tensor lie: C-contiguous in ``file`` from ``begin``, or,
    for a non-contiguous view, inside its base's bytes ``[begin, end)`` (``entry`` says how)."""

    name: str
    file: str
    begin: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    end: int = -1  # set for a non-contiguous view: the end of its base's bytes
    entry: dict[str, Any] | None = None


def _ints(value: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > _MAX_DIMS or \
            not all(type(x) is int and x >= 0 for x in value):
        raise CheckpointCorruptError(f"{where}: {what} {value!r:.80} is not a list of non-negative ints")
    return tuple(value)


def stored(m: Manifest, name: str, where: str) -> Stored:
    """Where tensor ``name`` of the manifest lies, checked against its file's size.

    Raises:
        CheckpointCorruptError: the index entry is malformed or points outside its file.
    """
    e = m.tensors.get(name) if isinstance(name, str) else None
    if not isinstance(e, dict):
        raise CheckpointCorruptError(f"{where}: the state names tensor {name!r}, which the index lacks")
    code = e.get("dtype")
    dtype = ST_TO_DTYPE.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise CheckpointCorruptError(f"{where}: tensor {name!r} has unknown dtype {e.get('dtype')!r}")
    shape = _ints(e.get("shape"), f"the shape of {name!r}", where)
    nbytes = math.prod(shape) * dtype.itemsize
    if "file" in e:
        rec = m.files[e["file"]]
        offs = e.get("offsets")
        b, end = offs if isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs) else (-1, -1)
        if not (0 <= b <= end and rec.header_size + end <= rec.size and end - b == nbytes):
            raise CheckpointCorruptError(f"{where}: tensor {name!r} has bad offsets {offs!r:.80}")
        return Stored(name, e["file"], rec.header_size + b, dtype, shape)
    base_name = e.get("view_of")
    base = m.tensors.get(base_name) if isinstance(base_name, str) else None
    if not isinstance(base, dict) or "file" not in base:
        raise CheckpointCorruptError(f"{where}: tensor {name!r} is a view of {base_name!r}, which is not stored")
    b = stored(m, base_name, where)  # type: ignore[arg-type]
    base_bytes = math.prod(b.shape) * b.dtype.itemsize
    stride = _ints(e.get("stride"), f"the stride of {name!r}", where)
    offset = e.get("byte_offset")
    if len(stride) != len(shape) or type(offset) is not int or offset < 0:
        raise CheckpointCorruptError(f"{where}: view {name!r} has a bad stride or byte offset")
    if offset % dtype.itemsize == 0 and offset + nbytes <= base_bytes and _c_contiguous(shape, list(stride)):
        return Stored(name, b.file, b.begin + offset, dtype, shape)
    return Stored(name, b.file, b.begin, dtype, shape, end=b.begin + base_bytes, entry=e)


def _c_contiguous(shape: tuple[int, ...], stride: Any) -> bool:
    if not isinstance(stride, list) or len(stride) != len(shape):
        return False
    want = contiguous_stride(shape)
    return all(s <= 1 or st == w for s, st, w in zip(shape, stride, want, strict=True))


@dataclass(frozen=True)
class Piece:
    """Box ``(lo, size)`` of saved tensor ``source`` (in its own coordinates) lands at
    ``dest_lo`` of the destination."""

    source: Stored
    lo: tuple[int, ...]
    size: tuple[int, ...]
    dest_lo: tuple[int, ...]

    def want(self, reads: RangedReads) -> None:
        s = self.source
        if s.entry is not None:  # a non-contiguous view: its base's bytes
            reads.want(s.file, s.begin, s.end)
            return
        for b, e in byte_runs(s.shape, s.dtype.itemsize, self.lo, self.size):
            reads.want(s.file, s.begin + b, s.begin + e)


def whole(source: Stored) -> Piece:
    """The whole of ``source``."""
    zero = (0,) * len(source.shape)
    return Piece(source, zero, source.shape, zero)


@dataclass
class Dest:
    """What this rank restores of one saved DTensor."""

    key: str
    path: str
    shape: tuple[int, ...]  # global
    dtype: torch.dtype
    box: Box | None  # the part of the global tensor this rank holds; None: a layout that is no box
    device: torch.device
    target: torch.Tensor | None = None  # the target's tensor at this place (a DTensor or a plain one)
    mesh: Any = None  # with placements: restored as a DTensor on this mesh; None: a plain tensor
    placements: tuple[Any, ...] | None = None
    own: str = ""  # the stored name of this rank's own saved shard, when it is exactly the destination
    pieces: list[Piece] = field(default_factory=list)

    @property
    def local_shape(self) -> tuple[int, ...]:
        assert self.box is not None
        return self.box[1]


def box_of(t: torch.Tensor) -> Box | None:
    """The box of the global tensor that this rank holds of DTensor ``t``; None when its
    placements do not make it a box (``Partial``, ``_StridedShard``)."""
    return box_for(tuple(t.shape), t.device_mesh, t.placements)  # type: ignore[attr-defined]


def box_for(shape: tuple[int, ...], mesh: Any, placements: Any) -> Box | None:
    """The box this rank holds of a DTensor of global ``shape`` laid out on ``mesh``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) is Shard or isinstance(p, Replicate) for p in placements):
        return None
    local, offset = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    if len(local) != len(shape):  # this rank is not in the mesh
        return None
    return tuple(int(x) for x in offset), tuple(int(x) for x in local)


def saved_boxes(m: Manifest, saved: SavedDTensor, where: str) -> tuple[tuple[int, ...], torch.dtype,
                                                                        list[tuple[Box | None, Stored]]]:
    """The global shape, the dtype, and each saved rank's (box, stored shard) of a DTensor.

    Raises:
        CheckpointCorruptError: the nodes disagree, or a shard lies outside the global shape.
    """
    n0 = saved.nodes[0]
    shape = _ints(n0.get("shape"), f"the global shape of {saved.path}", where)
    placements = n0.get("placements")
    mesh = n0.get("mesh")
    if not isinstance(placements, list) or not all(isinstance(p, str) for p in placements):
        raise CheckpointCorruptError(f"{where}: {saved.path} has malformed placements {placements!r:.80}")
    mesh_shape = _ints(mesh, f"the mesh of {saved.path}", where)
    out: list[tuple[Box | None, Stored]] = []
    dtype = None
    for rank, node in enumerate(saved.nodes):
        if node.get("shape") != list(shape):
            raise CheckpointCorruptError(f"{where}: the saved ranks disagree on the global shape of {saved.path}")
        s = stored(m, node["$dtensor"], where)
        if dtype is not None and s.dtype != dtype:
            raise CheckpointCorruptError(f"{where}: the saved ranks disagree on the dtype of {saved.path}")
        dtype = s.dtype
        if len(s.shape) != len(shape):
            raise CheckpointCorruptError(f"{where}: the shard of {saved.path} saved by rank {rank} has "
                                         f"{len(s.shape)} dims, the tensor {len(shape)}")
        box: Box | None
        if "offsets" in node:
            box = (_ints(node["offsets"], f"the offsets of {saved.path}", where), s.shape)
            if len(box[0]) != len(shape):
                raise CheckpointCorruptError(f"{where}: the offsets of {saved.path} saved by rank {rank} have "
                                             f"{len(box[0])} dims, the tensor {len(shape)}")
        else:  # written before shards recorded their offsets
            box = derive_offsets(shape, placements, mesh_shape, rank)
            if box is not None and box[1] != s.shape:
                box = None
        if box is not None and any(o + z > g for o, z, g in zip(box[0], box[1], shape, strict=True)):
            raise CheckpointCorruptError(f"{where}: the shard of {saved.path} saved by rank {rank} lies outside "
                                         f"its global shape {list(shape)}")
        out.append((box, s))
    assert dtype is not None
    return shape, dtype, out


def plan_dtensor(dest: Dest, shards: list[tuple[Box | None, Stored]], me: int, same_world: bool,
                 saved_placements: list[str], where: str) -> None:
    """Fill ``dest.own`` and ``dest.pieces``: the parts of the saved shards that make up the
    destination, each read from one rank that saved it.

    Raises:
        ConfigError: the destination needs shards whose layout cannot be resharded.
        CheckpointCorruptError: the saved shards do not tile the tensor.
    """
    mine = shards[me] if same_world and me < len(shards) else None
    target = dest.target
    if mine is not None and dest.box is not None and mine[0] == dest.box:
        dest.own = mine[1].name
    elif mine is not None and dest.box is None and target is not None and \
            [str(p) for p in getattr(target, "placements", ())] == saved_placements and \
            tuple(local_tensor(target).shape) == mine[1].shape:
        dest.own = mine[1].name  # same non-box layout (e.g. _StridedShard) on the same ranks: own shard as is
        return
    box = dest.box
    if box is None:
        raise ConfigError(f"{dest.path}: restoring into placements {list(getattr(target, 'placements', ()))} "
                          "needs the same layout and world size as the save (they are not plain boxes)")
    holders: dict[Box, list[int]] = {}
    for rank, (b, _) in enumerate(shards):
        if b is None:
            raise ConfigError(f"{dest.path} was saved with placements {saved_placements}, whose shards cannot be "
                              "resharded: restore it at the world size and layout it was saved with")
        if volume(b[1]):
            holders.setdefault(b, []).append(rank)
    if sum(volume(b[1]) for b in holders) != volume(dest.shape):
        raise CheckpointCorruptError(f"{where}: the saved shards of {dest.path} do not tile its global shape "
                                     f"{list(dest.shape)}")
    parts: list[tuple[Box, Box]] = []
    for b in holders:
        inter = intersect(b, box)
        if inter is not None:
            parts.append((b, inter))
    overlap = len(parts) <= _CHECK_PAIRS and any(
        intersect(x, y) is not None for k, (x, _) in enumerate(parts) for y, _ in parts[k + 1:])
    if overlap or sum(volume(i[1]) for _, i in parts) != volume(box[1]):
        raise CheckpointCorruptError(f"{where}: the saved shards of {dest.path} overlap or leave gaps")
    for b, inter in parts:
        ranks = holders[b]
        src = me if me in ranks and same_world else ranks[me % len(ranks)]
        dest.pieces.append(Piece(shards[src][1], tuple(x - y for x, y in zip(inter[0], b[0], strict=True)),
                                 inter[1], tuple(x - y for x, y in zip(inter[0], box[0], strict=True))))


def _source_view(reads: RangedReads, p: Piece, where: str) -> torch.Tensor | None:
    """Piece ``p`` of its source as a (strided) CPU tensor over verified bytes; None when its
    bytes are not in one run of chunks read."""
    s = p.source
    if s.entry is not None:
        raw = reads.get(s.file, s.begin, s.end)
        if raw is None:
            return None
        full = view_of(torch.from_numpy(raw), s.name, s.entry, where)
        return full[tuple(slice(a, a + z) for a, z in zip(p.lo, p.size, strict=True))]
    item = s.dtype.itemsize
    strides = contiguous_stride(s.shape)
    first = sum(a * st for a, st in zip(p.lo, strides, strict=True))
    last = sum((a + z - 1) * st for a, z, st in zip(p.lo, p.size, strides, strict=True))
    raw = reads.get(s.file, s.begin + first * item, s.begin + (last + 1) * item)
    if raw is None:
        return None
    return torch.from_numpy(raw).view(s.dtype).as_strided(p.size, strides)


def fill(out: torch.Tensor, pieces: list[Piece], reads: RangedReads, where: str) -> None:
    """Copy every piece into ``out`` (on any device), splitting pieces whose bytes span runs
    of chunks that were not read together."""
    todo = list(pieces)
    while todo:
        p = todo.pop()
        if not all(p.size):
            continue
        src = _source_view(reads, p, where)
        if src is not None:
            out[tuple(slice(a, a + z) for a, z in zip(p.dest_lo, p.size, strict=True))].copy_(src)
            continue
        d = next((i for i, z in enumerate(p.size) if z > 1), None)
        if d is None:
            raise CheckpointCorruptError(f"{where}: the bytes of {p.source.name!r} were not read")
        half = p.size[d] // 2
        for off, z in ((0, half), (half, p.size[d] - half)):
            todo.append(Piece(p.source, _shift(p.lo, d, off), tuple(z if i == d else x for i, x in enumerate(p.size)),
                              _shift(p.dest_lo, d, off)))


def _shift(lo: tuple[int, ...], d: int, by: int) -> tuple[int, ...]:
    return tuple(x + by if i == d else x for i, x in enumerate(lo))


def parse_placements(texts: list[str]) -> list[Any] | None:
    """Saved placement strings as ``Shard``/``Replicate`` objects; None when one is neither."""
    from torch.distributed.tensor import Replicate, Shard

    out: list[Any] = []
    for t in texts:
        d = parse_placement(t)
        if d is None:
            return None
        out.append(Replicate() if d < 0 else Shard(d))
    return out
