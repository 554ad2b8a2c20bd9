"""A spare staging slot (one made while training runs, for a later save) is made gently: its
pieces are pinned with a pause of at least ``SPARE_DUTY`` times each registration, the pause
ends at once when a save comes to wait for the slot, and its files are populated by fewer
threads. The first slot a pool makes (the one the next save needs) keeps the short pauses.

CUDA's registration is faked (no GPU here) on a simulated clock: each registration advances
it by a fixed time, and the pauses are recorded instead of slept; the real registrations run
on a GPU in test_cuda.py."""

from __future__ import annotations

import threading

import pytest
import torch

import ckptmgr._cuda as cuda_shim
import ckptmgr.save.buffers as buffers_mod
from ckptmgr import CheckpointManager, StagingOptions
from ckptmgr.save import memory
from ckptmgr.save.buffers import PIN_PAUSE_S, SPARE_DUTY, anonymous_buffer
from ckptmgr.save.slots import SlotPool

CHUNK = 4096
REGISTER_S = 0.01  # simulated seconds one registration takes


class Clock:
    """``time`` for the buffers module: registrations advance it, pauses are recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.pauses.append(s)


class Hurry:
    """A save's ``hurry`` event: its waits are recorded as pauses (none block)."""

    def __init__(self, clock: Clock, set_after: int | None = None) -> None:
        self.clock = clock
        self.set_after = set_after  # set once this many pauses were taken
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        self.clock.pauses.append(timeout)
        if self.set_after is not None and len(self.clock.pauses) >= self.set_after:
            self._set = True
        return self._set


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    registered: list[int] = []

    def register(ptr, n, read_only=False):
        c.now += REGISTER_S
        registered.append(n)

    monkeypatch.setattr(cuda_shim, "available", lambda: True)
    monkeypatch.setattr(cuda_shim, "host_register", register)
    monkeypatch.setattr(cuda_shim, "host_unregister", lambda ptr: None)
    monkeypatch.setattr(buffers_mod, "PIN_PIECE_BYTES", 4 * CHUNK)
    monkeypatch.setattr(buffers_mod, "time", c)
    return c


def test_a_spare_pauses_after_each_piece_for_a_multiple_of_its_registration(clock):
    buf = anonymous_buffer(8 * 4 * CHUNK)  # eight pieces
    assert buf.pin(CHUNK, hurry=Hurry(clock), duty=SPARE_DUTY)
    assert len(buf.registered) == 8
    assert clock.pauses == [pytest.approx(SPARE_DUTY * REGISTER_S)] * 7  # between the pieces, none after the last
    assert min(clock.pauses) > PIN_PAUSE_S  # (the multiple is what sets it here)
    buf.unpin()


def test_the_slot_a_save_needs_next_keeps_the_short_pause(clock):
    buf = anonymous_buffer(8 * 4 * CHUNK)
    assert buf.pin(CHUNK, hurry=Hurry(clock))
    assert clock.pauses == [PIN_PAUSE_S] * 7
    buf.unpin()


def test_a_save_that_comes_to_wait_ends_the_spare_pauses(clock):
    buf = anonymous_buffer(8 * 4 * CHUNK)
    hurry = Hurry(clock, set_after=2)  # a save waits for the slot during the second pause
    assert buf.pin(CHUNK, hurry=hurry, duty=SPARE_DUTY)
    assert len(buf.registered) == 8 and len(clock.pauses) == 2  # no pause once it waits
    buf.unpin()


def _state(n: int) -> dict:
    return {f"t{i}": torch.full((CHUNK,), float(i)) for i in range(n)}


