"""The state trees of a multi-rank checkpoint, read side: one tree for a restoring rank, built
from every saved rank's tree.

Every rank saved the same structure; the trees differ only inside ``PerRank`` values and in
the names of DTensor shards (each rank stored its own). :func:`rank_view` walks all of them
in step and gives the tree a restoring rank unflattens: the replicated parts, the PerRank
values of the saved rank it takes them from, and each DTensor node renamed to a key
(``~dtensor/3``) under which the restore puts the assembled tensor. It also lists, per key,
every saved rank's node, so that the restore knows where each shard lies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointCorruptError
from ..format.tree import PerRank, decode_plain, is_stateful

__all__ = ["RankView", "SavedDTensor", "dict_values", "optimizer_params", "per_rank_paths", "rank_view",
           "tensor_names"]

_LEAVES = ("$tensor", "$ndarray", "$npscalar")


@dataclass
class SavedDTensor:
    """One DTensor of the saved state: where it was, and each saved rank's skeleton node."""

    path: str
    nodes: list[dict[str, Any]]


@dataclass
class RankView:
    """What a restoring rank unflattens, and what its DTensor keys stand for."""

    skeleton: Any
    dtensors: dict[str, SavedDTensor] = field(default_factory=dict)  # key -> the saved DTensor
    per_rank: list[str] = field(default_factory=list)  # paths of the PerRank values


