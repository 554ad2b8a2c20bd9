"""A multi-rank checkpoint as whole tensors, written to plain safetensors files (what
``ckptmgr export`` writes for a sharded checkpoint).

Each DTensor is assembled from the shards of every rank that saved it and written under the
name a single process would have given it (``model/w``, not ``rank00000/model/w``);
replicated tensors are written once under their names; every rank's PerRank tensors under
their own names (``rank00001/rng``), so that no rank's values pass for another's. Tensors
are assembled a batch at a time (bounded memory), from verified reads of the checksum chunks
that hold them, and written at their place in output files of bounded size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..format.layout import DTYPE_TO_ST, StoredTensor, header_bytes
from ..format.manifest import Manifest
from ..restore.preflight import Source
from .coordinator import rank_prefix
from .ranged import RangedReads
from .reshard import Dest, Piece, fill, plan_dtensor, saved_boxes, stored, whole
from .skeletons import dict_values, rank_view, tensor_names

__all__ = ["Exported", "write_whole"]

_BATCH_BYTES = 256 << 20  # tensors assembled together: one pass over the chunks they share
_EMPTY = torch.empty(0, dtype=torch.uint8)


@dataclass
class Exported:
    """What :func:`write_whole` wrote.

    Attributes:
        weight_map: exported tensor name -> the file it is in.
        names: tensor name in ``skeleton`` -> its exported name (only those written).
        index: tensor name in ``skeleton`` -> ``{"dtype": "F32", "shape": [...]}``.
        skeleton: rank 0's state tree, each DTensor a ``$tensor`` of its whole tensor and each
            PerRank value ``{"$dict": {"rank00000": ..., "rank00001": ...}}``.
    """

    weight_map: dict[str, str]
    names: dict[str, str]
    index: dict[str, dict[str, Any]]
    skeleton: Any


@dataclass
class _Item:
    name: str  # exported name
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: list[Piece]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


def _items(m: Manifest, where: str) -> tuple[list[_Item], Any]:
    states = m.rank_states if m.rank_states is not None else [m.state]
    view = rank_view(states, 0, where)
    items: dict[str, _Item] = {}
    for n in sorted(tensor_names(view.skeleton, per_rank=False)):
        s = stored(m, n, where)
        items[n] = _Item(n, s.dtype, s.shape, [whole(s)])
    for state in states:
        for n in sorted(tensor_names(state, per_rank=True)):
            s = stored(m, n, where)
            items[n] = _Item(n, s.dtype, s.shape, [whole(s)])
    names: dict[str, str] = {}
    for key, sd in view.dtensors.items():
        shape, dtype, shards = saved_boxes(m, sd, where)
        full = Dest(key, sd.path, shape, dtype, ((0,) * len(shape), shape), torch.device("cpu"))
        plan_dtensor(full, shards, 0, False, sd.nodes[0]["placements"], where)
        name = str(sd.nodes[0]["$dtensor"]).removeprefix(rank_prefix(0))
        if name in items:  # a replicated tensor has the name already: keep the stored one
            name = str(sd.nodes[0]["$dtensor"])
        names[key] = name
        items[name] = _Item(name, dtype, shape, full.pieces)
    return list(items.values()), _rewrite(view.skeleton, names, states)


def _rewrite(node: Any, names: dict[str, str], states: list[Any]) -> Any:
    """The tree for state.json: DTensor keys -> ``$tensor`` of the exported name; PerRank
    values -> every rank's, keyed by rank."""
    every = _per_rank_values(states)

    def walk(n: Any) -> Any:
        if isinstance(n, list):
            return [walk(v) for v in n]
        if not isinstance(n, dict) or not n:
            return n
        tag, val = next(iter(n.items()))
        if tag == "$dtensor":
            return {"$tensor": names[val]}
        if tag == "$per_rank":
            return {"$dict": {rank_prefix(k).rstrip("/"): v for k, v in enumerate(every.pop(0))}}
        if tag == "$stateful":
            return {**n, "state": walk(n.get("state"))}
        if tag == "$tuple":
            return {"$tuple": walk(val)}
        if tag == "$dict":
            body = {k: walk(v) for k, v in val.items()} if isinstance(val, dict) else [[p[0], walk(p[1])] for p in val]
            return {**n, "$dict": body}
        return n

    return walk(node)


