"""Saves faster than the durable target absorbs them: every save lands in the local tier at
copy speed, the durable write coalesces to the newest locally committed step, and the steps
it passes over are reported (never silently lost). The durable target is held with gates;
the local commits are observed by wrapping the tier's commit."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from conftest import assert_tree_equal
from crash_writer import crash_state

from ckptmgr import CheckpointManager, ConfigError, Schedule, StagingOptions
from ckptmgr.storage.local import LocalTarget
from ckptmgr.storage.tier import LocalTier

WRITER = os.path.join(os.path.dirname(__file__), "coalesce_writer.py")


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 1024, generator=g), "b": torch.randn(1000, generator=g), "step": step}


class Gates:
    """Holds the durable write of chosen steps at ``begin`` and says when each local commit is done."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, held: set[int]) -> None:
        self.started = {s: threading.Event() for s in held}
        self.release = threading.Event()
        self.local: dict[int, threading.Event] = {}
        self.begun: list[int] = []
        self._mu = threading.Lock()
        real_begin, real_commit = LocalTarget.begin, LocalTier.commit
        gates = self

        def begin(self, step, prefix=""):
            gates.begun.append(step)
            if step in gates.started:
                gates.started[step].set()
                assert gates.release.wait(timeout=60)
            return real_begin(self, step, prefix)

        def commit(self, index, step, manifest):
            real_commit(self, index, step, manifest)
            gates.committed(step).set()

        monkeypatch.setattr(LocalTarget, "begin", begin)
        monkeypatch.setattr(LocalTier, "commit", commit)

    def committed(self, step: int) -> threading.Event:
        with self._mu:
            return self.local.setdefault(step, threading.Event())


def durable_steps(root: str) -> list[int]:
    target = LocalTarget(root)
    try:
        return target.list_steps()
    finally:
        target.close()


@pytest.fixture
def local_dir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


def test_saves_faster_than_the_disk_never_wait_and_the_durable_tier_ends_with_the_newest(
        root, local_dir, monkeypatch, caplog):
    gates = Gates(monkeypatch, held={1})
    caplog.set_level(logging.INFO, logger="ckptmgr")
    # on_busy="skip": a save that found no free slot would be skipped, so "nothing skipped"
    # means no save waited for a slot
    staging = StagingOptions(slots=3, on_busy="skip", local_dir=local_dir)
    with CheckpointManager(root, staging=staging) as mgr:
        handles = [mgr.save(1, _state(1), block=False)]
        assert gates.started[1].wait(timeout=60)  # step 1's durable write is held from here on
        for step in range(2, 8):
            h = mgr.save(step, _state(step), block=False)
            assert not h.skipped, f"step {step} found no free slot"
            h.wait_staged(timeout=60)
            assert gates.committed(step).wait(timeout=60)  # in the local tier, at copy speed
            handles.append(h)
            assert mgr.latest_step() == step
        superseded_early = [h.step for h in handles if h.done()]
        assert superseded_early == [2, 3, 4, 5]  # each one's slot was reused by step + 2
        gates.release.set()
        mgr.wait(timeout=60)
        infos = {h.step: h.result(timeout=0) for h in handles}
        assert durable_steps(root) == [1, 7]
        assert gates.begun == [1, 7]  # the writer went straight from 1 to the newest
        assert infos[1].durable and infos[7].durable and infos[7].superseded_by is None
        for step in range(2, 7):
            assert not infos[step].durable and infos[step].attempts == 0
            assert infos[step].superseded_by == step + 1  # the newest committed step when it was passed over
        assert mgr.stats()["durable_superseded"] == 5 and mgr.stats()["skips"] == 0
        skipped_logs = [r for r in caplog.records if "supersedes it there" in r.getMessage()]
        assert sorted(int(r.args[0]) for r in skipped_logs) == [2, 3, 4, 5, 6]  # one INFO line per step
        assert all(r.levelno == logging.INFO for r in skipped_logs)
        assert mgr.steps()[-1] == 7
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as fresh:
        assert_tree_equal(fresh.restore(), _state(7))


def test_the_slot_of_the_newest_step_and_the_slot_being_written_are_never_reused(root, local_dir, monkeypatch):
    gates = Gates(monkeypatch, held={1})
    with CheckpointManager(root, staging=StagingOptions(slots=2, on_busy="skip", local_dir=local_dir)) as mgr:
        h1 = mgr.save(1, _state(1), block=False)
        assert gates.started[1].wait(timeout=60)
        h2 = mgr.save(2, _state(2))
        assert gates.committed(2).wait(timeout=60)
        h3 = mgr.save(3, _state(3))  # one slot is being written (1), the other holds the newest (2)
        assert h3.skipped
        assert not h1.done() and not h2.done()  # neither was superseded
        gates.release.set()
        assert h1.result(timeout=60).durable and h2.result(timeout=60).durable
        assert durable_steps(root) == [1, 2]
        assert_tree_equal(mgr.restore(2), _state(2))


def test_a_superseded_step_stays_restorable_from_the_local_tier_until_its_slot_is_reused(
        root, local_dir, monkeypatch):
    gates = Gates(monkeypatch, held={1})
    with CheckpointManager(root, staging=StagingOptions(slots=4, local_dir=local_dir)) as mgr:
        mgr.save(1, _state(1), block=False)
        assert gates.started[1].wait(timeout=60)
        for step in (2, 3):
            mgr.save(step, _state(step))
            assert gates.committed(step).wait(timeout=60)
        gates.release.set()
        mgr.wait(timeout=60)
        assert durable_steps(root) == [1, 3]
        assert 2 in mgr.steps()  # superseded for the durable tier, still committed in RAM
        assert_tree_equal(mgr.restore(2), _state(2))


