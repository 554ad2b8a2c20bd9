"""``.ci/run`` leaves nothing behind: its virtual environment (about 1.4 GB) is removed when
the run ends, however it ends, unless CKPTMGR_CI_VENV names a cache to keep."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time

import pytest

CI_RUN = os.path.join(os.path.dirname(__file__), "..", ".ci", "run")
pytestmark = pytest.mark.skipif(not os.path.isfile(CI_RUN), reason="needs the source tree's .ci/run")

# Stands in for python3: makes the environment's directory with a file in it, as `venv`
# would, then fails (or hangs, to be interrupted) the way a broken install does.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    mkdir -p "$3/bin" && head -c 1048576 /dev/zero > "$3/bin/payload"
    echo "$3" > "{marker}"
    [ -n "${{HANG:-}}" ] && exec sleep 60
fi
exit 1
"""


def _fake_python(tmp_path, marker):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "python3"
    fake.write_text(FAKE_PYTHON.format(marker=marker))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return str(bindir)


def _env(tmp_path, bindir, **extra):
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    inherited = {k: v for k, v in os.environ.items() if k != "CKPTMGR_CI_VENV"}  # (this suite may run under a cache)
    return {**inherited, "PATH": f"{bindir}:{os.environ['PATH']}", "TMPDIR": str(tmp), **extra}


def test_a_failed_run_removes_its_environment(tmp_path):
    marker = tmp_path / "venv-path"
    env = _env(tmp_path, _fake_python(tmp_path, marker))
    r = subprocess.run(["bash", CI_RUN], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    venv = marker.read_text().strip()
    assert venv.startswith(str(tmp_path / "tmp"))  # it was made, in the temporary directory
    assert os.listdir(tmp_path / "tmp") == []  # and it is gone


def test_an_interrupted_run_removes_its_environment(tmp_path):
    marker = tmp_path / "venv-path"
    env = _env(tmp_path, _fake_python(tmp_path, marker), HANG="1")
    proc = subprocess.Popen(["bash", CI_RUN], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:  # bounded poll for the environment
        time.sleep(0.05)
    assert marker.exists()
    os.killpg(proc.pid, signal.SIGTERM)  # as a CI runner cancelling a job (Ctrl-C signals the group too)
    assert proc.wait(timeout=30) != 0
    assert os.listdir(tmp_path / "tmp") == []


def test_a_named_cache_is_kept(tmp_path):
    marker = tmp_path / "venv-path"
    cache = tmp_path / "cache"
    env = _env(tmp_path, _fake_python(tmp_path, marker), CKPTMGR_CI_VENV=str(cache))
    assert subprocess.run(["bash", CI_RUN], env=env, capture_output=True, timeout=60).returncode != 0
    assert (cache / "bin" / "payload").exists()


@pytest.mark.slow
def test_a_real_run_passes_and_leaves_nothing(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    r = subprocess.run(["bash", CI_RUN, "tests/test_errors.py"], env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "torch 2.13.0+cpu" in r.stdout
    assert [p for p in os.listdir(tmp_path) if p.startswith("ckptmgr-ci.")] == []
