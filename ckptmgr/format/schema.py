"""The manifest's schema: every field, its type and its bounds, checked on read.

A manifest comes from storage that other people and other processes can write, so it is
validated completely before anything it names is opened, allocated or trusted: the
top-level keys (no unknown ones), each file record, each tensor index entry, and the typed
skeletons of the state and the metadata (:func:`check_skeleton`).
Every stored tensor's byte size must equal its dtype and shape, and the stored tensors of a
file must tile its data region exactly: no overlaps, no holes, nothing past the end. The
real sizes of the files are compared later, by the reader, before it allocates anything.

docs/FORMAT.md lists every rule; a failure is a :class:`CheckpointCorruptError` that names
the field, e.g. ``files['data-00000.safetensors'].size``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Container
from typing import Any

from ..errors import CheckpointCorruptError
from .layout import DATA_ALIGN, ST_DTYPES
from .naming import STEP_DIGITS
from .tree import DTYPE_NAME_RE, FLOAT_NAMES, JSON, MAX_DIMS, MAX_FILE_BYTES, MAX_JSON_DEPTH, TENSOR_TAGS

__all__ = [
    "DATA_FILE_RE",
    "MAX_CHUNK_BYTES",
    "MAX_DIMS",
    "MAX_FILE_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_NAME_CHARS",
    "MAX_STEP",
    "check_manifest",
    "check_skeleton",
]

MAX_MANIFEST_BYTES = 256 << 20  # a manifest larger than this is not read at all
MAX_STEP = 10**STEP_DIGITS  # steps are ints in [0, MAX_STEP): what the zero-padded names order
MAX_HEADER_BYTES = 100 << 20  # safetensors readers refuse headers over 100 MB
MAX_CHUNK_BYTES = 1 << 30  # checksum chunks: multiples of 4096 up to 1 GiB
MAX_NAME_CHARS = 4096  # tensor names
MAX_WORLD_SIZE = 1 << 20
MAX_TEXT_CHARS = 256  # library_version
DATA_FILE_RE = re.compile(r"data-(?:r\d{5}-)?\d{5,9}(?:\.[0-9a-f]{16})?\.safetensors")  # (.<token>: object stores)
_CRC_RE = re.compile(r"[0-9a-f]{8}")

_REQUIRED = ("format", "format_version", "step", "time", "library_version", "protected", "files", "tensors",
             "state", "metadata")
_OPTIONAL = ("world_size", "rank_states", "manifest_crc32c")
_FILE_KEYS = frozenset({"size", "header_size", "chunk_size", "crc32c"})
_SUB_KEYS = frozenset({"sub_chunk_size", "sub_crc32c"})  # optional, together: multi-rank saves
_HEX_RE = re.compile(r"[0-9a-f]*")
MIN_SUB_CHUNK = 256
_STORED_KEYS = frozenset({"file", "dtype", "shape", "offsets"})
_VIEW_KEYS = frozenset({"view_of", "dtype", "shape", "stride", "byte_offset"})


class _Checker:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.where}: manifest field {field}: {what}")

    def int_in(self, value: Any, field: str, lo: int, hi: int) -> int:
        if type(value) is not int:
            raise self.fail(field, f"must be an int, got {_show(value)}")
        if not lo <= value <= hi:
            raise self.fail(field, f"must be in [{lo}, {hi}], got {value}")
        return value

    def ints(self, value: Any, field: str, lo: int, hi: int, *, max_len: int) -> list[int]:
        if type(value) is list and len(value) <= max_len and all(type(v) is int and lo <= v <= hi for v in value):
            return value  # (the common case, without a field name per item; else the message below)
        if not isinstance(value, list) or len(value) > max_len:
            raise self.fail(field, f"must be a list of at most {max_len} ints, got {_show(value)}")
        return [self.int_in(v, f"{field}[{i}]", lo, hi) for i, v in enumerate(value)]

    def keys(self, obj: Any, field: str, allowed: frozenset[str], required: frozenset[str]) -> dict[str, Any]:
        if type(obj) is dict and required <= obj.keys() <= allowed:
            return obj
        if not isinstance(obj, dict):
            raise self.fail(field, f"must be an object, got {_show(obj)}")
        missing = sorted(required - obj.keys())
        if missing:
            raise self.fail(field, f"lacks {', '.join(missing)}")
        unknown = sorted(obj.keys() - allowed)
        if unknown:
            raise self.fail(field, f"has unknown key(s) {', '.join(map(repr, unknown))}")
        return obj


def _show(value: Any) -> str:
    """A short, safe rendering of a bad value for a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _field(name: str) -> str:
    return f"[{_show(name)}]"


