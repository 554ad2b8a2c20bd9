"""A staging slot's buffers: what a slot holds, and how its buffers are made, pinned and freed.

:class:`Slot` is one row of the slot pool's table (see :mod:`ckptmgr.save.slots`, which also
says who owns what). :class:`SlotBuffers` is the part of :class:`~ckptmgr.save.slots.SlotPool`
that gives a slot its buffers: tmpfs files of the local tier or anonymous memory (see
:mod:`ckptmgr.save.buffers`), made in parallel, populated and pinned in pieces; made when a
state first needs them (:meth:`SlotBuffers.prepare` on a helper thread, or the first save) and
again only when the state changes size, never per save. Its state is the pool's, guarded as
:mod:`ckptmgr.save.slots` says: the buffers belong to whoever holds the slot busy or preparing.
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
from ..format.layout import file_name
from ..storage.tier import LocalTier
from ..storage.tier_pinning import Pinning
from .buffers import SPARE_DUTY, Flag, HostBuffer, PopulateAhead, anonymous_buffer, file_buffer

__all__ = ["Closing", "Slot", "SlotBuffers"]

log = logging.getLogger("ckptmgr")
_NOW = threading.Event()  # always set: pin without pauses (the caller itself waits for it)
_NOW.set()
MAKE_THREADS = 8  # files of a slot made (mapped and populated) at once
SPARE_THREADS = 2  # ... of a spare slot (made while training runs, for a later save), until a save waits for it
GATE_WAIT_S = 600.0  # at most this long, a spare's file waits for its turn to be made


class Closing(Exception):
    """A spare slot's making given up because the pool is closing (not an error to report)."""


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
    preparing: bool = False  # reserved by prepare() or being adopted: a save waits for it, never skips it
    replaced: int | None = None  # the step the slot held before acquire() handed it to a save
    wanted: bool = False  # ``step`` waits for its durable write (only a newer such step supersedes it)
    local_only: bool = False  # the schedule keeps ``step`` in the local tier only: a newer save may take the slot
    since: float = 0.0  # monotonic time the slot was last handed to a save (for messages)
    prep_wait_s: float = 0.0  # of the last acquire's wait, the part spent while a slot was being made

    @property
    def piece(self) -> int:
        """Copies into this slot's images must not cross multiples of this (0: no limit)."""
        return max((b.boundaries() for b in self.buffers), default=0)


