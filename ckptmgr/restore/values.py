"""The rules for a decoded value of the checkpoint against a restore's target.

:mod:`ckptmgr.restore.target` walks the target against the saved skeleton; the parts of the
skeleton it cannot judge without decoding them (numpy arrays, pickled and plain values, a
stored tensor where the target holds something else, what an empty container accepts) are
rebuilt and judged here, by :class:`_Applier`: with stand-in tensors before a byte is read,
with the loaded tensors once they are. One set of rules and messages for every restore.

:func:`check_target` and :func:`apply_target` apply the same rules to a whole rebuilt tree:
the reference the skeleton walk is held to (tests/test_match_target.py compares the two).

An empty dict or list in the target accepts whatever the checkpoint holds there: optimizer
state is created lazily, so a fresh optimizer's ``state`` is ``{}``.

A value that is :class:`~ckptmgr.PerRank` in the target, or in the checkpoint (a tree rebuilt
with ``keep_per_rank=True``), is a ``PerRank`` in the result: the restored tree saves again
as it was saved, each rank its own value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointCorruptError, StateMismatchError
from ..format.layout import ST_TO_DTYPE
from ..format.tree import PerRank, is_stateful

__all__ = ["StandIns", "apply_target", "check_target", "copy_into", "local_tensor"]

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types: no DTensor, no subclass to unwrap
_ABSENT = object()


class StandIns(Mapping[str, torch.Tensor]):
    """Stand-ins for the stored tensors, made on demand from the tensor index: each stored
    tensor's dtype and shape and no memory behind them (one zero-dim tensor per dtype,
    expanded), so that a part of the checkpoint can be rebuilt and judged before a byte is
    read."""

    def __init__(self, index: Mapping[str, Any]) -> None:
        self.index = index
        self.names: dict[int, str] = {}  # id of a placeholder made -> its stored name
        self._made: dict[str, torch.Tensor] = {}  # (keeps them alive: ids stay unique)
        self._zeros: dict[torch.dtype, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._made.get(name)
        if t is None:
            e = self.index[name]
            dtype = ST_TO_DTYPE.get(str(e.get("dtype")))
            if dtype is None:
                raise CheckpointCorruptError(f"tensor {name!r} has unknown dtype {e.get('dtype')!r}")
            zero = self._zeros.get(dtype)
            if zero is None:
                zero = self._zeros[dtype] = torch.zeros((), dtype=dtype)
            t = self._made[name] = zero.expand(e["shape"])  # the schema checked the shape
            self.names[id(t)] = name
        return t

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def _p(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


class _Applier:
    def __init__(self, names: dict[int, str] | None = None) -> None:
        self.problems: list[str] = []
        self.actions: list[Callable[[], None]] = []
        # check_target: id of a placeholder -> its stored name; ``dests`` collects, for each
        # placeholder that fits, the target's tensor (its local shard) it lands in
        self.names = names
        self.dests: dict[str, torch.Tensor] = {}

    def _mismatch(self, path: tuple[Any, ...], target: torch.Tensor, ckpt: torch.Tensor) -> None:
        self.problems.append(f"{_p(path)}: the target is {target.dtype} {list(target.shape)}, "
                             f"the checkpoint {ckpt.dtype} {list(ckpt.shape)}")

    def _matched(self, target: torch.Tensor, ckpt: torch.Tensor, apply: bool) -> None:
        """``ckpt`` fits ``target`` (a local tensor): note where it lands, or queue its copy
        (none when a loader landed the bytes in ``target`` already)."""
        if self.names is not None:
            name = self.names.get(id(ckpt))
            if name is not None:
                self.dests[name] = target
        elif apply and ckpt is not target:
            self.actions.append(lambda: copy_into(target, ckpt))

    def walk(self, target: Any, ckpt: Any, path: tuple[Any, ...], apply: bool = True) -> Any:
        """Check ``ckpt`` against ``target``; queue the copies; return the result node."""
        if type(target) in _PLAIN_TENSORS and type(ckpt) in _PLAIN_TENSORS:  # the common leaf, fast
            if ckpt.shape != target.shape or ckpt.dtype != target.dtype:
                self._mismatch(path, target, ckpt)
            else:
                self._matched(target, ckpt, apply)
            return target
        if isinstance(target, PerRank) or isinstance(ckpt, PerRank):
            # per rank in the target or in the checkpoint: per rank in the result, so that
            # saving the result again saves it per rank again
            return PerRank(self.walk(target.value if isinstance(target, PerRank) else target,
                                     ckpt.value if isinstance(ckpt, PerRank) else ckpt, path, apply))
        if is_stateful(target):
            # Check against what the object holds now; load_state_dict does the copying.
            self.walk(target.state_dict(), ckpt, path, apply=False)
            if apply:
                bare = _bare(ckpt)  # load_state_dict gets the values, as they were saved
                self.actions.append(lambda: target.load_state_dict(bare))
            return target
        if isinstance(target, torch.Tensor):
            original = target  # what the result holds: a DTensor stays a DTensor
            target = local_tensor(target)  # a DTensor is restored through its local shard
            ckpt = local_tensor(ckpt) if isinstance(ckpt, torch.Tensor) else ckpt
            if not isinstance(ckpt, torch.Tensor):
                self.problems.append(f"{_p(path)}: the target holds a tensor, the checkpoint a {type(ckpt).__name__}")
            elif ckpt.shape != target.shape or ckpt.dtype != target.dtype:
                self._mismatch(path, target, ckpt)
            else:
                self._matched(target, ckpt, apply)
            return original
        if isinstance(target, np.ndarray) and isinstance(ckpt, np.ndarray):
            if target.shape != ckpt.shape or target.dtype != ckpt.dtype:
                self.problems.append(f"{_p(path)}: the target is {target.dtype} {list(target.shape)}, "
                                     f"the checkpoint {ckpt.dtype} {list(ckpt.shape)}")
            elif apply and target.flags.writeable:
                self.actions.append(lambda: np.copyto(target, ckpt))
                return target
            return ckpt
        if isinstance(target, dict):
            if not isinstance(ckpt, dict):
                self.problems.append(f"{_p(path)}: the target holds a dict, the checkpoint a {type(ckpt).__name__}")
                return target
            if not target:
                return ckpt
            missing = [k for k in target if k not in ckpt]
            unexpected = [k for k in ckpt if k not in target]
            self.problems += [f"{_p((*path, k))}: missing from the checkpoint" for k in missing]
            self.problems += [f"{_p((*path, k))}: in the checkpoint but not in the target" for k in unexpected]
            out = type(ckpt)()
            for k, v in ckpt.items():
                t = target.get(k, _ABSENT)
                if t is _ABSENT:
                    out[k] = v
                elif type(t) in _PLAIN_TENSORS and type(v) in _PLAIN_TENSORS:  # walk()'s fast leaf, inline
                    if v.shape != t.shape or v.dtype != t.dtype:
                        self._mismatch((*path, k), t, v)
                    else:
                        self._matched(t, v, apply)
                    out[k] = t
                else:
                    out[k] = self.walk(t, v, (*path, k), apply)
            return out
        if isinstance(target, (list, tuple)):
            if not isinstance(ckpt, (list, tuple)):
                self.problems.append(f"{_p(path)}: the target holds a {type(target).__name__}, "
                                     f"the checkpoint a {type(ckpt).__name__}")
                return target
            if not target:
                return ckpt
            if len(target) != len(ckpt):
                self.problems.append(f"{_p(path)}: the target has {len(target)} items, the checkpoint {len(ckpt)}")
                return target
            items = [self.walk(t, c, (*path, i), apply) for i, (t, c) in enumerate(zip(target, ckpt, strict=True))]
            return type(ckpt)(items) if type(ckpt) in (list, tuple) else items
        return ckpt  # a plain leaf: the checkpoint's value


def _bare(x: Any) -> Any:
    """``x`` without PerRank wrappers (the containers that held one rebuilt, the rest as is)."""
    if isinstance(x, PerRank):
        return _bare(x.value)
    if isinstance(x, dict):
        items = {k: _bare(v) for k, v in x.items()}
        if all(items[k] is v for k, v in x.items()):
            return x
        out = type(x)(items)
        if hasattr(x, "_metadata"):
            out._metadata = x._metadata  # type: ignore[attr-defined]  # (a module's state_dict)
        return out
    if type(x) in (list, tuple):
        seq = [_bare(v) for v in x]
        if all(a is b for a, b in zip(seq, x, strict=True)):
            return x
        return type(x)(seq)
    return x


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (which shares storage with it); any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and hasattr(t, "placements") else t


@torch.no_grad()
def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` (nothing to do when a loader landed the bytes there: ``src``
    is ``dst``)."""
    if src is not dst:
        dst.copy_(src)


def check_target(target: Any, ckpt: Any, placeholders: dict[str, torch.Tensor] | None = None
                 ) -> dict[str, torch.Tensor]:
    """Raise StateMismatchError, listing every difference, unless ``ckpt`` fits ``target``.

    ``ckpt`` may hold placeholder tensors (only their shapes and dtypes are compared), so
    this runs before a single byte is read. With ``placeholders`` (stored name -> the
    placeholder in ``ckpt``), returns, for each placeholder that fits, the target's tensor (its
    local shard) where it lands.
    """
    a = _Applier({id(t): name for name, t in placeholders.items()} if placeholders is not None else None)
    a.walk(target, ckpt, (), apply=False)
    if a.problems:
        raise StateMismatchError(a.problems)
    return a.dests


def apply_target(target: Any, ckpt: Any) -> Any:
    """Copy the checkpoint tree into ``target``; return the target-shaped result tree.

    Raises:
        StateMismatchError: listing every difference; nothing has been modified.
    """
    a = _Applier()
    result = a.walk(target, ckpt, ())
    if a.problems:
        raise StateMismatchError(a.problems)
    for act in a.actions:
        act()
    return result