def _per_rank_values(states: list[Any]) -> list[list[Any]]:
    """For each PerRank value, in walk order, every rank's value."""
    per: list[list[Any]] = []
    for state in states:
        found: list[Any] = []

        def walk(n: Any, found: list[Any] = found) -> None:
            if isinstance(n, list):
                for v in n:
                    walk(v)
                return
            if not isinstance(n, dict) or not n:
                return
            tag, val = next(iter(n.items()))
            if tag == "$per_rank":
                found.append(val)
            elif tag == "$stateful":
                walk(n.get("state"))
            elif tag == "$tuple":
                walk(val)
            elif tag == "$dict":
                for v in dict_values(val):
                    walk(v)

        walk(state)
        per.append(found)
    return [list(vals) for vals in zip(*per, strict=True)]


def write_whole(source: Source, step: int, m: Manifest, directory: str, *, only: str = "",
                on_bytes: Callable[[int], None] | None = None, max_file_bytes: int = 4 << 30) -> Exported:
    """Write every tensor of multi-rank checkpoint ``m`` whole, as safetensors files in
    ``directory`` (``model-00001-of-00002.safetensors``, ...).

    Args:
        source: where the step's files are.
        step: the step.
        m: its manifest.
        directory: an existing directory to write the files in.
        only: write only tensors whose exported name starts with this; it is stripped from
            the names written.
        on_bytes: called with the number of bytes read, batch by batch.
        max_file_bytes: a file grows past this only for a single larger tensor.

    Raises:
        CheckpointCorruptError: a read fails its checksum, or the manifest is inconsistent.
    """
    where = f"{source.url}: step {step}"
    items, skeleton = _items(m, where)
    index = {it.name: {"dtype": DTYPE_TO_ST[it.dtype], "shape": list(it.shape)} for it in items}
    chosen = [it for it in items if it.name.startswith(only)]
    order = sorted(chosen, key=lambda it: (-it.dtype.itemsize, it.name))
    files: list[list[_Item]] = [[]]
    size = 0
    for it in order:
        if files[-1] and size + it.nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(it)
        size += it.nbytes
    files = [f for f in files if f]
    place: dict[str, tuple[str, int]] = {}  # exported name -> (file, offset of its data)
    handles: dict[str, int] = {}
    try:
        for i, group in enumerate(files):
            fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            stored_list, off = [], 0
            for it in group:
                stored_list.append(StoredTensor(it.name[len(only):], DTYPE_TO_ST[it.dtype], it.shape, off,
                                                off + it.nbytes, _EMPTY))
                off += it.nbytes
            header = header_bytes(stored_list, {"format": "pt", "step": str(step)})
            fd = os.open(os.path.join(directory, fname), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            handles[fname] = fd
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, len(header) + off)
            for st, it in zip(stored_list, group, strict=True):
                place[it.name] = (fname, len(header) + st.begin)
        for batch in _batches(chosen):
            reads = RangedReads(source, step, m)
            for it in batch:
                for p in it.pieces:
                    p.want(reads)
            reads.read()
            for it in batch:
                out = torch.empty(it.shape, dtype=it.dtype)
                fill(out, it.pieces, reads, where)
                fname, at = place[it.name]
                if it.nbytes:
                    os.pwrite(handles[fname], out.reshape(-1).view(torch.uint8).numpy().data, at)
            if on_bytes is not None:
                on_bytes(reads.bytes_read)
        for fd in handles.values():
            os.fsync(fd)
    finally:
        for fd in handles.values():
            os.close(fd)
    names = {it.name: it.name[len(only):] for it in chosen}
    return Exported({names[n]: place[n][0] for n in names}, names, index, skeleton)


def _batches(items: list[_Item]) -> list[list[_Item]]:
    """Items in the order of the bytes they read, in batches of about _BATCH_BYTES."""
    def first(it: _Item) -> tuple[str, int]:
        return (it.pieces[0].source.file, it.pieces[0].source.begin) if it.pieces else ("", 0)

    out: list[list[_Item]] = [[]]
    size = 0
    for it in sorted(items, key=first):
        if out[-1] and size + it.nbytes > _BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(it)
        size += it.nbytes
    return [b for b in out if b]
