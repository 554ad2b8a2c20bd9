"""The extras install one after another in any order, and all together in one command, into a
fresh virtual environment, without a conflict (pip's resolver and ``pip check``).

Slow (several minutes: each environment downloads and installs torch, transformers, datasets,
s3fs, ...) and needs the package index: run by hand, ``pytest -m slow tests/test_extras_install.py``.
Only PyTorch is pinned (to the CI lock's CPU build); everything else is what pip picks today.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CONFLICT = "dependency conflicts"  # pip: "... This behaviour is the source of the following dependency conflicts."


def torch_pin(tmp_path) -> str:
    with open(os.path.join(ROOT, ".ci", "constraints.txt"), encoding="utf-8") as f:
        pins = [ln.strip() for ln in f if ln.startswith("torch==")]
    assert pins, "the CI lock pins torch"
    path = tmp_path / "torch.txt"
    path.write_text("\n".join(pins) + "\n")
    return str(path)


def venv_pip(tmp_path) -> list[str]:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", "-U", "pip>=26"], check=True, timeout=600)
    return pip


def install(pip: list[str], spec: str, pin: str) -> None:
    r = subprocess.run([*pip, "install", "-q", spec, "-c", pin], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0 and CONFLICT not in r.stderr, f"pip install {spec}:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("order", [("torchtitan", "s3"), ("s3", "torchtitan"), ("s3,torchtitan,transformers",)])
def test_extras_install_in_any_order(tmp_path, order):
    pip, pin = venv_pip(tmp_path), torch_pin(tmp_path)
    for extras in order:
        install(pip, f"{ROOT}[{extras}]", pin)
    check = subprocess.run([*pip, "check"], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
