"""benchmarks/run.py end to end on the CPU (small sizes), and the report of the committed GPU run."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")

pytest.importorskip("matplotlib")


@pytest.mark.slow  # (a minute of CPU: the report's harness end to end)
def test_run_measures_peers_and_draws_the_chart(tmp_path):
    out = tmp_path / "report"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "--device", "cpu", "--quick",
                        "--parts", "staging,restore", "--out", str(out), "--scratch", str(tmp_path / "scratch"),
                        "--commit", "test"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    m = summary["metrics"]
    for metric in ("stall_s", "durable_s"):
        for tool in ("ckptmgr block", "torch.save", "safetensors.save_file"):
            assert {f"{tool} (first)", f"{tool} (later)"} <= set(m[metric]), (metric, tool)
        assert all(v > 0 for v in m[metric].values())
    for src in ("shm", "disk"):
        assert {f"ckptmgr restore(device) [{src}]", f"torch.load [{src}]"} <= set(m["restore_s"])
    assert m["extra_gpu_gib"] == {}  # no GPU: not a panel of zeros
    assert summary["machine"]["commit"] == "test"
    assert (out / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| stall per save (s) | value |" in r.stdout


@pytest.mark.parametrize("report", sorted(str(p.parent.relative_to(pathlib.Path(BENCH, "results")))
                                           for p in pathlib.Path(BENCH, "results").glob("**/summary.json")
                                           if "h200" in str(p)))
def test_committed_gpu_report_matches_its_data(tmp_path, report):
    src = pathlib.Path(BENCH, "results", report)
    for f in src.glob("*.json"):
        if f.name != "summary.json":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    r = subprocess.run([sys.executable, os.path.join(BENCH, "report.py"), str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    fresh = json.loads((tmp_path / "summary.json").read_text())
    committed = json.loads((src / "summary.json").read_text())
    assert fresh == committed  # the committed summary (and chart) come from the committed data
    assert fresh["machine"]["device"] == "NVIDIA H200"
