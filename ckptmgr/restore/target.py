"""The one walk of a restore's target against the saved skeleton, before a byte is read.

:func:`match_target` walks the target against the checkpoint's typed skeleton and tensor
index (Stateful objects through their current ``state_dict()``), collects *every* difference
and raises ``StateMismatchError``; in the same walk it finds the target tensor each stored
tensor lands in and builds the target-shaped result, so that :meth:`TargetPlan.finish` only
copies what did not land in place and calls ``load_state_dict``. The parts it cannot judge
without decoding them (numpy arrays, mismatched kinds, what an empty container accepts) are
rebuilt with stand-in tensors and judged by the rules of :mod:`ckptmgr.restore.values`, so
that every restore shares one set of rules and messages.

Every restore into a target goes through it: a single-process one with the manifest's
index, a multi-rank one (:mod:`ckptmgr.distributed.restore`) with an index that also gives,
for each DTensor, the local shape this rank restores. Before that, a multi-rank restore
needs to know what the target holds where the checkpoint holds a DTensor, and which
optimizer parameter each saved moment belongs to, to choose the layouts it reads into:
:func:`survey_target` is the same walk, without an index and without checks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import torch

from ..errors import StateMismatchError
from ..format.layout import ST_TO_DTYPE
from ..format.tree import PerRank, decode_plain, is_stateful, unflatten
from . import values as _values
from .loaders.landing import Dests

__all__ = ["TargetPlan", "TargetSurvey", "match_target", "survey_target"]

_PLAIN_TENSORS = _values._PLAIN_TENSORS
_ABSENT = _values._ABSENT


class _Pending:
    """A part of the result that exists only once the tensors are loaded."""

    __slots__ = ("value",)

    def __init__(self, value: Any = None) -> None:
        self.value = value  # a _Pending slot: filled by TargetPlan.finish


class _PendingContainer(_Pending):
    """A dict, list or tuple of the result that holds pending parts (``value``: the dict or
    list with them in place; ``kind``: ``tuple`` when it becomes one)."""

    __slots__ = ("kind",)

    def __init__(self, value: Any, kind: type) -> None:
        super().__init__(value)
        self.kind = kind


def _resolve(x: Any) -> Any:
    if type(x) is _Pending:
        return x.value
    if type(x) is not _PendingContainer:
        return x
    c = x.value
    if isinstance(c, dict):
        for k, v in c.items():
            if isinstance(v, _Pending):
                c[k] = _resolve(v)
        return c
    items = [_resolve(v) for v in c]
    if x.kind is PerRank:
        return PerRank(items[0])
    return tuple(items) if x.kind is tuple else items


_COPY, _LOAD, _APPLY, _CALL = range(4)  # kinds of TargetPlan steps
_SCALARS = (str, int, float, bool, type(None))


class TargetPlan:
    """The outcome of :func:`match_target`: where each stored tensor lands, and what is left
    to do once the bytes are loaded.

    Attributes:
        dests: stored tensor name -> the target's tensor (its local shard) at that place, for
            each that can take the stored bytes as they are (see :class:`Dests`): a loader
            writes them straight there where the device fits. The others are copied by
            :meth:`finish`.
        device: the first CUDA device among the target's matching tensors (None: none is on
            a GPU): where a restore into this target loads by default.
    """

    def __init__(self, dests: Dests, device: torch.device | None, result: Any,
                 steps: list[tuple[int, Any, Any]], allow_pickle: bool) -> None:
        self.dests = dests
        self.device = device
        self._result = result
        self._steps = steps  # in the order the walk met them, as apply_target runs its actions
        self._allow_pickle = allow_pickle

    def finish(self, tensors: Mapping[str, torch.Tensor]) -> Any:
        """Copy into the target what did not land there, call ``load_state_dict`` on its
        Stateful objects, and return the target-shaped result (as :func:`~ckptmgr.restore.values.apply_target`).
        Call once, after every byte verified.

        The loaders may already have written into the target, so nothing here may fail on
        the checkpoint's account: every part rebuilt here was rebuilt with stand-ins by
        :func:`match_target` first. An error from here is a bug (or a Stateful object's own
        ``load_state_dict`` failing), not a bad checkpoint.
        """
        ready: dict[int, Any] = {}  # rebuilt before the copies and load_state_dict calls below
        for i, (kind, a, b) in enumerate(self._steps):
            if kind == _LOAD:
                ready[i] = unflatten(b, tensors, allow_pickle=self._allow_pickle)
            elif kind == _APPLY:
                target, node, path = a
                applier = _values._Applier()
                b.value = applier.walk(target, unflatten(node, tensors, allow_pickle=self._allow_pickle,
                                                         keep_per_rank=True), path)
                if applier.problems:  # (the match saw the same shapes: not expected)
                    raise StateMismatchError(applier.problems)
                ready[i] = applier.actions
        for i, (kind, a, b) in enumerate(self._steps):
            if kind == _COPY:
                src = tensors[b]
                if type(src) not in _PLAIN_TENSORS:  # a DTensor: copied through its local shard
                    src = _values.local_tensor(src)
                if src is not a:  # a loader landed it in place: nothing to copy
                    _values.copy_into(a, src)
            elif kind == _LOAD:
                a.load_state_dict(ready[i])
            elif kind == _APPLY:
                for act in ready[i]:
                    act()
            else:
                a()
        return _resolve(self._result)


@dataclass
class TargetSurvey:
    """What a target holds where the checkpoint holds tensors (:func:`survey_target`).

    Attributes:
        tensors: stored name (or DTensor key) -> the target's tensor there (a DTensor's
            local shard), wherever the target holds a tensor.
        dtensors: DTensor key -> the target's tensor there, as it is (a DTensor or a plain
            tensor).
        params: DTensor key -> the parameter its optimizer state belongs to, for the state of
            every ``torch.optim.Optimizer`` in the target (moments restored into a fresh
            optimizer, whose state is still empty, take their parameter's layout).
        device: the first CUDA device among the target's tensors (None: none is on a GPU).
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    dtensors: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    device: torch.device | None = None


class _Matcher:
    """The one walk of the target against the skeleton: the same checks and messages as
    :class:`~ckptmgr.restore.values._Applier` over a tree of placeholders (which it uses
    itself for the parts it cannot judge undecoded: numpy arrays, mismatched kinds, what an
    empty container accepts). With ``survey``, it only notes what the target holds where
    (no index: nothing is checked, nothing is rebuilt)."""

    def __init__(self, index: Mapping[str, Any], allow_pickle: bool, survey: TargetSurvey | None = None) -> None:
        # Owned by one match_target() or survey_target() call on the caller's thread:
        # ``problems`` and ``dests`` are shared on purpose with the value walkers below,
        # which add to the same lists.
        self.survey = survey
        self.index = index
        self.allow_pickle = allow_pickle
        self.stand_ins = _values.StandIns(index)
        self.checker = _values._Applier(self.stand_ins.names)  # checks a rebuilt part; records where tensors land
        self.problems = self.checker.problems
        # Where each stored tensor goes: ``spans`` holds (first byte, end, name, device, tensor)
        # of each target tensor that can take the stored bytes as they are (contiguous, plain
        # values, writable, not empty: the candidates to land in place), ``dests`` the others
        self.spans: list[_Span] = []
        self.dests = self.checker.dests
        self.plain = _values._Applier()  # walks parts without stored tensors (plain values) for good
        self.plain.problems = self.problems
        self.steps: list[tuple[int, Any, Any]] = []
        self.pending = 0  # pending parts made so far

    def _mismatch(self, path: tuple[Any, ...], target: torch.Tensor, entry: dict[str, Any]) -> None:
        self.problems.append(f"{_values._p(path)}: the target is {target.dtype} {list(target.shape)}, "
                             f"the checkpoint {ST_TO_DTYPE.get(entry['dtype'])} {list(entry['shape'])}")

    def _note(self, name: str, target: torch.Tensor, local: torch.Tensor, dtensor: bool) -> None:
        """(survey) The target holds ``target`` where the skeleton holds ``name``."""
        assert self.survey is not None
        self.survey.tensors[name] = local
        if dtensor:
            self.survey.dtensors[name] = target
        if self.survey.device is None and local.device.type == "cuda":
            self.survey.device = local.device

    def _leaf(self, path: tuple[Any, ...], t: torch.Tensor, name: str, apply: bool) -> None:
        """``t`` matches stored tensor ``name``: note it as where the bytes land (in place when
        it takes them as they are), or refuse it now when it cannot be written at all, so that
        the failure comes before any byte lands. (:meth:`_dict` inlines the common case.)"""
        if t.is_inference() and not torch.is_inference_mode_enabled():
            self.problems.append(f"{_values._p(path)}: the target is an inference tensor (made under "
                                 "torch.inference_mode()) and cannot be written outside it")
            return
        if torch._debug_has_internal_overlap(t) == 1:  # (1: MemOverlap.Yes; never for a contiguous one)
            self.problems.append(f"{_values._p(path)}: the target has elements that share memory (an expanded "
                                 "tensor) and cannot be written")
            return
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()) and t.nbytes:
            ptr = t.data_ptr()
            self.spans.append((ptr, ptr + t.nbytes, name, t.device, t))
        else:
            self.dests[name] = t
        if apply:
            self.steps.append((_COPY, t, name))

    def _rebuilt(self, node: Any) -> Any:
        """``node`` rebuilt with placeholders: checked as the restore will rebuild it."""
        return unflatten(node, self.stand_ins, allow_pickle=self.allow_pickle, keep_per_rank=True)

    def _deferred(self, target: Any, node: Any, path: tuple[Any, ...], apply: bool) -> Any:
        """Check ``node`` rebuilt with placeholders; walk it for real once loaded."""
        if self.survey is not None:
            return None  # (a tensor the target does not hold: nothing to note)
        self.checker.walk(target, self._rebuilt(node), path, apply=False)
        if not apply:
            return None  # (inside a Stateful object: nothing to do, the result is discarded)
        slot = _Pending()
        self.pending += 1
        self.steps.append((_APPLY, (target, node, path), slot))
        return slot

    def _concrete(self, target: Any, node: Any, path: tuple[Any, ...], apply: bool) -> Any:
        """A node without stored tensors: decoded and walked now, its actions queued."""
        if self.survey is not None:
            return None
        value = node if type(node) in _SCALARS else unflatten(node, {}, allow_pickle=self.allow_pickle,
                                                              keep_per_rank=True)
        out = self.plain.walk(target, value, path, apply)
        if self.plain.actions:
            self.steps += [(_CALL, act, None) for act in self.plain.actions]
            self.plain.actions = []
        return out

    def match(self, target: Any, node: Any, path: tuple[Any, ...], apply: bool = True) -> Any:
        """Check ``node`` against ``target``; return the result node (or a pending one).

        A value that is PerRank in the target or in the checkpoint is PerRank in the result:
        the restored tree saves again as it was saved, each rank its own value."""
        per_rank = False
        while isinstance(target, PerRank):
            target, per_rank = target.value, True
        if type(node) is dict and next(iter(node), None) == "$per_rank":
            per_rank = True
        out = self._match(target, node, path, apply)
        if not per_rank or not apply:
            return out
        if isinstance(out, _Pending):
            self.pending += 1
            return _PendingContainer([out], PerRank)
        return PerRank(out)

    def _match(self, target: Any, node: Any, path: tuple[Any, ...], apply: bool) -> Any:
        tag = None
        saved_stateful = False
        if type(node) is dict:
            tag = next(iter(node), None)
            while tag == "$per_rank" or tag == "$stateful":  # rebuilt as what they hold
                saved_stateful = saved_stateful or tag == "$stateful"
                node = node[tag] if tag == "$per_rank" else node["state"]
                if type(node) is not dict:
                    tag = None
                    break
                tag = next(iter(node), None)
        if is_stateful(target):
            if self.survey is not None and saved_stateful and isinstance(target, torch.optim.Optimizer) and \
                    type(target).state_dict is torch.optim.Optimizer.state_dict:  # (not its own format)
                _moments(target, node, self.survey.params)
            # Check against what the object holds now; load_state_dict does the copying.
            self.match(target.state_dict(), node, path, apply=False)
            if apply:
                self.steps.append((_LOAD, target, node))
            return target
        if tag == "$tensor" or tag == "$dtensor":
            if not isinstance(target, torch.Tensor):
                return self._deferred(target, node, path, apply)
            local = _values.local_tensor(target)  # a DTensor is restored through its local shard
            name = node[tag]
            if self.survey is not None:
                self._note(name, target, local, tag == "$dtensor")
                return target
            e = self.index[name]
            if local.dtype != ST_TO_DTYPE.get(e["dtype"]) or local.shape != tuple(e["shape"]):
                self._mismatch(path, local, e)
            else:
                self._leaf(path, local, name, apply)
            return target  # a DTensor stays a DTensor
        if tag == "$dict":
            if isinstance(target, dict) and target:
                return self._dict(target, node, path, apply)
            return self._deferred(target, node, path, apply)
        if tag == "$tuple" or type(node) is list:
            if isinstance(target, (list, tuple)) and target:
                return self._seq(target, node, path, apply)
            return self._deferred(target, node, path, apply)
        if tag in ("$ndarray", "$npscalar"):
            return self._deferred(target, node, path, apply)
        return self._concrete(target, node, path, apply)  # plain values, torch.Size, pickled values

    def _dict(self, target: dict[Any, Any], node: dict[str, Any], path: tuple[Any, ...], apply: bool) -> Any:
        if self.survey is not None:
            body = node["$dict"]
            for k, v in body.items() if type(body) is dict else body:
                try:
                    t = target.get(k if type(body) is dict or type(k) in _SCALARS else decode_plain(k), _ABSENT)
                except Exception:  # a key this target cannot hold: nothing lands there (the match says why)
                    continue
                if t is not _ABSENT:
                    self.match(t, v, path, apply=False)
            return None
        if "metadata" in node:
            unflatten(node["metadata"], {}, allow_pickle=self.allow_pickle)  # checked; not in the result
        body = node["$dict"]
        items: dict[Any, Any]
        if type(body) is dict:
            items = body
        else:  # [[key, value], ...]: keys rebuilt as the restore rebuilds them (the last value of a key wins)
            items = {}
            for k, v in body:
                key = k if type(k) in _SCALARS else decode_plain(k)
                if key in items:  # (a crafted skeleton) the value it replaces is still rebuilt by the restore:
                    self._rebuilt(items[key])  # checked now, before any byte lands
                items[key] = v
        missing = [k for k in target if k not in items]
        unexpected = [k for k in items if k not in target]
        self.problems += [f"{_values._p((*path, k))}: missing from the checkpoint" for k in missing]
        self.problems += [f"{_values._p((*path, k))}: in the checkpoint but not in the target" for k in unexpected]
        out: dict[Any, Any] = OrderedDict() if node.get("type") == "OrderedDict" else {}
        pending = self.pending
        index, steps, spans = self.index, self.steps, self.spans
        for k, v in items.items():
            t = target.get(k, _ABSENT)
            if t is _ABSENT:
                out[k] = self._rebuilt(v)
                continue
            if type(t) in _PLAIN_TENSORS and type(v) is dict:  # the common leaf, inline
                name = v.get("$tensor")
                if name is not None:
                    e = index[name]
                    if t.dtype != ST_TO_DTYPE.get(e["dtype"]) or t.shape != tuple(e["shape"]):
                        self._mismatch((*path, k), t, e)
                    elif t.is_contiguous() and not (t.is_inference() or t.is_conj() or t.is_neg()) and (n := t.nbytes):
                        ptr = t.data_ptr()
                        spans.append((ptr, ptr + n, name, t.device, t))
                        if apply:
                            steps.append((_COPY, t, name))
                    else:
                        self._leaf((*path, k), t, name, apply)
                    out[k] = t
                    continue
            out[k] = self.match(t, v, (*path, k), apply)
        if self.pending != pending:
            self.pending += 1
            return _PendingContainer(out, dict)
        return out

    def _seq(self, target: list[Any] | tuple[Any, ...], node: Any, path: tuple[Any, ...], apply: bool) -> Any:
        body = node if type(node) is list else node["$tuple"]
        if len(target) != len(body):
            if self.survey is not None:
                return None
            self._rebuilt(node)
            self.problems.append(f"{_values._p(path)}: the target has {len(target)} items, the checkpoint {len(body)}")
            return target
        pending = self.pending
        items = [self.match(t, c, (*path, i), apply) for i, (t, c) in enumerate(zip(target, body, strict=True))]
        kind = list if type(node) is list else tuple
        if self.pending != pending:
            self.pending += 1
            return _PendingContainer(items, kind)
        return items if kind is list else tuple(items)


