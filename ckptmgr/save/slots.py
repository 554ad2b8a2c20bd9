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

Ownership: the slot table (every ``Slot`` field but the buffers) is guarded by ``_cond``. A
slot's buffers and segments belong to whoever holds the slot busy (one save or the persist
job after it) or is preparing it (the prepare thread); nobody else touches them. ``_cond``
is never held across I/O; it may be held while calling the tier (lock order pool -> tier).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import _cuda
from .._threads import DaemonPool
from ..errors import CapacityError, CkptTimeoutError
from ..format.layout import DATA_ALIGN, file_name
from ..storage.tier import LocalTier
from .buffers import HostBuffer, anonymous_buffer, file_buffer
from .memory import DEFAULT_HOST_SHARE, MAX_HOST_SHARE, HostMemory, MemoryProbe, allowed_bytes, read_host_memory

__all__ = ["AUTO_MAX_SLOTS", "Slot", "SlotPool", "slot_bytes"]

AUTO_MAX_SLOTS = 3  # slots the default options may grow to: one being written, one holding the newest, one filling

log = logging.getLogger("ckptmgr")
_NOW = threading.Event()  # always set: pin without pauses (the caller itself waits for it)
_NOW.set()


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 1 << 28 else f"{n / 2**20:.1f} MiB"