def test_prepare_makes_the_first_slot_at_full_speed_and_the_others_as_spares(root, monkeypatch, tmp_path):
    """``prepare()`` with the defaults where two slots fit: the first (the next save's) is made
    by every making thread with the short pauses; the second, made in the background once the
    first save holds the first, as a spare."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {(64 << 20) // 1024} kB\n")
    monkeypatch.setattr(memory, "MEMINFO", str(meminfo))
    monkeypatch.setattr(memory, "SELF_CGROUP", str(tmp_path / "no-such-cgroup-file"))
    monkeypatch.setattr(cuda_shim, "available", lambda: False)  # (the pinning is tested above)
    made: list[tuple[str, bool]] = []  # (thread, spare) per slot made
    real = SlotPool.fit

    def fit(self, slot, sizes, *, hurry=True, spare=False):
        if slot.kind == "none":  # (a save's fit of a slot already made allocates nothing)
            made.append((threading.current_thread().name, spare))
        return real(self, slot, sizes, hurry=hurry, spare=spare)

    monkeypatch.setattr(SlotPool, "fit", fit)
    state = _state(8)
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        mgr.prepare(state)
        mgr.wait(timeout=30)  # (waits for prepare())
        mgr.save(1, state).result(timeout=30)
        mgr.wait(timeout=30)
        assert mgr.stats()["slots"] == 2, mgr.stats()
    assert [spare for _, spare in made] == [False, True], made
    assert all(name.startswith("ckptmgr-prepare") for name, _ in made), made


@pytest.mark.parametrize("budget", [True, False], ids=["max_overhead", "defaults"])
def test_a_spare_waits_for_the_copies_of_its_save_only_where_the_next_save_is_far_off(root, monkeypatch, tmp_path,
                                                                                       budget):
    """Making a slot beside a save's copies slows them (page population and pinning compete with
    them) while the training step waits for them. Under ``Schedule(max_overhead=...)`` the next
    save is far off, so the spare the first save asks for is made once that save's copies have
    landed (reserved at once: a save that needs it waits for it rather than making it on the
    training thread). With the defaults the next save may come soon: the spare starts at once."""
    from ckptmgr import Schedule
    from ckptmgr.save.staging import StagingJob

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {(64 << 20) // 1024} kB\n")
    monkeypatch.setattr(memory, "MEMINFO", str(meminfo))
    monkeypatch.setattr(memory, "SELF_CGROUP", str(tmp_path / "no-such-cgroup-file"))
    monkeypatch.setattr(cuda_shim, "available", lambda: False)
    copies_land = threading.Event()  # the gate: the copies "land" for the spare's maker when the test opens it
    spare_started = threading.Event()
    maker_waited = threading.Event()  # the spare's maker waited for the save's copies
    started_before_copies: list[bool] = []
    real_wait, real_fit = StagingJob.wait, SlotPool.fit

    def wait(self, timeout=None):
        if threading.current_thread().name.startswith("ckptmgr-prepare"):  # (the spare's maker)
            maker_waited.set()
            assert copies_land.wait(30)
        return real_wait(self, timeout)

    def fit(self, slot, sizes, *, hurry=True, spare=False):
        if spare and slot.kind == "none":
            started_before_copies.append(not copies_land.is_set())
            spare_started.set()
        return real_fit(self, slot, sizes, hurry=hurry, spare=spare)

    monkeypatch.setattr(StagingJob, "wait", wait)
    monkeypatch.setattr(SlotPool, "fit", fit)
    state = _state(8)
    schedule = Schedule(max_overhead=0.01) if budget else None
    with CheckpointManager(root, staging=StagingOptions(local_tier=False), schedule=schedule) as mgr:
        mgr.prepare(state)
        mgr.wait(timeout=30)  # (the first slot, made by prepare())
        h = mgr.save(1, state)
        if budget:
            assert not spare_started.wait(0.5)  # (a bounded look: it must not start while the gate is shut)
            assert mgr.stats()["slots"] == 2  # reserved meanwhile
        else:
            assert spare_started.wait(30)  # started with the copies still running,
            assert not maker_waited.is_set()  # without waiting for them
        copies_land.set()
        assert spare_started.wait(30)
        h.result(timeout=30)
        mgr.wait(timeout=30)
    assert started_before_copies == [not budget], started_before_copies
    assert maker_waited.is_set() == budget


class _CountingCondition(threading.Condition):
    """The pool's lock, telling the test when ``calls`` of ``wait_for`` have been made."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls, self.made = calls, 0
        self.all_made = threading.Event()

    def wait_for(self, predicate, timeout=None):  # type: ignore[override]
        self.made += 1  # (lock held)
        if self.made >= self.calls:
            self.all_made.set()
        return super().wait_for(predicate, timeout)


def test_a_spares_files_are_made_two_at_a_time_until_a_save_waits_for_it(monkeypatch):
    """A spare's files are made (mapped, populated) by at most ``SPARE_THREADS`` threads at once
    while training runs; once a save comes to wait for the slot (``acquire`` finds it being
    made), every file left starts at once."""
    from ckptmgr.save import slot_buffers

    monkeypatch.setattr(cuda_shim, "available", lambda: False)
    files = 6
    pool = SlotPool(1, tier=None, max_host_bytes=None, memory=None)
    pool._cond = gate = _CountingCondition(files)
    entered: list[str] = []  # the files whose making began (guarded by ``seen``)
    seen = threading.Condition()
    release = threading.Event()
    real_make = SlotPool._make

    def make(self, index, name, nbytes, kind):
        with seen:
            entered.append(name)
            seen.notify_all()
        assert release.wait(30)
        return real_make(self, index, name, nbytes, kind)

    monkeypatch.setattr(SlotPool, "_make", make)
    slot = pool.slots[0]
    slot.preparing = True
    maker = threading.Thread(target=pool.fit, args=(slot, [CHUNK] * files), kwargs={"hurry": False, "spare": True})
    maker.start()
    try:
        assert gate.all_made.wait(30)  # every file has come to the gate,
        with seen:
            assert seen.wait_for(lambda: len(entered) >= slot_buffers.SPARE_THREADS, timeout=30)
            assert len(entered) == slot_buffers.SPARE_THREADS, entered  # and only two are being made
        got: list[object] = []
        saver = threading.Thread(target=lambda: got.append(pool.acquire(wait=True, timeout=30)))
        saver.start()  # a save comes and waits for the slot being made: the rest start at once
        with seen:
            assert seen.wait_for(lambda: len(entered) == files, timeout=30), entered
        release.set()
        maker.join(30)
        with pool._cond:
            slot.preparing = False
            pool._cond.notify_all()
        saver.join(30)
        assert got and got[0][0] is slot  # type: ignore[index]
        assert len(slot.buffers) == files and pool._making == 0
    finally:
        release.set()
        maker.join(30)