def rank_view(states: list[Any], per_rank_from: int, where: str) -> RankView:
    """The tree of a restoring rank: ``states[0]``'s replicated parts, ``states[per_rank_from]``'s
    PerRank values, DTensor nodes renamed to keys.

    Raises:
        CheckpointCorruptError: the saved ranks' trees do not have the same structure.
    """
    view = RankView(None)

    def bad(path: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{where}: the saved ranks' state trees differ at {path}")

    def walk(nodes: list[Any], path: str) -> Any:
        base = nodes[0]
        if isinstance(base, list):
            if any(not isinstance(n, list) or len(n) != len(base) for n in nodes):
                raise bad(path)
            return [walk([n[i] for n in nodes], f"{path}[{i}]") for i in range(len(base))]
        if not isinstance(base, dict) or not base:
            return base
        tag = next(iter(base))
        if any(not isinstance(n, dict) or not n or next(iter(n)) != tag for n in nodes):
            raise bad(path)
        if tag == "$per_rank":
            view.per_rank.append(path)
            return nodes[per_rank_from]
        if tag == "$dtensor":
            key = f"~dtensor/{len(view.dtensors)}"
            view.dtensors[key] = SavedDTensor(path, nodes)
            return {**base, "$dtensor": key}
        if tag == "$stateful":
            return {**base, "state": walk([n.get("state") for n in nodes], path)}
        if tag == "$tuple":
            return {"$tuple": walk([n["$tuple"] for n in nodes], path)}
        if tag == "$dict":
            body = base["$dict"]
            if isinstance(body, dict):
                if any(not isinstance(n["$dict"], dict) or n["$dict"].keys() != body.keys() for n in nodes):
                    raise bad(path)
                out: Any = {k: walk([n["$dict"][k] for n in nodes], f"{path}[{k!r}]") for k in body}
            else:
                if any(not isinstance(n["$dict"], list) or len(n["$dict"]) != len(body) for n in nodes):
                    raise bad(path)
                out = []
                for i, pair in enumerate(body):
                    if not isinstance(pair, list) or len(pair) != 2:
                        raise bad(path)
                    sub = [n["$dict"][i][1] if isinstance(n["$dict"][i], list) and len(n["$dict"][i]) == 2
                           else None for n in nodes]
                    out.append([pair[0], walk(sub, f"{path}[{_plain_key(pair[0])}]")])
            return {**base, "$dict": out}
        return base

    view.skeleton = walk(states, "state")
    return view


def _plain_key(encoded: Any) -> str:
    try:
        return repr(decode_plain(encoded))
    except Exception:  # a malformed key: name it as stored
        return repr(encoded)


def _dict_items(body: Any) -> list[tuple[Any, Any]]:
    """The (key, node) pairs of a ``$dict`` body: a JSON object, or a list of [key, node] pairs
    (malformed entries skipped: the restore reports them when it unflattens)."""
    if isinstance(body, dict):
        return list(body.items())
    if isinstance(body, list):
        return [(p[0], p[1]) for p in body if isinstance(p, list) and len(p) == 2]
    return []


def dict_values(body: Any) -> list[Any]:
    """The nodes of a ``$dict`` body."""
    return [v for _, v in _dict_items(body)]


def per_rank_paths(skeleton: Any) -> list[str]:
    """Paths of the PerRank values in one saved rank's tree."""
    return rank_view([skeleton], 0, "").per_rank


def tensor_names(node: Any, *, per_rank: bool) -> set[str]:
    """Stored names the tree refers to: outside PerRank values (``per_rank=False``: the
    replicated tensors) or inside them (``per_rank=True``). DTensor shards are not included."""
    out: set[str] = set()

    def walk(n: Any, inside: bool) -> None:
        if isinstance(n, list):
            for v in n:
                walk(v, inside)
            return
        if not isinstance(n, dict) or not n:
            return
        tag, val = next(iter(n.items()))
        if tag in _LEAVES:
            if inside == per_rank and isinstance(val, str):
                out.add(val)
        elif tag == "$per_rank":
            walk(val, True)
        elif tag == "$stateful":
            walk(n.get("state"), inside)
        elif tag == "$tuple":
            walk(val, inside)
        elif tag == "$dict":
            for v in dict_values(val):
                walk(v, inside)

    walk(node, False)
    return out


def optimizer_params(target: Any, skeleton: Any) -> dict[str, torch.Tensor]:
    """DTensor key -> the parameter its optimizer state belongs to, for the state of every
    ``torch.optim.Optimizer`` in ``target`` (so that moments restored into a fresh optimizer,
    whose state is still empty, take their parameter's layout)."""
    out: dict[str, torch.Tensor] = {}

    def keys_under(n: Any) -> list[str]:
        found: list[str] = []
        if isinstance(n, list):
            for v in n:
                found += keys_under(v)
        elif isinstance(n, dict) and n:
            tag, val = next(iter(n.items()))
            if tag == "$dtensor":
                found.append(val)
            elif tag == "$dict":
                for v in dict_values(val):
                    found += keys_under(v)
            elif tag == "$tuple":
                found += keys_under(val)
        return found

    def optimizer(opt: torch.optim.Optimizer, node: Any) -> None:
        if type(opt).state_dict is not torch.optim.Optimizer.state_dict:  # its own format (torchtitan's
            walk(opt.state_dict(), node.get("state") if isinstance(node, dict) else None)  # container): as a dict
            return
        groups = opt.state_dict()["param_groups"]
        index = {i: p for g_sd, g in zip(groups, opt.param_groups, strict=False)
                 for i, p in zip(g_sd["params"], g["params"], strict=False)}
        sd = node.get("state") if isinstance(node, dict) else None
        body = sd.get("$dict") if isinstance(sd, dict) else None
        state = body.get("state") if isinstance(body, dict) else None
        for k, v in _dict_items(state.get("$dict") if isinstance(state, dict) else None):
            try:
                param = index.get(decode_plain(k))
            except Exception:  # a key of no parameter
                param = None
            if param is not None:
                out.update(dict.fromkeys(keys_under(v), param))

    def walk(t: Any, n: Any) -> None:
        if isinstance(t, PerRank):
            t = t.value
        if isinstance(n, list):
            if isinstance(t, (list, tuple)) and len(t) == len(n):
                for a, b in zip(t, n, strict=True):
                    walk(a, b)
            return
        if not isinstance(n, dict) or not n:
            return
        tag, val = next(iter(n.items()))
        if tag == "$stateful" and isinstance(t, torch.optim.Optimizer):
            optimizer(t, n)
        elif tag == "$stateful" and is_stateful(t):
            walk(t.state_dict(), n.get("state"))
        elif tag == "$tuple":
            walk(t, val)
        elif tag == "$dict" and isinstance(t, dict):
            for k, v in _dict_items(val):
                try:
                    key = k if isinstance(val, dict) else decode_plain(k)
                    found = key in t
                except Exception:  # a key this target cannot hold
                    continue
                if found:
                    walk(t[key], v)

    walk(target, skeleton)
    return out
