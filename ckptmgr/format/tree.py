"""State tree <-> tensor leaves + a typed JSON skeleton.

``flatten`` walks a nested training state and splits it into the tensors (stored in
safetensors files) and a JSON skeleton that records everything else with its exact type:
int dict keys stay ints, tuples stay tuples, ``nan`` stays ``nan``. Tensors appear in the
skeleton as ``{"$tensor": name}``. ``unflatten`` rebuilds the tree from the skeleton and a
name -> tensor mapping.

Skeleton encoding (every tag is a one-key-plus-options JSON object, so plain JSON values
never collide with tags):

=================  ===============================================================
Python value       JSON
=================  ===============================================================
None/bool/int/str  the JSON value itself
float              the JSON number; ``{"$float": "nan" | "inf" | "-inf"}``
list               JSON array
tuple              ``{"$tuple": [...]}``
dict               ``{"$dict": {...}}`` (all keys str) or ``{"$dict": [[k, v], ...]}``;
                   ``"type": "OrderedDict"`` and ``"metadata"`` (module versions) kept
torch.Tensor       ``{"$tensor": name}``
numpy array        ``{"$ndarray": name}``; numpy scalar ``{"$npscalar": name}``
torch.dtype        ``{"$dtype": "float32"}``; torch.device ``{"$device": "cuda:0"}``
torch.Size         ``{"$size": [2, 3]}``
Stateful object    ``{"$stateful": "module.Class", "state": <its state_dict()>}``
PerRank(value)     ``{"$per_rank": <value>}``: saved by every rank for itself
DTensor            ``{"$dtensor": name, "shape": global, "placements": [...], "mesh": [...],
                   "offsets": [...]}``; the tensor stored is this rank's local shard, and
                   ``offsets`` where it starts in the global tensor (absent for placements
                   whose shards are not boxes, e.g. Partial)
anything else      refused, unless pickle is allowed: ``{"$pickle": base64}``
=================  ===============================================================

A skeleton read back is untrusted: :func:`ckptmgr.format.schema.check_skeleton` validates
every node (known tags, their keys and value types, tensor names that exist, dict keys that
can be keys) without recursion, and refuses nesting deeper than :data:`MAX_JSON_DEPTH`; ``flatten`` refuses
states nested deeper than :data:`MAX_NESTING` containers, so whatever it writes reads back.
A conjugate or negative view (``z.conj()``, the ``.imag`` of one) is stored as its values,
never as the tensor it views.

``flatten`` also refuses, with :class:`UnsupportedValueError` naming the path, every value the
format cannot hold, so that ``save()`` fails before it returns rather than in the background:
strings (values, dict keys, metadata) that are not valid Unicode text (a lone surrogate such as
``"\\ud800"`` has no UTF-8 encoding), ints of more than :data:`MAX_INT_DIGITS` digits (JSON
readers refuse them), nested (jagged) tensors, tensors whose storage is smaller than the
tensor (freed with ``resize_(0)``, as FSDP does) or not accessible (``torch.func`` wrappers),
tensors past the format's bounds (:data:`MAX_DIMS` dimensions, :data:`MAX_FILE_BYTES` bytes or
elements in a dimension), and numpy arrays in a non-native byte order.
"""

from __future__ import annotations

import base64
import math
import pickle
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # imported where tensors are made or recognised: reading a skeleton needs no torch
    import torch

from ..errors import CheckpointCorruptError, UnsupportedValueError

__all__ = ["DTYPE_NAME_RE", "FLOAT_NAMES", "MAX_DIMS", "MAX_FILE_BYTES", "MAX_INT_DIGITS", "MAX_JSON_DEPTH",
           "MAX_NESTING", "TENSOR_TAGS", "Leaf", "PerRank", "decode_plain", "encode_plain", "flatten", "is_stateful",
           "unflatten"]

JSON = Any  # a JSON-serialisable value
_RESERVED_NAMES = frozenset({"__metadata__"})
MAX_NESTING = 100  # containers inside containers in a saved state (a real one has fewer than 20)
MAX_JSON_DEPTH = 3 * MAX_NESTING + 20  # JSON nesting of a skeleton read back (a dict level takes up to 3)
_MAX_NAME = 1024  # tensor names derived from longer paths are cut (and made unique)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_DIMS = 64  # dimensions of a stored tensor (docs/FORMAT.md)
MAX_FILE_BYTES = 1 << 50  # 1 PiB: no file, tensor, dimension, stride or offset is larger
MAX_INT_DIGITS = 4300  # Python's json refuses to read longer ints (sys.get_int_max_str_digits())
_INT_BITS = 14284  # ints of at most this many bits have at most MAX_INT_DIGITS digits
_INT_LIMIT = 10**MAX_INT_DIGITS


