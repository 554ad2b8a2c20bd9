"""The files of one checkpoint directory, and how each one's bytes are made: the one place where
a file's format is decided.

A :class:`FileSet` collects what a library would write (see :mod:`._capture`):

* ``add_safetensors(name, tensors, metadata)``: a safetensors file. Its image (header, then
  the tensors, the header padded so the data starts on a 4096-byte boundary, as ckptmgr's
  own files) is laid out in a staging segment; the stager copies the tensors in; the
  segment is written as it is.
* ``add_torch(name, obj)``: a file ``torch.load(..., weights_only=True)`` reads, as
  ``torch.save`` writes it. Through :mod:`ckptmgr.format.torchzip` (the torch-zip image
  writer), the file is laid out as the archive ``torch.save`` would write (pickled at once,
  the storages' bytes left for the stager), filled by the staging copies and written from
  the segment as it is. When the image can take none of the object's storages, tensors
  reached through dicts, lists and tuples are staged and the file is serialized from the
  staged copies on the writer's thread; an
  object holding anything else (an arbitrary class, a tensor subclass) is serialized at once
  with ``torch.save`` (such objects are small: ``TrainingArguments``, a sampler), since only
  plain containers can be copied safely.
* ``add_bytes(name, data)``: bytes already made.

Every entry ends in :func:`write_file`, which writes a buffer into the checkpoint's
temporary directory in parallel chunks, computes each chunk's CRC32C on the way, and fsyncs.
"""

from __future__ import annotations

import abc
import io
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptmgr import UnsupportedValueError
from ckptmgr.extend import (
    DTYPE_TO_ST,
    FilePlan,
    FileRecord,
    StoredTensor,
    chunk_ranges,
    crc32c_hex,
    header_bytes,
    plan_image,
    seal,
)

__all__ = ["Entry", "FileSet", "write_file"]

_ALIGN = 64  # byte alignment of each staged tensor of a torch file (any dtype can view it)
_PAD = b"\0" * _ALIGN  # the stager copies a header into every segment; torch files get this one
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
              np.generic)


def write_file(path: str, data: np.ndarray[Any, Any] | memoryview, pool: Executor | None,
               chunk_size: int) -> FileRecord:
    """Write ``data`` (contiguous bytes) to the new file ``path``: chunks in parallel on
    ``pool``, each hashed as it is written; fsynced before returning."""
    arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, memoryview) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, arr.size)

        def chunk(rng: tuple[int, int]) -> str:
            b, e = rng
            view = memoryview(arr[b:e])  # type: ignore[arg-type]
            at = b
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
            return crc32c_hex(arr[b:e])

        ranges = chunk_ranges(arr.size, chunk_size)
        crcs = list(pool.map(chunk, ranges)) if pool is not None and len(ranges) > 1 else [chunk(r) for r in ranges]
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileRecord(int(arr.size), tuple(crcs))


class Entry(abc.ABC):
    """One file of the set, an image of the save engine. ``plan`` is what the stager copies
    into the entry's segment (None: nothing to stage), after :meth:`fill` has written the rest
    of the segment; :meth:`seal` and :meth:`write` run on the writer's thread once the copies
    have landed."""

    name: str
    plan: FilePlan | None = None

    @property
    def size(self) -> int:
        """Bytes of the entry's staging segment."""
        return self.plan.size if self.plan is not None else 0

    def fill(self, segment: torch.Tensor) -> None:  # noqa: B027 (most entries have nothing to fill)
        """Write what is not copied from tensors into the segment (training thread)."""

    def seal(self, buffer: np.ndarray[Any, Any], io: Executor) -> None:  # noqa: B027 (most have nothing to seal)
        """Finish the segment once the copies have landed (writer's thread)."""

    @abc.abstractmethod
    def write(self, segment: np.ndarray[Any, Any] | None, path: str, pool: Executor | None,
              chunk_size: int) -> FileRecord:
        """Write the file at ``path`` (writer's thread) and return its record."""


