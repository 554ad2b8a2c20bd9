"""benchmarks/bench_inplace.py end to end on the CPU, in a tiny size: every run in its own process,
the pinned file unlinked and still loaded bit for bit, the table and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # (the benchmark harness end to end, tiny)
def test_the_benchmark_runs_on_the_cpu(ram_dir, tmp_path):
    out = tmp_path / "inplace.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_inplace.py"), "--device", "cpu",
                        "--gib", "0.004", "--tensors", "8", "--rounds", "2", "--loads", "3",
                        "--tools", "ckptmgr.load_file,ckptmgr.pin_file", "--dir", os.path.join(ram_dir, "bench"),
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(x["tool"], x["round"]) for x in report["runs"]] == [
        ("ckptmgr.load_file", 0), ("ckptmgr.pin_file", 0), ("ckptmgr.pin_file", 1), ("ckptmgr.load_file", 1)]
    assert all(x["identical"] for x in report["runs"])
    pinned = report["summary"]["ckptmgr.pin_file"]
    assert pinned["identical"] and len(report["runs"][1]["later_s"]) == 2
    assert "mem_not_returned_mib_max" in pinned and pinned["pin_s"] > 0
    assert "ckptmgr.pin_file" in r.stdout and "later loads best" in r.stdout
    assert not os.path.exists(os.path.join(ram_dir, "bench"))  # its files are removed
