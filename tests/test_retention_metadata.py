"""Retention policies against whatever the manifests hold: metrics outside float range,
NaN, strings, containers and missing values are "no metric"; commit times that are not
finite numbers are "no time". No policy ever raises on metadata, so retention (and the next
save) keeps working."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from ckptmgr import AnyOf, CheckpointManager, KeepBest, KeepEverySeconds, KeepLatest, StagingOptions, StepInfo


def kept(policy, infos):
    return [i.step for i, k in zip(infos, policy.keep(infos), strict=True) if k]


ODD_METRICS = [10**400, -(10**400), float("nan"), float("inf"), float("-inf"), "0.1", None, [0.0], {"v": 0.0},
               True, b"0", complex(0, 1)]


@pytest.mark.parametrize("odd", ODD_METRICS, ids=repr)
@pytest.mark.parametrize("mode", ["min", "max"])
def test_keep_best_treats_an_odd_metric_as_no_metric(odd, mode):
    infos = [StepInfo(1, 1.0, {"loss": 0.5}), StepInfo(2, 2.0, {"loss": odd}), StepInfo(3, 3.0, {"loss": 0.7}),
             StepInfo(4, 4.0, {}), StepInfo(5, 5.0, None), StepInfo(6, 6.0, ["loss"])]  # type: ignore[arg-type]
    best = 1 if mode == "min" else 3
    assert kept(KeepBest(1, "loss", mode=mode), infos) == [best]
    assert kept(KeepBest(6, "loss", mode=mode), infos) == [1, 3]


def test_keep_best_takes_any_real_number():
    infos = [StepInfo(1, 0.0, {"m": np.float32(0.25)}), StepInfo(2, 0.0, {"m": Fraction(1, 8)}),
             StepInfo(3, 0.0, {"m": 10**300}), StepInfo(4, 0.0, {"m": np.int64(-3)})]
    assert kept(KeepBest(2, "m"), infos) == [2, 4]
    assert kept(KeepBest(1, "m", mode="max"), infos) == [3]


@pytest.mark.parametrize("odd", [float("nan"), float("inf"), float("-inf"), 10**400, "12", None], ids=repr)
def test_keep_every_seconds_places_only_finite_times(odd):
    infos = [StepInfo(1, 10.0), StepInfo(2, odd), StepInfo(3, 70.0), StepInfo(4, 75.0)]  # type: ignore[arg-type]
    assert kept(KeepEverySeconds(60), infos) == [1, 3]
    assert kept(AnyOf(KeepEverySeconds(60), KeepLatest(1)), infos) == [1, 3, 4]


def test_keep_every_seconds_with_a_time_too_large_for_its_window():
    infos = [StepInfo(1, 1e308), StepInfo(2, 5.0)]
    assert kept(KeepEverySeconds(1e-300), infos) == [2]


def test_a_metric_beyond_float_range_never_breaks_retention_or_the_next_save(root):
    """KeepBest over 10**400 used to raise OverflowError in every run (and fail the next save)."""
    with CheckpointManager(root, retention=KeepBest(1, "loss"), staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, {"x": 1}, metadata={"loss": 10**400}).result()
        mgr.save(2, {"x": 2}, metadata={"loss": 0.5}).result()
        mgr.save(3, {"x": 3}, metadata={"loss": 0.7}).result()
        mgr.wait()
        mgr.save(4, {"x": 4}, metadata={"loss": float("nan")}).result()
        mgr.wait()
        assert mgr.steps() == [2, 4]  # the best, and the newest (never deleted)
        assert mgr.metadata(2)["loss"] == 0.5
