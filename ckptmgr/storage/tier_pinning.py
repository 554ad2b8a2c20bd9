"""How far the adoption of a local-tier slot has pinned its images: what a restore waits on.

A manager that adopts an earlier process's slot pins the slot's file images in pieces on its
adoption thread (see :mod:`ckptmgr.save.slot_adoption`). A restore of that slot does not wait
for the whole adoption: :meth:`LocalTier.reading <ckptmgr.storage.tier.LocalTier.reading>`
hands it the mapped images with their :class:`Pinning`, and the restore copies each checksum
chunk as soon as the piece that holds it is pinned (:meth:`Pinning.wait`), while the adoption
registers the next piece. A restore that waits asks the adoption to hurry (``hurry``: no
pauses between pieces).

A restore that would otherwise wait while much is left to pin holds the adoption instead
(:meth:`Pinning.holding`, see :mod:`ckptmgr.restore.loaders.images`): the adoption thread and
its page-faulting threads park (:meth:`Pinning.unheld`) until the holds are released, the
adoption ends, the manager closes (:meth:`Pinning.stopping`) or :data:`HOLD_WAIT_S` has passed.

Ownership: the adoption thread writes the progress (:meth:`Pinning.pinned`,
:meth:`Pinning.revoke`, :meth:`Pinning.end`; :meth:`Pinning.end` also the tier's close, and
whoever cancels an adoption not begun); restores read it, and write the holds (and clear
``hurry`` when the last is released); the manager's close sets the stop. Every field but ``index``,
``images`` and ``hurry`` (set once, or an event) is guarded by the pinning's own condition
``_cond`` (never held across I/O or a CUDA call, and never while another lock is taken). Before the adoption undoes a
registration (a failed one, or a stop at close) it revokes the progress and waits, bounded,
until no restore holds a copy lease (:meth:`Pinning.copying`): a copy in flight never reads
pages being unpinned. A restore that finds the progress revoked, or the adoption ended
without the piece it needs, or no progress before its deadline, gets :class:`PinningLost` and
reads the slot's files instead.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the CLI reads a tier's listing without torch)
    import torch

__all__ = ["Pinning", "PinningLost", "TierImages"]

log = logging.getLogger("ckptmgr")

REVOKE_WAIT_S = 600.0  # at most this long, the adoption waits for restores' copies before it unpins
# At most this long from the first hold, restores that read the rest themselves keep the adoption
# parked (kept under the populate threads' own 600 s wait, past which the adoption would fail).
HOLD_WAIT_S = 300.0


class PinningLost(Exception):
    """The images a restore copies from will not be pinned (in time): the adoption failed,
    stopped, or made no progress before the restore's deadline. The restore has ended its
    copies; it reads the slot's files instead."""


