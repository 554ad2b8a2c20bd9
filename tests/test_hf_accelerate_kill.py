"""accelerate with ckptmgr: real processes SIGKILLed at the file-system operations of a
save (held there by tests/kill_points.py; the child is tests/hf_accelerate_run.py).

* Defect: ``save_state`` into an existing directory deleted it before renaming the new one
  in; killed in between, ``load_state`` of that directory failed. Now the old or the new
  state is always loadable (the exchange; without it, after start-up recovery).
* Defect: with automatic naming, the temporary ``.ckptmgr-<pid>-....partial`` lay in
  ``checkpoints/``; after a crash, stock ``Accelerator.load_state()`` (which takes the entry
  with the highest first number in its name: the pid) restored the uncommitted temporary.
  Now ``checkpoints/`` holds committed ``checkpoint_<n>`` only, and the stock call loads the
  newest committed one.

The default run kills in the window once per case; ``slow`` variants at every operation,
rounds set by KILL_ROUNDS (default 3).
"""

from __future__ import annotations

import os
import re
import sys

import kill_points
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning")
pytest.importorskip("accelerate")
from hf_accelerate_run import build  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from ckptmgr.integrations.accelerate import AsyncStateSaver  # noqa: E402

RUN = os.path.join(os.path.dirname(__file__), "hf_accelerate_run.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
RUN_KW = {"env": ENV, "template": "lightning"}  # the runs forked from a pre-imported template (zygote.py)
ROUNDS = int(os.environ.get("KILL_ROUNDS", "3"))


def _commit_start(events):
    for i, (name, paths, mode) in enumerate(events):
        if name == "open" and paths[0].endswith("/ckptmgr.json") and mode == "x":
            return i
    return None


def _which(tmp_path, model):
    got = {k: v.detach() for k, v in model.state_dict().items()}
    for version in ("old", "new"):
        ref = load_file(str(tmp_path / f"{version}.safetensors"))
        if ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref):
            return version
    raise AssertionError("the loaded weights are neither the old nor the new save's")


def _trial(tmp_path, mode, offset, exchange=True):
    """Run the child, SIGKILLed at operation ``offset`` of the second save's commit (from the
    record's creation); return (events, the version loaded afterwards or None if not killed)."""
    project = tmp_path / "p"

    def kill(i, events):
        start = _commit_start(events)
        return start is not None and i == start + offset

    extra = [] if exchange else ["--no-exchange"]
    res = kill_points.run([sys.executable, RUN, str(project), mode, *extra], str(project), **RUN_KW, kill=kill)
    if res.killed_at is None:
        assert res.returncode == 0, res.stderr
        return res.events, None
    if mode == "auto":
        entries = sorted(os.listdir(project / "checkpoints"))
        assert all(re.fullmatch(r"checkpoint_\d+", e) for e in entries), entries
        acc, model, _ = build(str(project), True)
        acc.load_state()  # stock discovery: the newest checkpoint_<n>
        version = _which(tmp_path, model)
        assert version == ("new" if "checkpoint_1" in entries else "old")
        return res.events, version
    state = str(project / "state")
    if exchange:  # stock load_state of the directory, before any recovery
        acc, model, _ = build(str(project), False)
        acc.load_state(state)
        assert _which(tmp_path, model) in ("old", "new")
    acc, model, _ = build(str(project), False)
    with AsyncStateSaver(acc) as saver:
        saver.load_state(state)  # restores an interrupted replacement first
    return res.events, _which(tmp_path, model)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "fallback"])
def test_save_state_into_the_same_directory_killed_in_the_window(tmp_path, exchange):
    events, version = _trial(tmp_path, "fixed", 3, exchange)
    assert version is not None, f"never reached the commit's window: {events}"


def test_stock_load_state_after_a_crash_takes_no_temporary(tmp_path):
    events, version = _trial(tmp_path, "auto", 1)  # the temporary complete, not yet renamed
    assert version == "old", events


@pytest.mark.slow
@pytest.mark.timeout(7200)  # many child processes
@pytest.mark.parametrize(("mode", "exchange"), [("fixed", True), ("fixed", False), ("auto", True)],
                         ids=["fixed-exchange", "fixed-fallback", "auto"])
def test_accelerate_killed_at_every_operation_many_rounds(tmp_path, mode, exchange):
    events, _ = _trial(tmp_path / "calibrate", mode, -10**6, exchange)
    start = _commit_start(events)
    assert start is not None, events
    seen = {"old": 0, "new": 0}
    for rnd in range(ROUNDS):
        for offset in range(len(events) - start):
            _, version = _trial(tmp_path / f"r{rnd}-{offset}", mode, offset, exchange)
            assert version is not None
            seen[version] += 1
    print(f"accelerate {mode} exchange={exchange}: {len(events) - start} operations x {ROUNDS} rounds: {seen}")
    assert seen["old"] and seen["new"]