def test_the_schedule_keeps_steps_local_and_writes_every_nth_durably(root, local_dir):
    schedule = Schedule(local_every=2, durable_every=6)
    with CheckpointManager(root, staging=StagingOptions(slots=2, local_dir=local_dir), schedule=schedule) as mgr:
        saved = [s for s in range(1, 13) if mgr.should_save(s)]
        assert saved == [2, 4, 6, 8, 10, 12]
        infos = {s: mgr.save(s, _state(s)).result(timeout=60) for s in saved}
        mgr.wait(timeout=60)
        assert durable_steps(root) == [6, 12]
        assert [s for s, i in infos.items() if i.durable] == [6, 12]
        assert all(i.superseded_by is None and i.local_s is not None for i in infos.values())
        assert mgr.stats()["local_only"] == 4
        assert mgr.latest_step() == 12


def test_without_a_local_tier_every_save_is_written_durably(root):
    schedule = Schedule(durable_every=100)
    with CheckpointManager(root, staging=StagingOptions(local_tier=False), schedule=schedule) as mgr:
        assert all(mgr.save(s, _state(s)).result(timeout=60).durable for s in (1, 2))
        assert durable_steps(root) == [1, 2]


def test_schedule_durable_by_time_and_by_step():
    s = Schedule(local_every=10, durable_every=100, durable_every_s=60.0)
    assert s.durable(200, 1.0) and s.durable(10, None) and s.durable(10, 61.0) and not s.durable(10, 59.0)
    assert Schedule().durable(7, 0.0) and Schedule(durable_every_s=5).durable(3, None)
    assert not Schedule(durable_every=5).durable(3, 1e9)
    assert Schedule(local_every=50, durable_every=500).should_save(500) and not Schedule(local_every=3).should_save(4)


@pytest.mark.parametrize("kwargs", [{"local_every": 0}, {"durable_every": -1}, {"local_every": True},
                                    {"durable_every_s": 0}, {"durable_every_s": float("nan")},
                                    {"durable_every_s": float("inf")}, {"durable_every": 2.0}])
def test_bad_schedules_are_refused(kwargs):
    with pytest.raises(ConfigError, match="Schedule"):
        Schedule(**kwargs)


def test_sigkill_while_durable_writes_are_coalesced_leaves_the_newest_step_restorable(tmp_path):
    root, local_dir = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    os.makedirs(local_dir)
    proc = subprocess.Popen([sys.executable, WRITER, root, local_dir, "5"], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(__file__))
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert durable_steps(root) == []  # the only durable write started (step 1) was held
    with CheckpointManager(root, staging=StagingOptions(slots=3, local_dir=local_dir)) as mgr:
        assert mgr.latest_step() == 5  # adopted from the local tier
        assert_tree_equal(mgr.restore(), crash_state(5))
        mgr.wait(timeout=60)  # the adopted newest step is written out; the older ones are superseded
        assert durable_steps(root) == [5]
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as fresh:
        assert_tree_equal(fresh.restore(), crash_state(5))


def test_a_step_meant_for_the_durable_tier_gives_way_only_to_a_newer_one_so_meant(root, local_dir, monkeypatch):
    gates = Gates(monkeypatch, held={3})
    schedule = Schedule(durable_every=3)  # 3 and 6 go to the durable target; 7, 8, 10 stay local
    staging = StagingOptions(slots=4, on_busy="skip", local_dir=local_dir)
    with CheckpointManager(root, staging=staging, schedule=schedule) as mgr:
        h3 = mgr.save(3, _state(3), block=False)
        assert gates.started[3].wait(timeout=60)
        handles = {}
        for step in (6, 7, 8, 10):  # 10 reuses 7's slot, never 6's: 6 waits for its durable write
            handles[step] = mgr.save(step, _state(step))
            assert not handles[step].skipped
            assert gates.committed(step).wait(timeout=60)
        assert not handles[6].done()
        assert [s for s in (7, 8, 10) if handles[s].result(timeout=60).durable] == []
        gates.release.set()
        assert h3.result(timeout=60).durable and handles[6].result(timeout=60).durable
        mgr.wait(timeout=60)
        assert durable_steps(root) == [3, 6]
        assert mgr.stats()["durable_superseded"] == 0 and mgr.stats()["local_only"] == 3


def test_with_one_slot_a_step_kept_local_by_the_schedule_gives_way_to_the_next_save(root, local_dir):
    """The default single slot: a step the schedule keeps in the local tier only is the newest
    committed step and its only copy, yet the next save takes its slot (it waited forever)."""
    schedule = Schedule(durable_every=2)  # odd steps stay in the local tier
    staging = StagingOptions(slots=1, local_dir=local_dir, busy_timeout=60)
    with CheckpointManager(root, staging=staging, schedule=schedule) as mgr:
        for step in (2, 3, 5, 6, 7):
            mgr.save(step, _state(step)).result(timeout=60)
        assert mgr.latest_step() == 7 and mgr._tier.steps() == {7: 0}
        assert_tree_equal(mgr.restore(), _state(7))
        assert durable_steps(root) == [2, 6]
        assert mgr.stats()["busy_wait_s"] < 60