def survey_target(target: Any, skeleton: Any) -> TargetSurvey:
    """What ``target`` holds where the ``skeleton`` holds tensors, and the parameters its
    optimizers' saved state belongs to: the walk of :func:`match_target`, without an index
    and without checks (a difference is reported by the match that follows)."""
    survey = TargetSurvey()
    _Matcher({}, allow_pickle=False, survey=survey).match(target, skeleton, (), apply=False)
    return survey


def match_target(target: Any, skeleton: Any, index: Mapping[str, Any], *, allow_pickle: bool) -> TargetPlan:
    """Match ``target`` against a checkpoint's typed ``skeleton`` and tensor ``index`` (the
    manifest's ``state`` and ``tensors``, validated), before a single byte is read.

    Checks and messages are those of :func:`~ckptmgr.restore.values.check_target` over the skeleton rebuilt with
    placeholders, in one walk that builds no placeholder for a tensor the target holds.

    Raises:
        StateMismatchError: listing every difference; nothing has been modified.
        CheckpointCorruptError: the skeleton cannot be rebuilt (checked as it is walked).
    """
    m = _Matcher(index, allow_pickle)
    result = m.match(target, skeleton, ())
    if m.problems:
        raise StateMismatchError(m.problems)
    dests, device = _in_place(m.spans, m.dests)
    return TargetPlan(dests, device, result, m.steps, allow_pickle)


