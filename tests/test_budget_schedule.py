"""Schedules set by a budget: the pure plan, and the planner driven by a simulated training
loop (a clock advanced by hand, a save cost and a durable bandwidth chosen per step), so the
intervals it picks, and how they follow a step time or a bandwidth that changes, are checked
deterministically. One test runs a real manager with a budget schedule on the CPU."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable

import pytest
import torch

from ckptmgr import CheckpointManager, ConfigError, Schedule, StagingOptions
from ckptmgr.save.budget import WARMUP, WINDOW, BudgetPlanner, Measurements, plan

GB = 10**9


# ---------------------------------------------------------------------------- the pure plan

def test_the_overhead_budget_gives_the_most_frequent_saves_within_it():
    it = plan(Schedule(max_overhead=0.01), Measurements(step_s=0.0527, save_cost_s=0.0275))
    assert it.local_steps == math.ceil(0.0275 / (0.01 * 0.0527)) == 53 and it.durable_s is None
    assert plan(Schedule(max_overhead=0.01, local_every=100),
                Measurements(step_s=0.0527, save_cost_s=0.0275)).local_steps == 100  # a floor
    # a save that seems free still leaves a step clear of its window, where the step time is measured
    assert plan(Schedule(max_overhead=0.01), Measurements(step_s=0.05, save_cost_s=0.0)).local_steps == WINDOW + 1


def test_a_slow_first_step_does_not_make_saves_look_free_for_good():
    # the first intervals are slow (start-up), so the step time starts high and a save's extra time
    # reads as nothing; the clear step between windows brings the step time, and the cost, back
    loop = Loop(Schedule(max_overhead=0.01), step_s=lambda k: 1.0 if k < 4 else 0.05, cost_s=lambda k: 0.03)
    loop.run(range(3000))
    assert set(loop.gaps(after=1500)) == {60}


def test_the_loss_budget_gives_the_least_frequent_saves_within_it():
    it = plan(Schedule(max_lost_s=60), Measurements(step_s=1.0, local_s=2.0))
    assert it.local_steps == 58 and not it.notes
    it = plan(Schedule(max_lost_s=1), Measurements(step_s=2.0))
    assert it.local_steps == 1 and it.notes[0][0] == "max_lost_s"


def test_with_both_budgets_the_overhead_wins_and_the_unmet_loss_budget_is_noted():
    it = plan(Schedule(max_overhead=0.01, max_lost_s=10), Measurements(step_s=0.1, save_cost_s=0.5))
    assert it.local_steps == 500 and it.notes[0][0] == "max_lost_s" and "every 500 steps" in it.notes[0][1]
    it = plan(Schedule(max_overhead=0.01, max_lost_s=100), Measurements(step_s=0.1, save_cost_s=0.5))
    assert it.local_steps == 500 and not it.notes


def test_the_durable_interval_leaves_room_for_the_write():
    s = Schedule(durable_max_lost_s=60)
    assert plan(s, Measurements(step_s=1.0)).durable_s == 0.0  # unmeasured: at once, to measure
    assert plan(s, Measurements(step_s=1.0, durable_s=10.0)).durable_s == 50.0
    it = plan(s, Measurements(step_s=1.0, durable_s=70.0))
    assert it.durable_s == 0.0 and it.notes[0][0] == "durable_max_lost_s" and "70.0 s" in it.notes[0][1]
    assert plan(Schedule(continuous=True), Measurements(step_s=1.0, durable_s=70.0)).durable_s == 0.0
    assert plan(Schedule(continuous=True), Measurements(step_s=1.0)).local_steps is None


@pytest.mark.parametrize("kwargs", [
    {"max_overhead": 0}, {"max_overhead": 1.5}, {"max_overhead": True}, {"max_lost_s": 0},
    {"durable_max_lost_s": float("inf")}, {"continuous": 1}, {"max_overhead": 0.01, "durable_every": 10},
    {"continuous": True, "durable_max_lost_s": 60}, {"max_lost_s": 60, "durable_every_s": 5.0},
])
def test_bad_budgets_are_refused(kwargs):
    with pytest.raises(ConfigError):
        Schedule(**kwargs)


# ---------------------------------------------------------------------------- a simulated loop

class Loop:
    """A training loop on a simulated clock. Each step takes ``step_s()``; a save adds
    ``cost_s()`` to the step after it; a durable write of ``nbytes`` runs on one writer at
    ``bandwidth()`` bytes per second and completes when the clock passes its end. A durable
    save made while the writer is busy waits for it, and a newer one supersedes it (as the
    saver coalesces)."""

    def __init__(self, schedule: Schedule, *, step_s: Callable[[int], float], cost_s: Callable[[int], float],
                 bandwidth: Callable[[int], float] = lambda k: 1 * GB, nbytes: int = 5 * GB,
                 tiered: bool = True, one_time_s: float | None = None, wait_s: float = 0.0) -> None:
        self.t = 0.0
        self.wait_s = wait_s  # what each save call waits (for a staging slot) before it stages
        self.began: dict[int, float] = {}  # step -> when its save call began
        self.p = BudgetPlanner(schedule, clock=lambda: self.t, tiered=tiered)
        self.step_s, self.cost_s, self.bandwidth, self.nbytes = step_s, cost_s, bandwidth, nbytes
        self.saves: list[int] = []
        self.durable: list[tuple[int, float, float]] = []  # (step, save time, commit time)
        self.writing: tuple[int, float, float] | None = None  # (step, staged at, ends at)
        self.queued: tuple[int, float] | None = None  # (step, staged at) waiting for the writer
        self.superseded: list[int] = []
        self.extra = 0.0  # cost the next step pays
        self.cost_total = 0.0
        self.one_time_s = one_time_s  # what the first save's allocation took, as the manager reports it

    def _deliver(self) -> None:
        while self.writing is not None and self.writing[2] <= self.t:
            step, staged, end = self.writing
            self.writing = None
            self.p.finished(step, durable=True, nbytes=self.nbytes, staged_at=staged, committed_at=end,
                            local_s=self.wait_s or None)  # (the manager's local_s: from the call, its wait included)
            self.durable.append((step, staged, end))
            if self.queued is not None:
                (k, at), self.queued = self.queued, None
                self.writing = (k, at, end + self.nbytes / self.bandwidth(k))

    def run(self, steps: range) -> None:
        for k in steps:
            self.t += self.step_s(k) + self.extra
            self.cost_total += self.extra
            self.extra = 0.0
            self._deliver()
            if self.p.should_save(k):
                self.saves.append(k)
                self.began[k] = self.t
                self.t += self.wait_s
                durable = self.p.durable(k, None)  # as the saver asks, inside save()
                first = len(self.saves) == 1  # the first save makes its slot
                self.p.saved(k, allocated=first, one_time_s=self.one_time_s if first else None, started=self.began[k])
                self.extra = self.cost_s(k)
                if durable and self.writing is None:
                    self.writing = (k, self.t, self.t + self.nbytes / self.bandwidth(k))
                elif durable:
                    if self.queued is not None:
                        self.superseded.append(self.queued[0])
                        self.p.finished(self.queued[0], durable=False)
                    self.queued = (k, self.t)
                else:
                    self.p.finished(k, durable=False)

    def gaps(self, after: int = 0) -> list[int]:
        s = [k for k in self.saves if k >= after]
        return [b - a for a, b in itertools.pairwise(s)]


def test_max_overhead_converges_to_the_interval_the_budget_allows_and_keeps_it():
    loop = Loop(Schedule(max_overhead=0.01), step_s=lambda k: 0.05, cost_s=lambda k: 0.03)
    loop.run(range(3000))
    assert loop.saves[0] == WARMUP  # the step time first, then one save to measure
    assert set(loop.gaps(after=500)) == {60}  # 0.03 / (0.01 * 0.05)
    assert loop.p.stats()["overhead"] <= 0.011
    assert loop.p.stats()["interval_steps"] == 60


def test_the_first_save_allocating_is_not_charged_and_cost_is_probed_one_window_at_a_time():
    loop = Loop(Schedule(max_overhead=0.01), step_s=lambda k: 0.05,
                cost_s=lambda k: 5.0 if k == WARMUP else 0.03)  # the first save: 5 s of allocation
    loop.run(range(WARMUP + 3 * (WINDOW + 1)))
    assert loop.saves[:2] == [WARMUP, WARMUP + WINDOW]  # the second save measures the cost
    assert loop.p.save_cost_s == pytest.approx(0.03)


def test_a_first_save_whose_allocation_time_is_known_measures_the_cost_without_a_probe():
    """The manager times a save that makes its staging slot: that time comes off the save's
    window, the rest is what a save costs, and the plan follows from the first save."""
    loop = Loop(Schedule(max_overhead=0.01), step_s=lambda k: 0.05,
                cost_s=lambda k: 5.03 if k == WARMUP else 0.03, one_time_s=5.0)  # 5 s allocation + 0.03 s copy
    loop.run(range(WARMUP + 200))
    assert loop.saves[:2] == [WARMUP, WARMUP + 60]  # no probing save: the next at the planned interval
    assert loop.p.save_cost_s == pytest.approx(0.03)
    assert loop.p.stats()["overhead"] * (loop.t - 0.05) == pytest.approx(loop.cost_total, rel=0.02)  # all of it told


def test_max_lost_s_alone_saves_every_interval_it_allows_not_every_step():
    loop = Loop(Schedule(max_lost_s=6), step_s=lambda k: 1.0, cost_s=lambda k: 0.0)
    loop.run(range(100))
    assert loop.saves[0] == WARMUP and set(loop.gaps()) == {6}  # floor(6 s / 1 s steps)


def test_max_lost_s_is_kept_in_seconds_when_saves_slow_the_steps_after_them():
    """Each save costs the loop 2 s here: six 1 s steps would leave 8 s between saves, over the
    6 s budget. The planner counts the seconds since the last save, so the achieved interval
    stays within the budget."""
    loop = Loop(Schedule(max_lost_s=6), step_s=lambda k: 1.0, cost_s=lambda k: 2.0)
    times: list[float] = []
    real = loop.p.saved

    def saved(step: int, **kw: object) -> None:
        times.append(loop.t)
        real(step, **kw)  # type: ignore[arg-type]

    loop.p.saved = saved  # type: ignore[method-assign]
    loop.run(range(200))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) > 20 and max(gaps) <= 6.0, gaps
    assert set(loop.gaps()[2:]) == {4}  # 4 steps of 1 s + the save's 2 s


def test_the_interval_follows_a_step_time_that_changes_mid_run():
    loop = Loop(Schedule(max_overhead=0.01), step_s=lambda k: 0.05 if k < 2000 else 0.1, cost_s=lambda k: 0.03)
    loop.run(range(6000))
    assert set(loop.gaps(after=500)[:20]) == {60}
    after = loop.gaps(after=2000)
    # the windows of the saves made as the step time changes charge the change to them for a
    # while (never spacing saves further than before the change); the estimate settles
    assert max(after) <= 60 and after[-20:] == [30] * 20


def test_durable_saves_adapt_when_the_bandwidth_drops_mid_run(caplog):
    # 5 GB per write: 5 s at 1 GB/s, then 20 s at 0.25 GB/s, then 100 s at 0.05 GB/s (over the budget)
    def bw(k: int) -> float:
        return 1 * GB if k < 1000 else 0.25 * GB if k < 2500 else 0.05 * GB

    loop = Loop(Schedule(max_lost_s=10, durable_max_lost_s=60), step_s=lambda k: 0.5, cost_s=lambda k: 0.0,
                bandwidth=bw)
    with caplog.at_level(logging.WARNING, logger="ckptmgr"):
        loop.run(range(4000))
    by = {"fast": [], "slow": [], "over": []}
    for (_, a, _), (step, b, end) in zip(loop.durable, loop.durable[1:], strict=False):
        phase = "fast" if step < 1000 else "slow" if step < 2500 else "over"
        by[phase].append((b - a, end - a))  # spacing of durable saves, and the loss window they leave
    fast, slow = by["fast"][1:], by["slow"][1:]  # (the first slower write is how it is measured)
    assert fast and slow
    # the loss window (previous durable save to the next durable commit) stays within the budget
    assert all(window <= 60 + 0.5 for _, window in fast + slow)
    # and the saves are spread as far as the budget allows: 60 - 5 s apart, then 60 - 20 s
    assert all(55 - 1 <= gap <= 55 + 0.5 for gap, _ in fast), fast
    assert all(40 - 1 <= gap <= 40 + 0.5 for gap, _ in slow), slow
    # over budget: continuous (the next durable save as soon as the write ended), said once
    over = by["over"][1:]
    assert over and all(gap <= 100 + 0.5 + 0.5 for gap, _ in over)
    told = [r for r in caplog.records if "durable_max_lost_s=60 s cannot be met" in r.getMessage()]
    assert len(told) == 1
    # the local tier's own budget holds throughout: a save at least every 10 s
    assert max(loop.gaps()) * 0.5 <= 10
    stats = loop.p.stats()
    assert stats["durable_write_s"] == pytest.approx(100, rel=0.05) and stats["durable_bytes_per_s"] > 0


def test_durable_max_lost_s_counts_from_when_a_durable_save_began():
    """Each save call here waits 3 s for a staging slot before it stages: the state it saves is
    the state when it began, so the node-loss window (a durable save's call to the next
    durable commit) must stay within ``durable_max_lost_s`` counted from there."""
    loop = Loop(Schedule(durable_max_lost_s=60), step_s=lambda k: 0.5, cost_s=lambda k: 0.0, wait_s=3.0)
    loop.run(range(2000))
    windows = [end - loop.began[a] for (a, _, _), (_, _, end) in zip(loop.durable, loop.durable[1:], strict=False)]
    assert len(windows) > 5 and max(windows[1:]) <= 60 + 0.5, windows


def test_continuous_starts_the_next_durable_save_when_the_last_write_ends():
    loop = Loop(Schedule(continuous=True), step_s=lambda k: 1.0, cost_s=lambda k: 0.0,
                bandwidth=lambda k: 1 * GB if k < 100 else 0.5 * GB)
    loop.run(range(200))
    for (_, _, end), (_, nxt, _) in zip(loop.durable, loop.durable[1:], strict=False):
        assert end <= nxt <= end + 1.0  # the first step after the write ended
    in_flight = [] if loop.writing is None else [loop.writing[0]]
    assert loop.saves == [s for s, _, _ in loop.durable] + in_flight  # no local-only saves without a local budget
    assert loop.p.stats()["durable_interval_s"] > 5


def test_continuous_within_an_overhead_budget_never_saves_more_often_than_it_allows():
    loop = Loop(Schedule(continuous=True, max_overhead=0.01), step_s=lambda k: 0.05, cost_s=lambda k: 0.03,
                bandwidth=lambda k: 50 * GB)  # writes of 0.1 s: the writer is always free
    loop.run(range(2000))
    assert set(loop.gaps(after=500)) == {60}
    assert len(loop.durable) >= len(loop.saves) - 2  # every save durable (the writer is free each time)


def test_without_a_local_tier_every_save_is_durable():
    loop = Loop(Schedule(max_overhead=0.01), step_s=lambda k: 0.05, cost_s=lambda k: 0.03, tiered=False,
                bandwidth=lambda k: 100 * GB)
    loop.run(range(600))
    assert len(loop.durable) >= len(loop.saves) - 1


# ---------------------------------------------------------------------------- the manager

def test_a_manager_with_a_budget_schedule_measures_saves_and_reports_intervals(root, tmp_path):
    local = tmp_path / "shm"
    local.mkdir()
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(root, schedule=Schedule(max_overhead=0.5, durable_max_lost_s=3600),
                           staging=StagingOptions(local_dir=str(local))) as mgr:
        handles = []
        for step in range(40):
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            if mgr.should_save(step):
                handles.append(mgr.save(step, {"model": model, "optim": opt}))
        for h in handles:
            h.result(timeout=60)
        stats = mgr.stats()
    # (the first save measures what a save costs; how many follow in 40 steps depends on that
    # cost against this machine's step time)
    assert handles and handles[0].step == WARMUP
    assert stats["budget_interval_steps"] >= 1 and stats["budget_step_s"] > 0 and "budget_save_cost_s" in stats
    assert "budget_durable_write_s" in stats and stats["budget_durable_bytes_per_s"] > 0


def test_a_durable_save_the_caller_asked_for_counts_as_one():
    """``save(durable=True)`` goes past the planner; the planner still counts it: in continuous
    mode the next durable save waits for that write to end, as for one it chose."""
    t = [0.0]
    p = BudgetPlanner(Schedule(continuous=True), clock=lambda: t[0], tiered=True)
    p.durable_asked(10)
    t[0] = 1.0
    assert not p.durable(11, None)  # the asked-for write is still in flight
    p.finished(10, durable=True, nbytes=1 << 20, staged_at=0.0, committed_at=2.0)
    t[0] = 3.0
    assert p.durable(12, None)


def test_a_due_save_waits_for_its_slot_to_be_made_without_losing_the_step_count():
    """While the staging slot is still being made, a due save is put off step by step (a wait
    for memory being pinned is not what a save costs) and happens at the first step after."""
    t = [0.0]
    making = [True]
    p = BudgetPlanner(Schedule(max_overhead=0.1), clock=lambda: t[0], making=lambda: making[0])
    said = []
    for step in range(8):
        t[0] += 1.0
        if step == 5:
            making[0] = False  # the slot is made
        said.append(p.should_save(step))
        if said[-1]:
            p.saved(step)
    assert said == [False] * 5 + [True, False, False]  # due at WARMUP (3), made at 5
    assert p.measurements().step_s == 1.0


def test_a_slot_being_made_never_puts_a_save_off_past_max_lost_s():
    """Under ``max_lost_s`` a due save is put off for a slot being made only while one more
    step keeps the time since the last save within the budget."""
    t = [0.0]
    making = [False]
    p = BudgetPlanner(Schedule(max_lost_s=6), clock=lambda: t[0], making=lambda: making[0])
    saves: list[float] = []
    for step in range(40):
        t[0] += 1.0
        making[0] = step >= 10  # a slot is being made from step 10 to the end
        if p.should_save(step):
            saves.append(t[0])
            p.saved(step)
    gaps = [b - a for a, b in itertools.pairwise(saves)]
    assert len(gaps) >= 5 and max(gaps) <= 6.0, gaps  # (without the guard: no save after step 9)


def test_max_lost_s_counts_from_when_a_save_began_not_from_when_its_wait_for_a_slot_ended():
    """A save call that waits for a staging slot still saves the state as it was when it was
    called: the time lost to a crash runs from there until the next save's local commit. Each
    save here waits 1.5 s for a slot and is committed locally 2 s after it began; with a 6 s
    budget, the saves must begin at most 4 s apart (counted from the end of the wait, they
    were 5.5 s apart: 7.5 s lost)."""
    t = [0.0]
    p = BudgetPlanner(Schedule(max_lost_s=6), clock=lambda: t[0])
    starts: list[float] = []
    for step in range(80):
        t[0] += 1.0
        if p.should_save(step):
            starts.append(t[0])
            t[0] += 1.5  # the call waits for a slot
            p.saved(step, started=starts[-1])
            p.finished(step, durable=False, local_s=2.0)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert len(gaps) >= 10 and max(gaps) + 2.0 <= 6.0, gaps
    assert p.stats()["interval_s"] == pytest.approx(sum(gaps) / len(gaps))


def test_max_overhead_holds_over_the_run_from_its_first_save():
    """The budget is the share of the time since the first step: the first save's cost, which
    no earlier time paid for, puts the second off until the run has earned it."""
    loop = Loop(Schedule(max_overhead=0.01), step_s=lambda k: 0.05, cost_s=lambda k: 0.03, one_time_s=0.0)
    loop.run(range(300))
    assert loop.saves[0] == WARMUP and loop.saves[1] >= 118  # 2 x 0.03 s of cost needs 6 s of run
    for n in range(len(loop.saves)):  # at every save, what saves cost so far is within 1% (+ one step)
        k = loop.saves[n]
        assert 0.03 * (n + 1) <= 0.01 * (k + 1) * 0.05 + 0.03 * 0.05 + 1e-9 or n == 0


def test_a_loop_that_runs_ahead_of_the_gpu_is_charged_only_what_a_save_loses():
    """A loop queueing GPU work ahead waits for it at the save, then runs ahead again: the
    window nets the two, so the cost measured is what the save lost, not the wait."""
    t = [0.0]
    p = BudgetPlanner(Schedule(max_overhead=0.01), clock=lambda: t[0])
    after: list[float] = []  # the step intervals after the save: +0.3 s, then 6 x -0.045 s
    for k in range(40):
        t[0] += after.pop(0) if after else 0.05
        if p.should_save(k):
            assert k == WARMUP
            p.saved(k)
            after = [0.35] + [0.005] * 6
    assert p.save_cost_s == pytest.approx(0.3 - 6 * 0.045, abs=1e-6)


def test_a_framework_save_told_once_per_file_counts_once_and_its_first_is_not_charged():
    t = [0.0]
    p = BudgetPlanner(Schedule(max_overhead=0.1), clock=lambda: t[0])
    for step in range(WARMUP + 1):
        t[0] += 1.0
        p.should_save(step)
    p.saved_once(WARMUP)
    p.saved_once(WARMUP)  # (a top-k and a last checkpoint of one step)
    for step in range(WARMUP + 1, WARMUP + 2 + WINDOW):
        t[0] += 2.0  # every step in the window 1 s slower: a cost, but the first save's is not charged
        p.should_save(step)
    assert p._saves == 1 and p.save_cost_s is None


def test_a_save_that_raises_after_the_schedule_sent_it_durable_does_not_stop_durable_saves(root, tmp_path,
                                                                                          monkeypatch):
    """In continuous mode the next durable save waits for the last one's write to end. A save
    that raised inside the call, after the schedule had sent it durable, has no write to wait
    for: the next save goes durable (before, the schedule waited for it for ever)."""
    from ckptmgr.save.saver import Saver

    local = tmp_path / "shm"
    local.mkdir()
    state = {"w": torch.arange(64, dtype=torch.float32)}
    real = Saver._enqueue
    failing = [True]

    def enqueue(self, job, ticket):
        if failing[0]:
            failing[0] = False
            raise RuntimeError("injected: the save fails once its durable write was decided")
        return real(self, job, ticket)

    monkeypatch.setattr(Saver, "_enqueue", enqueue)
    with CheckpointManager(root, schedule=Schedule(continuous=True),
                           staging=StagingOptions(local_dir=str(local))) as mgr:
        with pytest.raises(RuntimeError, match="injected"):
            mgr.save(1, state)
        info = mgr.save(2, state).result(timeout=60)
        assert info.durable, info
        assert 2 in mgr.steps()