def check_manifest(obj: Any, where: str) -> None:
    """Validate a parsed manifest (the JSON object) against the schema of docs/FORMAT.md.

    ``format`` and ``format_version`` are checked by the caller first (a newer version is a
    :class:`~ckptmgr.FormatVersionError`, not corruption).

    Raises:
        CheckpointCorruptError: the first rule broken, naming the field.
    """
    c = _Checker(where)
    c.keys(obj, "(top level)", frozenset(_REQUIRED + _OPTIONAL), frozenset(_REQUIRED))
    c.int_in(obj["step"], "step", 0, MAX_STEP - 1)
    t = obj["time"]
    if type(t) not in (int, float) or not (type(t) is float or abs(t) < 2**63) or not math.isfinite(t):
        raise c.fail("time", f"must be a finite number, got {_show(t)}")
    lv = obj["library_version"]
    if not isinstance(lv, str) or len(lv) > MAX_TEXT_CHARS or "\x00" in lv:
        raise c.fail("library_version", f"must be a short string, got {_show(lv)}")
    if type(obj["protected"]) is not bool:
        raise c.fail("protected", f"must be true or false, got {_show(obj['protected'])}")
    files = obj["files"]
    if not isinstance(files, dict):
        raise c.fail("files", f"must be an object, got {_show(files)}")
    for fname, rec in files.items():
        _check_file(c, fname, rec)
    tensors = obj["tensors"]
    if not isinstance(tensors, dict):
        raise c.fail("tensors", f"must be an object, got {_show(tensors)}")
    _check_tensors(c, tensors, files)
    world = obj.get("world_size", 1)
    c.int_in(world, "world_size", 1, MAX_WORLD_SIZE)
    names = tensors.keys()
    check_skeleton(obj["state"], tensors=names, where=where, field="state")
    if obj["metadata"] is not None:
        check_skeleton(obj["metadata"], tensors=None, where=where, field="metadata")
    ranks = obj.get("rank_states")
    if world > 1 or ranks is not None:
        if not isinstance(ranks, list) or len(ranks) != world:
            raise c.fail("rank_states", f"must list the skeletons of all {world} ranks, got {_show(ranks)}")
        for i, skeleton in enumerate(ranks):
            check_skeleton(skeleton, tensors=names, where=where, field=f"rank_states[{i}]")
    crc = obj.get("manifest_crc32c")
    if crc is not None and (not isinstance(crc, str) or not _CRC_RE.fullmatch(crc)):
        raise c.fail("manifest_crc32c", f"must be 8 lowercase hex digits, got {_show(crc)}")


