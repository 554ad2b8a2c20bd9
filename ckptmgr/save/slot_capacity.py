"""How many staging slots fit: the host-memory guard of the slot pool, and its growth.

:class:`SlotCapacity` is the part of :class:`~ckptmgr.save.slots.SlotPool` that refuses a
state whose slots would not fit (:meth:`SlotCapacity.check_capacity`, before anything is
allocated) and, with the default options, adds slots as long as every slot fits the share of
host memory the default may use (see :mod:`ckptmgr.save.memory`): ahead of need, made in the
background (:meth:`SlotCapacity._spare`: a second slot once a save holds the first, a third
when the forecast of the next saves against the durable writes says a save would otherwise
wait, see :mod:`ckptmgr.save.forecast`), and, where none was made in time, on the spot for a
save that would otherwise wait (:meth:`SlotCapacity._grow`). Its state is the pool's, guarded
by the pool's ``_cond``.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable

from ..errors import CapacityError
from ..format.layout import DATA_ALIGN
from .forecast import Writes, first_wait
from .memory import DEFAULT_HOST_SHARE, MAX_HOST_SHARE, HostMemory, MemoryProbe, allowed_bytes
from .slot_buffers import Slot

EAGER_SLOTS = 2  # slots the default makes ahead of need (in the background) when they fit
MAKE_LEAD = 1.5  # a slot beyond them is made this many times its expected making time before it is needed
DEFAULT_MAKE_S = 2.0  # a slot's expected making time before one was made

__all__ = ["EAGER_SLOTS", "Make", "SlotCapacity", "slot_bytes"]

log = logging.getLogger("ckptmgr")


class Make(enum.Enum):
    """When the caller of :meth:`SlotCapacity._spare` starts making the slot it waits for."""

    NOW = "now"  # at once: the next save may need it
    AFTER_COPIES = "after copies"  # once the copies of the save that asked have landed (a forecast's slot)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 1 << 28 else f"{n / 2**20:.1f} MiB"


def slot_bytes(sizes: list[int]) -> int:
    """Host bytes one slot needs for files of ``sizes`` (each image starts page-aligned)."""
    return sum(-(-s // DATA_ALIGN) * DATA_ALIGN for s in sizes)


class SlotCapacity:
    """The pool's capacity checks and growth (see the module docstring); a base of
    :class:`~ckptmgr.save.slots.SlotPool`, not used on its own."""

    slots: list[Slot]
    auto: bool
    max_slots: int
    max_host_bytes: int | None
    memory: MemoryProbe | None
    _sizes: list[int] | None
    _last_save: float | None
    _told_no_room: bool
    _overlapped: bool
    _interval: float | None
    clock: Callable[[], float]
    _make_s: float | None
    _cond: threading.Condition
    # the pool's, declared here for the forecast (SlotPool's)
    _newest_committed: Callable[[], int | None]
    _newest_wanted: Callable[[], int | None]
    _reusable: Callable[[Slot, int | None, int | None], int | None]

    def check_capacity(self, sizes: list[int]) -> None:
        """Raise CapacityError, before anything is allocated, when the slots of this state
        exceed ``max_host_bytes`` or the host memory the guard allows (see
        :mod:`ckptmgr.save.memory`): the share of what the node and this process's cgroup
        have available. The memory is read only when the slots would grow."""
        per = slot_bytes(sizes)
        with self._cond:
            count = 1 if self.auto else len(self.slots)  # (the default's other slots are checked as they are added)
            held = self._held()
            self._sizes = list(sizes)
        need = per * count
        if self.max_host_bytes is not None and need > self.max_host_bytes:
            raise CapacityError(
                f"staging this state needs {need / 2**30:.2f} GiB of host memory ({count} slot(s) of "
                f"{per / 2**30:.2f} GiB), over StagingOptions.max_host_bytes="
                f"{self.max_host_bytes / 2**30:.2f} GiB; raise the cap or use fewer slots")
        if need <= held or self.memory is None:
            return  # nothing to allocate: what the slots hold is theirs
        mem = self.memory()
        allowed = allowed_bytes(mem, held, default=self.auto, max_host_bytes=self.max_host_bytes)
        if mem is None or allowed is None or need <= allowed:
            return
        if self.auto and self.max_host_bytes is None:
            raise CapacityError(
                f"staging this state needs {per / 2**30:.2f} GiB of host memory for one slot, over the "
                f"{DEFAULT_HOST_SHARE:.0%} of host memory the default options may use "
                f"({self._memory_text(mem, held)}); "
                f"set StagingOptions(slots=1) or max_host_bytes to allow up to {MAX_HOST_SHARE:.0%}, or save less "
                f"per process (more ranks, a smaller state)")
        raise CapacityError(
            f"staging this state needs {need / 2**30:.2f} GiB of host memory ({count} slot(s) of {per / 2**30:.2f} "
            f"GiB), over the {allowed / 2**30:.2f} GiB this process may use ({MAX_HOST_SHARE:.0%} of "
            f"{self._memory_text(mem, held)}); nothing was allocated. Use fewer StagingOptions.slots (or leave "
            f"slots unset: the manager then uses as many as fit), or save less per process")

    def _held(self) -> int:
        return sum(b.nbytes for s in self.slots for b in s.buffers)

    @staticmethod
    def _memory_text(mem: HostMemory, held: int) -> str:
        extra = f" + {held / 2**30:.2f} GiB the slots hold" if held else ""
        return mem.describe() + extra

    def _spare(self, writes: Writes | None = None) -> Make | None:
        """(lock held, default options only) After a save took a slot: add a slot, to be made
        in the background, when one more fits the share of host memory the default may use
        and it is needed. Up to :data:`EAGER_SLOTS`, when none is left for the next save (every
        other slot busy): the next save then never waits for the previous one's durable write,
        nor makes its slot on the training thread. Beyond, up to ``max_slots``, once saves
        have come while an earlier one was still in flight: when the forecast of the next
        saves against the durable writes (``writes``, see :mod:`ckptmgr.save.forecast`) says
        one would wait before the save after next (the next decision), soon enough to make the
        slot first; without a forecast (no write timed yet), when every slot is busy.

        Returns when the caller is to start :meth:`prepare` for a slot never made, added here
        or configured: :attr:`Make.NOW`, or :attr:`Make.AFTER_COPIES` for a slot the forecast
        added ahead of need (made beside the save's copies it would slow them, and the training
        step waits for those; a save that comes to wait for the slot meanwhile starts it);
        None: nothing to make."""
        fresh = Make.NOW if any(s.kind == "none" and not s.busy and not s.preparing for s in self.slots) else None
        if not self.auto or self._sizes is None:
            return fresh  # (configured slots: the others are made in the background after the first save)
        if fresh or len(self.slots) >= self.max_slots or any(s.preparing for s in self.slots):
            return fresh
        when = Make.NOW
        if len(self.slots) < EAGER_SLOTS:
            if any(not s.busy for s in self.slots):
                return None
            why = "previous one's durable write"
        elif not self._overlapped:
            return None  # (a caller whose saves never overlap a durable write never needs one)
        elif writes is not None:
            wait_at = self._forecast(writes)
            if wait_at is None:
                return None
            why = f"durable writes still running (a save in {wait_at - self.clock():.2f} s would wait)"
            when = Make.AFTER_COPIES
        elif all(s.busy for s in self.slots):
            why = "durable writes still running"
        else:
            return None
        per = slot_bytes(self._sizes)
        count = len(self.slots)
        mem = self.memory() if self.memory is not None else None
        allowed = allowed_bytes(mem, self._held(), default=True, max_host_bytes=self.max_host_bytes)
        if allowed is not None and per * (count + 1) > allowed:
            return None
        self.slots.append(Slot(count))
        room = "" if allowed is None else f"; all slots {_size(per * (count + 1))} of {_size(allowed)} allowed"
        log.info("staging slot %d of at most %d is being made in the background (%s of host memory%s), so that the "
                 "next save need not wait for the %s (StagingOptions(slots=%d) keeps %d)", count + 1,
                 self.max_slots, _size(per), room, why, count, count)
        return when

    def _forecast(self, writes: Writes) -> float | None:
        """(lock held) When a save would first find no slot free, soon enough that a slot made
        from now would be needed (see :func:`~ckptmgr.save.forecast.first_wait`); None when none
        would or the saves' spacing is not known yet."""
        if self._last_save is None or not self._interval:
            return None
        now = self.clock()
        newest, wanted = self._newest_committed(), self._newest_wanted()
        free_at: list[float] = []
        queued = 0
        for s in self.slots:
            if s.index == writes.slot:
                free_at.append(writes.ends)
            elif s.busy or self._reusable(s, newest, wanted) is None:
                queued += 1  # being staged, or the newest step: its write comes after the one in flight
            else:
                free_at.append(now)
        make_s = self._make_s if self._make_s is not None else DEFAULT_MAKE_S
        return first_wait(now=now, interval=self._interval, write_s=writes.write_s,
                          free_at=free_at, queued=queued, writing_ends=writes.ends,
                          horizon_s=self._interval + MAKE_LEAD * make_s)

    def _grow(self, now: float) -> Slot | None:
        """(lock held, default options only) A new slot for a save that would otherwise wait,
        when one more fits the share of host memory the default may use; told once each."""
        if not self.auto or len(self.slots) >= self.max_slots or self._sizes is None:
            return None
        per = slot_bytes(self._sizes)
        count = len(self.slots)
        held = self._held()
        mem = self.memory() if self.memory is not None else None
        allowed = allowed_bytes(mem, held, default=True, max_host_bytes=self.max_host_bytes)
        busy = [s for s in self.slots if s.busy]
        oldest = min(busy, key=lambda s: s.since, default=None)
        spacing = "" if self._last_save is None else f" {now - self._last_save:.2f} s after the previous one"
        why = (f"a save came{spacing} while {len(busy)} earlier save(s) were still being staged or written "
               f"(the oldest since {now - oldest.since:.2f} s)" if oldest is not None else
               f"a save came{spacing} while all {count} staging slot(s) held steps not yet durable")
        if allowed is not None and per * (count + 1) > allowed:
            if not self._told_no_room:
                self._told_no_room = True
                limit = (f"StagingOptions.max_host_bytes={self.max_host_bytes / 2**30:.2f} GiB"
                         if self.max_host_bytes is not None else "the host memory available" if mem is None else
                         f"{DEFAULT_HOST_SHARE:.0%} of {self._memory_text(mem, held)}")
                log.warning("%s; it waits: another staging slot of %s would exceed %s. Save less often "
                            "(Schedule(max_overhead=...) picks the interval), or set StagingOptions(slots=%d) "
                            "to allow up to %.0f%% of available memory", why, _size(per), limit, count + 1,
                            MAX_HOST_SHARE * 100)
            return None
        slot = Slot(count)
        self.slots.append(slot)
        # Saves outpace the durable target: the next one will want another slot too. When it fits, a spare
        # (never filled yet) is added as well; the saver makes it in the background after this save.
        spare = count + 2 <= self.max_slots and (allowed is None or per * (count + 2) <= allowed)
        if spare:
            self.slots.append(Slot(count + 1))
        total = len(self.slots)
        room = "" if allowed is None else f"; all slots {_size(per * total)} of {_size(allowed)} allowed"
        log.warning("%s; added staging slot %d%s of at most %d (%s of host memory each%s) rather than wait. "
                    "StagingOptions(slots=%d) makes them up front; Schedule(max_overhead=...) saves only as often "
                    "as the durable target absorbs", why, count + 1,
                    f" (and slot {total}, made in the background)" if spare else "", self.max_slots, _size(per),
                    room, total)
        return slot
