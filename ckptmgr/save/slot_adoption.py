"""Adopting the slots an earlier process left committed in the local tier, in the background.

After a crash, the restarted job's manager takes over the tier's committed slots
(:meth:`SlotAdoption.adopt`, called from the constructor through the saver). The constructor
does only what ``latest_step()`` and the write-out of the adopted steps need: the tier's scan
has read and validated the manifests, and :meth:`~SlotAdoption.adopt` maps each slot's files
(no page is touched: mapping costs microseconds) and records its step in the slot table.
What costs time per byte runs afterwards on one background thread, ``ckptmgr-adopt``, the
newest slot first, only with CUDA (without it there is nothing to pin or to check ahead, and
the slot is ready at once):

1. the checks of the images start (``on_mapped``: the restorer's, on its ring's threads;
   started from :meth:`~SlotAdoption.adopt` itself, so that a restore that comes at once
   finds them);
2. the pages are faulted in, on several threads, in file order
   (:class:`~ckptmgr.save.buffers.PopulateAhead`);
3. meanwhile the images are pinned in pieces of whole checksum chunks, each once its pages
   are in, each piece reported to the
   tier's :class:`~ckptmgr.storage.tier_pinning.Pinning` of the slot, then attached to the
   tier. Between two pieces the thread pauses (as :meth:`~ckptmgr.save.slots.SlotPool.prepare`
   does, so that a training loop already running is not held), unless a restore or a save
   waits for the slot.

Only the operations that need the slot wait for it, each with a timeout: a restore from the
slot (:meth:`LocalTier.reading <ckptmgr.storage.tier.LocalTier.reading>` yields the images
with their pinning progress; the restore waits for the images' checks, then copies each
piece as soon as it is pinned, while the next one is registered), and a save that would reuse
the slot (the slot is ``preparing`` meanwhile, and :meth:`~ckptmgr.save.slots.SlotPool.acquire`
waits for a slot being prepared). Before the adoption undoes any registration (a failure, or
a stop at close), it revokes the progress, and waits (bounded) until no restore copies from
the images.

Ownership: while a slot is ``preparing`` for its adoption, the pinning state of its buffers
(registrations, populated) belongs to the adoption thread; their bytes, a committed step, are
only read, by anyone (the durable write of an adopted step may read them meanwhile). How far
they are pinned is published to restores through the tier's
:class:`~ckptmgr.storage.tier_pinning.Pinning` of the slot (written by the adoption thread only,
guarded by the pinning's own lock; see :mod:`ckptmgr.storage.tier_pinning`). The
futures of the adoptions and the set of those given up by :meth:`close` are guarded by the
pool's ``_cond``. :meth:`~SlotAdoption.stop_adoptions` (at close) stops the thread between two
pieces and waits for it up to its timeout; an adoption still running after that (a
registration that does not return) frees its slot itself when it ends: it unpins, then lets
the mapping go, and leaves the slot's files for the next start.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from .. import _cuda
from .._threads import DaemonPool
from ..format.layout import file_name
from ..storage.tier import LocalTier
from ..storage.tier_pinning import Pinning
from .buffers import Flag, HostBuffer, PopulateAhead, file_buffer
from .slot_buffers import Slot

__all__ = ["ADOPTION_STOP_WAIT_S", "SlotAdoption"]

log = logging.getLogger("ckptmgr")

ADOPTION_STOP_WAIT_S = 60.0  # at most this long, close() waits for an adoption to stop between two pieces


class SlotAdoption:
    """The pool's adoption of an earlier process's slots (see the module docstring); a base
    of :class:`~ckptmgr.save.slots.SlotPool`, not used on its own."""

    tier: LocalTier | None
    slots: list[Slot]
    auto: bool
    max_slots: int
    stop: threading.Event
    hurry: threading.Event
    _cond: threading.Condition
    _adopter: DaemonPool | None  # the adoption thread, made by the first adoption    (guarded by _cond)
    _adopting: dict[int, Future[None]]  # slot index -> its adoption, until it ends     (_cond)
    _abandoned: set[int]  # slots whose adoption close() stopped waiting for          (_cond)

    # the pool's and its buffers' own, declared here for the adoption
    _note_durable: Callable[[int | None], None]  # (SlotPool's)
    _pin: Callable[[Slot, bool | Flag, int | None, Pinning | None, PopulateAhead | None], None]  # (SlotBuffers')

    def adopt(self, index: int, step: int, sizes: list[int], chunk_size: int, *, durable: bool,
              on_mapped: Callable[[dict[str, torch.Tensor]], None] | None = None) -> Slot:
        """Take over the committed tmpfs slot ``index`` an earlier process left (at start-up):
        map its files and record ``step`` now; with CUDA, check, populate and pin them on the
        adoption thread. ``chunk_size``: the images' checksum chunk (pinned in whole chunks).
        ``on_mapped``: told the file images once they are mapped, before they are pinned
        (only with CUDA), so that they can be verified meanwhile.

        Raises:
            OSError: a file is not the regular file of its manifest's size any more.
        """
        assert self.tier is not None
        with self._cond:
            while self.auto and len(self.slots) <= index < self.max_slots:
                self.slots.append(Slot(len(self.slots)))
            slot = self.slots[index]
            slot.preparing = True  # nobody takes it before it is settled
        try:
            buffers: list[HostBuffer] = []
            for i, n in enumerate(sizes):
                fd = self.tier.open_file(index, file_name(i), n, create=False)
                try:
                    buffers.append(file_buffer(fd, n, file_name(i)))
                finally:
                    os.close(fd)
        except BaseException:
            with self._cond:
                slot.preparing = False
                self._cond.notify_all()
            raise
        background = _cuda.available()
        with self._cond:
            slot.kind, slot.buffers, slot.segments = "tmpfs", buffers, [b.tensor for b in buffers]
            slot.step, slot.durable = step, durable
            if durable:
                self._note_durable(step)
            if not background:
                slot.preparing = False
                self._cond.notify_all()
                return slot
        # restores of the slot copy from here on, each piece once it is pinned
        pinning = self.tier.adopting(index, {file_name(i): b.tensor for i, b in enumerate(buffers)},
                                     {file_name(i): b.identity for i, b in enumerate(buffers) if b.identity})
        try:
            if on_mapped is not None:
                on_mapped(dict(pinning.images))
            with self._cond:
                if self._adopter is None:
                    self._adopter = DaemonPool(1, thread_name_prefix="ckptmgr-adopt")
                future = self._adopter.submit(self._settle, slot, chunk_size, pinning)
                self._adopting[index] = future
        except BaseException:
            self._settled(slot)
            raise
        future.add_done_callback(lambda f: self._settled(slot) if f.cancelled() else None)
        return slot

    def _settle(self, slot: Slot, chunk_size: int, pinning: Pinning) -> None:
        """(adoption thread) Populate and pin ``slot``'s images, each piece once its pages are
        in (the populate threads run ahead), reporting each piece to ``pinning``."""
        try:
            with PopulateAhead(slot.buffers, stop=self.stop, pause=pinning.unheld) as ahead:
                if not self.stop.is_set():
                    self._pin(slot, _Either(pinning.hurry, self.hurry), chunk_size, pinning, ahead)
        except Exception as exc:  # its restores read through the files instead, and verify them
            log.warning("the adopted staging slot %d could not be pinned in place (%s: %s); restores of step %s "
                        "read its files instead", slot.index, type(exc).__name__, exc, slot.step)
            pinning.revoke()  # (a buffer pinned before the failure stays so until the slot is freed)
        finally:
            self._settled(slot, pinning)

    def _settled(self, slot: Slot, pinning: Pinning | None = None) -> None:
        """The adoption of ``slot`` ended (or never started): wake whoever waits for it; free
        the slot when :meth:`stop_adoptions` gave up waiting for it (no restore copies from
        its ``pinning`` then). Idempotent."""
        with self._cond:
            if self._adopting.pop(slot.index, None) is None and not slot.preparing:
                return
            slot.preparing = False
            abandoned = slot.index in self._abandoned
            self._abandoned.discard(slot.index)
            if abandoned:
                buffers, slot.buffers, slot.segments, slot.kind = slot.buffers, [], [], "none"
            self._cond.notify_all()
        if self.tier is not None:
            self.tier.adopted(slot.index)
        if abandoned:  # (this thread is the last to use them: unpin, then the mapping goes with the views)
            if self.tier is not None:
                self.tier.detach(slot.index)
            if pinning is not None:
                pinning.revoke()
            for b in buffers:
                b.path = None  # the files stay for the next start
                b.unpin()

    def adopting(self) -> list[int]:
        """The slots whose adoption has not ended yet."""
        with self._cond:
            return sorted(self._adopting)

    def stop_adoptions(self, timeout: float | None) -> list[int]:
        """Stop the adoption thread (``stop`` is set by the caller) and wait for it up to
        ``timeout`` seconds (None: :data:`ADOPTION_STOP_WAIT_S`); return the slots still being
        adopted then, which their adoption frees when it ends."""
        with self._cond:
            adopter = self._adopter
        if adopter is None:
            return []
        wait = ADOPTION_STOP_WAIT_S if timeout is None else max(0.0, min(timeout, ADOPTION_STOP_WAIT_S))
        adopter.stop(cancel=True, timeout=wait)  # (those not started are cancelled, and settled by their callback)
        with self._cond:
            left = sorted(i for i in self._adopting if self.slots[i].preparing)
            self._abandoned.update(left)
        if left:
            log.warning("the adoption of staging slot(s) %s did not stop within %.3g s; it frees them when it ends",
                        left, wait)
        return left


class _Either:
    """A flag set when any of its events is (the adoption's ``hurry``: a restore of the slot,
    or a save, waits for it)."""

    def __init__(self, *events: threading.Event) -> None:
        self.events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)