def _check_file(c: _Checker, fname: Any, rec: Any) -> None:
    field = f"files{_field(fname)}"
    if not isinstance(fname, str) or not DATA_FILE_RE.fullmatch(fname):
        raise c.fail(field, "is not a data file name ckptmgr writes (data-<n>.safetensors, "
                            "data-r<rank>-<n>.safetensors, each optionally with .<16 hex> before "
                            ".safetensors); path separators and other names are refused")
    has_sub = isinstance(rec, dict) and bool(_SUB_KEYS & rec.keys())
    c.keys(rec, field, _FILE_KEYS | _SUB_KEYS, _FILE_KEYS | _SUB_KEYS if has_sub else _FILE_KEYS)
    size = c.int_in(rec["size"], f"{field}.size", 8, MAX_FILE_BYTES)
    header = c.int_in(rec["header_size"], f"{field}.header_size", DATA_ALIGN, min(size, MAX_HEADER_BYTES))
    if header % DATA_ALIGN:
        raise c.fail(f"{field}.header_size", f"must be a multiple of {DATA_ALIGN}, got {header}")
    chunk = c.int_in(rec["chunk_size"], f"{field}.chunk_size", DATA_ALIGN, MAX_CHUNK_BYTES)
    if chunk % DATA_ALIGN:
        raise c.fail(f"{field}.chunk_size", f"must be a multiple of {DATA_ALIGN}, got {chunk}")
    crcs = rec["crc32c"]
    want = -(-size // chunk)
    if not isinstance(crcs, list) or len(crcs) != want:
        raise c.fail(f"{field}.crc32c", f"must list {want} checksum(s) for {size} bytes in chunks of {chunk}")
    for i, v in enumerate(crcs):
        if not isinstance(v, str) or not _CRC_RE.fullmatch(v):
            raise c.fail(f"{field}.crc32c[{i}]", f"must be 8 lowercase hex digits, got {_show(v)}")
    if "sub_chunk_size" in rec:
        sub = c.int_in(rec["sub_chunk_size"], f"{field}.sub_chunk_size", MIN_SUB_CHUNK, chunk)
        if chunk % sub:
            raise c.fail(f"{field}.sub_chunk_size", f"must divide chunk_size {chunk}, got {sub}")
        text, want = rec["sub_crc32c"], 8 * -(-size // sub)
        if not isinstance(text, str) or len(text) != want or not _HEX_RE.fullmatch(text):
            raise c.fail(f"{field}.sub_crc32c", f"must be {want} lowercase hex digits (8 per sub-chunk of {sub} "
                                                f"bytes), got {_show(text)}")


def _check_name(c: _Checker, name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or "\x00" in name:
        raise c.fail(f"tensors{_field(name)}", f"a tensor name must be a non-empty string of at most "
                                               f"{MAX_NAME_CHARS} characters without NUL")
    if name == "__metadata__":
        raise c.fail("tensors['__metadata__']", "is reserved by the safetensors format")
    return name


def _common(c: _Checker, e: dict[str, Any], field: str) -> tuple[int, list[int]]:
    """The item size of an entry's dtype and its shape."""
    dtype = ST_DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
    if dtype is None:
        raise c.fail(f"{field}.dtype", f"unknown dtype {_show(e['dtype'])}")
    shape = c.ints(e["shape"], f"{field}.shape", 0, MAX_FILE_BYTES, max_len=MAX_DIMS)
    return dtype[1], shape


def _check_tensors(c: _Checker, tensors: dict[str, Any], files: dict[str, Any]) -> None:
    stored: dict[str, list[tuple[int, int, str]]] = {f: [] for f in files}
    views: list[tuple[str, dict[str, Any]]] = []
    for name, e in tensors.items():
        field = f"tensors{_field(_check_name(c, name))}"
        if isinstance(e, dict) and "view_of" in e:
            c.keys(e, field, _VIEW_KEYS, _VIEW_KEYS)
            views.append((name, e))
            continue
        c.keys(e, field, _STORED_KEYS, _STORED_KEYS)
        if not isinstance(e["file"], str) or e["file"] not in files:
            raise c.fail(f"{field}.file", f"names no file of the manifest: {_show(e['file'])}")
        itemsize, shape = _common(c, e, field)
        offsets = c.ints(e["offsets"], f"{field}.offsets", 0, MAX_FILE_BYTES, max_len=2)
        if len(offsets) != 2 or offsets[0] > offsets[1]:
            raise c.fail(f"{field}.offsets", f"must be [begin, end] with begin <= end, got {offsets}")
        nbytes = math.prod(shape) * itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise c.fail(f"{field}.offsets", f"{offsets} span {offsets[1] - offsets[0]} bytes; "
                                             f"{e['dtype']}{shape} needs {nbytes}")
        stored[e["file"]].append((offsets[0], offsets[1], name))
    for fname, spans in stored.items():
        _check_tiling(c, fname, spans, files[fname]["size"] - files[fname]["header_size"])
    for name, e in views:
        _check_view(c, name, e, tensors)


def _check_tiling(c: _Checker, fname: str, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """The stored tensors of ``fname`` cover its data region exactly once, in some order."""
    pos, prev = 0, None
    for begin, end, name in sorted(spans):
        if begin != pos:
            what = f"overlaps {_show(prev)}" if begin < pos else f"leaves a hole of {begin - pos} bytes before it"
            raise c.fail(f"tensors{_field(name)}.offsets", f"[{begin}, {end}) in {fname} {what}")
        pos, prev = end, name
    if pos != data_len:
        raise c.fail(f"files{_field(fname)}.size",
                     f"the data region is {data_len} bytes; its tensors cover {pos}")


def _check_view(c: _Checker, name: str, e: dict[str, Any], tensors: dict[str, Any]) -> None:
    field = f"tensors{_field(name)}"
    base = tensors.get(e["view_of"]) if isinstance(e["view_of"], str) else None
    if not isinstance(base, dict) or "file" not in base:
        raise c.fail(f"{field}.view_of", f"names no stored tensor: {_show(e['view_of'])}")
    itemsize, shape = _common(c, e, field)
    stride = c.ints(e["stride"], f"{field}.stride", 0, MAX_FILE_BYTES, max_len=MAX_DIMS)
    if len(stride) != len(shape):
        raise c.fail(f"{field}.stride", f"has {len(stride)} entries for {len(shape)} dimensions")
    offset = c.int_in(e["byte_offset"], f"{field}.byte_offset", 0, MAX_FILE_BYTES)
    extent = 0 if 0 in shape else 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    begin, end = base["offsets"]
    if offset + extent * itemsize > end - begin:
        raise c.fail(field, f"reaches byte {offset + extent * itemsize} of {_show(e['view_of'])}, "
                            f"which has {end - begin}")


_TAG_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {  # tag -> (required, optional) other keys
    "$dict": (frozenset(), frozenset({"type", "metadata"})),
    "$tuple": (frozenset(), frozenset()),
    "$float": (frozenset(), frozenset()),
    "$per_rank": (frozenset(), frozenset()),
    "$tensor": (frozenset(), frozenset()),
    "$ndarray": (frozenset(), frozenset()),
    "$npscalar": (frozenset(), frozenset()),
    "$dtensor": (frozenset({"shape", "placements", "mesh"}), frozenset({"offsets"})),
    "$dtype": (frozenset(), frozenset()),
    "$device": (frozenset(), frozenset()),
    "$size": (frozenset(), frozenset()),
    "$stateful": (frozenset({"state"}), frozenset()),
    "$pickle": (frozenset(), frozenset()),
}
_KEY_TAGS = frozenset({"$tuple", "$float", "$dtype", "$device", "$size"})  # values that can be dict keys
_DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?")
_NORMAL, _PLAIN, _KEY = 0, 1, 2  # what a node may hold: anything; no tensors; only dict-key values


_STORED_DTYPE_NAMES = frozenset(name for name, _ in ST_DTYPES.values())


def _is_dtype(name: str) -> bool:
    """Whether ``torch.<name>`` is a dtype; the stored dtypes' names are known without torch."""
    if name in _STORED_DTYPE_NAMES:
        return True
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def check_skeleton(skeleton: JSON, *, tensors: Container[str] | None, where: str, field: str) -> None:
    """Validate a typed JSON skeleton read from storage, iteratively (any depth is safe).

    Args:
        skeleton: the parsed JSON.
        tensors: the tensor names it may refer to; None where no tensor may appear (metadata).
        where: the step or file, for messages.
        field: the manifest field, for messages.

    Raises:
        CheckpointCorruptError: naming the first bad node by its path in the skeleton.
    """
    root_mode = _NORMAL if tensors is not None else _PLAIN
    stack: list[tuple[JSON, int, tuple[str, ...], int]] = [(skeleton, 1, (), root_mode)]
    while stack:
        node, depth, path, mode = stack.pop()
        if node is None or isinstance(node, (bool, int, str)):
            continue

        def fail(what: str, path: tuple[str, ...] = path) -> CheckpointCorruptError:
            return CheckpointCorruptError(f"{where}: manifest field {field}{''.join(path)[:200]}: {what}")

        if isinstance(node, float):
            if not math.isfinite(node):
                raise fail("a non-finite number must be written as {\"$float\": ...}")
            continue
        if depth > MAX_JSON_DEPTH:
            raise fail(f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, list):
            if mode == _KEY:
                raise fail("a list cannot be a dict key")
            stack.extend((v, depth + 1, (*path, f"[{i}]"), mode) for i, v in enumerate(node))
            continue
        tags = [k for k in node if k.startswith("$")] if isinstance(node, dict) else []
        if len(tags) != 1 or tags[0] not in _TAG_KEYS:
            raise fail(f"not a typed value: {str(node)[:60]}")
        tag = tags[0]
        val = node[tag]
        required, optional = _TAG_KEYS[tag]
        others = node.keys() - {tag}
        if required - others or others - required - optional:
            raise fail(f"{tag} takes the keys {sorted(required | optional)}, got {sorted(others)[:5]}")
        if mode == _KEY and tag not in _KEY_TAGS:
            raise fail(f"a {tag} cannot be a dict key")
        if tag in TENSOR_TAGS:
            if mode != _NORMAL or tensors is None:
                raise fail(f"{tag} cannot appear here")
            if not isinstance(val, str) or val not in tensors:
                raise fail(f"{tag} names no tensor of the index: {str(val)[:60]}")
            if tag == "$dtensor" and not (_is_int_list(node["shape"]) and _is_int_list(node["mesh"]) and
                                          isinstance(node["placements"], list) and
                                          all(isinstance(p, str) for p in node["placements"]) and
                                          _is_int_list(node.get("offsets", []))):
                raise fail("$dtensor needs int lists shape, mesh and offsets and a list of str placements")
        elif tag == "$dict":
            if node.get("type", "OrderedDict") != "OrderedDict":
                raise fail(f"unknown dict type {str(node['type'])[:40]}")
            if "metadata" in node:
                if node.get("type") != "OrderedDict":
                    raise fail("$dict metadata belongs to an OrderedDict (type missing)")
                stack.append((node["metadata"], depth + 1, (*path, ".metadata"), _PLAIN))
            if isinstance(val, dict):
                stack.extend((v, depth + 2, (*path, f"[{k[:60]!r}]"), mode) for k, v in val.items())
            elif isinstance(val, list):
                for i, pair in enumerate(val):
                    if not isinstance(pair, list) or len(pair) != 2:
                        raise fail("$dict items must be [key, value] pairs", (*path, f".$dict[{i}]"))
                    stack.append((pair[0], depth + 3, (*path, f".$dict[{i}][0]"), _KEY))
                    stack.append((pair[1], depth + 3, (*path, f".$dict[{i}][1]"), mode))
            else:
                raise fail("$dict holds an object or a list of pairs")
        elif tag == "$tuple":
            if not isinstance(val, list):
                raise fail("$tuple holds a list")
            stack.extend((v, depth + 2, (*path, f".$tuple[{i}]"), mode) for i, v in enumerate(val))
        elif tag in ("$per_rank", "$stateful"):
            inner = val if tag == "$per_rank" else node["state"]
            if tag == "$stateful" and (not isinstance(val, str) or len(val) > 1024):
                raise fail("$stateful names a class")
            stack.append((inner, depth + 1, (*path, f".{tag}"), mode))
        elif tag == "$float" and (not isinstance(val, str) or val not in FLOAT_NAMES):
            raise fail(f"$float is one of nan, inf, -inf, got {str(val)[:20]}")
        elif tag == "$dtype" and not (isinstance(val, str) and DTYPE_NAME_RE.fullmatch(val) and _is_dtype(val)):
            raise fail(f"unknown dtype {str(val)[:40]}")
        elif tag == "$device" and not (isinstance(val, str) and _DEVICE_RE.fullmatch(val)):
            raise fail(f"not a device: {str(val)[:40]}")
        elif tag == "$size" and not _is_int_list(val):
            raise fail("$size holds a list of ints")
        elif tag == "$pickle" and not isinstance(val, str):
            raise fail("$pickle holds base64 text")
