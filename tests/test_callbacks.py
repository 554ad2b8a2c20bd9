"""The plain-loop callback: a run SIGKILLed at random moments and resumed ends bitwise
identical to one never interrupted; SIGTERM saves the current step and stops cleanly."""

import os
import random
import signal
import subprocess
import sys

import pytest
import torch
import zygote

from ckptmgr import CheckpointManager, ConfigError, Schedule, StagingOptions, StepNotFoundError
from ckptmgr.integrations.callbacks import CheckpointCallback
from ckptmgr.save.budget import WARMUP

TRAINER = os.path.join(os.path.dirname(__file__), "callback_trainer.py")
TOTAL = 30


def start(root, out):
    # the trainer's own directory (tests/) is on its path first: conftest imports from there
    return zygote.Popen([sys.executable, TRAINER, root, out, str(TOTAL)], template="torch", stdout=subprocess.PIPE,
                        text=True)


def finish(proc):
    try:
        lines, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and lines.split()[-1] == "done", lines
    return lines


def run_to_end(root, out):
    return finish(start(root, out))


def test_killed_and_resumed_run_ends_identical(tmp_path):
    ref = start(str(tmp_path / "ref"), str(tmp_path / "ref.pt"))  # never interrupted, on its own root: beside
    root, rng = str(tmp_path / "run"), random.Random(5)
    for _ in range(3):
        proc = start(root, str(tmp_path / "run.pt"))
        assert proc.stdout.readline().startswith("resumed")
        for _ in range(rng.randint(2, 8)):  # let it train a few steps, then kill it mid-run
            proc.stdout.readline()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    lines = run_to_end(root, str(tmp_path / "run.pt"))
    assert int(lines.split()[1]) > 0  # it resumed, not restarted
    finish(ref)
    ref, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_sigterm_saves_the_current_step_and_stops(tmp_path):
    root = str(tmp_path / "run")
    proc = start(root, str(tmp_path / "run.pt"))
    assert proc.stdout.readline().strip() == "resumed 0"
    for _ in range(4):
        proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    stopped = int(out.split("stopped")[1].split()[0])
    with CheckpointManager(root) as mgr:
        assert mgr.latest_step() == stopped
    lines = run_to_end(root, str(tmp_path / "run.pt"))
    assert lines.split()[:2] == ["resumed", str(stopped + 1)]


def test_bad_arguments(root):
    with CheckpointManager(root) as mgr:
        with pytest.raises(ConfigError, match="needs every_n_steps"):
            CheckpointCallback(mgr, {})
        with pytest.raises(ConfigError, match="every_n_steps"):
            CheckpointCallback(mgr, {}, every_n_steps=0)
        with pytest.raises(ConfigError, match="every_n_seconds"):
            CheckpointCallback(mgr, {}, every_n_seconds=-1)
    with pytest.raises(ConfigError, match="manager must be"):
        CheckpointCallback("root", {}, every_n_steps=1)


def test_a_manager_with_a_budget_schedule_drives_the_callback(root, tmp_path):
    local = tmp_path / "shm"
    local.mkdir()
    state = {"w": torch.zeros(3)}
    mgr = CheckpointManager(root, schedule=Schedule(max_overhead=0.5), staging=StagingOptions(local_dir=str(local)))
    with CheckpointCallback(mgr, state) as ckpt:  # no every_n_*: the manager's budget decides
        assert ckpt.by_budget
        for step in range(12):
            state["w"] += 1
            ckpt.before_optimizer_step(step)
            assert not ckpt.after_step(step)
        ckpt.manager.wait()
        saved = ckpt.manager.steps()
        stats = ckpt.manager.stats()
    assert saved and min(saved) >= WARMUP  # the step time measured first, then saves
    assert stats["saves"] >= len(saved) and "budget_step_s" in stats
    with CheckpointManager(root) as plain, pytest.raises(ConfigError, match="budget"):
        CheckpointCallback(plain, state)


def test_every_n_seconds_and_resume_on_a_fresh_root(root):
    state = {"w": torch.zeros(3)}
    with CheckpointCallback(CheckpointManager(root), state, every_n_seconds=1e-9, block=True) as ckpt:
        assert ckpt.resume() == 0 and ckpt.resumed_step is None
        for step in range(3):
            state["w"] += 1
            ckpt.before_optimizer_step(step)
            assert not ckpt.after_step(step)
        ckpt.manager.wait()
        assert ckpt.manager.steps() == [0, 1, 2]
    state["w"].zero_()
    with CheckpointCallback(CheckpointManager(root), state, every_n_steps=1) as ckpt:
        assert ckpt.resume() == 3 and ckpt.resumed_step == 2 and torch.equal(state["w"], torch.full((3,), 3.0))


def _corrupt_newest(root: str, step: int) -> None:
    path = os.path.join(root, f"step_{step:012d}", "data-00000.safetensors")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1)
        last = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([last[0] ^ 0xFF]))


def test_resume_skips_a_corrupt_newest_step_like_restore(root):
    state = {"w": torch.zeros(3)}
    with CheckpointCallback(CheckpointManager(root, staging=StagingOptions(local_tier=False)), state,
                            every_n_steps=1, block=True) as ckpt:
        for step in range(3):
            state["w"] += 1
            ckpt.before_optimizer_step(step)
            ckpt.after_step(step)
    _corrupt_newest(root, 2)
    state["w"].zero_()
    with CheckpointCallback(CheckpointManager(root), state, every_n_steps=1) as ckpt:
        with pytest.warns(RuntimeWarning, match="skipping step 2"):
            assert ckpt.resume() == 2  # step 1 restored: continue at 2
        assert ckpt.resumed_step == 1 and torch.equal(state["w"], torch.full((3,), 2.0))
    _corrupt_newest(root, 1)
    _corrupt_newest(root, 0)
    with CheckpointCallback(CheckpointManager(root), state, every_n_steps=1) as ckpt, pytest.warns(RuntimeWarning), \
            pytest.raises(StepNotFoundError, match=r"no checkpoint .* verifies"):
        ckpt.resume()


def test_close_closes_the_manager_so_the_next_one_gets_the_local_tier(root, caplog):
    ckpt = CheckpointCallback(CheckpointManager(root), {"w": torch.ones(2)}, every_n_steps=1)
    ckpt.after_step(0)
    ckpt.close()
    with pytest.raises(ConfigError, match="closed"):
        ckpt.manager.steps()
    with caplog.at_level("WARNING", logger="ckptmgr"), CheckpointManager(root) as mgr:
        assert mgr.steps() == [0]
    assert "in use by another process" not in caplog.text


def test_the_fallback_warning_is_printed_once(tmp_path):
    root = str(tmp_path / "run")
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((4,), float(step))}).result()
    _corrupt_newest(root, 2)
    code = f"from ckptmgr import CheckpointManager; print(CheckpointManager({root!r}).restore()['w'][0].item())"
    out = zygote.run([sys.executable, "-c", code], template="torch", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "1.0", out.stderr
    assert out.stderr.count("skipping step 2") == 1, out.stderr