def slot_bytes(sizes: list[int]) -> int:
    """Host bytes one slot needs for files of ``sizes`` (each image starts page-aligned)."""
    return sum(-(-s // DATA_ALIGN) * DATA_ALIGN for s in sizes)


@dataclass
class Slot:
    """One staging buffer set and what it holds (fields guarded by the pool's lock)."""

    index: int
    kind: str = "none"  # "none" (no buffers yet) | "tmpfs" | "memory"
    buffers: list[HostBuffer] = field(default_factory=list)  # one per data file (owner: the holder)
    segments: list[torch.Tensor] = field(default_factory=list)  # the buffers' tensors
    step: int | None = None  # the step whose image the slot holds (None: nothing valid)
    durable: bool = False  # ``step`` is committed on the durable target
    busy: bool = False  # held by a save, its persist job, or a retry of its durable write
    preparing: bool = False  # reserved by prepare(): the next save waits for it, never skips it
    replaced: int | None = None  # the step the slot held before acquire() handed it to a save
    wanted: bool = False  # ``step`` waits for its durable write (only a newer such step supersedes it)
    local_only: bool = False  # the schedule keeps ``step`` in the local tier only: a newer save may take the slot
    since: float = 0.0  # monotonic time the slot was last handed to a save (for messages)

    @property
    def piece(self) -> int:
        """Copies into this slot's images must not cross multiples of this (0: no limit)."""
        return max((b.boundaries() for b in self.buffers), default=0)


class SlotPool:
    """``count`` slots, created lazily, reused for the life of the manager. ``chunk_size``: the
    checksum chunk of the images (pinning pieces are whole numbers of it).

    ``count=None`` (the default options) sizes the pool itself: one slot, and one more (up to
    :data:`AUTO_MAX_SLOTS`) each time a save would otherwise wait for one, with a spare slot
    that the saver makes in the background, as long as all of them fit
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
        self._cond = threading.Condition()
        self.hurry = threading.Event()  # set while a save waits for a slot being prepared
        self.on_wait: Callable[[], None] | None = None  # called (lock held) when a save starts waiting
        self.stop = threading.Event()  # set at close: preparation gives up between pieces
        # counters, guarded by _cond
        self.allocations = 0
        self.registrations = 0
        self.counts: dict[str, float] = {"saves": 0, "skips": 0, "busy_waits": 0, "busy_wait_s": 0.0}
        self.newest_durable: int | None = None
        if tier is not None:
            tier.on_read_done = self._wake

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------ capacity

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
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        grown: Slot | None = None
        with self._cond:
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
                        return None, time.monotonic() - t0
                    if preparing:
                        self.hurry.set()  # the caller waits: pin without pauses
                    elif self.on_wait is not None and time.monotonic() - t0 < 1e-3:
                        self.on_wait()
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise CkptTimeoutError(f"no staging slot became free within {timeout} s")
                    self._cond.wait(left)
            finally:
                self.hurry.clear()
            waited = time.monotonic() - t0
            if waited > 1e-3 and grown is None:  # (a slot added instead is no wait)
                self.counts["busy_waits"] += 1
                self.counts["busy_wait_s"] += waited
            if slot.step is not None and not slot.durable and slot.kind == "memory":
                log.warning("reusing staging slot %d: it held step %d, whose durable write failed; that step "
                            "is dropped", slot.index, slot.step)
            old, slot.busy, slot.since = slot.step, True, t0
            self._last_save = t0
            slot.replaced = old if not slot.durable else None
            slot.step, slot.durable, slot.wanted, slot.local_only = None, False, False, False
        if old is not None and slot.kind == "tmpfs" and self.tier is not None:
            self.tier.invalidate(slot.index)  # the manifest goes before the data changes
        return slot, waited

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

    # -------------------------------------------------------------- buffers

    def fit(self, slot: Slot, sizes: list[int], *, hurry: bool = True) -> None:
        """Make ``slot`` hold files of exactly ``sizes`` bytes, pinned; allocate only what changed.
        The caller holds the slot (busy or preparing)."""
        if self.tier is not None and slot.kind in ("none", "tmpfs"):
            try:
                self._fit(slot, sizes, "tmpfs", hurry)
                return
            except OSError as exc:
                log.warning("staging slot %d cannot live in %s (%s); using host memory instead",
                            slot.index, self.tier.path, exc)
                self._free(slot)
                self.tier.remove_slot(slot.index)
        self._fit(slot, sizes, "memory", hurry)

    def prepare(self, sizes: list[int]) -> None:
        """Make the buffers of every slot never filled yet, pinned with pauses between pieces
        (run on a helper thread; a save that needs one of these slots waits for it)."""
        with self._cond:
            fresh = [s for s in self.slots if s.kind == "none" and not s.busy and not s.preparing]
            for s in fresh:
                s.preparing = True
        try:
            for s in fresh:
                try:
                    if not self.stop.is_set():
                        self.fit(s, sizes, hurry=False)
                except Exception as exc:  # the next save() fits again and raises there
                    log.warning("preparing staging slot %d failed: %s", s.index, exc)
                finally:
                    with self._cond:
                        s.preparing = False
                        self._cond.notify_all()
        finally:
            with self._cond:
                for s in fresh:
                    s.preparing = False
                self._cond.notify_all()

    def _fit(self, slot: Slot, sizes: list[int], kind: str, hurry: bool) -> None:
        same = slot.kind == kind and [b.nbytes for b in slot.buffers] == sizes
        if same and (all(b.pinned for b in slot.buffers) or not _cuda.available()):
            return
        if kind == "tmpfs":
            assert self.tier is not None
            grow = sum(sizes) - sum(b.nbytes for b in slot.buffers)
            if grow > 0 and grow > self.tier.free_bytes():
                raise OSError(f"{grow} more bytes are needed and only {self.tier.free_bytes()} are free")
            self.tier.detach(slot.index)
        keep: dict[int, HostBuffer] = {}
        for i, old in enumerate(slot.buffers):
            if slot.kind == kind and i < len(sizes) and old.nbytes == sizes[i]:
                keep[i] = old
            else:
                self._drop(slot, old)
        slot.kind = kind
        make = [i for i in range(len(sizes)) if i not in keep]
        # Made in parallel: reserving and populating pages is ~0.1-0.3 s per GiB for one thread.
        with DaemonPool(min(8, max(1, len(make))), thread_name_prefix="ckptmgr-alloc") as pool:
            futures = [pool.submit(self._make, slot.index, file_name(i), sizes[i], kind) for i in make]
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        made = [f.result() for f in futures if f.exception() is None]
        if failed is not None:
            for b in made:
                self._drop(slot, b)
            for b in keep.values():
                self._drop(slot, b)
            slot.buffers, slot.segments, slot.kind = [], [], "none"
            raise failed
        keep.update(zip(make, made, strict=True))
        slot.buffers = [keep[i] for i in range(len(sizes))]
        slot.segments = [b.tensor for b in slot.buffers]
        self._pin(slot, hurry)

    def _make(self, index: int, name: str, nbytes: int, kind: str) -> HostBuffer:
        if kind == "tmpfs":
            assert self.tier is not None
            fd = self.tier.open_file(index, name, nbytes, create=True)
            try:
                buf = file_buffer(fd, nbytes, name)
            finally:
                os.close(fd)
        else:
            buf = anonymous_buffer(nbytes)
        buf.populate()  # on this helper thread, with no CUDA lock held
        with self._cond:
            self.allocations += 1
        return buf

    def _pin(self, slot: Slot, hurry: bool) -> None:
        """Pin each buffer in pieces (one at a time: the driver serializes them anyway)."""
        for b in slot.buffers:
            if b.registered:
                continue
            done = b.pin(self.chunk_size, hurry=_NOW if hurry else self.hurry, stop=self.stop)
            if not done:
                b.unpin()
                return
            if b.registered:
                with self._cond:
                    self.registrations += 1
        if slot.kind == "tmpfs" and self.tier is not None and all(b.pinned for b in slot.buffers):
            self.tier.attach(slot.index, {file_name(i): b.tensor for i, b in enumerate(slot.buffers)})

    def _drop(self, slot: Slot, buf: HostBuffer) -> None:
        buf.unpin()  # before the mapping goes
        if buf.path is not None and self.tier is not None:
            self.tier.remove_file(slot.index, buf.path)
            buf.path = None

    def _free(self, slot: Slot) -> None:
        if slot.kind == "tmpfs" and self.tier is not None:
            self.tier.detach(slot.index)
        for b in slot.buffers:
            self._drop(slot, b)
        slot.buffers, slot.segments = [], []

    def adopt(self, index: int, step: int, sizes: list[int], chunk_size: int, *, durable: bool,
              on_mapped: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Slot:
        """Take over the committed tmpfs slot ``index`` an earlier process left (at start-up).
        ``on_mapped``: told the file images once mapped, before they are pinned (only with
        CUDA), so that they can be verified meanwhile."""
        assert self.tier is not None
        with self._cond:
            while self.auto and len(self.slots) <= index < self.max_slots:
                self.slots.append(Slot(len(self.slots)))
        slot = self.slots[index]
        slot.kind = "tmpfs"
        for i, n in enumerate(sizes):
            fd = self.tier.open_file(index, file_name(i), n, create=False)
            try:
                slot.buffers.append(file_buffer(fd, n, file_name(i)))
            finally:
                os.close(fd)
        slot.segments = [b.tensor for b in slot.buffers]
        if on_mapped is not None and _cuda.available():
            on_mapped({file_name(i): b.tensor for i, b in enumerate(slot.buffers)})
        saved, self.chunk_size = self.chunk_size, chunk_size  # pinned in pieces of its own chunks
        try:
            self._pin(slot, hurry=True)
        finally:
            self.chunk_size = saved
        with self._cond:
            slot.step, slot.durable = step, durable
            if durable:
                self._note_durable(step)
        return slot

    def close(self) -> tuple[list[int], list[int]]:
        """Free every idle slot whose step is durable, superseded or not committed; return the
        committed steps kept in the tier for the next start, and the steps of slots still busy
        (left alone: a writer may still read them)."""
        self.stop.set()
        kept: list[int] = []
        busy: list[int] = []
        free: list[tuple[Slot, bool]] = []  # (slot, keep its files)
        with self._cond:
            newest = self._newest_committed()
            for s in self.slots:
                if s.busy or s.preparing:
                    busy.append(s.step if s.step is not None else -1)
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
