"""The product benchmarks (benchmarks/*.py) use only ckptmgr's public API, as a user's code
would: the names in ``ckptmgr.__all__`` and the integrations' modules under
``ckptmgr.integrations``. One-off probes that need internals live in benchmarks/probes/ and
are not checked; result folders hold data only. Every product benchmark answers ``--help``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import zygote

import ckptmgr

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
PUBLIC = set(ckptmgr.__all__)
PRODUCT = sorted(f for f in os.listdir(BENCH) if f.endswith(".py"))


def _public_module(module: str) -> bool:
    """``ckptmgr`` itself, or a public module of ``ckptmgr.integrations``."""
    parts = module.split(".")
    if parts == ["ckptmgr"]:
        return True
    return parts[:2] == ["ckptmgr", "integrations"] and not any(p.startswith("_") for p in parts)


def violations(source: str, filename: str = "<benchmark>") -> list[str]:
    """Every use of ckptmgr in ``source`` that is not public: ``file:line what``."""
    tree = ast.parse(source, filename)
    aliases: set[str] = set()  # names bound to the ckptmgr package itself
    bad: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top == "integrations" or (top == "ckptmgr" and not _public_module(a.name)):
                    bad.append(f"{filename}:{node.lineno} import {a.name}")
                elif top == "ckptmgr" and (a.asname is None or a.name == "ckptmgr"):
                    aliases.add(a.asname or "ckptmgr")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            top = module.split(".")[0]
            if node.level:
                bad.append(f"{filename}:{node.lineno} relative import from {module!r}")
            elif top == "integrations" or (top == "ckptmgr" and not _public_module(module)):
                bad.append(f"{filename}:{node.lineno} from {module} import ...")
            elif module == "ckptmgr":
                bad += [f"{filename}:{node.lineno} from ckptmgr import {a.name}" for a in node.names
                        if a.name not in PUBLIC and a.name != "integrations"]
            elif top == "ckptmgr":
                bad += [f"{filename}:{node.lineno} from {module} import {a.name}" for a in node.names
                        if a.name.startswith("_")]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr not in PUBLIC and node.attr != "integrations"):
            bad.append(f"{filename}:{node.lineno} {node.value.id}.{node.attr}")
    return bad


def test_the_walk_sees_the_product_benchmarks_and_not_the_probes():
    assert {"common.py", "bench_staging.py", "bench_restore.py", "bench_training.py", "bench_distributed.py",
            "bench_lightning.py", "bench_hf_trainer.py", "bench_tier_restore.py"} <= set(PRODUCT)
    probes = os.listdir(os.path.join(BENCH, "probes"))
    assert "bench_pinning.py" in probes and not set(probes) & set(PRODUCT)


@pytest.mark.parametrize("source", [
    "import ckptmgr.save.buffers as buffers",
    "from ckptmgr.format.checksum import crc32c_hex",
    "from ckptmgr import _cuda",
    "from ckptmgr.storage.local import LocalTarget",
    "from integrations.lightning import CkptmgrCheckpointIO",
    "from ckptmgr.integrations._dirwriter import DirectoryWriter",
    "import ckptmgr\nckptmgr.save.buffers.PIN_MODE = 'x'",
    "import ckptmgr as c\nc.manager",
])
def test_the_check_refuses_internals(source):
    assert violations(source)


@pytest.mark.parametrize("source", [
    "import ckptmgr\nckptmgr.load_file('x')",
    "from ckptmgr import CheckpointManager, KeepLatest, Schedule, StagingOptions",
    "from ckptmgr.integrations.lightning import CkptmgrCheckpointIO",
    "import torch.distributed.checkpoint as dcp",
])
def test_the_check_accepts_the_public_api(source):
    assert violations(source) == []


@pytest.mark.parametrize("name", PRODUCT)
def test_product_benchmarks_use_only_the_public_api(name):
    path = os.path.join(BENCH, name)
    with open(path, encoding="utf-8") as f:
        assert violations(f.read(), f"benchmarks/{name}") == []


def test_result_folders_hold_data_only():
    code = [os.path.relpath(os.path.join(d, f), BENCH) for d, _, files in os.walk(os.path.join(BENCH, "results"))
            for f in files if f.endswith((".py", ".sh"))]
    assert code == [], "scripts belong in benchmarks/ or benchmarks/probes/, not with the data"


def test_every_product_benchmark_answers_help():
    """One process per benchmark script, started together: each parses its arguments (imports
    and all) and prints its usage. (Modules without a ``__main__`` block, common.py and
    dist_reshard.py, are run by the scripts that import them.)"""
    scripts = []
    for n in PRODUCT:
        with open(os.path.join(BENCH, n), encoding="utf-8") as f:
            if 'if __name__ == "__main__":' in f.read():
                scripts.append(n)
    assert {"bench_training.py", "bench_restore.py", "bench_staging.py", "run.py"} <= set(scripts)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    procs = {n: zygote.Popen([sys.executable, os.path.join(BENCH, n), "--help"], template="lightning",
                             stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=REPO, env=env) for n in scripts}
    failed = []
    for n, p in procs.items():
        out, err = p.communicate(timeout=300)
        if p.returncode != 0 or "usage:" not in out:
            failed.append(f"{n}: rc {p.returncode}: {err.strip()[-500:]}")
    assert not failed, "\n".join(failed)


def test_gpu_suite_runs_product_benchmarks_only():
    """Every script gpu_suite.sh runs is a product benchmark of this tree (none from results/ or
    probes/), and every mode its header lists has a branch."""
    import re

    with open(os.path.join(BENCH, "gpu_suite.sh"), encoding="utf-8") as f:
        suite = f.read()
    scripts = set(re.findall(r"benchmarks/([\w/]+\.py)", suite))
    assert scripts and not {s for s in scripts if "/" in s}, scripts
    assert scripts - {"bench_inplace.py"} <= set(PRODUCT), scripts - set(PRODUCT)
    header = suite[:suite.index("set -uo pipefail")]
    listed = set(re.findall(r"^#   (\w+)  ", header, re.M))  # "#   mode   what it measures"
    assert {"tests", "loadfile", "budget", "staging", "restore", "tier", "lightning", "hf", "dist"} <= listed
    branches = set(re.findall(r"^    ([\w|]+)\)", suite, re.M))
    assert listed <= {m for b in branches for m in b.split("|")}, listed
