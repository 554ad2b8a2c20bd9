"""The package's imports show its separation, and this test keeps them so.

Every ``import`` in ckptmgr's modules (lazy ones inside functions included) is read with
``ast`` and checked against the rules below; a forbidden edge or an import cycle fails with
the modules and lines that make it.
"""

from __future__ import annotations

import ast
import os

import pytest

import ckptmgr

PKG = os.path.dirname(ckptmgr.__file__)

# (importer prefix, imported prefix, why it is forbidden)
FORBIDDEN = [
    ("ckptmgr.restore", "ckptmgr.save", "the read path imports nothing of the save path"),
    ("ckptmgr.restore", "ckptmgr.distributed",
     "the multi-rank layer builds on the read path, which imports nothing of it (the manager injects it)"),
    ("ckptmgr.storage", "ckptmgr.restore", "storage knows no loaders"),
    ("ckptmgr.storage", "ckptmgr.save", "storage is below the save path"),
    ("ckptmgr.storage", "ckptmgr.retention", "storage is below retention"),
    ("ckptmgr.storage", "ckptmgr.distributed", "storage is below the multi-rank layer"),
    ("ckptmgr.format", "ckptmgr.storage", "the format does no I/O"),
    ("ckptmgr.format", "ckptmgr.save", "the format does no I/O"),
    ("ckptmgr.format", "ckptmgr.restore", "the format does no I/O"),
]
ABOVE_THE_MANAGER = ("ckptmgr.handle", "ckptmgr.manager", "ckptmgr.cli", "ckptmgr.integrations", "ckptmgr")
MANAGER_USERS = ("ckptmgr.manager", "ckptmgr.cli", "ckptmgr.integrations", "ckptmgr")  # may import the handle


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
    return rel.removesuffix(".__init__")


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    # ``from pkg import name`` may import the submodule ``pkg.name``: count it when it exists
    out = [stem]
    for alias in node.names:
        sub = f"{stem}.{alias.name}"
        if os.path.exists(_path_of(sub) or ""):
            out.append(sub)
    return out


def _path_of(module: str) -> str | None:
    if not module.startswith("ckptmgr"):
        return None
    parts = module.split(".")[1:]
    base = os.path.join(PKG, *parts)
    if os.path.isfile(base + ".py"):
        return base + ".py"
    if os.path.isfile(os.path.join(base, "__init__.py")):
        return os.path.join(base, "__init__.py")
    return None


