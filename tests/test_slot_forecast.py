"""When the default options make a third staging slot: the forecast of the next saves against
the durable writes (ckptmgr.save.forecast), on its own and driving the real slot pool on a
simulated clock (saves every ``interval`` seconds, one durable write at a time, each taking
``write_s``): two slots while the writes keep pace, a third made early enough before the
first save that would wait, never at the first sign of overlap, and at once when the disk
slows down mid-run."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from ckptmgr import CheckpointManager, StagingOptions
from ckptmgr.save import slot_capacity
from ckptmgr.save.forecast import Progress, Writes, WriteWatch, first_wait
from ckptmgr.save.slots import SlotPool, slot_bytes
from ckptmgr.storage.local import LocalTarget

MIB = 1 << 20
SIZES = [3 * MIB, MIB]
PER = slot_bytes(SIZES)


# ------------------------------------------------------------------ the forecast on its own

def test_two_slots_carry_saves_while_each_write_ends_before_the_save_after_next():
    # a decoder saving every 2.45 s, its write 3.0 s: at its second save the first write ends at
    # 3.1 s; the third save (4.9 s) reuses that slot, the fourth the second's (ends 6.1 s)
    assert first_wait(now=2.45, interval=2.45, write_s=3.0, free_at=[3.1], queued=1,
                      writing_ends=3.1, horizon_s=2.45 + 1.5 * 1.3) is None
    # looking far enough ahead, the backlog (0.55 s a save) makes the seventh save wait
    assert first_wait(now=2.45, interval=2.45, write_s=3.0, free_at=[3.1], queued=1,
                      writing_ends=3.1, horizon_s=60) == pytest.approx(6 * 2.45)
    # at its sixth save, that wait is the next save's
    assert first_wait(now=12.25, interval=2.45, write_s=3.0, free_at=[15.1], queued=1,
                      writing_ends=15.1, horizon_s=4.4) == pytest.approx(14.7)


def test_saves_faster_than_the_first_write_want_the_slot_at_once():
    # 4.83 GB every 1.32 s, its first write 2.6 s: the third save (2.64 s) finds both slots busy
    assert first_wait(now=1.32, interval=1.32, write_s=2.6, free_at=[2.7], queued=1,
                      writing_ends=2.7, horizon_s=1.32 + 1.5 * 1.5) == pytest.approx(2.64)


def test_writes_faster_than_the_saves_never_need_a_third_slot():
    assert first_wait(now=5.0, interval=2.0, write_s=1.9, free_at=[5.5], queued=1,
                      writing_ends=5.5, horizon_s=1e6) is None


def test_a_slot_free_now_and_nothing_known_of_the_spacing():
    assert first_wait(now=1.0, interval=1.0, write_s=5.0, free_at=[1.0, 1.0], queued=0,
                      writing_ends=1.0, horizon_s=1.5) is None
    assert first_wait(now=1.0, interval=0.0, write_s=5.0, free_at=[9.0], queued=1,
                      writing_ends=9.0, horizon_s=100) is None


def test_the_watch_times_a_write_from_its_progress_before_any_completed():
    watch = WriteWatch()
    assert watch.view(0.0, 100) is None  # nothing known
    p = Progress()
    watch.begin(0, 1000, 10.0, p)
    p.add(10)  # 1%: too little to trust
    assert watch.view(11.0, 1000) is None
    p.add(390)  # 40% after 2 s: 200 B/s, 3 s left
    w = watch.view(12.0, 1000)
    assert w == Writes(write_s=pytest.approx(5.0), slot=0, ends=pytest.approx(15.0))
    watch.end(15.0, ok=True)
    assert watch.rate == pytest.approx(200.0)
    assert watch.view(20.0, 500) == Writes(write_s=pytest.approx(2.5), slot=None, ends=20.0)


def test_a_write_that_reported_all_its_bytes_is_timed_from_its_start_not_taken_as_done():
    """Bytes can run ahead of a write's end (an fsync, an upload at close, a multi-rank commit):
    once all are reported, the write is timed by the last completed write's rate, from its start;
    before any write completed, it cannot be timed at all."""
    watch = WriteWatch()
    p = Progress()
    watch.begin(0, 1000, 0.0, p)
    p.add(1000)
    assert watch.view(0.5, 1000) is None  # (all reported, still running, nothing completed)
    watch.end(4.0, ok=True)  # 250 B/s, tail included
    p = Progress()
    watch.begin(1, 1000, 10.0, p)
    p.add(1000)
    assert watch.view(10.5, 1000) == Writes(write_s=pytest.approx(4.0), slot=1, ends=pytest.approx(14.0))
    assert watch.view(14.5, 1000) is None  # its tail runs longer than the last write's: not timed


def test_a_target_that_reports_no_bytes_is_timed_from_the_writes_start_until_it_is_overdue():
    watch = WriteWatch()
    watch.begin(1, 1000, 0.0, Progress())
    watch.end(2.0, ok=True)  # 500 B/s
    watch.begin(0, 1000, 10.0, Progress())  # (S3, GDS: nothing reported)
    assert watch.view(11.5, 1000) == Writes(write_s=pytest.approx(2.0), slot=0, ends=pytest.approx(12.0))
    assert watch.view(13.0, 1000) is None  # overdue, and nothing tells how much is left: not timed


def test_a_disk_that_slows_down_counts_at_once_and_a_failed_write_sets_no_rate():
    watch = WriteWatch()
    watch.begin(1, 1000, 0.0, Progress())
    watch.end(1.0, ok=True)  # 1000 B/s
    p = Progress()
    watch.begin(0, 1000, 2.0, p)
    p.add(100)  # 100 B/s now
    w = watch.view(3.0, 1000)
    assert w is not None and w.write_s == pytest.approx(10.0) and w.ends == pytest.approx(12.0)
    watch.end(4.0, ok=False)
    assert watch.rate == pytest.approx(1000.0)


# ------------------------------------------------------- the real pool on a simulated clock

class _Run:
    """Saves every ``interval`` s into a real SlotPool (no local tier: a slot is busy until its
    durable write ends) and durable writes one at a time; the pool's clock is simulated.

    Without a local tier nothing supersedes a step waiting for its write: where the disk is
    slower than the saves, even three slots only put the first wait off. With one (the default),
    the third slot lets the newest step supersede the queued one, and no save waits; the
    forecast decides the same in both: when two slots would first make a save wait."""

    def __init__(self, monkeypatch, interval: float, write_s, make_s: float = 1.3, first_stall: float = 0.0,
                 reports: bool = True) -> None:
        self.now = 0.0
        self.pool = SlotPool(None, tier=None, max_host_bytes=None, memory=None)
        self.pool.clock = lambda: self.now
        self.pool.check_capacity(SIZES)
        self.interval, self.write_s, self.make_s = interval, write_s, make_s
        self.first_stall = first_stall  # the first save's own stall (it makes its slot on the spot)
        self.reports = reports  # the target reports its bytes as written (S3 and GDS do not)
        self.grown: list[int] = []  # saves that found no slot and added one on the spot (the training thread's)
        self.watch = WriteWatch()
        self.queue: list = []  # (slot, step) waiting for their write
        self.writing: tuple | None = None  # (slot, step, began, ends, progress)
        self.waits: list[int] = []  # saves that found no slot
        self.added: list[tuple[float, int]] = []  # (time, slots after) each time the pool added one
        self.used: dict[int, float] = {}  # slot index -> when a save first took it

    def _decide(self) -> None:
        if self.writing is not None and self.reports:  # the write in flight reports its bytes so far
            _, _, began, ends, progress = self.writing
            want = int(PER * min(1.0, (self.now - began) / (ends - began)))
            progress.add(want - progress.bytes)
        if self.pool.spare(self.watch.view(self.now, PER)):
            reserved = self.pool.reserve()
            self.pool.prepare(SIZES, reserved)  # (made at once here; make_s is what the pool plans with)
            self.pool._make_s = self.make_s
            self.added.append((self.now, len(self.pool.slots)))

    def _start_write(self) -> None:
        if self.writing is None and self.queue:
            slot, step = self.queue.pop(0)
            p = Progress()
            self.watch.begin(slot.index, PER, self.now, p)
            self.writing = (slot, step, self.now, self.now + self.write_s(self.now), p)

    def run(self, saves: int) -> None:
        for k in range(saves):
            t_save = 0.0 if k == 0 else self.first_stall + k * self.interval  # (intervals of training)
            while self.writing is not None and self.writing[3] <= t_save:  # writes ending first
                slot, step, _, ends, _ = self.writing
                self.now = ends
                self.watch.end(ends, ok=True)
                self.pool.release(slot, step=step, durable=True)
                self.writing = None
                self._start_write()
            self.now = t_save
            count = len(self.pool.slots)
            slot, _ = self.pool.acquire(wait=False, timeout=None)
            if slot is None:
                self.waits.append(k)
                continue
            if k > 0 and len(self.pool.slots) > count:
                self.grown.append(k)
            self.used.setdefault(slot.index, t_save)
            if slot.kind == "none":
                self.pool.fit(slot, SIZES)  # the first save makes its own slot
            self.queue.append((slot, k))
            self.now = t_save + (self.first_stall if k == 0 else 0.0)
            self._start_write()
            self._decide()
            self.pool.returned()


def test_a_decoder_whose_disk_lags_gets_its_third_slot_just_before_it_is_needed(monkeypatch):
    two = _Run(monkeypatch, interval=2.45, write_s=lambda now: 3.0)
    two.pool.max_slots = 2
    two.run(40)
    assert two.waits[0] == 6  # two slots alone: the seventh save is the first to wait
    run = _Run(monkeypatch, interval=2.45, write_s=lambda now: 3.0)
    run.run(40)
    assert [n for _, n in run.added] == [2, 3]
    when, _ = run.added[1]
    assert when > 4 * 2.45, run.added  # not within the first four saves: two slots carry them
    assert when <= 6 * 2.45 - 1.5 * run.make_s + 1e-9, run.added  # made in time for that seventh save
    assert run.waits[0] > 6, run.waits  # (later waits: no tier here, nothing supersedes)


def test_saves_that_outpace_the_first_write_get_the_third_slot_at_the_second_save(monkeypatch):
    # 4.83 GB every 25 steps of 52.8 ms on an H100 whose disk writes it in 2.2 s. The first save's own
    # stall (0.45 s, making its slot) is not part of the saves' spacing: counted from acquire to
    # acquire, the second save would seem 1.77 s after the first, and the third slot would come late
    # for the fourth save
    run = _Run(monkeypatch, interval=1.32, write_s=lambda now: 2.2, make_s=1.4, first_stall=0.45)
    run.run(20)
    assert run.added[:2] == [(0.45, 2), (pytest.approx(0.45 + 1.32), 3)]
    assert run.added[1][0] <= 0.45 + 3 * 1.32 - 1.4  # made before the fourth save, the first to need it


def test_a_disk_that_keeps_pace_never_costs_a_third_slot(monkeypatch):
    run = _Run(monkeypatch, interval=2.45, write_s=lambda now: 2.2)
    run.run(60)
    assert run.waits == [] and [n for _, n in run.added] == [2] and len(run.pool.slots) == 2


def test_a_disk_that_slows_down_mid_run_gets_the_third_slot_before_a_save_waits(monkeypatch):
    two = _Run(monkeypatch, interval=2.0, write_s=lambda now: 1.5 if now < 30 else 4.0)
    two.pool.max_slots = 2
    two.run(60)
    first = two.waits[0] * 2.0  # when two slots alone first make a save wait
    run = _Run(monkeypatch, interval=2.0, write_s=lambda now: 1.5 if now < 30 else 4.0)
    run.run(60)
    assert [n for _, n in run.added] == [2, 3]
    assert 30 <= run.added[1][0] <= first - 1.5 * run.make_s + 1e-9, (run.added, first)  # once slower, in time
    assert run.waits[0] * 2.0 > first, run.waits


def test_a_write_that_frees_its_slot_a_moment_after_a_save_comes_counts_as_a_wait(monkeypatch):
    """A save that finds no slot free makes one on the spot, on the training thread, however
    soon the write in flight would have ended: the forecast has no tolerance for it."""
    run = _Run(monkeypatch, interval=2.0, write_s=lambda now: 2.145)
    run.run(24)
    assert run.grown == [], (run.grown, run.added)
    assert [n for _, n in run.added] == [2, 3]


def test_a_target_that_reports_no_bytes_and_slows_down_gets_the_third_slot_in_the_background(monkeypatch):
    run = _Run(monkeypatch, interval=2.0, write_s=lambda now: 1.5 if now < 30 else 5.0, reports=False)
    run.run(40)
    assert run.grown == [], (run.grown, run.added)
    assert [n for _, n in run.added] == [2, 3] and run.added[1][0] >= 30


# ------------------------------------------------------------------ the manager's wiring

def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 1024, generator=g), "step": seed}  # 1 MiB


def test_every_durable_write_reports_its_bytes_and_sets_the_rate(tmp_path, monkeypatch):
    reported: list[int] = []
    real_begin = LocalTarget.begin

    def begin(self, step, prefix=""):
        w = real_begin(self, step, prefix)
        real_write = w.write_files

        def write_files(files, chunk_size, *, checksum=True):
            outer = w.progress
            assert outer is not None  # the saver asks every durable write for its progress
            w.progress = lambda n: (reported.append(n), outer(n))
            return real_write(files, chunk_size, checksum=checksum)

        w.write_files = write_files
        return w

    monkeypatch.setattr(LocalTarget, "begin", begin)
    with CheckpointManager(str(tmp_path / "root"), staging=StagingOptions(local_tier=False)) as mgr:
        info = mgr.save(1, {"w": torch.ones(9, 1 << 20)}).result(timeout=30)  # 36 MiB: written with O_DIRECT
        # the bytes written with O_DIRECT, as they are (not the small files, nor a file's unaligned tail:
        # those go through the page cache, which would report them before they reach the disk)
        assert 0.9 * info.bytes <= sum(reported) <= info.bytes, (sum(reported), info.bytes)
        assert all(n % 4096 == 0 for n in reported)
        assert mgr._saver._writes.rate is not None and mgr._saver._writes.rate > 0


def test_the_saves_spacing_counts_from_the_previous_saves_return(tmp_path, monkeypatch):
    """The first save makes its own slot (its stall, 0.45 s here on the pool's clock); the
    spacing of the saves, for the forecast, is the training time after it returned."""
    now = [100.0]
    real_fit = SlotPool.fit
    main = threading.current_thread()

    def fit(self, *args, **kw):
        if threading.current_thread() is main:
            now[0] += 0.45  # (the first save's own slot)
        return real_fit(self, *args, **kw)

    monkeypatch.setattr(SlotPool, "fit", fit)
    with CheckpointManager(str(tmp_path / "root"), staging=StagingOptions(local_tier=False)) as mgr:
        pool = mgr._saver.pool
        pool.clock = lambda: now[0]
        mgr.save(1, _state(1)).result(timeout=30)
        mgr.wait(timeout=30)
        now[0] += 1.32  # training
        mgr.save(2, _state(2)).result(timeout=30)
        assert pool._interval == pytest.approx(1.32), pool._interval  # (1.77 from acquire to acquire)


@pytest.mark.parametrize("tier", [True, False], ids=["local-tier", "no-tier"])
@pytest.mark.parametrize("wait_predicted", [False, True], ids=["no-wait", "wait"])
def test_a_save_that_overlaps_a_write_gets_a_third_slot_only_when_the_forecast_says_so(
        tmp_path, monkeypatch, caplog, wait_predicted, tier):
    """Step 2's durable write is held (a gate at its start) while step 3 is saved: both slots
    are then busy and saves overlap, where the earlier rule always made a third slot. With a
    write timed (step 1's), the pool follows the forecast, whose answer is fixed here."""
    gate, held = threading.Event(), threading.Event()
    real_begin = LocalTarget.begin

    def begin(self, step, prefix=""):
        if step >= 2:
            held.set()
            assert gate.wait(30)
        return real_begin(self, step, prefix)

    monkeypatch.setattr(LocalTarget, "begin", begin)
    asked: list[Writes] = []

    def forecast(**kw):
        asked.append(kw)
        return kw["now"] + 0.5 if wait_predicted else None

    monkeypatch.setattr(slot_capacity, "first_wait", forecast)
    caplog.set_level(logging.INFO, logger="ckptmgr")
    local = tmp_path / "shm"
    local.mkdir()
    mgr = CheckpointManager(str(tmp_path / "root"), staging=StagingOptions(local_tier=tier, local_dir=str(local)))
    try:
        mgr.save(1, _state(1)).result(timeout=30)
        mgr.wait(timeout=30)  # (the second slot, made in the background)
        with mgr._saver._mu:  # a slow disk (step 1's write took milliseconds: step 2's, held, would look overdue)
            mgr._saver._writes.rate = 1e3
        h2 = mgr.save(2, _state(2))
        assert held.wait(30)  # step 2's write is in flight
        h3 = mgr.save(3, _state(3))
        h3.wait_staged(30)
        assert len(asked) == 1 and asked[0]["write_s"] > 1, asked  # asked once, with the rate set above
        # the slot being written is free once its write ends; the one step 3 took waits for its write
        assert len(asked[0]["free_at"]) == 1 and asked[0]["queued"] == 1, asked
        assert mgr.stats()["slots"] == (3 if wait_predicted else 2), mgr.stats()
        told = [r.getMessage() for r in caplog.records if "staging slot 3 of at most 3" in r.getMessage()]
        assert len(told) == (1 if wait_predicted else 0) and all("would wait" in m for m in told), told
    finally:
        gate.set()
    h2.result(timeout=30)
    h3.result(timeout=30)
    mgr.close()



class _Gated:
    """A manager whose steps from 2 on are held at the start of their durable write, and whose
    slot makers (the ``ckptmgr-prepare`` threads) find the copies they wait for still running
    until ``copies_land`` is set; the forecast says a save would wait."""

    def __init__(self, tmp_path, monkeypatch, tier: bool) -> None:
        from ckptmgr.errors import CkptTimeoutError
        from ckptmgr.save.staging import StagingJob

        self.gate, self.held = threading.Event(), threading.Event()
        self.copies_land = threading.Event()
        self.maker_waiting = threading.Event()  # a maker waits for a save's copies
        self.third_started = threading.Event()
        self.started: list[tuple[int, bool]] = []  # (slot, copies landed) as each slot's making starts
        real_begin, real_wait, real_fit = LocalTarget.begin, StagingJob.wait, SlotPool.fit

        def begin(target, step, prefix=""):
            if step >= 2:
                self.held.set()
                assert self.gate.wait(30)
            return real_begin(target, step, prefix)

        def wait(job, timeout=None):
            if threading.current_thread().name.startswith("ckptmgr-prepare"):
                self.maker_waiting.set()
                if not self.copies_land.wait(30 if timeout is None else timeout):
                    raise CkptTimeoutError("(the test's gate: the copies are still running)")
            return real_wait(job, timeout)

        def fit(pool, slot, sizes, *, hurry=True, spare=False):
            if slot.kind == "none" and threading.current_thread().name.startswith("ckptmgr-prepare"):
                self.started.append((slot.index, self.copies_land.is_set()))
                if slot.index == 2:
                    self.third_started.set()
            return real_fit(pool, slot, sizes, hurry=hurry, spare=spare)

        monkeypatch.setattr(LocalTarget, "begin", begin)
        monkeypatch.setattr(StagingJob, "wait", wait)
        monkeypatch.setattr(SlotPool, "fit", fit)
        monkeypatch.setattr(slot_capacity, "first_wait", lambda **kw: kw["now"] + 0.5)
        local = tmp_path / "shm"
        local.mkdir()
        self.mgr = CheckpointManager(str(tmp_path / "root"),
                                     staging=StagingOptions(local_tier=tier, local_dir=str(local)))

    def overlap(self) -> list:
        """Saves 1 to 3: the second slot made (at once), then step 2's write held while step 3
        is saved, which asks for a third slot."""
        mgr = self.mgr
        mgr.save(1, _state(1)).result(timeout=30)
        mgr.wait(timeout=30)  # the second slot: made at once, while copies_land is still shut
        assert self.started == [(1, False)] and not self.maker_waiting.is_set(), self.started
        with mgr._saver._mu:
            mgr._saver._writes.rate = 1e3  # (a slow disk: see the test above)
        h2 = mgr.save(2, _state(2))
        assert self.held.wait(30)
        h3 = mgr.save(3, _state(3))
        assert mgr.stats()["slots"] == 3  # reserved at once
        assert self.maker_waiting.wait(30)  # its maker waits for step 3's copies,
        assert not self.third_started.is_set()  # and has not started it
        return [h2, h3]

    def end(self, handles: list) -> None:
        self.copies_land.set()
        self.gate.set()
        for h in handles:
            h.result(timeout=30)
        self.mgr.close()


@pytest.mark.parametrize("tier", [True, False], ids=["local-tier", "no-tier"])
def test_a_slot_the_forecast_adds_is_made_once_the_copies_of_its_save_have_landed(tmp_path, monkeypatch, tier):
    """Making a slot beside a save's copies slows them while the training step waits for them.
    The default's second slot, asked for by the first save, starts at once (the next save may
    come soon); a slot the forecast adds ahead of need starts once the copies of the save that
    asked for it have landed (reserved at once: a save that needs it waits for it)."""
    run = _Gated(tmp_path, monkeypatch, tier)
    handles: list = []
    try:
        handles = run.overlap()
        run.copies_land.set()
        assert run.third_started.wait(30)
        assert run.started == [(1, False), (2, True)], run.started
    finally:
        run.end(handles)


def test_a_save_that_comes_to_wait_for_that_slot_starts_it_without_the_copies(tmp_path, monkeypatch):
    """While the third slot's maker waits for step 3's copies, step 4 finds no slot free (step
    2's write is held, step 3's queued behind it): it waits for the slot being made, and its
    wait (the pool's ``hurry``) starts the making at once, copies landed or not."""
    run = _Gated(tmp_path, monkeypatch, tier=False)
    handles: list = []
    try:
        handles = run.overlap()
        got: list = []
        saver = threading.Thread(target=lambda: got.append(run.mgr.save(4, _state(4))), daemon=True)
        saver.start()
        assert run.third_started.wait(30)  # with the copies still "running"
        saver.join(30)
        assert not saver.is_alive() and len(got) == 1
        handles.append(got[0])
        assert run.started == [(1, False), (2, False)], run.started
        assert not run.copies_land.is_set()
    finally:
        run.end(handles)


def test_a_maker_that_fails_before_making_gives_its_slot_up(tmp_path, monkeypatch):
    """A maker interrupted while it waits for a save's copies (any BaseException) gives up
    the slot it reserved: a save never waits for a slot nobody makes, and the pool may add it
    again."""
    from ckptmgr.save.saver import Saver

    def interrupted(saver, after):
        raise KeyboardInterrupt  # (as a helper thread cannot be interrupted, a stand-in for any BaseException)

    monkeypatch.setattr(Saver, "_await_copies", interrupted)
    errors: list = []
    told = threading.Event()  # the maker's thread ended with its error

    def hook(args):
        errors.append(args.exc_type)
        told.set()

    monkeypatch.setattr(threading, "excepthook", hook)
    run = _Gated(tmp_path, monkeypatch, tier=False)
    handles: list = []
    try:
        mgr = run.mgr
        mgr.save(1, _state(1)).result(timeout=30)
        mgr.wait(timeout=30)
        with mgr._saver._mu:
            mgr._saver._writes.rate = 1e3
        handles.append(mgr.save(2, _state(2)))
        assert run.held.wait(30)
        handles.append(mgr.save(3, _state(3)))
        assert told.wait(30)  # (after the maker's finally)
        assert errors == [KeyboardInterrupt], errors
        pool = mgr._saver.pool
        assert not any(sl.preparing for sl in pool.slots)  # nothing left reserved
        assert [sl.index for sl in pool.slots if sl.kind == "none"] == [2]  # never made, to be made again
    finally:
        run.end(handles)
