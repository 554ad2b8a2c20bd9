"""The state trees of a multi-rank checkpoint, read side: one tree for a restoring rank, built
from every saved rank's tree.

Every rank saved the same structure; the trees differ only inside ``PerRank`` values and in
the names of DTensor shards (each rank stored its own). :func:`rank_view` walks all of them
in step and gives the tree a restoring rank unflattens: the replicated parts, the PerRank
values of the saved rank it takes them from, and each DTensor node renamed to a key
(``~dtensor/3``) under which the restore puts the assembled tensor. It also lists, per key,
every saved rank's node, so that the restore knows where each shard lies.

These walks read the saved trees only; the restore's target is walked against the tree by
:mod:`ckptmgr.restore.target`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointCorruptError
from ..format.tree import decode_plain

__all__ = ["RankView", "SavedDTensor", "dict_values", "per_rank_paths", "rank_view", "tensor_names"]

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