class _Bytes(Entry):
    def __init__(self, name: str, data: bytes) -> None:
        self.name, self.data = name, data

    def write(self, segment: np.ndarray[Any, Any] | None, path: str, pool: Executor | None,
              chunk_size: int) -> FileRecord:
        return write_file(path, memoryview(self.data), pool, chunk_size)


class _Safetensors(Entry):
    def __init__(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> None:
        self.name = name
        if metadata is not None and not (isinstance(metadata, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise UnsupportedValueError(name, "safetensors metadata must map str to str")
        items = []
        for key, t in tensors.items():
            if not isinstance(key, str) or not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                raise UnsupportedValueError(f"{name}[{key!r}]", "safetensors stores dense tensors under str names")
            if t.dtype not in DTYPE_TO_ST:
                raise UnsupportedValueError(f"{name}[{key!r}]", f"dtype {t.dtype} has no safetensors equivalent")
            items.append((key, t.detach()))
        # descending item size keeps every tensor naturally aligned; ties keep the given order
        order = sorted(range(len(items)), key=lambda i: (-items[i][1].element_size(), i))
        stored, off = [], 0
        for i in order:
            key, t = items[i]
            n = t.numel() * t.element_size()
            stored.append(StoredTensor(key, DTYPE_TO_ST[t.dtype], tuple(t.shape), off, off + n, t))
            off += n
        self.plan = FilePlan(name, header_bytes(stored, dict(metadata or {})), stored)

    def write(self, segment: np.ndarray[Any, Any] | None, path: str, pool: Executor | None,
              chunk_size: int) -> FileRecord:
        assert segment is not None
        assert self.plan is not None
        return write_file(path, segment[:self.plan.size], pool, chunk_size)


@dataclass
class _Tensor:  # a staged tensor of a torch file: where its bytes are in the segment
    begin: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


@dataclass
class _Walk:
    tensors: dict[int, _Tensor] = field(default_factory=dict)  # id(tensor) -> slot place
    stored: list[StoredTensor] = field(default_factory=list)
    end: int = 0
    plain: bool = True  # only containers, tensors and immutable values


def _walk(obj: Any, w: _Walk, keep: list[Any]) -> Any:
    """``obj`` with every plain tensor replaced by its :class:`_Tensor` (one per tensor, so
    that aliases stay aliases); marks ``w.plain`` False on anything it cannot copy."""
    if type(obj) is torch.Tensor:
        if obj.layout != torch.strided or obj.device.type == "meta" or obj.is_quantized:
            w.plain = False
            return obj
        placed = w.tensors.get(id(obj))
        if placed is None:
            n = obj.numel() * obj.element_size()
            begin = -(-w.end // _ALIGN) * _ALIGN
            placed = _Tensor(len(_PAD) + begin, obj.dtype, tuple(obj.shape), obj.requires_grad)
            w.tensors[id(obj)] = placed
            keep.append(obj)  # ids stay unique while the walk runs
            if n:
                src = obj.detach().reshape(-1).view(torch.uint8)
                w.stored.append(StoredTensor(f"t{len(w.stored)}", "U8", (n,), begin, begin + n, src))
            w.end = begin + n
        return placed
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, _walk(v, w, keep)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_walk(v, w, keep) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if not isinstance(obj, _IMMUTABLE):
        w.plain = False
    return obj


def _rebuild(node: Any, segment: torch.Tensor, memo: dict[int, torch.Tensor]) -> Any:
    if isinstance(node, _Tensor):
        t = memo.get(id(node))
        if t is None:
            n = int(np.prod(node.shape, dtype=np.int64)) * torch.empty((), dtype=node.dtype).element_size()
            raw = segment[node.begin:node.begin + n]
            t = raw.view(node.dtype).view(node.shape).clone() if n else torch.empty(node.shape, dtype=node.dtype)
            t.requires_grad_(node.requires_grad)
            memo[id(node)] = t
        return t
    if type(node) in (dict, OrderedDict):
        return type(node)((k, _rebuild(v, segment, memo)) for k, v in node.items())
    if type(node) in (list, tuple):
        return type(node)(_rebuild(v, segment, memo) for v in node)
    return node


class _Torch(Entry):
    def __init__(self, name: str, skeleton: Any, stored: list[StoredTensor], end: int,
                 serialize: Callable[[Any, Any], None]) -> None:
        self.name = name
        self.skeleton = skeleton
        self.serialize = serialize
        self.plan = FilePlan(name, _PAD, stored) if end else None
        self.nbytes = end

    def write(self, segment: np.ndarray[Any, Any] | None, path: str, pool: Executor | None,
              chunk_size: int) -> FileRecord:
        seg = torch.from_numpy(segment) if segment is not None else torch.empty(0, dtype=torch.uint8)
        obj = _rebuild(self.skeleton, seg, {})
        buf = io.BytesIO()
        self.serialize(obj, buf)
        return write_file(path, buf.getbuffer(), pool, chunk_size)


class _TorchZip(Entry):
    """A torch file as the image ``torch.save`` writes, staged in place (see torchzip)."""

    def __init__(self, name: str, image: Any) -> None:
        self.name, self.image = name, image
        head = image.static[0][1]
        assert image.static[0][0] == 0
        assert head
        self.plan = FilePlan(name, head, [StoredTensor(f"data/{s.key}", "U8", (s.nbytes,), s.offset - len(head),
                                                       s.offset - len(head) + s.nbytes, s.source)
                                          for s in image.spans])

    @property
    def size(self) -> int:
        return int(self.image.size)

    def fill(self, segment: torch.Tensor) -> None:
        self.image.write_static(segment.numpy())

    def seal(self, buffer: np.ndarray[Any, Any], io: Executor) -> None:
        seal(self.image, buffer[:self.image.size], io)

    def write(self, segment: np.ndarray[Any, Any] | None, path: str, pool: Executor | None,
              chunk_size: int) -> FileRecord:
        assert segment is not None
        return write_file(path, segment[:self.image.size], pool, chunk_size)


class FileSet:
    """The files of one checkpoint, collected in ``directory`` (the temporary directory the
    library writes its own small files into).

    Args:
        directory: where the files go (absolute).
        serialize: ``torch.save`` as the library would call it (never a captured one).
    """

    def __init__(self, directory: str, serialize: Callable[[Any, Any], None]) -> None:
        self.directory = os.path.abspath(directory)
        self.entries: dict[str, Entry] = {}
        self._serialize = serialize

    def _add(self, entry: Entry) -> None:
        if entry.name in self.entries:
            raise UnsupportedValueError(entry.name, "the checkpoint writes this file twice")
        self.entries[entry.name] = entry

    def add_bytes(self, name: str, data: bytes) -> None:
        self._add(_Bytes(name, bytes(data)))

    def add_safetensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> None:
        self._add(_Safetensors(name, tensors, metadata))

    def add_torch(self, name: str, obj: Any) -> None:
        image = plan_image(obj)
        if image.spans:
            self._add(_TorchZip(name, image))
            return
        w, keep = _Walk(), []  # type: ignore[var-annotated]
        skeleton = _walk(obj, w, keep)
        if not w.plain or not w.stored:  # nothing to overlap, or nothing we may copy: serialize now
            buf = io.BytesIO()
            self._serialize(obj, buf)
            self._add(_Bytes(name, buf.getvalue()))
            return
        self._add(_Torch(name, skeleton, w.stored, w.end, self._serialize))

    def staged(self) -> list[Entry]:
        """The entries with tensors to stage, in a fixed order."""
        return [e for e in self.entries.values() if e.plan is not None]

    def sizes(self) -> list[int]:
        """Staging bytes of each staged entry (one segment each)."""
        return [e.size for e in self.staged()]
