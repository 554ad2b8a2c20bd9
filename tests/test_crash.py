"""A writer SIGKILLed at random moments never leaves restore() unable to return the newest
complete step, byte for byte, and the next start removes its leftovers."""

import collections
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import zygote
from conftest import assert_tree_equal
from crash_writer import crash_state

from ckptmgr import CheckpointManager
from ckptmgr.format.naming import step_name

WRITER = os.path.join(os.path.dirname(__file__), "crash_writer.py")


AHEAD = 2  # writers started (importing, the root untouched) before their trial: overlaps imports with trials


def _start_writer(root: str) -> subprocess.Popen[str]:
    return zygote.Popen([sys.executable, WRITER, root, "-"], template="torch", stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)


def _run_trials(root: str, trials: int, seed: int) -> None:
    rng = random.Random(seed)
    next_step = 0
    ahead = collections.deque(_start_writer(root) for _ in range(min(AHEAD, trials)))
    try:
        for trial in range(trials):
            proc = ahead.popleft()
            if trial + len(ahead) + 1 < trials:
                ahead.append(_start_writer(root))
            next_step = _trial(root, trial, proc, next_step, rng)
    finally:
        for proc in ahead:
            proc.kill()
            proc.communicate(timeout=30)


def _trial(root: str, trial: int, proc: subprocess.Popen[str], next_step: int, rng: random.Random) -> int:
    """One writer, told its first step, SIGKILLed at a random moment; the restart checked.
    Returns the step the next writer starts at."""
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "loaded"
        proc.stdin.write(f"{next_step}\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.4))
    finally:
        proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=30)
    reported = [int(x) for x in out.split()]
    with CheckpointManager(root) as mgr:  # the restart
        # a step that reached only the local tier is being written out now; let it land
        mgr.wait(timeout=60)
        leftovers = [n for n in os.listdir(root) if n.startswith(".step_")]
        assert leftovers == [], f"trial {trial}: leftovers not cleaned: {leftovers}"
        steps = mgr.steps()
        latest = mgr.latest_step()
        if reported:
            # everything reported is committed; at most one more committed before its print
            assert latest is not None and reported[-1] <= latest <= reported[-1] + 1, (trial, reported, steps)
        if latest is None:
            return next_step
        assert_tree_equal(mgr.restore(), crash_state(latest))
        assert steps == list(range(steps[0], latest + 1))
        # and the newest step is on the durable root now, whichever tier it survived in
        assert os.path.isfile(os.path.join(root, step_name(latest), "manifest.json")), (trial, latest)
    return latest + 1


def test_sigkill_during_saves(tmp_path):
    _run_trials(str(tmp_path / "ckpt"), trials=20, seed=1)


@pytest.mark.slow
def test_sigkill_during_saves_many(tmp_path):
    _run_trials(str(tmp_path / "ckpt"), trials=150, seed=2)
