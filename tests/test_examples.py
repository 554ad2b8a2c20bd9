"""The README's first command runs this demo: it must keep working."""

import os
import subprocess
import sys

DEMO = os.path.join(os.path.dirname(__file__), "..", "examples", "demo.py")


def test_demo_resumes_identical():
    out = subprocess.run([sys.executable, DEMO], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed from step" in out.stdout
    assert "IDENTICAL" in out.stdout
