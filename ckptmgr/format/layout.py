"""Tensor leaves -> a safetensors file plan: names, dtypes, shapes, offsets, header bytes.

Rules (docs/FORMAT.md):

* the JSON header is padded with spaces so the data region starts on a 4096-byte boundary;
* tensors are laid out by descending alignment (the dtype's item size), so each one is
  naturally aligned in the file and in memory mapped at a page boundary; no gaps;
* tensors that share storage (tied weights, views) are stored once. When all of them are
  the same tensor, or one contiguous member covers the others, that member is stored and the
  rest become *views* of it; otherwise the spanned bytes of the storage are stored as one
  ``U8`` tensor and every member is a view into it;
* a large state is split into several files of similar size (tensors are never split), so
  that the files can be written and read in parallel.
"""

from __future__ import annotations

import heapq
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where tensors are laid out: reading a manifest needs no torch
    import torch

from ..errors import UnsupportedValueError
from .tree import MAX_FILE_BYTES, Leaf

__all__ = [
    "DATA_ALIGN",
    "DTYPE_TO_ST",
    "MIN_SHARD_BYTES",
    "ST_DTYPES",
    "ST_TO_DTYPE",
    "FilePlan",
    "Plan",
    "StoredTensor",
    "ViewEntry",
    "contiguous_stride",
    "file_name",
    "header_bytes",
    "plan_layout",
]

DATA_ALIGN = 4096
MIN_SHARD_BYTES = 64 << 20  # smallest file worth a thread of its own
# The safetensors dtype codes ckptmgr stores: code -> (torch dtype name, item size in bytes).
# Reading a manifest needs only this; the torch dtype tables below are built from it on first use.
ST_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "C64": ("complex64", 8),
}

if TYPE_CHECKING:
    DTYPE_TO_ST: dict[torch.dtype, str]  # torch dtype -> safetensors code
    ST_TO_DTYPE: dict[str, torch.dtype]  # safetensors code -> torch dtype


def _dtype_table(name: str) -> Any:
    """``DTYPE_TO_ST`` or ``ST_TO_DTYPE``, both built from :data:`ST_DTYPES` on first use
    (threads that get there at once each build the same tables; the last one stays)."""
    if name not in globals():
        import torch

        to_st = {getattr(torch, dtype): code for code, (dtype, _) in ST_DTYPES.items()}
        globals().update(DTYPE_TO_ST=to_st, ST_TO_DTYPE={v: k for k, v in to_st.items()})
    return globals()[name]


