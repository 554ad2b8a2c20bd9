"""The integration examples run, stop and resume as their docstrings say."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest
import zygote

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def start_example(name, *args, env=None):
    """The example running, its output to files (runs side by side: none blocks on a full pipe)."""
    files = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # noqa: SIM115  (closed in finish_example)
    proc = zygote.Popen([sys.executable, os.path.join(EXAMPLES, name), *args], template="lightning", stdout=files[0],
                        stderr=files[1], text=True, env=env or ENV)
    return proc, files


def finish_example(started, check=True):
    proc, files = started
    try:
        proc.wait(timeout=240)
        stdout, stderr = ((f.seek(0), f.read())[1] for f in files)
    finally:
        proc.kill()
        proc.wait()
        for f in files:
            f.close()
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return out


def example(name, *args, env=None, check=True):
    return finish_example(start_example(name, *args, env=env), check=check)


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
    # the uninterrupted run and the one that is killed have their own directories: side by side
    full = start_example("dataloader_resume.py", str(tmp_path / "full"), "--log", str(tmp_path / "full.log"))
    killed = example("dataloader_resume.py", str(tmp_path / "run"), "--kill-at", "17", "--log",
                     str(tmp_path / "run.log"), check=False)
    finish_example(full)
    assert killed.returncode == -9  # SIGKILL
    out = example("dataloader_resume.py", str(tmp_path / "run"), "--log", str(tmp_path / "run.log")).stdout
    assert "starting at step 16" in out  # the checkpoint after step 15
    assert _steps(tmp_path / "run.log.0") == _steps(tmp_path / "full.log.0")


def test_dataloader_resumes_per_rank(tmp_path):
    pytest.importorskip("torchdata")

    used: set[int] = set()

    def start_ranks(*args):
        port = 0
        while port == 0 or port in used:  # two pairs may run at once: never the same rendezvous port
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        used.add(port)
        env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        return [zygote.Popen([sys.executable, os.path.join(EXAMPLES, "dataloader_resume.py"), *args],
                             template="lightning",
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for r in range(2)]

    def finish_ranks(procs):
        try:
            outs = [p.communicate(timeout=240) for p in procs]
        finally:
            for p in procs:
                p.kill()
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]

    # the uninterrupted pair and the pair that is killed have their own directories: side by side
    full_ranks = start_ranks(str(tmp_path / "full"), "--steps", "16", "--log", str(tmp_path / "full.log"))
    finish_ranks(start_ranks(str(tmp_path / "run"), "--steps", "16", "--kill-at", "12", "--log",
                             str(tmp_path / "run.log")))
    finish_ranks(full_ranks)
    results = finish_ranks(start_ranks(str(tmp_path / "run"), "--steps", "16", "--log", str(tmp_path / "run.log")))
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
