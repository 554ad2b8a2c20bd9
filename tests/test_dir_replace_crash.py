"""Replacing an existing checkpoint directory (the same step saved again), SIGKILLed at each
file-system operation of the replace: the old or the new complete checkpoint is under the
final name, with the exchange (the default on Linux) at every instant, and with the
fallback (rename away, rename in) once start-up recovery has run; nothing else is left.

The child (tests/dir_replace_run.py) is held at each operation by tests/kill_points.py
(Python audit events, reported over a pipe before the operation runs). The default run kills
in the window (offsets 2 and 3 from the record's creation) in each mode; the slow variant at
every operation of the commit, KILL_ROUNDS rounds (3 by default).
"""

from __future__ import annotations

import os
import re
import sys

import kill_points
import pytest

from ckptmgr.format.dirrecord import read_record
from ckptmgr.integrations._session import DirectoryWriter, latest_checkpoint
from ckptmgr.restore.dircheck import verify_dir

RUN = os.path.join(os.path.dirname(__file__), "dir_replace_run.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
STEP_RE = re.compile(r"step-(\d+)")
ROUNDS = int(os.environ.get("KILL_ROUNDS", "3"))  # slow variant: rounds over every operation


def _version(path):
    with open(os.path.join(path, "version.txt")) as f:
        version = f.read()
    assert read_record(path)["metadata"]["version"] == version
    return version


def _commit_start(events):
    """The index of the commit record's creation: the commit's first operation."""
    for i, (name, paths, mode) in enumerate(events):
        if name == "open" and paths[0].endswith("/ckptmgr.json") and mode == "x":
            return i
    return None


def _trial(tmp_path, mode, offset):
    """Kill the second save at the ``offset``-th operation of its commit (counted from the
    record's creation); check what is left."""
    parent = str(tmp_path / "ckpts")
    final = os.path.join(parent, "step-5")

    def kill(i, events):
        start = _commit_start(events)
        return start is not None and i == start + offset

    out = kill_points.run([sys.executable, RUN, parent, mode], parent, env=ENV, kill=kill, template="torch")
    if out.killed_at is None:
        assert out.returncode == 0, out.stderr
        return out.events, None
    if mode == "exchange":  # stock readers, before any recovery: the name is never empty
        assert os.path.isdir(final), (out.events, os.listdir(parent))
        assert verify_dir(final) is True
        assert _version(final) in ("old", "new")
    assert latest_checkpoint(parent, STEP_RE) == final, (out.events, os.listdir(parent))  # recovers first
    assert verify_dir(final) is True
    version = _version(final)
    assert version in ("old", "new")
    writer = DirectoryWriter()  # the next start sweeps what the dead writer left
    try:
        fs = writer.begin(parent)
        assert sorted(os.listdir(parent)) == sorted(["step-5", os.path.basename(fs.directory)])
    finally:
        writer.close(30)
    return out.events, version


# the record, the temporary's fsync, then: the exchange's fsync of the parent (exchange) or
# the rename of the old copy away (fallback) and the fsync between the two renames
@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_replace_killed_in_its_window(tmp_path, mode):
    for offset in (2, 3):
        events, version = _trial(tmp_path / str(offset), mode, offset)
        assert version is not None, f"never reached operation {offset} of the commit: {events}"


@pytest.mark.slow
@pytest.mark.timeout(7200)  # many child processes
@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_replace_killed_at_every_operation_many_rounds(tmp_path, mode):
    events, _ = _trial(tmp_path / "calibrate", mode, -10**6)  # never killed: the list of operations
    start = _commit_start(events)
    assert start is not None, events
    seen = {"old": 0, "new": 0}
    for rnd in range(ROUNDS):
        for offset in range(len(events) - start):
            _, version = _trial(tmp_path / f"r{rnd}-{offset}", mode, offset)
            assert version is not None
            seen[version] += 1
    print(f"{mode}: {len(events) - start} operations x {ROUNDS} rounds: {seen}")
    assert seen["old"] and seen["new"]
