"""The slot pool: reusable host buffers, each holding one complete checkpoint image.

A slot is one of two kinds, chosen when it is first filled:

* ``tmpfs``: one file per data file in the local tier (see :mod:`ckptmgr.storage.tier`),
  mapped MAP_SHARED and, with CUDA, pinned in place. When the copy ends the files *are* the
  checkpoint: the tier commits it by writing its manifest.
* ``memory``: anonymous host memory, one buffer per data file, pinned with CUDA.

Buffers are made (see :mod:`ckptmgr.save.buffers`) when a state first needs them, by
:meth:`SlotPool.prepare` or by the first save, and again only when the state changes size;
never per save. The counters ``allocations`` and ``registrations`` say how often.

Reuse rule, the "never lose the newest" invariant. A slot is handed to a new save only when
it is not busy (being staged, or written to the durable target) and what it holds is not
needed: empty; durable on the target; superseded by a newer committed step (in the local
tier or on the target: a step that waited for its durable write is then superseded there
too, but only by a newer step also meant for the durable target, never by one a schedule
keeps local); or (memory slots only) a step whose durable write failed and that exists nowhere
else, as a last resort. A tmpfs slot holding the only copy of the newest committed step is
never handed out: the saver writes it (retrying a failed write) while the slot holds it,
and the slot becomes free once that write succeeds or a newer step commits.

The pool is built from parts, one module each: :mod:`.slot_capacity` (how many slots fit the
host memory, and the default's growth), :mod:`.slot_buffers` (the :class:`Slot` row, and
making, pinning and freeing a slot's buffers) and :mod:`.slot_adoption` (taking over the
slots an earlier process left in the local tier, pinned in the background).

Ownership: the slot table (every ``Slot`` field but the buffers) is guarded by ``_cond``. A
slot's buffers and segments belong to whoever holds the slot busy (one save or the persist
job after it) or is preparing it (the prepare thread, or the adoption thread for an adopted
slot, whose committed bytes the persist job may read meanwhile); nobody else touches them.
``_cond`` is never held across I/O; it may be held while calling the tier (lock order pool
-> tier).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from .._threads import DaemonPool, holding
from ..errors import CkptTimeoutError
from ..storage.tier import LocalTier
from .forecast import Writes
from .memory import MemoryProbe, read_host_memory
from .slot_adoption import SlotAdoption
from .slot_buffers import Slot, SlotBuffers
from .slot_capacity import Make, SlotCapacity, slot_bytes

__all__ = ["AUTO_MAX_SLOTS", "Slot", "SlotPool", "slot_bytes"]  # (Slot and slot_bytes: from their modules)

AUTO_MAX_SLOTS = 3  # slots the default options may grow to: one being written, one holding the newest, one filling

log = logging.getLogger("ckptmgr")


class SlotPool(SlotCapacity, SlotBuffers, SlotAdoption):
    """``count`` slots, created lazily, reused for the life of the manager. ``chunk_size``: the
    checksum chunk of the images (pinning pieces are whole numbers of it).

    ``count=None`` (the default options) sizes the pool itself: one slot, a second made in the
    background once a save holds the first, and a third (up to :data:`AUTO_MAX_SLOTS`) once
    saves come while earlier ones are still in flight and a forecast of the next saves against
    the durable writes says one would otherwise wait (see :meth:`spare`); a save that finds
    none free adds one on the spot; all of them only as long as they fit
    :data:`~ckptmgr.save.memory.DEFAULT_HOST_SHARE` of the host memory available.
    ``memory``: how much host memory is available (see :mod:`ckptmgr.save.memory`; injectable
    for tests; None: nothing is guarded but ``max_host_bytes``)."""

    def __init__(self, count: int | None, *, tier: LocalTier | None, max_host_bytes: int | None,
                 chunk_size: int = 16 << 20, memory: MemoryProbe | None = read_host_memory) -> None:
        self.tier = tier
        self.max_host_bytes = max_host_bytes
        self.chunk_size = chunk_size
        self.auto = count is None
        self.max_slots = AUTO_MAX_SLOTS if count is None else count
        self.slots = [Slot(i) for i in range(1 if count is None else count)]
        self.memory = memory
        self._sizes: list[int] | None = None  # the file sizes of the state last checked (guarded by _cond)
        self._last_save: float | None = None  # monotonic time of the last acquire (for messages)
        self._told_no_room = False
        self._overlapped = False  # a save came while another was in flight (guarded by _cond)
        self._interval: float | None = None  # seconds of training between the last two saves (guarded by _cond)
        self._returned: float | None = None  # monotonic time the last save's call returned (guarded by _cond)
        self.clock: Callable[[], float] = time.monotonic  # the pool's clock: the saves' times (injectable for tests)
        self._make_s: float | None = None  # seconds the last spare slot took to make (guarded by _cond)
        self._cond = threading.Condition()
        self.hurry = threading.Event()  # set while a save waits for a slot being prepared
        self.on_wait: Callable[[], None] | None = None  # called (lock held) when a save starts waiting
        self.stop = threading.Event()  # set at close (see halt): preparation gives up between pieces
        # counters, guarded by _cond
        self.allocations = 0
        self.registrations = 0
        self._making = 0  # spare files being made now (see SlotBuffers._make_gently)
        self.counts: dict[str, float] = {"saves": 0, "skips": 0, "busy_waits": 0, "busy_wait_s": 0.0}
        self.newest_durable: int | None = None
        self._adopter: DaemonPool | None = None  # (see .slot_adoption; guarded by _cond)
        self._adopting: dict[int, Future[None]] = {}
        self._abandoned: set[int] = set()
        if tier is not None:
            tier.on_read_done = self._wake

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------ capacity

    # ------------------------------------------------------ acquire/release

    def _newest_committed(self) -> int | None:
        newest = self.newest_durable
        local = self.tier.steps() if self.tier is not None else {}
        for step in local:
            newest = step if newest is None else max(newest, step)
        return newest

    def _newest_wanted(self) -> int | None:
        """The newest step durable, or committed in the tier and meant for the durable target
        (read from the tier: a slot's own fields lag behind its commit until it is released)."""
        newest = self.newest_durable
        for s in self.slots:
            held = self.tier.holds(s.index) if s.wanted and self.tier is not None else None
            if held is not None and (newest is None or held > newest):
                newest = held
        return newest

    def mark_wanted(self, slot: Slot, wanted: bool, *, local_only: bool = False) -> None:
        """The step being staged into ``slot`` (held by the caller) is meant for the durable
        target (``wanted``), or by the schedule for the local tier only (``local_only``)."""
        with self._cond:
            slot.wanted, slot.local_only = wanted, local_only

    def _reusable(self, s: Slot, newest: int | None, newest_wanted: int | None) -> int | None:
        """How freely ``s`` may be reused (lower first), or None when it may not be."""
        if s.busy or s.preparing:
            return None
        if s.step is None:
            return 0
        if s.durable:
            return 1
        if newest is not None and s.step < newest and (
                not s.wanted or (newest_wanted is not None and s.step < newest_wanted)):
            return 2  # (a step waiting for its durable write gives way only to a newer one that does)
        if s.local_only:
            return 3  # kept local by the schedule: a newer save takes its place (else one slot would stall)
        committed_here = self.tier is not None and s.kind == "tmpfs" and self.tier.holds(s.index) == s.step
        return None if committed_here else 3  # never the only copy of the newest committed step

    def _pick(self) -> Slot | None:
        newest, wanted = self._newest_committed(), self._newest_wanted()
        ranked = sorted((r, s.step if s.step is not None else -1, s.index, s) for s in self.slots
                        if (r := self._reusable(s, newest, wanted)) is not None)
        for _, _, _, s in ranked:
            if s.kind == "tmpfs" and self.tier is not None and not self.tier.claim(s.index):
                continue  # a restore is reading it
            return s
        return None

    def why_busy(self) -> str:
        """Why no slot is free, for messages (call without the lock)."""
        with self._cond:
            held = [s.step for s in self.slots if s.step is not None and not s.busy and not s.durable]
            busy = [s.step for s in self.slots if s.busy and s.step is not None]
        if held and not busy:
            return (f"the staging slot(s) hold step(s) {held}, not yet written to the durable target (the write "
                    f"failed and is being retried); they are kept until then or until a newer step commits")
        return f"all {len(self.slots)} staging slot(s) are busy writing earlier steps"

    def acquire(self, *, wait: bool, timeout: float | None) -> tuple[Slot | None, float]:
        """A slot for a new save, marked busy (None when none is free and not ``wait``), and
        the seconds spent waiting for it. A slot being prepared is always waited for.

        Raises:
            CkptTimeoutError: none became free within ``timeout`` seconds.
        """
        t0 = self.clock()
        deadline = None if timeout is None else t0 + timeout
        grown: Slot | None = None
        prep_wait = 0.0  # of ``waited``: while a slot was being made (a one-time cost, not a busy slot)
        with holding(self._cond):  # (a Ctrl-C while the save waits is raised as itself)
            self.counts["saves"] += 1
            try:
                while True:
                    slot = self._pick()
                    if slot is not None:
                        break
                    preparing = any(s.preparing for s in self.slots)
                    if not preparing:
                        slot = grown = self._grow(t0)
                        if slot is not None:
                            break
                    if not wait and not preparing:
                        self.counts["skips"] += 1
                        return None, self.clock() - t0
                    if preparing:
                        if not self.hurry.is_set():  # the caller waits: pin without pauses, make every file at once
                            self.hurry.set()
                            # (spare files waiting for their turn start now; only when hurry is new: a save
                            # already waiting here would be woken, and wake this one back, without end)
                            self._cond.notify_all()
                    elif self.on_wait is not None and self.clock() - t0 < 1e-3:
                        self.on_wait()
                    left = None if deadline is None else deadline - self.clock()
                    if left is not None and left <= 0:
                        raise CkptTimeoutError(f"no staging slot became free within {timeout} s")
                    t_wait = self.clock()
                    self._cond.wait(left)
                    if preparing:
                        prep_wait += self.clock() - t_wait
            finally:
                self.hurry.clear()
            waited = self.clock() - t0
            if waited > 1e-3 and grown is None:  # (a slot added instead is no wait)
                self.counts["busy_waits"] += 1
                self.counts["busy_wait_s"] += waited
            if slot.step is not None and not slot.durable and slot.kind == "memory":
                log.warning("reusing staging slot %d: it held step %d, whose durable write failed; that step "
                            "is dropped", slot.index, slot.step)
            self._overlapped = self._overlapped or any(s.busy for s in self.slots if s is not slot)
            old, slot.busy, slot.since, slot.prep_wait_s = slot.step, True, t0, prep_wait
            if self._last_save is not None:  # (from the previous save's return: its own stall, a slot made on
                returned = self._returned   # the spot the first time, is not part of the spacing of the saves)
                since = returned if returned is not None and returned >= self._last_save else self._last_save
                self._interval = t0 - since
            self._last_save = t0
            slot.replaced = old if not slot.durable else None
            slot.step, slot.durable, slot.wanted, slot.local_only = None, False, False, False
        if old is not None and slot.kind == "tmpfs" and self.tier is not None:
            self.tier.invalidate(slot.index)  # the manifest goes before the data changes
        return slot, waited

    def making(self) -> bool:
        """True while a save made now would wait for a slot being made (one is being prepared
        and no other is free)."""
        with self._cond:
            if not any(s.preparing for s in self.slots):
                return False
            newest, wanted = self._newest_committed(), self._newest_wanted()
            return all(self._reusable(s, newest, wanted) is None for s in self.slots)

    def drop_step(self, step: int) -> bool:
        """``step`` was deleted from the durable target (retention, or the user): the idle slot
        that holds it in the local tier gives it up (its manifest goes; the buffers stay for
        the next save), so that the tier never lists nor serves a step the root no longer has.
        False when no idle slot holds it or a restore reads it now (then it goes when the slot
        is reused). The slot is held busy while its manifest is removed (outside the lock)."""
        with self._cond:
            slot = next((s for s in self.slots if s.step == step and not s.busy and not s.preparing), None)
            if slot is None or self.tier is None or slot.kind != "tmpfs" or not self.tier.claim(slot.index):
                return False
            slot.busy = True
            slot.step, slot.durable, slot.wanted, slot.local_only = None, False, False, False
        try:
            self.tier.invalidate(slot.index)
        finally:
            with self._cond:
                slot.busy = False
                self._cond.notify_all()
        return True

    def spare(self, writes: Writes | None = None) -> Make | None:
        """After a save took a slot (default options): add a slot to
        make in the background when one fits and the next saves need it, by the forecast of
        them against ``writes`` (see :meth:`SlotCapacity._spare`); when a slot waits to be
        made, when to start making it (the caller then runs :meth:`prepare` off the training
        thread), else None."""
        with self._cond:
            return self._spare(writes)

    def returned(self) -> None:
        """The save that acquired last has returned to the training loop (the saves' spacing,
        for the forecast, is counted from here to the next save)."""
        with self._cond:
            self._returned = self.clock()

    def slot_bytes(self) -> int | None:
        """Host bytes of one slot of the state last checked (None before the first)."""
        with self._cond:
            return None if self._sizes is None else slot_bytes(self._sizes)

    def release(self, slot: Slot, *, step: int | None, durable: bool, wanted: bool = False,
                given_up: bool = False) -> None:
        """Return ``slot``, recording the step it now holds (None: its content is not valid);
        ``wanted``: the step still waits for its durable write; ``given_up``: its durable write
        failed for good, so it stays only until a newer save needs the slot (as a step the
        schedule keeps local does: else one slot would stall every later save)."""
        with self._cond:
            slot.busy = False
            slot.step, slot.durable = step, durable and step is not None
            slot.wanted = wanted and step is not None and not slot.durable
            if given_up and slot.step is not None and not slot.durable:
                slot.local_only = True
            if slot.durable:
                self._note_durable(step)
            self._cond.notify_all()

    def hold(self, slot: Slot, step: int) -> bool:
        """Mark ``slot`` busy for the durable write of ``step``, which its local commit
        released; False when a save has taken the slot since."""
        with self._cond:
            if slot.busy or slot.step != step:
                return False
            slot.busy = True
            return True

    def newest_committed(self) -> int | None:
        """The newest step committed in the local tier or on the durable target."""
        with self._cond:
            return self._newest_committed()

    def hold_for_retry(self, slot: Slot, step: int) -> bool:
        """Mark ``slot`` busy for another durable write of ``step``; False when the slot no
        longer holds it, is busy, or a newer step has committed (nothing to retry then)."""
        with self._cond:
            newest = self._newest_committed()
            if slot.busy or slot.step != step or slot.durable or (newest is not None and step < newest):
                return False
            slot.busy = True
            return True

    def note_durable(self, step: int) -> None:
        with self._cond:
            self._note_durable(step)
            self._cond.notify_all()

    def _note_durable(self, step: int | None) -> None:
        if step is not None:
            self.newest_durable = step if self.newest_durable is None else max(self.newest_durable, step)

    def superseded(self, step: int) -> bool:
        with self._cond:
            newest = self._newest_committed()
            return newest is not None and step < newest

    def halt(self) -> None:
        """Set ``stop`` (closing), and wake whoever waits on the pool's lock for it: a spare's
        files waiting for their turn (see :meth:`SlotBuffers._make_gently`) go at once."""
        self.stop.set()
        if self.tier is not None:  # (an adoption parked by a restore's hold sees the stop at once)
            self.tier.stop_holds()
        self._wake()  # (the waits check ``stop`` under the lock: none misses it)

    def close(self, timeout: float | None = None) -> tuple[list[int], list[int]]:
        """Free every idle slot whose step is durable, superseded or not committed; return the
        committed steps kept in the tier for the next start, and the steps of slots still busy
        (left alone: a writer may still read them). Adoptions still running are stopped and
        waited for up to ``timeout`` seconds (see :meth:`stop_adoptions`)."""
        self.halt()
        abandoned = self.stop_adoptions(timeout)
        kept: list[int] = []
        busy: list[int] = []
        free: list[tuple[Slot, bool]] = []  # (slot, keep its files)
        with self._cond:
            newest = self._newest_committed()
            for s in self.slots:
                if s.busy or s.preparing:
                    busy.append(s.step if s.step is not None else -1)
                    if s.index in abandoned and s.step is not None and not s.durable:
                        kept.append(s.step)  # (its adoption leaves its files for the next start)
                    continue
                local = (self.tier is not None and s.kind == "tmpfs" and s.step is not None
                         and self.tier.holds(s.index) == s.step)
                keep = local and not s.durable and not (newest is not None and s.step is not None and s.step < newest)
                if keep and s.step is not None:
                    kept.append(s.step)
                s.busy = True  # nobody takes it from here on
                free.append((s, keep))
        for s, keep in free:
            if keep:
                for b in s.buffers:
                    b.path = None  # the files stay for the next start
            kind = s.kind
            self._free(s)
            if not keep and self.tier is not None and kind == "tmpfs":
                self.tier.remove_slot(s.index)
            s.kind = "none"
        return kept, busy
