"""The S3 fencing scenarios marked ``one_server_in_ci`` (tests/conftest.py): the default run
(CI's) collects each on exactly one server, both servers among them; ``-m 'not cuda'`` collects
each on both. Checked by collecting the fencing files in a second pytest process."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest

pytest.importorskip("s3fs")

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = [os.path.join(HERE, "test_s3_fencing.py"), os.path.join(HERE, "test_s3_fencing_committed.py")]


def _collected(*extra: str) -> list[str]:
    cmd = [sys.executable, "-P", "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *extra, *FILES]
    out = subprocess.run(cmd, cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return [line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line]


def _by_scenario(ids: list[str]) -> dict[str, list[str]]:
    runs = collections.defaultdict(list)
    for test_id in ids:
        name, _, params = test_id.partition("[")
        parts = params.rstrip("]").split("-") if params else []
        server = next((p for p in parts if p in ("moto", "seaweedfs")), None)
        rest = "-".join(p for p in parts if p != server)
        runs[f"{name}[{rest}]"].append(server)
    return runs


def _marked() -> set[str]:
    """The marked test functions' names, from the sources."""
    names = set()
    for path in FILES:
        with open(path) as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            if line.strip() == "@pytest.mark.one_server_in_ci":
                j = i + 1
                while not lines[j].startswith("def "):
                    j += 1
                names.add(lines[j][4:].split("(", 1)[0])
    return names


def test_ci_runs_each_marked_scenario_on_one_server_and_both_servers_overall():
    marked = _marked()
    assert len(marked) >= 6, marked
    default = {k: v for k, v in _by_scenario(_collected()).items() if k.partition("[")[0] in marked}
    assert {k.partition("[")[0] for k in default} == marked  # every scenario still runs in CI
    assert all(len(servers) == 1 for servers in default.values()), default
    assert {s for servers in default.values() for s in servers} == {"moto", "seaweedfs"}
    every = {k: v for k, v in _by_scenario(_collected("-m", "not cuda")).items() if k.partition("[")[0] in marked}
    assert every.keys() == default.keys() and all(sorted(v) == ["moto", "seaweedfs"] for v in every.values()), every
