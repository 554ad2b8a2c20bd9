"""benchmarks/bench_hf_trainer.py runs end to end (a tiny model on the CPU) and writes its JSON:
the GPU run it is written for must not fail on a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_hf_trainer.py")


@pytest.mark.slow  # (the benchmark harness end to end, tiny)
def test_smoke(tmp_path):
    out = subprocess.run([sys.executable, BENCH, "--tiny", "--cpu", "--steps", "4", "--save-steps", "2", "--seq", "16",
                          "--batch", "2", "--out", str(tmp_path), "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_hf_trainer.json").read_text())
    assert {r["mode"] for r in doc["runs"]} == {"none", "stock", "ckptmgr"}
    for r in doc["runs"]:
        assert len(r["step_s"]) == 4
        assert r["saves"] == (0 if r["mode"] == "none" else 2)
        assert (r["checkpoint_bytes"] > 0) == (r["mode"] != "none")
    assert set(doc["summary"]) == {"none", "stock", "ckptmgr"}
