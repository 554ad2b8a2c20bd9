"""Schedules set by a budget: the decisions behind ``Schedule(max_overhead=..., max_lost_s=...,
durable_max_lost_s=..., continuous=...)``.

Two layers, so that the decisions test without a GPU, a disk or a clock:

* :func:`plan`: pure. Given the :class:`Schedule` and the :class:`Measurements` so far, the
  :class:`Intervals` to keep: every how many steps to save, and how long after the last
  durable save the next one goes durable; with the budgets that cannot be met and why.
* :class:`BudgetPlanner`: the manager's runtime of a budget schedule. It is fed the
  measurements as training runs (the spacing of ``should_save`` calls, the saves made, the
  outcome of each save) on an injectable clock, keeps them as moving averages (so the
  intervals follow a step time or a bandwidth that changes), and answers ``should_save``
  and ``durable`` from :func:`plan`.

What is measured, and how:

* the step time: the spacing of ``should_save(step)`` calls, per step, on steps whose
  spacing no save touched;
* the cost of a save to the loop: what the :data:`WINDOW` step intervals after a save took
  beyond the step time (the ``save()`` call itself, ``wait_staged()``, and the copies'
  contention with the next steps). A save that allocated its staging slot (the first one,
  a slot added) pays a cost once: the seconds it spent making the slot are taken off its
  window when the caller knows them (the manager does: a save that allocates is timed), so
  the first save measures what a save costs; a save whose one-time part is not known is
  not counted, and the next save measures;
* the durable write time: from a step's end of staging (or the previous durable commit,
  whichever is later: one writer) to its durable commit, and its bytes per second. A write
  slower than the estimate replaces it at once (a bandwidth that drops must not break the
  loss budget for several writes); faster ones ease it down;
* the local latency: ``save()`` to the local-tier commit (``SaveInfo.local_s``).

Nothing here does I/O; the planner's lock is never held while calling out.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..options import Schedule

__all__ = ["WARMUP", "WINDOW", "BudgetPlanner", "DurablePolicy", "Intervals", "Measurements", "plan"]

log = logging.getLogger("ckptmgr")

WINDOW = 8  # step intervals after a save whose extra time is charged to it (see _observe)
WARMUP = 3  # step intervals measured before the first save of a budget schedule
ALPHA = 0.3  # weight of a new sample in the step-time and save-cost averages
ALPHA_DURABLE = 0.5  # ... in the durable write time (a bandwidth that drops shows within two writes)


class DurablePolicy(Protocol):
    """What the saver asks of a schedule for each save: does it go to the durable target too?"""

    def durable(self, step: int, since_durable_s: float | None) -> bool: ...


@dataclass(frozen=True)
class Measurements:
    """What a budget decision is based on (None: not measured yet).

    Attributes:
        step_s: seconds per training step, without saves.
        save_cost_s: seconds one save adds to the training loop.
        local_s: seconds from ``save()`` to the local-tier commit.
        durable_s: seconds one durable write takes.
    """

    step_s: float | None = None
    save_cost_s: float | None = None
    local_s: float | None = None
    durable_s: float | None = None


@dataclass(frozen=True)
class Intervals:
    """What :func:`plan` decides.

    Attributes:
        local_steps: save every this many steps; None: only when a durable save is due
            (no budget for the local tier).
        durable_s: a save goes durable once this many seconds (less one step) have passed
            since the last save that did, and no durable write is in flight; 0: as soon as
            the last durable write ended (continuous); None: every save is meant for the
            durable target (durable writes that fall behind coalesce to the newest step).
        notes: budgets that cannot be met, keyed by budget, each with the numbers.
    """

    local_steps: int | None
    durable_s: float | None
    notes: tuple[tuple[str, str], ...] = ()


def plan(schedule: Schedule, m: Measurements) -> Intervals:
    """The intervals that keep ``schedule``'s budgets, given the measurements ``m``.

    ``max_overhead``: the most frequent saves whose cost stays within the budget,
    ``ceil(save_cost_s / (max_overhead * step_s))`` steps apart, and never closer than
    ``WINDOW + 1`` steps (a step clear of any save's window keeps the step time measured). ``max_lost_s`` alone: the
    least frequent saves that lose at most the budget to a crash (the steps since the
    last save and the save's own latency to the local commit). ``durable_max_lost_s``: the
    durable saves far enough apart that a write of the measured length still ends within
    the budget; continuous when it cannot. ``local_every`` is a floor throughout.

    Example:
        >>> plan(Schedule(max_overhead=0.01), Measurements(step_s=0.05, save_cost_s=0.03)).local_steps
        60
        >>> plan(Schedule(durable_max_lost_s=60), Measurements(step_s=1.0, durable_s=20.0)).durable_s
        40.0
    """
    notes: list[tuple[str, str]] = []
    n: int | None = None
    if schedule.max_overhead is not None or schedule.max_lost_s is not None:
        n = schedule.local_every
    step_s = m.step_s
    n_lost: int | None = None
    if step_s is not None and step_s > 0:
        if schedule.max_lost_s is not None:
            n_lost = math.floor((schedule.max_lost_s - (m.local_s or 0.0)) / step_s)
            if n_lost < 1:
                notes.append(("max_lost_s", f"max_lost_s={schedule.max_lost_s:g} s cannot be met: one step takes "
                                            f"{step_s:.3f} s and a save {m.local_s or 0.0:.3f} s to commit locally; "
                                            "saving every step"))
                n_lost = 1
        if schedule.max_overhead is not None and m.save_cost_s is not None:
            n = max(schedule.local_every, WINDOW + 1,  # (one step clear of every save's window: the baseline)
                    math.ceil(m.save_cost_s / (schedule.max_overhead * step_s) - 1e-9))
        elif n_lost is not None and schedule.max_overhead is None:
            n = max(schedule.local_every, n_lost)
        if n_lost is not None and n is not None and n > n_lost and schedule.max_overhead is not None:
            notes.append(("max_lost_s", f"max_lost_s={schedule.max_lost_s:g} s is not met: within max_overhead="
                                        f"{schedule.max_overhead:g} a save ({m.save_cost_s or 0.0:.3f} s of "
                                        f"{step_s:.3f} s steps) comes every {n} steps, and a crash loses up to "
                                        f"{n * step_s + (m.local_s or 0.0):.1f} s"))
    durable_s: float | None = None
    if schedule.continuous:
        durable_s = 0.0
    elif schedule.durable_max_lost_s is not None:
        budget = schedule.durable_max_lost_s
        if m.durable_s is None:
            durable_s = 0.0  # not measured yet: write as soon as possible, and measure
        else:
            durable_s = budget - m.durable_s - (m.local_s or 0.0)
            if durable_s <= 0:
                notes.append(("durable_max_lost_s", f"durable_max_lost_s={budget:g} s cannot be met: a durable write "
                                                    f"takes {m.durable_s:.1f} s; writing continuously, so losing the "
                                                    f"node loses up to {2 * m.durable_s:.1f} s"))
                durable_s = 0.0
    return Intervals(n, durable_s, tuple(notes))


class BudgetPlanner:
    """The runtime of a budget :class:`Schedule` for one manager.

    Thread-safe: ``should_save`` and ``saved`` run on the training thread, ``durable`` on it
    too (inside ``save()``), ``finished`` on the persist thread.

    Args:
        schedule: a schedule with a budget (``schedule.budget``).
        clock: seconds, monotonic (injectable: tests drive it by hand). The times passed to
            :meth:`finished` are on this clock.
        tiered: the manager has a local tier (without one every save is durable).
        making: True while a save made now would wait for its staging slot to be made
            (:meth:`~ckptmgr.save.slots.SlotPool.making`): a save that is due is then put off
            to the first step after (a wait for memory being pinned is not what a save costs,
            and would break ``max_overhead``). None: never.

    Example:
        >>> now = [0.0]
        >>> p = BudgetPlanner(Schedule(max_overhead=0.1), clock=lambda: now[0])
        >>> for step in range(4):
        ...     now[0] += 1.0
        ...     p.should_save(step)
        False
        False
        False
        True
    """

    def __init__(self, schedule: Schedule, *, clock: Callable[[], float] = time.perf_counter,
                 tiered: bool = True, making: Callable[[], bool] | None = None) -> None:
        self.schedule = schedule
        self.tiered = tiered
        self._making = making
        self._clock = clock
        self._lock = threading.Lock()
        self.step_s: float | None = None
        self.save_cost_s: float | None = None
        self.local_s: float | None = None
        self.durable_s: float | None = None
        self.durable_bps: float | None = None
        self._prev: tuple[int, float] | None = None  # the last should_save step and its time
        self._intervals = 0  # step intervals measured
        self._warm: list[float] = []  # the first WARMUP of them
        self._window: list[float] | None = None  # see saved()
        self._last_save: tuple[int, float] | None = None
        self._first_save_t: float | None = None
        self._saves = 0
        self._in_flight: set[int] = set()  # steps sent durable, not resolved yet
        self._last_durable_t: float | None = None  # when the last save sent durable was made (its call began)
        self._durable_step: int | None = None  # the step durable() last sent durable, until saved() of it
        self._last_commit_t: float | None = None  # when the last durable write ended
        self._commits: list[float] = []  # times of the durable commits (first and last kept)
        self._commit_count = 0
        self._cost_total = 0.0  # what saves cost the loop so far, one-time parts included
        self._cost_recurring = 0.0  # ... less the one-time parts (what max_overhead is held to)
        self._start_t: float | None = None
        self._told: set[str] = set()

    # ------------------------------------------------------------ decisions

    def measurements(self) -> Measurements:
        with self._lock:
            return Measurements(self.step_s, self.save_cost_s, self.local_s, self.durable_s)

    def intervals(self) -> Intervals:
        """The intervals kept now (:func:`plan` of the measurements so far)."""
        it = plan(self.schedule, self.measurements())
        self._tell(it)
        return it

    def should_save(self, step: int) -> bool:
        """Record that the loop reached ``step`` now; whether to save it."""
        due = self._due(step)
        if due and self._making is not None and self._making() and not self._lost_overdue(self._clock()):
            return False  # (the slot is being made: the next step saves, unless max_lost_s would be overrun)
        return due

    def _lost_overdue(self, now: float) -> bool:
        """True when ``max_lost_s`` is set and one more step without a save would take the time
        since the last save, plus the local commit, past it."""
        budget = self.schedule.max_lost_s
        if budget is None:  # (asked every step: no lock taken without the budget)
            return False
        with self._lock:
            last = self._last_save
            ahead = (self.step_s or 0.0) + (self.local_s or 0.0)
        return last is not None and now - last[1] + ahead > budget + 1e-9

    def _due(self, step: int) -> bool:
        now = self._clock()
        with self._lock:
            self._observe(step, now)
            measured = self._intervals >= WARMUP
            last = self._last_save
        if not measured and last is None:
            return False  # the step time first (the first save measures what a save costs)
        it = self.intervals()
        since = math.inf if last is None else step - last[0]
        if since < self.schedule.local_every:
            return False
        if self.schedule.max_overhead is not None:
            with self._lock:
                probing = self.save_cost_s is None
                window_open = self._window is not None
            if probing:  # what a save costs is not known yet: one save per window, to measure it
                return not window_open
            return it.local_steps is not None and since >= it.local_steps and self._affordable(now)
        if it.local_steps is not None and since >= it.local_steps:
            return True
        if self._lost_overdue(now):  # (seconds, not steps: a save's own cost and slower steps count too)
            return True
        return it.durable_s is not None and self._durable_due(now, it)  # (None: no durable budget to keep)

    def durable(self, step: int, since_durable_s: float | None) -> bool:
        """Whether the save of ``step`` being made goes to the durable target too (the
        saver asks once per save; ``since_durable_s`` is ignored: the planner keeps its own)."""
        now = self._clock()
        go = not self.tiered or self._durable_due(now, self.intervals())
        with self._lock:
            if go:
                self._in_flight.add(step)
                self._last_durable_t = now
                self._durable_step = step  # (saved() moves the time back to when the call began)
        return go

    def abandoned(self, step: int) -> None:
        """The save of ``step`` raised before it was queued: no durable write of it is in flight
        (else the schedule would wait for it for ever and send no durable save again)."""
        with self._lock:
            self._in_flight.discard(step)
            if self._durable_step == step:
                self._durable_step = None

    def durable_asked(self, step: int, *, started: float | None = None) -> None:
        """The save of ``step`` goes to the durable target because its caller asked
        (``save(durable=True)``), not because :meth:`durable` said so. ``started``: when the
        save call began (default: now)."""
        now = self._clock()
        with self._lock:
            self._in_flight.add(step)
            self._last_durable_t = now if started is None else min(started, now)

    def _affordable(self, now: float) -> bool:
        """``max_overhead`` as a budget over the run so far: the saves' costs (one-time parts
        aside), the next one's included, are within the share of the time since the first
        step. In steady state the interval alone keeps it; it binds after saves that cost more
        than the estimate, and after the first save (which no earlier time paid for)."""
        assert self.schedule.max_overhead is not None
        with self._lock:
            start, spent, next_cost = self._start_t, self._cost_recurring, self.save_cost_s or 0.0
            if self._window is not None:
                spent += max(0.0, self._window[1])
        return start is None or spent + next_cost <= self.schedule.max_overhead * (now - start) + 1e-9

    def _durable_due(self, now: float, it: Intervals) -> bool:
        if it.durable_s is None:
            return True
        with self._lock:
            if self._in_flight:
                return False
            last, step_s = self._last_durable_t, self.step_s or 0.0
        return last is None or now - last + step_s >= it.durable_s

    # ------------------------------------------------------------ measurements

    def _observe(self, step: int, now: float) -> None:
        """(lock held) One should_save call: a step interval, charged to a save's window or
        taken as the step time."""
        if self._start_t is None:
            self._start_t = now
        prev, self._prev = self._prev, (step, now)
        if prev is None or step <= prev[0]:
            return
        steps = step - prev[0]
        dt = (now - prev[1]) / steps
        w = self._window
        if w is not None:
            if self.step_s is not None:
                # Shorter steps count too: a loop that queues GPU work ahead of the GPU waits for
                # it at the save (wait_staged), then runs ahead again for a few steps; the save
                # costs only what the window loses in all (the total is never below zero).
                w[1] += (dt - self.step_s) * steps
            w[0] -= steps
            if w[0] <= 0:
                self._close_window()
            return
        self._intervals += 1
        if self._intervals <= WARMUP:  # the median of the first few: a slow first step (start-up) is no baseline
            self._warm.append(dt)
            self.step_s = statistics.median(self._warm)
        else:
            self.step_s = (1 - ALPHA) * (self.step_s or dt) + ALPHA * dt

    def _close_window(self) -> None:
        w, self._window = self._window, None
        if w is None:
            return
        cost = max(0.0, w[1])
        self._cost_total += cost + w[3]
        if w[2]:
            self._cost_recurring += cost
            self.save_cost_s = cost if self.save_cost_s is None else (1 - ALPHA) * self.save_cost_s + ALPHA * cost

    def saved(self, step: int, *, allocated: bool = False, one_time_s: float | None = None,
              started: float | None = None) -> None:
        """A save of ``step`` was made (after the should_save call of its step).
        ``allocated``: it made staging memory, a one-time cost that is not charged to saves:
        ``one_time_s``, the seconds that took, is taken off what the save's window measures;
        None (not known): the save is not counted at all. ``started``: when the save call
        began, on the planner's clock (default: now). The state saved is the state then, so
        the time lost to a crash (``max_lost_s``, ``durable_max_lost_s``) and the interval
        achieved count from there: a save that waited for a slot must not move the next one
        later by its wait."""
        now = self._clock()
        began = now if started is None else min(started, now)
        one_time = max(0.0, one_time_s or 0.0) if allocated else 0.0
        with self._lock:
            self._close_window()
            # [intervals left, extra seconds so far less the one-time part, count it, the one-time part]
            self._window = [float(WINDOW), -one_time, 0.0 if allocated and one_time_s is None else 1.0, one_time]
            self._last_save = (step, began)
            if self._durable_step == step:  # sent durable by durable(), inside this save's call
                self._durable_step = None
                if self._last_durable_t is not None:
                    self._last_durable_t = min(self._last_durable_t, began)
            self._saves += 1
            if self._first_save_t is None:
                self._first_save_t = began

    def saved_once(self, step: int) -> None:
        """A save of ``step`` made by a framework's own checkpointing, told for each file it
        writes (a top-k and a last checkpoint of one step): counted once per step. The first
        save of this planner makes the writer's staging memory, a one-time cost it does not
        time: that save is not charged (see :meth:`saved`)."""
        with self._lock:
            if self._last_save is not None and self._last_save[0] == step:
                return
            first = self._saves == 0
        self.saved(step, allocated=first)

    def finished(self, step: int, *, durable: bool, nbytes: int = 0, staged_at: float | None = None,
                 committed_at: float | None = None, local_s: float | None = None) -> None:
        """The save of ``step`` resolved: written durably (``durable``; staged at
        ``staged_at`` and committed at ``committed_at`` on the planner's clock), kept local,
        superseded, or failed (``durable`` False)."""
        with self._lock:
            self._in_flight.discard(step)
            if local_s is not None:
                self.local_s = local_s if self.local_s is None else (1 - ALPHA) * self.local_s + ALPHA * local_s
            if not durable or committed_at is None:
                return
            start = staged_at if staged_at is not None else committed_at
            if self._last_commit_t is not None:
                start = max(start, self._last_commit_t)
            write = max(committed_at - start, 1e-6)
            self._last_commit_t = committed_at
            # a slower write counts at once (the loss budget must hold from the next save on), a
            # faster one eases the estimate down
            self.durable_s = write if self.durable_s is None or write > self.durable_s else (
                (1 - ALPHA_DURABLE) * self.durable_s + ALPHA_DURABLE * write)
            if nbytes:
                self.durable_bps = nbytes / self.durable_s
            self._commit_count += 1
            self._commits = [self._commits[0] if self._commits else committed_at, committed_at]

    # ------------------------------------------------------------ reporting

    def _tell(self, it: Intervals) -> None:
        """Say once per budget that cannot be met, and once the first plan, with the numbers."""
        new: list[str] = []
        with self._lock:
            for key, text in it.notes:
                if key not in self._told:
                    self._told.add(key)
                    new.append(text)
            first = "plan" not in self._told and self.step_s is not None and (
                self.schedule.max_overhead is None or self.save_cost_s is not None)
            if first:
                self._told.add("plan")
        for text in new:
            log.warning("checkpoint schedule: %s", text)
        if first:
            m = self.measurements()
            durable = ("every save (coalesced to the newest when the target falls behind)" if it.durable_s is None
                       else "as soon as the last durable write ended" if it.durable_s == 0
                       else f"every {it.durable_s:.1f} s")
            local = "when a durable save is due" if it.local_steps is None else f"every {it.local_steps} steps"
            log.info("checkpoint schedule: a save %s (steps of %.3f s, a save costs the loop %s), "
                     "durable %s; adapted as these change", local, m.step_s or 0.0,
                     "unmeasured" if m.save_cost_s is None else f"{m.save_cost_s:.3f} s", durable)

    def stats(self) -> dict[str, float]:
        """The intervals planned and achieved, and what they are based on (keys present once
        measured): ``interval_steps`` (planned), ``interval_s`` (achieved: mean seconds
        between saves), ``durable_interval_s`` (achieved: mean seconds between durable
        commits), ``overhead`` (achieved: seconds saves added to the loop, as a share of the
        time since the first step), ``step_s``, ``save_cost_s``, ``durable_write_s``,
        ``durable_bytes_per_s``."""
        it = plan(self.schedule, self.measurements())
        now = self._clock()
        with self._lock:
            out: dict[str, float] = {} if it.local_steps is None else {"interval_steps": float(it.local_steps)}
            if self._saves > 1 and self._last_save is not None and self._first_save_t is not None:
                out["interval_s"] = (self._last_save[1] - self._first_save_t) / (self._saves - 1)
            if self._commit_count > 1:
                out["durable_interval_s"] = (self._commits[1] - self._commits[0]) / (self._commit_count - 1)
            if self._start_t is not None and now > self._start_t:
                out["overhead"] = self._cost_total / (now - self._start_t)
            for key, value in (("step_s", self.step_s), ("save_cost_s", self.save_cost_s),
                               ("durable_write_s", self.durable_s), ("durable_bytes_per_s", self.durable_bps)):
                if value is not None:
                    out[key] = value
        return out