@dataclass(frozen=True)
class Leaf:
    """One tensor found in the state."""

    name: str  # unique key in the safetensors file(s)
    path: str  # where it was found, as Python syntax: state["model"]["w"]
    tensor: torch.Tensor
    per_rank: bool = False  # under PerRank or a DTensor's local shard: this rank's own


class PerRank:
    """Marks a part of the state that differs between ranks (RNG, data-loader position).

    In a multi-rank job every rank saves its own copy and gets its own back; the rest of the
    state is taken to be identical on every rank and is written once. Without
    ``torch.distributed`` the wrapper changes nothing.

    Example:
        >>> state = {"model": model, "optim": opt, "rng": PerRank(torch.get_rng_state())}  # doctest: +SKIP
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


def _dtensor_type() -> type[Any] | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _shard_offsets(value: Any) -> list[int] | None:
    """The global offset of this rank's shard of DTensor ``value``, when its placements make the
    shard a box (only ``Shard`` and ``Replicate``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) is Shard or isinstance(p, Replicate) for p in value.placements):
        return None
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return [int(x) for x in offset]


def is_stateful(obj: object) -> bool:
    """True for objects saved through ``state_dict()`` and restored by ``load_state_dict()``."""
    import torch

    if isinstance(obj, (torch.Tensor, dict, list, tuple, type)):
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _path_str(path: tuple[Any, ...], root: str = "state") -> str:
    return root + "".join(f"[{k!r}]" for k in path)


