"""The slot pool: reusable host buffers, each holding one complete checkpoint image.

A slot is one of three kinds, chosen when it is first filled:

* ``tmpfs``: one file per data file in the local tier (see :mod:`ckptmgr.storage.tier`), mapped
  MAP_SHARED and, with CUDA, pinned in place once with cudaHostRegister. When the copy ends
  the files *are* the checkpoint: the local tier commits it by writing its manifest.
* ``pinned``: page-locked host memory (CUDA present, no local tier).
* ``memory``: ordinary host memory (no CUDA).

Slots are allocated and pinned when a state first needs them and again only when the state
grows (or, for tmpfs files, changes size); never per save. The counters ``allocations`` and
``registrations`` say how often that happened.

Reuse rule, the "never lose the newest" invariant: a slot is handed out only when what it
holds is durable elsewhere, or superseded by a newer committed step, or, as a last resort
when every slot holds a step whose durable write failed, the oldest such step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .. import _cuda
from ..errors import CapacityError, CkptTimeoutError
from ..format.layout import DATA_ALIGN, file_name
from ..storage.tier import LocalTier

__all__ = ["Slot", "SlotPool", "slot_bytes"]

log = logging.getLogger("ckptmgr")


def slot_bytes(sizes: list[int]) -> int:
    """Host bytes one slot needs for files of ``sizes`` (each image starts page-aligned)."""
    return sum(-(-s // DATA_ALIGN) * DATA_ALIGN for s in sizes)


@dataclass
class _Buffer:
    tensor: torch.Tensor  # uint8 CPU; the first ``offset`` bytes are alignment padding
    offset: int
    nbytes: int
    registered: int | None = None  # the pointer passed to cudaHostRegister
    path: str | None = None


@dataclass
class Slot:
    """One staging buffer and what it holds. Fields are guarded by the pool's lock."""

    index: int
    kind: str = "none"
    segments: list[torch.Tensor] = field(default_factory=list)  # one uint8 view per data file
    step: int | None = None  # the step whose image the slot holds (None: nothing valid)
    committed: bool = False  # the local tier lists ``step``
    durable: bool = False  # ``step`` is committed on the durable target
    failed: bool = False  # the durable write of ``step`` failed
    busy: bool = False
    readers: int = 0
    buffers: list[_Buffer] = field(default_factory=list)