def _edges() -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported ckptmgr module, line)], every import statement in the file."""
    edges: dict[str, list[tuple[str, int]]] = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            module = _module_name(path)
            with open(path, encoding="utf-8") as src:
                tree = ast.parse(src.read(), path)
            found = []
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found += [(a.name, node.lineno) for a in node.names if a.name.startswith("ckptmgr")]
                elif isinstance(node, ast.ImportFrom):
                    found += [(m, node.lineno) for m in _resolve(module, f == "__init__.py", node)
                              if m.startswith("ckptmgr")]
            edges[module] = [(m, line) for m, line in found if _path_of(m) is not None and m != module]
    return edges


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


EDGES = _edges()


def test_the_walk_sees_the_package():
    assert {"ckptmgr.manager", "ckptmgr.save.saver", "ckptmgr.restore.restorer", "ckptmgr.storage.tier"} <= set(EDGES)
    assert any(m == "ckptmgr.save.saver" for m, _ in EDGES["ckptmgr.parts"])  # (the manager's parts are built there)


@pytest.mark.parametrize(("importer", "imported", "why"), FORBIDDEN)
def test_forbidden_edges(importer, imported, why):
    bad = [f"{m}:{line} imports {dep}" for m, deps in EDGES.items() if _under(m, importer)
           for dep, line in deps if _under(dep, imported)]
    assert not bad, f"{why}: " + "; ".join(bad)


def test_nothing_below_the_manager_imports_the_handle():
    bad = [f"{m}:{line}" for m, deps in EDGES.items() if not any(_under(m, p) if p != "ckptmgr" else m == p
                                                                  for p in MANAGER_USERS)
           for dep, line in deps if dep == "ckptmgr.handle"]
    assert not bad, "SaveHandle is the user-facing facade; lower layers use ckptmgr.save: " + ", ".join(bad)


def test_nothing_below_the_manager_imports_the_manager():
    bad = [f"{m}:{line}" for m, deps in EDGES.items()
           if not any(_under(m, p) if p != "ckptmgr" else m == p for p in ABOVE_THE_MANAGER)
           for dep, line in deps if dep == "ckptmgr.manager"]
    assert not bad, ", ".join(bad)


def test_no_import_cycles():
    graph = {m: sorted({d for d, _ in deps if d in EDGES}) for m, deps in EDGES.items()}
    # A package's __init__ re-exporting its own modules is not a cycle of the data flow.
    for m in graph:
        graph[m] = [d for d in graph[m] if not (_under(d, m) and _path_of(m).endswith("__init__.py"))]
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in graph.get(m, []):
            if state.get(d) == 1:
                return [*stack[stack.index(d):], d]
            if d not in state:
                cycle = visit(d)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_forbidden_edge_is_caught(tmp_path):
    """The checker itself: a lazy import inside a function counts."""
    src = "def f():\n    from ..save.slots import Slot\n    return Slot\n"
    tree = ast.parse(src)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert "ckptmgr.save.slots" in _resolve("ckptmgr.restore.restorer", False, node)


def test_a_lazy_import_back_up_is_caught():
    """A lazy import of the multi-rank layer from the read path counts as an edge."""
    src = "def f():\n    from ..distributed.restore import RankRestore\n    return RankRestore\n"
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom))
    deps = _resolve("ckptmgr.restore.restorer", False, node)
    assert any(_under(d, "ckptmgr.distributed") for d in deps)


# ------------------------------------------------------------ the integrations' imports

INTEGRATIONS_MAY_IMPORT = ("ckptmgr", "ckptmgr.extend")  # the public API and the extension API


def _integration_imports(root: str) -> list[tuple[str, int, str]]:
    """``(file, line, ckptmgr module)`` for every absolute ckptmgr import in ``root``'s
    modules, lazy ones inside functions included; ``from ckptmgr import name`` counts as
    the module ``ckptmgr.name`` where that is a module of the package."""
    found = []
    for f in sorted(os.listdir(root)):
        if not f.endswith(".py"):
            continue
        with open(os.path.join(root, f), encoding="utf-8") as src:
            tree = ast.parse(src.read(), f)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module == "ckptmgr":
                    names += [f"ckptmgr.{a.name}" for a in node.names if _path_of(f"ckptmgr.{a.name}")]
            else:
                continue
            found += [(f, node.lineno, n) for n in names if n == "ckptmgr" or n.startswith("ckptmgr.")]
    return found


def _not_allowed(found: list[tuple[str, int, str]]) -> list[str]:
    return [f"{f}:{line} imports {m}" for f, line, m in found
            if m not in INTEGRATIONS_MAY_IMPORT and not _under(m, "ckptmgr.integrations")]


def test_integrations_import_only_the_public_and_the_extension_api():
    import ckptmgr.integrations

    found = _integration_imports(os.path.dirname(ckptmgr.integrations.__file__))
    assert {m for _, _, m in found} >= {"ckptmgr", "ckptmgr.extend"}  # the walk sees them
    bad = _not_allowed(found)
    assert not bad, "integrations build on ckptmgr and ckptmgr.extend only: " + "; ".join(bad)


def test_an_integration_importing_a_core_module_is_caught(tmp_path):
    """The checker itself: a lazy import and a submodule named in ``from ckptmgr import`` count."""
    (tmp_path / "x.py").write_text("import ckptmgr\nfrom ckptmgr.extend import AsyncWriter\n"
                                    "def f():\n    from ckptmgr.save.slots import SlotPool\n"
                                    "    from ckptmgr import _lifecycle, ConfigError\n")
    bad = _not_allowed(_integration_imports(str(tmp_path)))
    assert bad == ["x.py:4 imports ckptmgr.save.slots", "x.py:5 imports ckptmgr._lifecycle"]


def test_the_core_never_imports_the_integrations():
    found = []
    for dirpath, _, files in os.walk(PKG):
        found += [(os.path.relpath(os.path.join(dirpath, f), PKG), line, m)
                  for f, line, m in _integration_imports(dirpath) if f in files]
    bad = [f"{f}:{line} imports {m}" for f, line, m in found if _under(m, "ckptmgr.integrations")]
    assert not bad, "; ".join(bad)


# ------------------------------------------------------------ the wheel holds every package

def test_every_package_of_the_source_tree_is_listed_for_the_wheel():
    """pyproject.toml names the packages a wheel holds: a subpackage missing there installs
    without its modules, and only an installed run (CI) finds out."""
    import tomllib

    here = os.path.join(os.path.dirname(__file__), "..")
    pyproject = os.path.join(here, "pyproject.toml")
    if not os.path.isfile(pyproject):
        pytest.skip("needs the source tree's pyproject.toml")
    with open(pyproject, "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("ckptmgr", "ckptmgr"), ("integrations", "ckptmgr.integrations")):
        base = os.path.join(here, top)
        for dirpath, dirs, files in os.walk(base):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(dirpath, base)
                found.add(name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}")
    assert found == listed, f"missing from pyproject.toml: {sorted(found - listed)}; listed but absent: " \
                            f"{sorted(listed - found)}"
