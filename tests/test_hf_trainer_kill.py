"""A real Hugging Face Trainer (tests/hf_trainer_run.py, a subprocess) SIGKILLed at the
file-system operations of its checkpoint directories, held there by tests/kill_points.py.

* Defect: a Trainer resumed from an earlier checkpoint saves the same step again; the old
  ``checkpoint-4`` was deleted before the new one was renamed in, and a kill in between left
  neither (resume then went back to ``checkpoint-2``). Now the two are exchanged (or, without
  the exchange, the old one is restored at start-up): killed in the window, the newest
  checkpoint is there, verifies, and training resumes from it.
* Defect: with ``save_total_limit=1`` and ``load_best_model_at_end``, the stock end of
  training deleted every checkpoint but the best with ``shutil.rmtree`` under its final
  name: the newest was lost, and a kill mid-delete left it torn where ``get_last_checkpoint``
  finds it. Now the newest and the best stay, and every deletion renames away first.

The default run kills a few times; the ``slow`` variants kill at every operation, rounds
set by KILL_ROUNDS (default 3).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import kill_points
import pytest

pytest.importorskip("transformers")
from transformers.trainer_utils import get_last_checkpoint as stock_last_checkpoint

from ckptmgr.format.dirrecord import read_record
from ckptmgr.integrations.transformers import get_last_checkpoint
from ckptmgr.restore.dircheck import verify_dir

RUN = os.path.join(os.path.dirname(__file__), "hf_trainer_run.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}
RUN_KW = {"env": ENV, "template": "lightning"}  # the runs forked from a pre-imported template (zygote.py)
ROUNDS = int(os.environ.get("KILL_ROUNDS", "3"))
FINAL_RE = re.compile(r"checkpoint-\d+")
DELETES = ("os.rename", "os.remove", "os.rmdir", "shutil.rmtree")


def _cmd(out, result, *extra):
    return [sys.executable, RUN, str(out), str(result), "--trainer", "ckptmgr", *extra]


def _losses(result):
    with open(result) as f:
        return sorted(int(k) for k in json.load(f)["losses"])


@pytest.fixture(scope="module")
def saved_twice(tmp_path_factory):
    """checkpoint-2 and checkpoint-4 of a 4-step run, committed by CkptmgrTrainer."""
    d = tmp_path_factory.mktemp("base")
    out = kill_points.run(_cmd(d / "out", d / "r.json", "--max-steps", "4", "--save-steps", "2"), str(d / "out"),
                          **RUN_KW, kill=lambda *_: False)
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(d / "out")) == ["checkpoint-2", "checkpoint-4"]
    return d / "out"


def _commit_start(events):
    for i, (name, paths, mode) in enumerate(events):
        if name == "open" and paths[0].endswith("/ckptmgr.json") and mode == "x":
            return i
    return None


def _resave_killed(saved, tmp_path, mode, offset):
    """Resume from checkpoint-2 and save checkpoint-4 again, SIGKILLed at operation ``offset``
    of its commit (counted from the record's creation). Returns the run's events."""
    out = tmp_path / "out"
    shutil.copytree(saved, out)
    old_time = read_record(str(out / "checkpoint-4"))["time"]

    def kill(i, events):
        start = _commit_start(events)
        return start is not None and i == start + offset

    extra = ["--no-exchange"] if mode == "fallback" else []
    res = kill_points.run(_cmd(out, tmp_path / "k.json", "--resume-from", str(out / "checkpoint-2"), "--max-steps",
                               "4", "--save-steps", "2", *extra), str(out), **RUN_KW, kill=kill)
    if res.killed_at is None:
        assert res.returncode == 0, res.stderr
        return res.events, None
    final = str(out / "checkpoint-4")
    if mode == "exchange":  # the stock Trainer's discovery, before anything ran: never empty
        assert stock_last_checkpoint(str(out)) == final, (res.events[-4:], os.listdir(out))
        assert verify_dir(final) is True
    assert get_last_checkpoint(str(out)) == final, (res.events[-4:], os.listdir(out))  # recovers first
    assert verify_dir(final) is True
    assert stock_last_checkpoint(str(out)) == final
    return res.events, "old" if read_record(final)["time"] == old_time else "new"


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_resaved_step_killed_in_the_window_resumes_from_it(saved_twice, tmp_path, mode):
    events, version = _resave_killed(saved_twice, tmp_path, mode, 3)
    assert version is not None, f"never reached the commit's window: {events}"
    if mode == "fallback":  # the full symptom: the resumed run starts after step 4
        out = tmp_path / "out"
        r = kill_points.run(_cmd(out, tmp_path / "resumed.json", "--resume", "--max-steps", "6", "--save-steps", "2"),
                            str(out), **RUN_KW, kill=lambda *_: False)
        assert r.returncode == 0, r.stderr
        assert _losses(tmp_path / "resumed.json") == [5, 6]


@pytest.mark.slow
@pytest.mark.timeout(7200)  # many child processes
@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_resaved_step_killed_at_every_operation_many_rounds(saved_twice, tmp_path, mode):
    events, _ = _resave_killed(saved_twice, tmp_path / "calibrate", mode, -10**6)
    start = _commit_start(events)
    assert start is not None, events
    seen = {"old": 0, "new": 0}
    for rnd in range(ROUNDS):
        for offset in range(len(events) - start):
            _, version = _resave_killed(saved_twice, tmp_path / f"r{rnd}-{offset}", mode, offset)
            assert version is not None
            seen[version] += 1
    print(f"trainer re-save, {mode}: {len(events) - start} operations x {ROUNDS} rounds: {seen}")
    assert seen["old"] and seen["new"]


BEST = ["--max-steps", "4", "--save-steps", "1", "--save-total-limit", "1", "--best", "2"]


def _deletions(events):
    """Indices of the operations that rename or remove a checkpoint under its final name."""
    return [i for i, (name, paths, _) in enumerate(events)
            if name in DELETES and FINAL_RE.fullmatch(paths[0].split("/")[0])]


def _check_complete(out):
    """Every checkpoint under its final name is complete; the newest (4) and the best (2) are there."""
    names = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    for n in names:
        assert verify_dir(str(out / n)) is True, f"{n} has no commit record: {sorted(os.listdir(out / n))}"
    last = stock_last_checkpoint(str(out))
    assert last is not None and verify_dir(last) is True
    return names


def test_save_total_limit_1_with_best_keeps_the_newest(tmp_path):
    out = tmp_path / "out"
    res = kill_points.run(_cmd(out, tmp_path / "r.json", *BEST), str(out), **RUN_KW, kill=lambda *_: False)
    assert res.returncode == 0, res.stderr
    assert _check_complete(out) == ["checkpoint-2", "checkpoint-4"]
    dels = _deletions(res.events)
    assert dels, "retention deleted nothing"
    k = dels[-1]  # killed at the run's last deletion under a final name
    out2 = tmp_path / "killed"
    res2 = kill_points.run(_cmd(out2, tmp_path / "k.json", *BEST), str(out2), **RUN_KW,
                           kill=kill_points.same_as(res.events, k))
    assert res2.killed_at is not None, f"never reached {res.events[k]}"
    assert "checkpoint-4" in _check_complete(out2)


@pytest.mark.slow
@pytest.mark.timeout(7200)  # many child processes
def test_save_total_limit_1_with_best_killed_at_every_deletion_many_rounds(tmp_path):
    out = tmp_path / "calibrate"
    res = kill_points.run(_cmd(out, tmp_path / "r.json", *BEST), str(out), **RUN_KW, kill=lambda *_: False)
    assert res.returncode == 0, res.stderr
    dels = _deletions(res.events)
    assert dels
    trials = 0
    for rnd in range(ROUNDS):
        for k in dels:
            d = tmp_path / f"r{rnd}-{k}"
            r = kill_points.run(_cmd(d, tmp_path / "k.json", *BEST), str(d), **RUN_KW,
                                kill=kill_points.same_as(res.events, k))
            assert r.killed_at is not None, f"never reached {res.events[k]}"
            _check_complete(d)
            trials += 1
    print(f"save_total_limit=1 + best: {len(dels)} deletions x {ROUNDS} rounds = {trials} kills, all complete")