def __getattr__(name: str) -> Any:
    """The torch dtype tables, made on first use (PEP 562), so that importing this module (to
    read a manifest) does not import torch."""
    if name in ("DTYPE_TO_ST", "ST_TO_DTYPE"):
        return _dtype_table(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def file_name(index: int, prefix: str = "data-") -> str:
    """Name of the ``index``-th data file of a checkpoint (of one rank's share: ``data-r00001-``)."""
    return f"{prefix}{index:05d}.safetensors"


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class StoredTensor:
    """A tensor written to a file: ``source``'s bytes land at ``[begin, end)`` of the data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    source: torch.Tensor = field(repr=False, compare=False)


@dataclass(frozen=True)
class ViewEntry:
    """A tensor restored as a view into a stored tensor's bytes (aliasing kept)."""

    name: str
    base: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int


@dataclass
class FilePlan:
    name: str
    header: bytes
    tensors: list[StoredTensor]

    @property
    def data_size(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @property
    def size(self) -> int:
        return len(self.header) + self.data_size


@dataclass
class Plan:
    files: list[FilePlan]
    views: list[ViewEntry]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def tensor_index(self) -> dict[str, dict[str, Any]]:
        """The manifest's tensor index: where each tensor lives, by name."""
        index: dict[str, dict[str, Any]] = {}
        for f in self.files:
            for t in f.tensors:
                index[t.name] = {"file": f.name, "dtype": t.dtype, "shape": list(t.shape),
                                 "offsets": [t.begin, t.end]}
        for v in self.views:
            index[v.name] = {"view_of": v.base, "dtype": v.dtype, "shape": list(v.shape),
                             "stride": list(v.stride), "byte_offset": v.byte_offset}
        return index


def header_bytes(tensors: list[StoredTensor], metadata: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header, space-padded so that data starts at DATA_ALIGN."""
    obj: dict[str, Any] = {"__metadata__": metadata}
    for t in tensors:
        obj[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
    raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    total = -(-(8 + len(raw)) // DATA_ALIGN) * DATA_ALIGN
    n = total - 8
    return n.to_bytes(8, "little") + raw + b" " * (n - len(raw))


def _st_dtype(leaf: Leaf) -> str:
    to_st: dict[torch.dtype, str] = _dtype_table("DTYPE_TO_ST")
    try:
        return to_st[leaf.tensor.dtype]
    except KeyError:
        raise UnsupportedValueError(
            leaf.path, f"dtype {leaf.tensor.dtype} is not supported by the safetensors format; "
            f"convert it first (supported: {', '.join(str(d) for d in to_st)})"
        ) from None


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = int(t.storage_offset()) * t.element_size()
    extent = 1 + sum((int(s) - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return start, start + extent * t.element_size()


@dataclass
class _Entry:  # a tensor to store, before offsets are known
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    align: int
    source: torch.Tensor


def _whole(leaf: Leaf) -> _Entry:
    """Store the leaf's tensor as it is (a non-contiguous one is compacted by the copy)."""
    t = leaf.tensor
    return _Entry(leaf.name, _st_dtype(leaf), tuple(t.shape), t.numel() * t.element_size(), t.element_size(), t)


def _resolve_aliases(leaves: list[Leaf]) -> tuple[list[_Entry], list[ViewEntry]]:
    groups: dict[tuple[str, int], list[Leaf]] = defaultdict(list)
    entries: list[_Entry] = []
    views: list[ViewEntry] = []
    for leaf in leaves:
        t = leaf.tensor
        if t.is_conj() or t.is_neg():  # flatten() resolves them; its bytes are not the values it shows
            raise UnsupportedValueError(leaf.path, "a conjugate or negative view cannot be stored as its base's "
                                                   "bytes; store t.resolve_conj().resolve_neg()")
        if t.numel() == 0:
            entries.append(_whole(leaf))
        else:
            _st_dtype(leaf)  # refuse unsupported dtypes before any grouping work
            groups[(str(t.device), t.untyped_storage().data_ptr())].append(leaf)

    for members in groups.values():
        first = members[0].tensor
        sig = (first.storage_offset(), tuple(first.shape), first.stride(), first.dtype)
        if all((m.tensor.storage_offset(), tuple(m.tensor.shape), m.tensor.stride(), m.tensor.dtype) == sig
               for m in members):
            # One tensor, or the same tensor reached several times (tied weights): store it
            # once, alias the rest.
            entries.append(_whole(members[0]))
            for m in members[1:]:
                views.append(ViewEntry(m.name, members[0].name, _st_dtype(m), tuple(first.shape),
                                       contiguous_stride(tuple(first.shape)), 0))
            continue
        ranges = [_byte_range(m.tensor) for m in members]
        lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
        cover = next((m for m, r in zip(members, ranges, strict=True)
                      if r == (lo, hi) and m.tensor.is_contiguous()), None)
        if cover is not None:
            base_name = cover.name
            ct = cover.tensor
            entries.append(_Entry(cover.name, _st_dtype(cover), tuple(ct.shape), hi - lo,
                                  ct.element_size(), ct))
        else:
            align = max(m.tensor.element_size() for m in members)
            nbytes_storage = first.untyped_storage().nbytes()
            lo = lo // align * align
            hi = min(-(-hi // align) * align, nbytes_storage)
            base_name = f"{members[0].name}~storage"
            import torch

            span = torch.empty(0, dtype=torch.uint8, device=first.device)
            span.set_(first.untyped_storage(), lo, (hi - lo,), (1,))
            entries.append(_Entry(base_name, "U8", (hi - lo,), hi - lo,
                                  align if (hi - lo) % align == 0 else 1, span))
        for m, r in zip(members, ranges, strict=True):
            if cover is not None and m is cover:
                continue
            if any(st > MAX_FILE_BYTES for st in m.tensor.stride()):
                raise UnsupportedValueError(m.path, f"a view with strides {list(m.tensor.stride())}; the format "
                                                    f"holds strides of at most {MAX_FILE_BYTES}: store t.clone()")
            views.append(ViewEntry(m.name, base_name, _st_dtype(m), tuple(m.tensor.shape),
                                   tuple(m.tensor.stride()), r[0] - lo))
    return entries, views


def _assign(entries: list[_Entry], max_file_bytes: int, files_hint: int) -> list[list[int]]:
    """Group entry indices into files: as many as ``files_hint`` (each of at least
    MIN_SHARD_BYTES) so that files can be written in parallel, and enough that none
    exceeds ``max_file_bytes`` where the tensors allow."""
    total = sum(e.nbytes for e in entries)
    n = max(-(-total // max_file_bytes), min(files_hint, total // MIN_SHARD_BYTES), 1)
    n = min(n, max(len(entries), 1))
    if n == 1:
        return [list(range(len(entries)))]
    # Largest first, each into the lightest file: balanced files, deterministic.
    heap = [(0, i) for i in range(n)]
    groups: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(entries)), key=lambda i: (-entries[i].nbytes, i)):
        load, f = heapq.heappop(heap)
        groups[f].append(i)
        heapq.heappush(heap, (load + entries[i].nbytes, f))
    return [g for g in groups if g]


def plan_layout(leaves: list[Leaf], *, max_file_bytes: int, metadata: dict[str, str],
                files_hint: int = 1, file_prefix: str = "data-") -> Plan:
    """Lay the leaves out in one or more safetensors files.

    Args:
        leaves: the tensors to store.
        max_file_bytes: a file grows past this only when a single tensor is larger.
        metadata: the safetensors ``__metadata__`` of every file.
        files_hint: split a large state into up to this many files of similar size, so
            that they can be written in parallel (the kernel serializes buffered writes to
            one file). States under ``2 * MIN_SHARD_BYTES`` stay in one file.

    Raises:
        UnsupportedValueError: a tensor's dtype has no safetensors equivalent, or a view's
            stride is over MAX_FILE_BYTES (``flatten`` refused the other bounds).
    """
    entries, views = _resolve_aliases(leaves)
    plans = []
    for idx, group in enumerate(_assign(entries, max_file_bytes, files_hint)):
        # Descending alignment keeps every tensor naturally aligned; ties keep state order.
        group = sorted(group, key=lambda i: (-entries[i].align, i))
        stored, off = [], 0
        for i in group:
            e = entries[i]
            stored.append(StoredTensor(e.name, e.dtype, e.shape, off, off + e.nbytes, e.source))
            off += e.nbytes
        plans.append(FilePlan(file_name(idx, file_prefix), header_bytes(stored, metadata), stored))
    return Plan(plans, views)