def _check_text(text: str, path: tuple[Any, ...], root: str, what: str) -> None:
    """Refuse a str that has no UTF-8 encoding (a lone surrogate): JSON and safetensors
    headers are UTF-8, so it could never be written."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UnsupportedValueError(
            _path_str(path, root), f"{what} {text[max(0, exc.start - 20):exc.start + 20]!r} is not valid Unicode "
            f"text: character {exc.start} is a lone surrogate {text[exc.start]!r}, which has no UTF-8 encoding "
            "(decode bytes with errors='replace', or store them as a numpy uint8 array)") from None


def _check_int(value: int, path: tuple[Any, ...], root: str) -> None:
    if value.bit_length() > _INT_BITS and abs(value) >= _INT_LIMIT:
        raise UnsupportedValueError(
            _path_str(path, root), f"an int of {value.bit_length()} bits has more than {MAX_INT_DIGITS} digits, "
            "more than JSON readers accept; store it as a str or split it")


def _tensor_name(path: tuple[Any, ...]) -> str:
    """The path joined by ``/``; control characters become ``?`` and long names are cut."""
    name = "/".join(str(k) for k in path) or "tensor"
    return _CONTROL.sub("?", name)[:_MAX_NAME]


class _Flattener:
    def __init__(self, allow_pickle: bool, root: str = "state", rank_prefix: str = "") -> None:
        self.allow_pickle = allow_pickle
        self.root = root  # how error messages name the top of the tree
        self.rank_prefix = rank_prefix  # names of this rank's own tensors start with it
        self.leaves: list[Leaf] = []
        self._names: set[str] = set()
        self._per_rank = 0  # depth of PerRank wrappers around the value being encoded
        self._depth = 0  # containers around the value being encoded

    def _add(self, path: tuple[Any, ...], tensor: torch.Tensor, own: bool = False) -> str:
        if tensor.dim() > MAX_DIMS:
            raise UnsupportedValueError(_path_str(path, self.root), f"a tensor of {tensor.dim()} dimensions; the "
                                        f"format holds at most {MAX_DIMS}: reshape it")
        if any(s > MAX_FILE_BYTES for s in tensor.shape) or tensor.numel() * tensor.element_size() > MAX_FILE_BYTES:
            raise UnsupportedValueError(_path_str(path, self.root), f"a tensor of shape {list(tensor.shape)} "
                                        f"({tensor.dtype}); the format holds dimensions and tensors of at most "
                                        f"{MAX_FILE_BYTES} bytes")
        own = own or self._per_rank > 0
        base = (self.rank_prefix if own else "") + _tensor_name(path)
        name, n = base, 0
        while name in self._names or name in _RESERVED_NAMES:
            n += 1
            suffix = f"~{n}"
            name = base[:_MAX_NAME - len(suffix)] + suffix
        self._names.add(name)
        self.leaves.append(Leaf(name, _path_str(path, self.root), tensor, own))
        return name

    def encode(self, value: Any, path: tuple[Any, ...], *, tensors: bool = True) -> JSON:
        t = type(value)
        if value is None or t is bool:
            return value
        if t is str:
            _check_text(value, path, self.root, "the string")
            return value
        if t is int:
            _check_int(value, path, self.root)
            return value
        if t is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if self._depth >= MAX_NESTING:
            raise UnsupportedValueError(_path_str(path, self.root), f"the state is nested deeper than {MAX_NESTING} "
                                        "containers; flatten it (checkpoints stay readable by any reader)")
        self._depth += 1
        try:
            return self._encode(value, t, path, tensors)
        finally:
            self._depth -= 1

    def _encode(self, value: Any, t: type, path: tuple[Any, ...], tensors: bool) -> JSON:
        import torch

        if t is list:
            return [self.encode(v, (*path, i), tensors=tensors) for i, v in enumerate(value)]
        if t is tuple:
            return {"$tuple": [self.encode(v, (*path, i), tensors=tensors) for i, v in enumerate(value)]}
        if t is dict or t is OrderedDict:
            return self._encode_dict(value, path, tensors)
        if isinstance(value, torch.dtype):
            return {"$dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"$device": str(value)}
        if t is torch.Size:
            return {"$size": list(value)}
        if tensors and isinstance(value, torch.Tensor) and t in (torch.Tensor, torch.nn.Parameter):
            return {"$tensor": self._add(path, self._check_tensor(value, path))}
        if t is PerRank:
            self._per_rank += 1
            try:
                return {"$per_rank": self.encode(value.value, path, tensors=tensors)}
            finally:
                self._per_rank -= 1
        dtensor = _dtensor_type() if tensors and isinstance(value, torch.Tensor) else None
        if dtensor is not None and isinstance(value, dtensor):
            local = self._check_tensor(value.to_local(), path)
            node = {"$dtensor": self._add(path, local, own=True), "shape": list(value.shape),
                    "placements": [str(p) for p in value.placements], "mesh": list(value.device_mesh.shape)}
            offsets = _shard_offsets(value)
            if offsets is not None:  # where the shard lies: what restoring at another layout needs
                node["offsets"] = offsets
            return node
        if tensors and isinstance(value, np.ndarray):
            return {"$ndarray": self._add(path, self._from_numpy(value, path))}
        if tensors and isinstance(value, np.generic):
            return {"$npscalar": self._add(path, self._from_numpy(np.asarray(value), path))}
        if tensors and is_stateful(value):  # (the class name is for people: made writable, never refused)
            cls = f"{t.__module__}.{t.__qualname__}".encode("utf-8", "backslashreplace").decode("utf-8")[:1024]
            return {"$stateful": cls, "state": self.encode(value.state_dict(), path)}
        if self.allow_pickle:
            try:
                data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise UnsupportedValueError(_path_str(path, self.root), f"cannot be pickled: {exc}") from exc
            return {"$pickle": base64.b64encode(data).decode("ascii")}
        what = f"a {t.__module__}.{t.__qualname__}"
        if isinstance(value, torch.Tensor):
            what = f"the tensor subclass {t.__qualname__}"
        raise UnsupportedValueError(
            _path_str(path, self.root),
            f"{what} cannot be stored without pickle. Convert it to supported types "
            "(tensors, numpy arrays, str/int/float/bool/None, lists, tuples, dicts, "
            "torch.dtype/device/Size, objects with state_dict()/load_state_dict()), "
            "or pass allow_pickle=True to CheckpointManager if you trust every reader.",
        )

    def _encode_dict(self, value: dict[Any, Any], path: tuple[Any, ...], tensors: bool) -> JSON:
        if all(type(k) is str for k in value):
            for k in value:
                _check_text(k, (*path, k), self.root, "the key")
            body: JSON = {k: self.encode(v, (*path, k), tensors=tensors) for k, v in value.items()}
        else:
            body = [
                [self.encode(k, (*path, k), tensors=False), self.encode(v, (*path, k), tensors=tensors)]
                for k, v in value.items()
            ]
        out: dict[str, JSON] = {"$dict": body}
        if type(value) is OrderedDict:
            out["type"] = "OrderedDict"
            meta = getattr(value, "_metadata", None)
            if meta is not None:
                out["metadata"] = self.encode(meta, (*path, "_metadata"), tensors=False)
        return out

    def _check_tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
        import torch

        if t.is_sparse or t.layout != torch.strided:
            raise UnsupportedValueError(
                _path_str(path, self.root), f"tensors of layout {t.layout} are not supported; store t.to_dense()")
        if t.is_nested:
            raise UnsupportedValueError(_path_str(path, self.root), "nested tensors are not supported; store "
                                        "t.unbind() (a list of tensors) or t.to_padded_tensor(0)")
        if t.is_quantized:
            raise UnsupportedValueError(
                _path_str(path, self.root), "quantized tensors are not supported; store t.dequantize() or t.int_repr()")
        if t.device.type == "meta":
            raise UnsupportedValueError(_path_str(path, self.root), "a tensor on the meta device has no data to save")
        try:
            have = t.untyped_storage().nbytes()
        except (NotImplementedError, RuntimeError) as exc:  # a torch.func (grad, vmap) wrapper: no storage
            raise UnsupportedValueError(_path_str(path, self.root), f"a tensor without storage of its own ({exc}); "
                                        "inside torch.func.grad/vmap, save outside the transform") from None
        if t.numel():
            need = (t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)))
            if need * t.element_size() > have:
                raise UnsupportedValueError(
                    _path_str(path, self.root), f"the tensor reaches byte {need * t.element_size()} of its storage, "
                    f"which holds {have} bytes (freed with resize_(0), as FSDP does with sharded parameters?): its "
                    "values are not there to save")
        if t.is_conj() or t.is_neg():
            # A lazy conjugate or negation shares its base's memory: store its values, never the base's bytes.
            return t.detach().resolve_conj().resolve_neg()
        return t.detach()

    def _from_numpy(self, a: np.ndarray[Any, Any], path: tuple[Any, ...]) -> torch.Tensor:
        import torch

        if not a.dtype.isnative:
            raise UnsupportedValueError(_path_str(path, self.root), f"numpy dtype {a.dtype.str} is not in this "
                                        "machine's byte order; store a.astype(a.dtype.newbyteorder('='))")
        try:
            return torch.from_numpy(a if a.flags.c_contiguous else a.copy(order="C"))
        except TypeError as exc:
            raise UnsupportedValueError(
                _path_str(path, self.root), f"numpy dtype {a.dtype} has no torch equivalent") from exc


def flatten(state: Any, *, allow_pickle: bool = False, rank_prefix: str = "") -> tuple[JSON, list[Leaf]]:
    """Split ``state`` into a JSON skeleton and its tensor leaves.

    ``rank_prefix`` starts the names of this rank's own tensors (under :class:`PerRank`,
    and DTensor shards), so that every rank's names are distinct in a shared checkpoint.

    Raises:
        UnsupportedValueError: a value cannot be stored; the message names its path.
    """
    f = _Flattener(allow_pickle, rank_prefix=rank_prefix)
    skeleton = f.encode(state, ())
    return skeleton, f.leaves


def encode_plain(value: Any, *, what: str = "metadata") -> JSON:
    """Encode a tensor-free value (user metadata) with the skeleton's typed JSON."""
    return _Flattener(allow_pickle=False, root=what).encode(value, (), tensors=False)