def test_closing_the_pool_ends_a_spares_making_without_making_the_files_still_waiting(monkeypatch):
    """``close`` (``stop``) ends the wait of a spare's files for their turn at once (not after a
    file being made finishes), and they are not made: the slot's making gives up, and the
    files made before are dropped."""
    from ckptmgr.save import slot_buffers

    monkeypatch.setattr(cuda_shim, "available", lambda: False)
    files = 5
    pool = SlotPool(1, tier=None, max_host_bytes=None, memory=None)
    pool._cond = gate = _CountingCondition(files)
    entered: list[str] = []  # the files whose making began (guarded by ``seen``)
    gave_up: list[str] = []  # the files that left the gate without being made (guarded by ``seen``)
    seen = threading.Condition()
    release = threading.Event()  # (the files being made finish only once it is set)
    real_make, real_gently = SlotPool._make, SlotPool._make_gently

    def make(self, index, name, nbytes, kind):
        with seen:
            entered.append(name)
            seen.notify_all()
        assert release.wait(120)  # (longer than the test waits for the others: they must not need it)
        return real_make(self, index, name, nbytes, kind)

    def gently(self, index, name, nbytes, kind):
        try:
            return real_gently(self, index, name, nbytes, kind)
        except slot_buffers.Closing:
            with seen:
                gave_up.append(name)
                seen.notify_all()
            raise

    monkeypatch.setattr(SlotPool, "_make", make)
    monkeypatch.setattr(SlotPool, "_make_gently", gently)
    slot = pool.slots[0]
    slot.preparing = True
    raised: list[BaseException] = []

    def fit() -> None:
        try:
            pool.fit(slot, [CHUNK] * files, hurry=False, spare=True)
        except BaseException as exc:  # (told to the test)
            raised.append(exc)

    maker = threading.Thread(target=fit)
    maker.start()
    try:
        assert gate.all_made.wait(30)  # every file has come to the gate,
        with seen:
            assert seen.wait_for(lambda: len(entered) >= slot_buffers.SPARE_THREADS, timeout=30)
            assert len(entered) == slot_buffers.SPARE_THREADS, entered  # two are being made (and held there)
        pool.close()
        with seen:  # the others leave while those two are still being made, unmade
            assert seen.wait_for(lambda: len(gave_up) == files - slot_buffers.SPARE_THREADS, timeout=30), gave_up
            assert len(entered) == slot_buffers.SPARE_THREADS, entered
    finally:
        release.set()
        maker.join(30)
    assert not maker.is_alive() and pool._making == 0
    assert len(raised) == 1 and isinstance(raised[0], slot_buffers.Closing), raised
    assert slot.buffers == [] and slot.kind == "none"  # the two made are dropped


class _WakeCountingCondition(threading.Condition):
    """The pool's lock, counting the threads waiting on it, the waits begun, and the
    notifications given while a thread waited (``wakes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = self.waits = self.wakes = 0  # (lock held)
        self.two_waits = threading.Event()

    def wait(self, timeout=None):  # type: ignore[override]
        self.waiting, self.waits = self.waiting + 1, self.waits + 1
        if self.waits >= 2:
            self.two_waits.set()
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1

    def notify_all(self) -> None:
        self.wakes += self.waiting > 0
        super().notify_all()


def test_two_saves_waiting_for_a_slot_being_made_do_not_wake_each_other():
    """A save that comes to wait for a slot being made, while another save already waits
    for it, wakes nobody (the spare's files were told to hurry by the first): each woke the
    other, which woke it back, tens of thousands of times a second until the slot was made,
    holding the pool's lock meanwhile."""
    pool = SlotPool(1, tier=None, max_host_bytes=None, memory=None)
    pool._cond = cond = _WakeCountingCondition()
    slot = pool.slots[0]
    slot.preparing = True
    got: list[object] = []

    def save() -> None:
        s, _ = pool.acquire(wait=True, timeout=30)
        got.append(s)
        pool.release(s, step=None, durable=False)  # type: ignore[arg-type]

    savers = [threading.Thread(target=save) for _ in range(2)]
    for t in savers:
        t.start()
    try:
        assert cond.two_waits.wait(30)  # both saves have come to wait,
        with cond:  # (taken once the second waits)
            hurried, wakes = pool.hurry.is_set(), cond.wakes
    finally:
        with cond:
            slot.preparing = False  # the slot is made
            cond.notify_all()
        for t in savers:
            t.join(60)
    assert hurried and wakes == 0, wakes  # and neither has woken the other
    assert got == [slot, slot] and not pool.hurry.is_set()
