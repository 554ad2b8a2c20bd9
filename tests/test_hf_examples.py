"""The integration examples run, stop and resume as their docstrings say."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def example(name, *args, env=None, check=True):
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True, text=True,
                         timeout=240, env=env or ENV)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return out


def _steps(path):
    """{step: sample ids} of a run's log (a later line for a step wins: the resumed run's)."""
    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec["ids"]
    return out


def test_dataloader_resumes_at_the_next_sample(tmp_path):
    pytest.importorskip("torchdata")
    example("dataloader_resume.py", str(tmp_path / "full"), "--log", str(tmp_path / "full.log"))
    killed = example("dataloader_resume.py", str(tmp_path / "run"), "--kill-at", "17", "--log",
                     str(tmp_path / "run.log"), check=False)
    assert killed.returncode == -9  # SIGKILL
    out = example("dataloader_resume.py", str(tmp_path / "run"), "--log", str(tmp_path / "run.log")).stdout
    assert "starting at step 16" in out  # the checkpoint after step 15
    assert _steps(tmp_path / "run.log.0") == _steps(tmp_path / "full.log.0")


def test_dataloader_resumes_per_rank(tmp_path):
    pytest.importorskip("torchdata")

    def ranks(*args):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs = [subprocess.Popen([sys.executable, os.path.join(EXAMPLES, "dataloader_resume.py"), *args],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate(timeout=240) for p in procs]
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]

    ranks(str(tmp_path / "full"), "--steps", "16", "--log", str(tmp_path / "full.log"))
    ranks(str(tmp_path / "run"), "--steps", "16", "--kill-at", "12", "--log", str(tmp_path / "run.log"))
    results = ranks(str(tmp_path / "run"), "--steps", "16", "--log", str(tmp_path / "run.log"))
    assert all("starting at step 11" in out for _, out, _ in results), results
    full = [_steps(tmp_path / f"full.log.{r}") for r in range(2)]
    assert full[0][0] != full[1][0]  # each rank reads its own samples
    for r in range(2):
        assert _steps(tmp_path / f"run.log.{r}") == full[r]


def test_hf_trainer_example_resumes(tmp_path):
    pytest.importorskip("transformers")
    d = str(tmp_path / "run")
    assert "global step 20" in example("hf_trainer_resume.py", d, "--steps", "20").stdout
    out = example("hf_trainer_resume.py", d, "--steps", "30").stdout
    assert "checkpoint-20" in out.splitlines()[0] and "global step 30" in out
    assert "['checkpoint-10', 'checkpoint-20', 'checkpoint-30']" in out


def test_accelerate_example_resumes(tmp_path):
    pytest.importorskip("accelerate")
    d = str(tmp_path / "run")
    assert "starting fresh" in example("accelerate_resume.py", d, "--steps", "40").stdout
    out = example("accelerate_resume.py", d, "--steps", "80").stdout
    assert "checkpoint_1" in out.splitlines()[0] and "step 80" in out
    assert sorted(os.listdir(os.path.join(d, "checkpoints"))) == ["checkpoint_2", "checkpoint_3"]


def test_torchtitan_example_resumes(tmp_path):
    pytest.importorskip("torchtitan")
    d = str(tmp_path / "run")
    assert "step 12" in example("torchtitan_checkpointing.py", d, "--stop-after", "12").stdout
    out = example("torchtitan_checkpointing.py", d).stdout
    assert "starting at step 11" in out and "step 20" in out