def decode_plain(skeleton: JSON) -> Any:
    """Decode a tensor-free skeleton (user metadata)."""
    return unflatten(skeleton, {}, allow_pickle=False)


TENSOR_TAGS = frozenset({"$tensor", "$ndarray", "$npscalar", "$dtensor"})  # tags that name a stored tensor
FLOAT_NAMES = frozenset({"nan", "inf", "-inf"})  # the values of {"$float": ...}
DTYPE_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")  # what {"$dtype": ...} may name (a torch attribute)


def unflatten(skeleton: JSON, tensors: Mapping[str, torch.Tensor], *, allow_pickle: bool,
              keep_per_rank: bool = False) -> Any:
    """Rebuild the state tree. Stateful objects come back as their state dicts; PerRank values
    as what they hold, or, with ``keep_per_rank``, wrapped in :class:`PerRank` again.

    The skeleton of a manifest has passed ``schema.check_skeleton``; this still refuses, with
    :class:`CheckpointCorruptError` rather than a crash, anything it cannot rebuild (nesting
    deeper than :data:`MAX_JSON_DEPTH`, keys that cannot be keys, a missing tensor).

    Raises:
        CheckpointCorruptError: the skeleton is malformed or names a missing tensor.
    """

    def dec(node: JSON, depth: int) -> Any:  # one frame per level: no comprehensions inside
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if depth > MAX_JSON_DEPTH:
            raise CheckpointCorruptError(f"the state skeleton is nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, list):
            items = []
            for v in node:
                items.append(dec(v, depth + 1))
            return items
        if not isinstance(node, dict) or not node:
            raise CheckpointCorruptError(f"malformed state skeleton node: {node!r:.80}")
        tag = next(iter(node))
        val = node[tag]
        if tag == "$dict":
            out: dict[Any, Any] = OrderedDict() if node.get("type") == "OrderedDict" else {}
            if not isinstance(val, (dict, list)):
                raise CheckpointCorruptError(f"malformed $dict node: {node!r:.80}")
            pairs: Any = val.items() if isinstance(val, dict) else val
            for pair in pairs:
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise CheckpointCorruptError(f"malformed $dict item: {pair!r:.80}")
                k = pair[0] if isinstance(val, dict) else dec(pair[0], depth + 2)
                v = dec(pair[1], depth + 2)
                try:
                    out[k] = v
                except TypeError:
                    raise CheckpointCorruptError(f"a skeleton dict key is not hashable: {k!r:.80}") from None
            if "metadata" in node:
                if not isinstance(out, OrderedDict):
                    raise CheckpointCorruptError(f"$dict metadata without type OrderedDict: {node!r:.80}")
                out._metadata = dec(node["metadata"], depth + 1)  # type: ignore[attr-defined]
            return out
        if tag == "$tuple":
            if not isinstance(val, list):
                raise CheckpointCorruptError(f"malformed $tuple node: {node!r:.80}")
            return tuple(dec(val, depth))
        if tag == "$float":
            if not isinstance(val, str) or val not in FLOAT_NAMES:
                raise CheckpointCorruptError(f"malformed $float node: {node!r:.80}")
            return float(val)
        if tag == "$per_rank":
            return PerRank(dec(val, depth + 1)) if keep_per_rank else dec(val, depth + 1)
        if tag in TENSOR_TAGS:
            if not isinstance(val, str) or val not in tensors:
                raise CheckpointCorruptError(f"the skeleton names tensor {val!r:.80}, which the checkpoint lacks")
            t = tensors[val]
            if tag in ("$tensor", "$dtensor"):  # a DTensor comes back as this rank's local shard
                return t
            try:
                arr = t.cpu().numpy()
            except (TypeError, RuntimeError) as exc:
                raise CheckpointCorruptError(f"tensor {val!r:.80} cannot be a numpy array ({exc})") from None
            return arr[()] if tag == "$npscalar" else arr
        if tag in ("$dtype", "$device", "$size"):
            import torch
        if tag == "$dtype":
            dtype = getattr(torch, val, None) if isinstance(val, str) and DTYPE_NAME_RE.fullmatch(val) else None
            if not isinstance(dtype, torch.dtype):
                raise CheckpointCorruptError(f"unknown dtype {val!r:.40} in the state skeleton")
            return dtype
        if tag == "$device":
            try:
                return torch.device(val)
            except (RuntimeError, TypeError, ValueError):
                raise CheckpointCorruptError(f"not a device in the state skeleton: {val!r:.40}") from None
        if tag == "$size":
            try:
                return torch.Size(val)
            except (TypeError, ValueError, RuntimeError):
                raise CheckpointCorruptError(f"not a torch.Size in the state skeleton: {val!r:.80}") from None
        if tag == "$stateful":
            if "state" not in node:
                raise CheckpointCorruptError(f"malformed $stateful node: {node!r:.80}")
            return dec(node["state"], depth + 1)
        if tag == "$pickle":
            if not allow_pickle:
                raise CheckpointCorruptError(
                    "this checkpoint holds pickled values; loading them can run arbitrary code. "
                    "Pass allow_pickle=True to CheckpointManager only if you trust its writer."
                )
            try:
                return pickle.loads(base64.b64decode(val))
            except Exception as exc:  # anything unpickling raises is a damaged value; BaseException passes
                raise CheckpointCorruptError(f"a pickled value cannot be loaded ({exc!r:.200})") from exc
        raise CheckpointCorruptError(f"unknown skeleton tag {tag!r:.40}")

    return dec(skeleton, 1)