_Span = tuple[int, int, str, torch.device, torch.Tensor]  # (first byte, end, name, device, target tensor)


def _in_place(spans: list[_Span], rest: dict[str, torch.Tensor]) -> tuple[Dests, torch.device | None]:
    """The target tensors of ``spans`` that take their stored bytes in place: all of them but
    any that shares memory with another target tensor (of ``spans`` or ``rest``); and the
    first CUDA device among all of them.

    Target tensors that share memory (tied weights, views) are all left to be loaded apart
    and copied in walk order, as apply_target would: landing them in place would write one
    stored tensor over another, and the loaders' checks of what landed would fail. The
    check is conservative for interleaved strided views. (Host and device pointers share one
    address space in a CUDA process, so they are compared as they are.)
    """
    devices = {s[3] for s in spans}  # (one, nearly always)
    every: list[tuple[int, int, str]] = [s[:3] for s in spans]
    for name, t in rest.items():  # (strided, empty, conjugate, ...) copied at finish; in the check too
        n = t.nbytes
        if n:
            ptr = t.data_ptr()
            if not t.is_contiguous():
                n = (1 + sum((d - 1) * st for d, st in zip(t.shape, t.stride(), strict=True))) * t.element_size()
            every.append((ptr, ptr + n, name))
    every.sort(key=_FIRST)
    shared: set[str] = set()
    end, owner = -1, ""
    for begin, stop, name in every:
        if begin < end:
            shared.update((name, owner))
        if stop > end:
            end, owner = stop, name
    out = Dests({s[2]: s[4] for s in spans if s[2] not in shared})
    if shared and len(devices) > 1:
        devices = {s[3] for s in spans if s[2] not in shared}
    out.device = next(iter(devices)) if len(devices) == 1 else None
    if any(d.type == "cuda" for d in devices):
        return out, next(s[3] for s in spans if s[3].type == "cuda")
    return out, next((t.device for t in rest.values() if t.is_cuda), None)