class Pinning:
    """The pinning progress of one slot being adopted (see the module docstring)."""

    def __init__(self, index: int, images: dict[str, torch.Tensor],
                 identities: dict[str, tuple[int, int]] | None = None) -> None:
        self.index = index  # the slot's
        self.images = images  # file name -> the mapped image (read only, by anyone)
        self.identities = identities or {}  # file name -> the mapped file's (device, inode) (set once)
        self.hurry = threading.Event()  # set by a restore that waits: the adoption skips its pauses
        self._cond = threading.Condition()
        self._upto = dict.fromkeys(images, 0)  # file -> bytes pinned from its start    (guarded by _cond)
        self._ended = False  # the adoption will pin nothing more                          (_cond)
        self._revoked = False  # registrations are being undone: copy from none of them   (_cond)
        self._copying = 0  # restores holding a copy lease                                 (_cond)
        self._held = 0  # restores reading what is not pinned yet themselves (see holding) (_cond)
        self._held_until = 0.0  # (monotonic) when the holds stop parking the adoption      (_cond)
        self._stopping = False  # the manager closes: holds no longer park the adoption     (_cond)
        self._overheld = False  # a run of holds outlasted HOLD_WAIT_S (said once)           (_cond)

    # ------------------------------------------------ the adoption thread's side

    def pinned(self, name: str, upto: int) -> None:
        """Bytes ``[0, upto)`` of image ``name`` are pinned. While a restore holds the
        adoption (:meth:`holding`), returns only once none does, or as :meth:`unheld` says
        (the holds' bound, :meth:`stopping`, :meth:`end`), so that the next registration waits."""
        with self._cond:
            self._upto[name] = max(self._upto.get(name, 0), upto)
            self._cond.notify_all()
        self.unheld()

    def unheld(self) -> None:
        """(the adoption's threads) Return once no restore holds the adoption
        (:meth:`holding`), or it has ended, or the manager closes (:meth:`stopping`), or
        :data:`HOLD_WAIT_S` seconds after the first of the holds began."""
        with self._cond:
            def free() -> bool:
                return not self._held or self._ended or self._stopping

            left = self._held_until - time.monotonic()
            if not free() and (left <= 0 or not self._cond.wait_for(free, left)) and not self._overheld:
                self._overheld = True
                log.warning("restores held the adoption of slot %d for over %s s; it goes on", self.index,
                            HOLD_WAIT_S)

    def stopping(self) -> None:
        """(the manager's close) The adoption is told to stop: holds no longer park it, so it
        sees the stop at its next piece."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def revoke(self, timeout: float | None = None) -> bool:
        """Registrations are about to be undone: tell every restore, and wait up to
        ``timeout`` seconds (None: :data:`REVOKE_WAIT_S`) until none holds a copy lease.
        Returns False when some still did then (the caller unpins all the same)."""
        timeout = REVOKE_WAIT_S if timeout is None else timeout
        with self._cond:
            self._revoked = self._ended = True
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: self._copying == 0, timeout)
        if not done:
            log.warning("a restore still copied from an adopted slot's pinned images after %s s; they are "
                        "unpinned all the same", timeout)
        return done

    def end(self) -> None:
        """The adoption is over (whatever it pinned stays pinned until revoked)."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    # ------------------------------------------------------- a restore's side

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the adoption after the piece it registers now, while a restore reads what is
        not pinned yet by other means: a registration keeps the driver from running other
        CUDA calls meanwhile, the restore's copies included (its threads that fault pages in
        ahead of the registrations wait too, see :meth:`unheld`: they would take the CPUs and
        memory bandwidth the restore reads with). Released, the adoption goes on (with its
        pauses again: the last hold released clears ``hurry``, which a restore that then
        waits sets again). The adoption parks at most :data:`HOLD_WAIT_S` seconds from the
        first of a run of holds."""
        with self._cond:
            if not self._held:
                self._held_until, self._overheld = time.monotonic() + HOLD_WAIT_S, False
            self._held += 1
        try:
            yield
        finally:
            with self._cond:
                self._held -= 1
                if not self._held:
                    self.hurry.clear()
                self._cond.notify_all()

    def upto(self, name: str) -> int:
        """Bytes of image ``name`` pinned from its start, now."""
        with self._cond:
            return self._upto.get(name, 0)

    def unpinned(self, names: Iterable[str]) -> int:
        """Bytes of images ``names`` not pinned yet (0 once revoked or ended: nothing more will be)."""
        with self._cond:
            if self._revoked or self._ended:
                return 0
            return sum(int(self.images[n].numel()) - self._upto.get(n, 0) for n in names if n in self.images)

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Hold a copy lease: no registration is undone until it is released. Release it only
        once every copy queued from the images has finished.

        Raises:
            PinningLost: the registrations are being undone already.
        """
        with self._cond:
            if self._revoked:
                raise PinningLost("the adoption is undoing its registrations")
            self._copying += 1
        try:
            yield
        finally:
            with self._cond:
                self._copying -= 1
                self._cond.notify_all()

    def wait(self, name: str, end: int, deadline: float, budget: float) -> int:
        """Wait until bytes ``[0, end)`` of image ``name`` are pinned, at most until
        ``deadline`` (``time.monotonic()``, ``budget`` seconds after the restore began); asks
        the adoption to hurry. Returns how many bytes of the image are pinned (at least ``end``).

        Raises:
            PinningLost: revoked, or the adoption ended without pinning them, or the deadline passed.
        """
        self.hurry.set()
        with self._cond:
            def ready() -> bool:
                return self._revoked or self._ended or self._upto.get(name, 0) >= end

            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PinningLost(f"the adoption of slot {self.index} did not end within {budget} s")
                self._cond.wait(left)
            if self._revoked or self._upto.get(name, 0) < end:
                raise PinningLost(f"the adoption of slot {self.index} ended without pinning its images")
            return self._upto[name]


class TierImages(dict[str, "torch.Tensor"]):
    """A slot's file images (file name -> uint8 CPU tensor of the whole file) as
    :meth:`LocalTier.reading <ckptmgr.storage.tier.LocalTier.reading>` yields them;
    ``pinning``: the adoption's progress while the slot is still being pinned (copy a chunk
    only once :meth:`wait` says its piece is), None once it is pinned whole."""

    pinning: Pinning | None = None
    deadline = 0.0  # (time.monotonic()) the restore waits for the adoption until then
    budget = 0.0  # seconds from the restore's start to ``deadline``

    def wait(self, name: str, end: int) -> int:
        """Bytes of image ``name`` pinned from its start, once at least ``end`` are (see
        :meth:`Pinning.wait`); the whole image when no pinning is in progress.

        Raises:
            PinningLost: they will not be pinned before the deadline.
        """
        if self.pinning is None:
            return int(self[name].numel())
        return self.pinning.wait(name, end, self.deadline, self.budget)
