"""Retention: policies as tables of fake step infos in, kept steps out; then the deleter
against real roots: newest, protected and restoring steps, foreign files, neighbours."""

import os
import threading

import pytest
import torch
from conftest import assert_tree_equal
from test_fsspec_target import FaultyFS, faulty  # noqa: F401  (fixture)

from ckptmgr import (
    AnyOf,
    CheckpointManager,
    ConfigError,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepEverySeconds,
    KeepLatest,
    RetentionPolicy,
    StagingOptions,
    StepInfo,
    StepNotFoundError,
    StorageError,
)
from ckptmgr.format.naming import step_name


def infos(steps, times=None, metrics=None):
    times = times or [float(s) for s in steps]
    metrics = metrics or [{} for _ in steps]
    return [StepInfo(s, t, m) for s, t, m in zip(steps, times, metrics, strict=True)]


def kept(policy, steps, **kw):
    inf = infos(steps, **kw)
    return [i.step for i, k in zip(inf, policy.keep(inf), strict=True) if k]


@pytest.mark.parametrize(("policy", "steps", "expected"), [
    (KeepAll(), [], []),
    (KeepAll(), [1, 2, 3], [1, 2, 3]),
    (KeepLatest(0), [1, 2, 3], []),
    (KeepLatest(2), [1, 2, 3], [2, 3]),
    (KeepLatest(5), [1, 2, 3], [1, 2, 3]),
    (KeepLatest(1), [], []),
    # windows [m*k, (m+1)*k) with m >= 1: the first step of each; window 0 never
    (KeepEvery(10), [0, 5, 10, 15, 20, 25], [10, 20]),
    (KeepEvery(10), [3, 9, 12, 19, 31, 38, 41], [12, 31, 41]),  # saves off the multiples
    (KeepEvery(10), [12, 13, 14], [12]),
    (KeepEvery(1), [0, 1, 2], [1, 2]),
    (KeepEvery(1000), [500, 1100, 1500, 2050, 2600, 2900], [1100, 2050]),
    (AnyOf(KeepLatest(2), KeepEvery(1000)), [500, 1100, 1500, 2050, 2600, 2900], [1100, 2050, 2600, 2900]),
    (AnyOf(KeepLatest(0)), [1, 2], []),
    (AnyOf(KeepAll(), KeepLatest(0)), [1, 2], [1, 2]),
    (AnyOf(KeepLatest(1), AnyOf(KeepEvery(10), KeepLatest(2))), [5, 11, 12, 13], [11, 12, 13]),
], ids=repr)
def test_step_policies(policy, steps, expected):
    assert kept(policy, steps) == expected


@pytest.mark.parametrize(("seconds", "times", "expected"), [
    (3600, [0, 100, 3599, 3600, 3700, 7300, 7301], [1, 4, 6]),  # first in each hour
    (60, [10, 20, 30], [1]),
    (0.5, [0.1, 0.6, 1.1], [1, 2, 3]),
    (60, [130, 70, 75], [1, 2]),  # clock went back: the earliest time in a window wins
])
def test_keep_every_seconds(seconds, times, expected):
    steps = list(range(1, len(times) + 1))
    assert kept(KeepEverySeconds(seconds), steps, times=[float(t) for t in times]) == expected


@pytest.mark.parametrize(("policy", "expected"), [
    (KeepBest(2, "loss"), [3, 5]),
    (KeepBest(1, "loss", mode="max"), [1]),
    (KeepBest(0, "loss"), []),
    (KeepBest(10, "loss"), [1, 2, 3, 5]),  # steps without a finite number are never "best"
    (KeepBest(2, "acc", mode="max"), [2, 5]),  # tie between 2 and 5 is the newer, and a bool is no number
    (AnyOf(KeepBest(1, "loss"), KeepLatest(1)), [3, 6]),
])
def test_keep_best(policy, expected):
    metrics = [{"loss": 0.9, "acc": 0.1}, {"loss": 0.5, "acc": 0.8}, {"loss": 0.1, "acc": 0.8},
               {"loss": float("nan")}, {"loss": 0.3, "acc": 0.9}, {"loss": "low", "acc": True}]
    metrics[4]["acc"] = 0.8
    metrics[1]["acc"] = 0.8
    metrics[2]["acc"] = 0.2
    assert kept(policy, [1, 2, 3, 4, 5, 6], metrics=metrics) == expected