_FIRST = itemgetter(0)


def _moments(opt: torch.optim.Optimizer, node: Any, out: dict[str, torch.Tensor]) -> None:
    """Add to ``out``, for the saved state ``node`` of optimizer ``opt`` (its ``state_dict()``
    as saved), DTensor key -> the parameter the state under that key belongs to. (Reads the
    skeleton only: any part that is not as a ``torch.optim.Optimizer`` saves it is skipped.)"""
    groups = opt.state_dict()["param_groups"]
    index = {i: p for g_sd, g in zip(groups, opt.param_groups, strict=False)
             for i, p in zip(g_sd["params"], g["params"], strict=False)}
    body = node.get("$dict") if isinstance(node, dict) else None
    state = body.get("state") if isinstance(body, dict) else None
    items = state.get("$dict") if isinstance(state, dict) else None
    pairs = items.items() if isinstance(items, dict) else \
        [p for p in items if isinstance(p, list) and len(p) == 2] if isinstance(items, list) else []
    for k, v in pairs:
        try:
            param = index.get(decode_plain(k))
        except Exception:  # a key of no parameter
            param = None
        if param is not None:
            out.update(dict.fromkeys(_dtensor_keys(v), param))


def _dtensor_keys(node: Any) -> list[str]:
    """The DTensor keys a skeleton node holds (through dicts, lists and tuples)."""
    found: list[str] = []
    if isinstance(node, list):
        for v in node:
            found += _dtensor_keys(v)
    elif isinstance(node, dict) and node:
        tag, val = next(iter(node.items()))
        if tag == "$dtensor":
            found.append(val)
        elif tag == "$dict":
            for v in val.values() if isinstance(val, dict) else \
                    [p[1] for p in val if isinstance(p, list) and len(p) == 2] if isinstance(val, list) else []:
                found += _dtensor_keys(v)
        elif tag == "$tuple":
            found += _dtensor_keys(val)
    return found