class SlotBuffers:
    """The pool's buffer making (see the module docstring); a base of
    :class:`~ckptmgr.save.slots.SlotPool`, not used on its own."""

    tier: LocalTier | None
    chunk_size: int
    slots: list[Slot]
    stop: threading.Event
    hurry: threading.Event
    allocations: int
    registrations: int
    _making: int  # spare files being made now (guarded by _cond)
    _make_s: float | None  # seconds the last spare slot took to make (guarded by _cond)
    _cond: threading.Condition

    def fit(self, slot: Slot, sizes: list[int], *, hurry: bool = True, spare: bool = False) -> None:
        """Make ``slot`` hold files of exactly ``sizes`` bytes, pinned; allocate only what changed.
        The caller holds the slot (busy or preparing). ``spare``: a slot for a later save, made
        while training runs, more gently (fewer threads, longer pauses; see
        :mod:`ckptmgr.save.buffers`)."""
        if self.tier is not None and slot.kind in ("none", "tmpfs"):
            try:
                self._fit(slot, sizes, "tmpfs", hurry, spare)
                return
            except OSError as exc:
                log.warning("staging slot %d cannot live in %s (%s); using host memory instead",
                            slot.index, self.tier.path, exc)
                self._free(slot)
                self.tier.remove_slot(slot.index)
        self._fit(slot, sizes, "memory", hurry, spare)

    def reserve(self) -> tuple[list[Slot], bool]:
        """Mark every slot never filled yet as being prepared (a save that needs one waits for
        it from now on); returns them for :meth:`prepare`, and whether they are the pool's first."""
        with self._cond:
            fresh = [s for s in self.slots if s.kind == "none" and not s.busy and not s.preparing]
            first = all(s.kind == "none" for s in self.slots)
            for s in fresh:
                s.preparing = True
        return fresh, first

    def unreserve(self, reserved: tuple[list[Slot], bool]) -> None:
        """Undo :meth:`reserve` (the preparation could not start)."""
        with self._cond:
            for s in reserved[0]:
                s.preparing = False
            self._cond.notify_all()

    def prepare(self, sizes: list[int], reserved: tuple[list[Slot], bool]) -> None:
        """Make the buffers of the slots ``reserved`` by :meth:`reserve`, pinned with pauses
        between pieces (run on a helper thread; a save that needs one of these slots waits for
        it). The first slot the pool makes is made at full speed; the others are spares, made
        gently."""
        fresh, first = reserved
        try:
            for j, s in enumerate(fresh):
                try:
                    if not self.stop.is_set():
                        spare, t0 = not (first and j == 0), time.monotonic()
                        self.fit(s, sizes, hurry=False, spare=spare)
                        if spare:
                            with self._cond:  # (how long a slot takes to make: the forecast's lead)
                                self._make_s = time.monotonic() - t0
                except Closing as exc:
                    log.debug("%s", exc)
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

    def _fit(self, slot: Slot, sizes: list[int], kind: str, hurry: bool, spare: bool = False) -> None:
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
        t0 = time.perf_counter()
        # Made in parallel: reserving and populating pages is ~0.1-0.3 s per GiB for one thread. A spare
        # is made SPARE_THREADS files at a time, all of them at once from when a save waits for it.
        make_one = self._make_gently if spare else self._make
        with DaemonPool(min(MAKE_THREADS, max(1, len(make))), thread_name_prefix="ckptmgr-alloc") as pool:
            futures = [pool.submit(make_one, slot.index, file_name(i), sizes[i], kind) for i in make]
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
        t1 = time.perf_counter()
        self._pin(slot, hurry, duty=SPARE_DUTY if spare else 0.0)
        log.debug("staging slot %d (%s): %d of %d file(s) made and populated in %.3f s, pinned in %.3f s%s",
                  slot.index, kind, len(make), len(sizes), t1 - t0, time.perf_counter() - t1,
                  "" if hurry else " (a spare: gently, unless a save waits)" if spare else
                  " (with pauses unless a save waits)")

    def _make_gently(self, index: int, name: str, nbytes: int, kind: str) -> HostBuffer:
        """:meth:`_make` for a spare: at most :data:`SPARE_THREADS` at once, unless a save waits
        for a slot being made (``hurry``: then every file left starts at once) or the pool stops.
        Each file waits its turn for at most :data:`GATE_WAIT_S` seconds, then goes anyway; a
        file whose turn comes after the pool stopped is not made (:class:`Closing`: the slot's
        files made so far are dropped, nothing is pinned)."""
        with self._cond:
            self._cond.wait_for(lambda: self._making < SPARE_THREADS or self.hurry.is_set() or self.stop.is_set(),
                                timeout=GATE_WAIT_S)
            if self.stop.is_set():
                raise Closing(f"staging slot {index} is not made: the manager is closing")
            self._making += 1
        try:
            return self._make(index, name, nbytes, kind)
        finally:
            with self._cond:
                self._making -= 1
                self._cond.notify_all()

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

    def _pin(self, slot: Slot, hurry: bool | Flag, chunk_size: int | None = None,
             progress: Pinning | None = None, ahead: PopulateAhead | None = None, duty: float = 0.0) -> None:
        """Pin each buffer in pieces (one at a time: the driver serializes them anyway), of
        whole ``chunk_size`` chunks (default: the pool's). ``hurry``: True (no pauses), False
        (pauses unless a save waits), or a flag that says when to stop pausing. ``progress``
        (an adopted slot's): told each piece pinned, and revoked before anything is undone.
        ``ahead``: the buffers' pages being faulted in, each piece registered once its are."""
        flag = _NOW if hurry is True else self.hurry if hurry is False else hurry
        for i, b in enumerate(slot.buffers):
            if b.registered:
                continue
            on_piece, on_undo = _reports(progress, file_name(i))
            done = b.pin(chunk_size or self.chunk_size, hurry=flag, stop=self.stop, on_piece=on_piece,
                         on_undo=on_undo, ahead=ahead, duty=duty)
            if not done:
                if progress is not None:
                    progress.revoke()  # (returns once no restore copies from any piece of the slot)
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


def _reports(progress: Pinning | None, name: str) -> tuple[Callable[[int], None] | None, Callable[[], None] | None]:
    """What :meth:`HostBuffer.pin` tells ``progress`` of image ``name``: each piece pinned,
    and the revocation before a failed pin is undone."""
    if progress is None:
        return None, None

    def on_piece(n: int) -> None:
        progress.pinned(name, n)

    def on_undo() -> None:
        progress.revoke()
    return on_piece, on_undo