@pytest.mark.parametrize(("make", "match"), [
    (lambda: KeepLatest(-1), "KeepLatest"),
    (lambda: KeepLatest(1.5), "KeepLatest"),
    (lambda: KeepEvery(0), "KeepEvery"),
    (lambda: KeepEvery(-5), "KeepEvery"),
    (lambda: KeepEverySeconds(0), "KeepEverySeconds"),
    (lambda: KeepEverySeconds(float("inf")), "KeepEverySeconds"),
    (lambda: KeepBest(-1, "loss"), "KeepBest"),
    (lambda: KeepBest(1, ""), "metric"),
    (lambda: KeepBest(1, "loss", mode="lowest"), "mode"),
    (lambda: AnyOf(), "at least one"),
    (lambda: AnyOf(KeepLatest(1), 3), "AnyOf"),
])
def test_invalid_arguments_raise_at_construction(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_manager_refuses_a_non_policy(root):
    with pytest.raises(ConfigError, match="retention must be of type RetentionPolicy"):
        CheckpointManager(root, retention=3)


# ------------------------------------------------------------------ the deleter

def small(step):
    return {"w": torch.full((8,), float(step)), "step": step}


def committed_dirs(root):
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


def test_deletes_what_the_policy_drops_and_keeps_the_rest(root):
    policy = AnyOf(KeepLatest(2), KeepEvery(10))
    one = StagingOptions(slots=1)  # every save written durably (more slots coalesce a tight loop's saves)
    with CheckpointManager(root, retention=policy, staging=one) as mgr:
        for step in range(0, 35, 3):
            mgr.save(step, small(step))
        mgr.wait()
        assert mgr.steps() == [12, 21, 30, 33]
        assert mgr.stats()["deleted"] == 8
        assert_tree_equal(mgr.restore(12), small(12))
    assert committed_dirs(root) == [step_name(s) for s in (12, 21, 30, 33)]


def test_never_deletes_the_newest_committed_step(root):
    with CheckpointManager(root, retention=KeepLatest(0)) as mgr:
        for step in range(4):
            mgr.save(step, small(step)).result()
        mgr.wait()
        assert mgr.steps() == [3]
        assert_tree_equal(mgr.restore(), small(3))


def test_protected_steps_are_kept_durably(root):
    with CheckpointManager(root, retention=KeepLatest(1)) as mgr:
        mgr.save(1, small(1)).result()
        mgr.protect(1)
        mgr.save(2, small(2))
        mgr.protect(2)  # still being saved: protected when it commits
        mgr.wait()
        mgr.save(3, small(3))
        mgr.wait()
        assert mgr.steps() == [1, 2, 3]
        assert mgr.is_protected(1) and mgr.is_protected(2) and not mgr.is_protected(3)
        with pytest.raises(StepNotFoundError):
            mgr.protect(99)
    # a new manager on the root sees the protection
    with CheckpointManager(root, retention=KeepLatest(1)) as mgr:
        assert mgr.is_protected(1)
        mgr.unprotect(1)
        mgr.save(4, small(4))
        mgr.wait()
        assert mgr.steps() == [2, 4]


def test_retention_leaves_foreign_files_and_neighbouring_roots_alone(tmp_path):
    parent = tmp_path / "runs"
    a, b = str(parent / "a"), str(parent / "b")
    one = StagingOptions(slots=1)  # every save written durably (more slots coalesce a tight loop's saves)
    with CheckpointManager(a, retention=KeepLatest(1), staging=one) as ma, \
            CheckpointManager(b, retention=KeepLatest(1), staging=one) as mb:
        for step in range(2):
            ma.save(step, small(step))
            mb.save(step, small(step))
        ma.wait()  # (step 1 committed, and kept until a newer one commits)
        mb.wait()
        # foreign things inside root a: a file at the top, a directory that looks almost like
        # ours, and a user's file inside one of our step directories
        (parent / "a" / "notes.txt").write_text("mine")
        (parent / "a" / "step_12").mkdir()
        (parent / "a" / "step_000000000001" / "eval.json").write_text("{}")
        for step in range(2, 5):
            ma.save(step, small(step))
            mb.save(step, small(step))
        ma.wait()
        mb.wait()
        assert ma.steps() == [4] and mb.steps() == [4]
    assert (parent / "a" / "notes.txt").read_text() == "mine"
    assert (parent / "a" / "step_12").is_dir()
    assert (parent / "a" / "step_000000000001" / "eval.json").read_text() == "{}"
    assert sorted(os.listdir(parent / "a" / "step_000000000001")) == ["eval.json"]  # ours are gone
    assert sorted(os.listdir(parent)) == ["a", "b"]
    with CheckpointManager(a) as ma:  # the next start leaves the user's file where it is
        assert ma.steps() == [4]
    assert (parent / "a" / "step_000000000001" / "eval.json").exists()


def test_a_step_being_restored_is_not_deleted(root, monkeypatch):
    import ckptmgr.restore.restorer as manager_mod

    with CheckpointManager(root, retention=KeepLatest(1), staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, small(1)).result()
        mgr.protect(1)  # before step 2 commits, or retention may already have dropped it
        mgr.save(2, small(2)).result()
        mgr.wait()
        entered, release = threading.Event(), threading.Event()
        real = manager_mod.read_tensors

        def slow_read(*args, **kw):
            entered.set()
            release.wait(10)
            return real(*args, **kw)

        monkeypatch.setattr(manager_mod, "read_tensors", slow_read)
        mgr.unprotect(1)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("s", mgr.restore(1)))
        t.start()
        assert entered.wait(10)
        mgr.save(3, small(3))
        mgr.wait()  # the deleter ran while step 1 was being read: it kept it
        assert 1 in mgr.steps()
        release.set()
        t.join()
        assert_tree_equal(out["s"], small(1))
        monkeypatch.setattr(manager_mod, "read_tensors", real)
        mgr.save(4, small(4))
        mgr.wait()  # not being read any more: now it goes
        assert mgr.steps() == [4]