class SlotPool:
    """``count`` slots, created lazily, reused for the life of the manager."""

    def __init__(self, count: int, *, tier: LocalTier | None, max_host_bytes: int | None) -> None:
        self.tier = tier
        self.max_host_bytes = max_host_bytes
        self.slots = [Slot(i) for i in range(count)]
        self.allocations = 0
        self.registrations = 0
        self.counts: dict[str, float] = {"saves": 0, "skips": 0, "busy_waits": 0, "busy_wait_s": 0.0}
        self.newest_durable: int | None = None
        self._cond = threading.Condition()

    # ------------------------------------------------------------ capacity

    def check_capacity(self, sizes: list[int]) -> None:
        """Raise CapacityError when ``count`` slots of this state exceed the cap."""
        need = slot_bytes(sizes) * len(self.slots)
        if self.max_host_bytes is not None and need > self.max_host_bytes:
            raise CapacityError(
                f"staging this state needs {need / 2**30:.2f} GiB of host memory ({len(self.slots)} slot(s) of "
                f"{slot_bytes(sizes) / 2**30:.2f} GiB), over StagingOptions.max_host_bytes="
                f"{self.max_host_bytes / 2**30:.2f} GiB; raise the cap or use fewer slots")

    # ------------------------------------------------------ acquire/release

    def _pick(self) -> Slot | None:
        newest = self.newest_durable
        for s in self.slots:
            if s.committed and s.step is not None and not s.busy:
                newest = s.step if newest is None else max(newest, s.step)
        idle = [s for s in self.slots if not s.busy and s.readers == 0]
        for ok in (lambda s: s.step is None,
                   lambda s: s.durable,
                   lambda s: newest is not None and s.step < newest,
                   lambda s: s.failed):
            cands = [s for s in idle if ok(s)]
            if cands:
                return min(cands, key=lambda s: (s.step if s.step is not None else -1, s.index))
        return None

    def acquire(self, *, wait: bool, timeout: float | None) -> tuple[Slot | None, float]:
        """A slot for a new save, marked busy (None when none is free and not ``wait``), and
        the seconds spent waiting for it. Counted in ``counts``.

        Raises:
            CkptTimeoutError: none became free within ``timeout`` seconds.
        """
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        with self._cond:
            self.counts["saves"] += 1
            while True:
                slot = self._pick()
                if slot is not None:
                    break
                if not wait:
                    self.counts["skips"] += 1
                    return None, time.monotonic() - t0
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CkptTimeoutError(f"no staging slot became free within {timeout} s")
                self._cond.wait(left)
            waited = time.monotonic() - t0
            if waited > 1e-3:
                self.counts["busy_waits"] += 1
                self.counts["busy_wait_s"] += waited
            if slot.failed and slot.step is not None:
                log.warning("reusing staging slot %d: it held step %d, whose durable write failed and which "
                            "exists only in the local tier", slot.index, slot.step)
            slot.busy = True
            old, slot.step, slot.committed, slot.durable, slot.failed = slot.step, None, False, False, False
        if self.tier is not None and old is not None:
            self.tier.invalidate(slot.index)
        return slot, waited

    def release(self, slot: Slot, *, step: int | None, durable: bool, failed: bool = False) -> None:
        """Return ``slot`` to the pool, recording what it now holds."""
        with self._cond:
            slot.busy = False
            slot.step = step if slot.kind == "tmpfs" else None
            slot.committed = slot.step is not None and self.tier is not None and step in self.tier.steps()
            slot.durable, slot.failed = durable, failed
            if durable and step is not None:
                self.newest_durable = step if self.newest_durable is None else max(self.newest_durable, step)
            self._cond.notify_all()

    def mark_committed(self, slot: Slot, step: int) -> None:
        with self._cond:
            slot.step, slot.committed = step, True

    def note_durable(self, step: int) -> None:
        with self._cond:
            self.newest_durable = step if self.newest_durable is None else max(self.newest_durable, step)
            self._cond.notify_all()

    @contextlib.contextmanager
    def reading(self, step: int) -> Iterator[Slot | None]:
        """Keep the slot holding ``step`` from being reused while it is read."""
        with self._cond:
            slot = next((s for s in self.slots if s.step == step and s.committed), None)
            if slot is not None:
                slot.readers += 1
        try:
            yield slot
        finally:
            if slot is not None:
                with self._cond:
                    slot.readers -= 1
                    self._cond.notify_all()

    # -------------------------------------------------------------- buffers

    def fit(self, slot: Slot, sizes: list[int]) -> None:
        """Make ``slot`` hold files of exactly ``sizes`` bytes; allocate only what changed."""
        if self.tier is not None and slot.kind in ("none", "tmpfs"):
            try:
                self._fit_tmpfs(slot, sizes)
                return
            except OSError as exc:
                log.warning("staging slot %d cannot live in %s (%s); using host memory instead",
                            slot.index, self.tier.path, exc)
                self._free(slot)
                self.tier.remove_slot(slot.index)
        self._fit_memory(slot, sizes)

    def prepare(self, sizes: list[int]) -> None:
        """Create the buffers of every slot never filled yet (run on a helper thread)."""
        with self._cond:
            fresh = [s for s in self.slots if s.kind == "none" and not s.busy]
            for s in fresh:
                s.busy = True
        for s in fresh:
            try:
                self.fit(s, sizes)
            except Exception as exc:  # the next save() fits again and raises there
                log.warning("preparing staging slot %d failed: %s", s.index, exc)
            finally:
                self.release(s, step=None, durable=False)

    def _fit_tmpfs(self, slot: Slot, sizes: list[int]) -> None:
        assert self.tier is not None
        slot.kind = "tmpfs"
        if [b.nbytes for b in slot.buffers] == sizes:
            return
        grow = sum(sizes) - sum(b.nbytes for b in slot.buffers)
        if grow > 0 and grow > self.tier.free_bytes():
            raise OSError(f"{grow} more bytes are needed and only {self.tier.free_bytes()} are free")
        tier = self.tier
        keep: dict[int, _Buffer] = {}
        for i, old in enumerate(slot.buffers):
            if i < len(sizes) and old.nbytes == sizes[i]:
                keep[i] = old
            else:
                self._drop(old)
        make = [i for i in range(len(sizes)) if i not in keep]
        # Files are created in parallel: reserving tmpfs pages zeroes them, ~0.1 s per GiB a thread.
        with ThreadPoolExecutor(min(8, max(1, len(make)))) as pool:
            futures = [pool.submit(self._map_file, tier.file_path(slot.index, file_name(i)), sizes[i], create=True)
                       for i in make]
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            for f in futures:
                if f.exception() is None:
                    self._drop(f.result())
            slot.buffers, slot.segments = [], []
            raise failed
        keep.update(zip(make, (f.result() for f in futures), strict=True))
        slot.buffers = [keep[i] for i in range(len(sizes))]
        new = slot.buffers
        slot.segments = [b.tensor for b in new]

    def _map_file(self, path: str, nbytes: int, *, create: bool) -> _Buffer:
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserve tmpfs pages now: ENOSPC here, not SIGBUS later
            except OSError:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                raise
            os.close(fd)
        t = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)  # MAP_SHARED
        buf = _Buffer(t, 0, nbytes, path=path)
        with self._cond:
            self.allocations += 1
        self._register(buf)
        return buf

    def _fit_memory(self, slot: Slot, sizes: list[int]) -> None:
        need = slot_bytes(sizes)
        pin = _cuda.available()
        slot.kind = "pinned" if pin else "memory"
        if not slot.buffers or slot.buffers[0].nbytes < need:
            self._free(slot)
            if pin:
                t = _cuda.pinned_empty(need)
                offset = 0
            else:  # over-allocate so every image starts page-aligned (O_DIRECT-friendly)
                t = torch.empty(need + DATA_ALIGN, dtype=torch.uint8)
                offset = -t.data_ptr() % DATA_ALIGN
            slot.buffers = [_Buffer(t, offset, need)]
            self.allocations += 1
        buf = slot.buffers[0]
        segs, pos = [], buf.offset
        for n in sizes:
            segs.append(buf.tensor[pos:pos + n])
            pos += -(-n // DATA_ALIGN) * DATA_ALIGN
        slot.segments = segs

    def _register(self, buf: _Buffer) -> None:
        if _cuda.available() and buf.nbytes:
            ptr = buf.tensor.data_ptr()
            _cuda.host_register(ptr, buf.nbytes)
            buf.registered = ptr
            with self._cond:
                self.registrations += 1

    def _drop(self, buf: _Buffer) -> None:
        if buf.registered is not None:  # unregister before the mapping goes away
            _cuda.host_unregister(buf.registered)
            buf.registered = None
        if buf.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(buf.path)
        del buf.tensor

    def _free(self, slot: Slot) -> None:
        for b in slot.buffers:
            self._drop(b)
        slot.buffers, slot.segments = [], []

    def adopt(self, index: int, step: int, sizes: list[int], *, durable: bool) -> Slot:
        """Take over the committed tmpfs slot ``index`` left by an earlier process."""
        assert self.tier is not None
        slot = self.slots[index]
        slot.kind = "tmpfs"
        slot.buffers = [self._map_file(self.tier.file_path(index, file_name(i)), n, create=False)
                        for i, n in enumerate(sizes)]
        slot.segments = [b.tensor for b in slot.buffers]
        slot.step, slot.committed, slot.durable = step, True, durable
        if durable:
            self.note_durable(step)
        return slot

    def close(self) -> list[int]:
        """Free every slot whose step is durable or superseded; return steps kept in the tier."""
        kept = []
        with self._cond:
            for s in self.slots:
                superseded = self.newest_durable is not None and s.step is not None and s.step < self.newest_durable
                if s.kind == "tmpfs" and s.committed and s.step is not None and not (s.durable or superseded):
                    kept.append(s.step)
                    for b in s.buffers:
                        b.path = None  # keep the files for the next start
                    self._free(s)
                    continue
                self._free(s)
                if self.tier is not None and s.kind == "tmpfs":
                    self.tier.remove_slot(s.index)
        return kept
