"""Restore into an existing target: check everything first, then copy in place.

:func:`check_target` walks the target against a rebuilt checkpoint tree (stand-in tensors in
place of the stored ones), collects *every* difference and raises ``StateMismatchError``;
:func:`apply_target` then copies in place and calls ``load_state_dict``. A single-process
restore goes through :mod:`ckptmgr.restore.match`, which walks the skeleton directly and
defers to the walker here for the rare parts it does not walk itself; a multi-rank restore
uses these functions.

An empty dict or list in the target accepts whatever the checkpoint holds there: optimizer
state is created lazily, so a fresh optimizer's ``state`` is ``{}``.

A value that is :class:`~ckptmgr.PerRank` in the target, or in the checkpoint (a tree rebuilt
with ``keep_per_rank=True``), is a ``PerRank`` in the result: the restored tree saves again
as it was saved, each rank its own value.

:mod:`ckptmgr.restore.match` uses this module's private walker and helpers (``_Applier``,
``_p``, ``_copy``, ``_PLAIN_TENSORS``, ``_ABSENT``): one set of rules and messages for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import StateMismatchError
from ..format.tree import PerRank, decode_plain, is_stateful

__all__ = ["apply_target", "check_target", "local_tensor", "target_tensors"]

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # exact types: no DTensor, no subclass to unwrap
_ABSENT = object()


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
            self.actions.append(lambda: _copy(target, ckpt))

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
def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src is not dst:  # a loader may have landed the bytes in ``dst`` already
        dst.copy_(src)


def check_target(target: Any, ckpt: Any, placeholders: dict[str, torch.Tensor] | None = None
                 ) -> dict[str, torch.Tensor]:
    """Raise StateMismatchError, listing every difference, unless ``ckpt`` fits ``target``.

    ``ckpt`` may hold placeholder tensors (only their shapes and dtypes are compared), so
    this runs before a single byte is read. With ``placeholders`` (stored name -> the
    placeholder in ``ckpt``), returns what :func:`target_tensors` would, from the same walk.
    """
    a = _Applier({id(t): name for name, t in placeholders.items()} if placeholders is not None else None)
    a.walk(target, ckpt, (), apply=False)
    if a.problems:
        raise StateMismatchError(a.problems)
    return a.dests


def target_tensors(target: Any, skeleton: Any, originals: dict[str, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
    """Stored tensor name -> the target's tensor at the same place in the tree, for every
    place where the target holds a tensor (through ``state_dict()`` for Stateful objects,
    whose tensors share storage with the object's own)."""
    out: dict[str, torch.Tensor] = {}

    def walk(t: Any, node: Any) -> None:
        if isinstance(node, list):
            if isinstance(t, (list, tuple)) and len(t) == len(node):
                for a, b in zip(t, node, strict=True):
                    walk(a, b)
            return
        if not isinstance(node, dict) or not node:
            return
        tag = next(iter(node))
        val = node[tag]
        if isinstance(t, PerRank):
            t = t.value
        if tag in ("$tensor", "$dtensor"):
            if isinstance(t, torch.Tensor):
                out[val] = local_tensor(t)
                if originals is not None and tag == "$dtensor":
                    originals[val] = t
        elif tag == "$per_rank":
            walk(t, val)
        elif tag == "$stateful":
            if is_stateful(t):
                walk(t.state_dict(), node["state"])
        elif tag == "$tuple":
            walk(t, val)
        elif tag == "$dict" and isinstance(t, dict):
            for k, v in (val.items() if isinstance(val, dict) else val):
                try:
                    key = k if isinstance(val, dict) else decode_plain(k)
                    found = key in t
                except Exception:  # a key this target cannot hold: nothing lands there directly
                    continue
                if found:
                    walk(t[key], v)

    walk(target, skeleton)
    return out


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