def test_deletion_failure_surfaces_at_the_next_save(faulty, monkeypatch):  # noqa: F811
    with CheckpointManager("faulty://ret", retention=KeepLatest(1),
                           staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, small(1)).result()

        def refuse(self, path, *a, **kw):
            raise PermissionError(13, "Permission denied (injected)")

        monkeypatch.setattr(FaultyFS, "rm_file", refuse)
        mgr.save(2, small(2)).result()
        with pytest.raises(StorageError, match=r"retention.*Permission denied"):
            mgr.wait()
        monkeypatch.undo()
        mgr.save(3, small(3)).result()  # told once; the next run deletes both
        mgr.wait()
        assert mgr.steps() == [3]


def test_crash_mid_delete_leaves_garbage_that_the_next_start_removes(root):
    with CheckpointManager(root, staging=StagingOptions(slots=1)) as mgr:  # every save written durably
        for step in range(3):
            mgr.save(step, small(step))
    # what a crash right after the commit record went leaves behind
    os.unlink(os.path.join(root, step_name(1), "manifest.json"))
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [0, 2]
        assert not os.path.exists(os.path.join(root, step_name(1)))


def test_apply_retention_runs_a_policy_whose_answer_changed(root):
    class Dropped(RetentionPolicy):
        def __init__(self):
            self.dropped = set()

        def keep(self, steps):
            return [s.step not in self.dropped for s in steps]

    policy = Dropped()
    with CheckpointManager(root, retention=policy) as mgr:
        for step in range(3):
            mgr.save(step, small(step)).result()
        mgr.wait()
        assert mgr.steps() == [0, 1, 2]
        policy.dropped.add(1)
        mgr.wait()  # no commit since: nothing ran
        assert mgr.steps() == [0, 1, 2]
        mgr.apply_retention()
        assert mgr.steps() == [0, 2]
    mgr.close()
    with pytest.raises(ConfigError, match="closed"):
        mgr.apply_retention()
