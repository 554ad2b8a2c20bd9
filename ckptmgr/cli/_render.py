"""Output of the command line: tables, sizes, the state tree, JSON, and progress bars.

Progress bars go to stderr and only when stderr is a terminal (and neither ``--quiet`` nor
``--json`` was given), so scripts and logs see clean output. ``--json`` prints one JSON
document on stdout per command.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..format.tree import decode_plain

__all__ = ["SEQUENCE_LIMIT", "Progress", "Tensors", "human_bytes", "plain_tree", "print_json", "progress", "table",
           "text_tree", "when"]

Tensors = dict[str, dict[str, Any]]  # tensor name -> its manifest index entry


def human_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def when(t: float) -> str:
    """A commit time as local ISO date and time."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=1, ensure_ascii=False, allow_nan=False)
    sys.stdout.write("\n")


def tensor_bytes(entry: dict[str, Any]) -> int:
    """Bytes a tensor occupies in its file (0 for a view, which shares its base's bytes)."""
    if "offsets" in entry:
        return int(entry["offsets"][1]) - int(entry["offsets"][0])
    return 0


def plain_tree(node: Any, leaf: Callable[[str, str], Any]) -> Any:
    """The state skeleton as plain JSON: tuples become lists, non-str keys strings, special
    floats strings, dtypes and devices their names, Stateful objects their state; each
    tensor becomes ``leaf(kind, name)``."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [plain_tree(v, leaf) for v in node]
    if not isinstance(node, dict) or not node:
        return str(node)
    tag, val = next(iter(node.items()))
    if tag == "$dict":
        items = val.items() if isinstance(val, dict) else ((decode_plain(k), v) for k, v in val)
        return {str(k): plain_tree(v, leaf) for k, v in items}
    if tag == "$tuple":
        return [plain_tree(v, leaf) for v in val]
    if tag in ("$tensor", "$ndarray", "$npscalar", "$dtensor"):
        return leaf(tag[1:], val)
    if tag == "$per_rank":  # PerRank(value): each rank saved its own
        return {"per_rank": plain_tree(val, leaf)}
    if tag == "$stateful":
        return plain_tree(node["state"], leaf)
    if tag == "$dtype":
        return f"torch.{val}"
    if tag == "$pickle":
        return {"pickled_bytes": len(val) * 3 // 4}
    return val if tag in ("$float", "$device", "$size") else str(node)


SEQUENCE_LIMIT = 16  # longer lists, tuples and int-keyed dicts are summarized unless --all


def text_tree(node: Any, tensors: Tensors, name: str = "state", depth: int = 0, *,
              limit: int | None = SEQUENCE_LIMIT) -> Iterator[str]:
    """The state skeleton as indented lines: containers with their type, tensors with dtype,
    shape and bytes, other values with their (shortened) repr. A list, tuple or int-keyed
    dict of more than ``limit`` items shows its first items and a count (a sequence of
    plain values, such as Python's RNG state, one line); ``limit=None`` shows everything."""
    pad = "  " * depth
    if node is None or isinstance(node, (bool, int, float, str)):
        yield f"{pad}{name}: {_short(node)}"
        return
    if isinstance(node, list):
        yield from _items(f"{pad}{name}: list", list(enumerate(node)), tensors, depth, limit)
        return
    if not isinstance(node, dict) or not node:
        yield f"{pad}{name}: {_short(str(node))}"
        return
    tag, val = next(iter(node.items()))
    if tag == "$dict" and isinstance(val, dict):
        yield f"{pad}{name}: {node.get('type', 'dict')}[{len(val)}]"
        for k, v in val.items():
            yield from text_tree(v, tensors, str(k), depth + 1, limit=limit)
    elif tag == "$dict":
        items = [(repr(decode_plain(k)), v) for k, v in val]
        yield from _items(f"{pad}{name}: {node.get('type', 'dict')}", items, tensors, depth, limit)
    elif tag == "$tuple":
        yield from _items(f"{pad}{name}: tuple", list(enumerate(val)), tensors, depth, limit)
    elif tag == "$stateful":
        yield f"{pad}{name}: {val}"
        state = node.get("state")
        if isinstance(state, dict) and isinstance(state.get("$dict"), dict):
            for k, v in state["$dict"].items():
                yield from text_tree(v, tensors, k, depth + 1, limit=limit)
        else:
            yield from text_tree(state, tensors, "state", depth + 1, limit=limit)
    elif tag in ("$tensor", "$ndarray", "$npscalar"):
        e = tensors.get(val, {}) if isinstance(val, str) else {}
        where = f"view of {e['view_of']}" if "view_of" in e else human_bytes(tensor_bytes(e))
        kind = "" if tag == "$tensor" else f" ({tag[1:]})"
        yield f"{pad}{name}: {e.get('dtype', '?')} {e.get('shape', '?')} {where}{kind}"
    elif tag == "$dtensor":
        e = tensors.get(val, {}) if isinstance(val, str) else {}
        yield (f"{pad}{name}: {e.get('dtype', '?')} {node.get('shape', '?')} (DTensor; this shard "
               f"{e.get('shape', '?')} {human_bytes(tensor_bytes(e))})")
    elif tag == "$per_rank":  # PerRank(value): the value's lines, marked
        lines = text_tree(val, tensors, name, depth, limit=limit)
        first = next(lines, None)
        if first is not None:
            yield f"{first} (per rank)"
        yield from lines
    elif tag == "$float":
        yield f"{pad}{name}: {val}"
    else:
        yield f"{pad}{name}: {_short(plain_tree(node, lambda k, n: n))}"


def _plain_value(node: Any) -> str | None:
    """The type name of a plain (non-container) skeleton value, None for anything else."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return "None" if node is None else type(node).__name__
    if isinstance(node, dict) and len(node) == 1 and "$float" in node:
        return "float"
    return None


def _items(head: str, items: list[tuple[Any, Any]], tensors: Tensors, depth: int,
           limit: int | None) -> Iterator[str]:
    """A container's header line, then its items (summarized past ``limit``)."""
    n = len(items)
    if limit is None or n <= limit:
        yield f"{head}[{n}]"
        for k, v in items:
            yield from text_tree(v, tensors, str(k), depth + 1, limit=limit)
        return
    kinds = {_plain_value(v) for _, v in items}
    if None not in kinds:  # plain values: one line
        preview = ", ".join(_short(plain_tree(v, lambda k, n: n), 20) for _, v in items[:4])
        yield f"{head}[{n}] of {'/'.join(sorted(k for k in kinds if k))}: [{preview}, ...] (--all shows every item)"
        return
    shown = limit // 2
    yield f"{head}[{n}]"
    for k, v in items[:shown]:
        yield from text_tree(v, tensors, str(k), depth + 1, limit=limit)
    yield f"{'  ' * (depth + 1)}... {n - shown} more (--all shows every item)"


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Progress:
    """A byte counter that drives a tqdm bar when one is shown; thread-safe ``update``."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)


@contextmanager
def progress(total: int, desc: str, *, enabled: bool) -> Iterator[Progress]:
    """A progress bar on stderr over ``total`` bytes, shown only when ``enabled`` and stderr
    is a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield Progress(None)
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              leave=False, dynamic_ncols=True) as bar:
        yield Progress(bar)
