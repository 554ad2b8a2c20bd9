"""What a local tier holds at start-up: which root its slots belong to, and which of them are
committed steps for the restarted job to adopt.

:class:`TierScan` is the part of :class:`~ckptmgr.storage.tier.LocalTier` that reads a tier an
earlier process left (:meth:`TierScan.scan`, once, in the manager's constructor) and records
what a later start must know: the identity of the root the slots belong to
(:meth:`TierScan.bind`) and which steps are durable on the root too
(:meth:`TierScan.mark_durable`). A slot is adopted only when it belongs to this very root and
its manifest and files verify; anything else found there is removed, never followed through a
symlink. Its state is the tier's, guarded by the tier's ``_mu`` (never held across I/O).

A slot that is not adopted (the earlier process never committed it: a spare it made, a save cut
short; or it is damaged, of another root, or deleted from the root) can hold gigabytes, and
freeing tmpfs pages runs at about 10 GB/s: on the restart's critical path that was 0.4 s for one
4.5 GiB spare (H200). So the scan renames it out of the slots' names at once (``gone-*``, a new
save may take its index at once) and a sweeper thread deletes it; the next start sweeps
whatever a crash left of that. The sweeper starts once the adopted slots are pinned
(:meth:`TierScan.sweep_after_adoptions`), not beside their pinning: freeing pages and pinning
pages contend in the kernel, and the restart's first restore waits for the pinning.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import stat
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import CheckpointCorruptError, CkptError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.schema import MAX_MANIFEST_BYTES
from .private import UnsafePathError, empty_dir, read_small, write_small
from .tier_layout import DURABLE_MARK, ROOT_ID, marked_durable

if TYPE_CHECKING:
    from .tier_pinning import Pinning

__all__ = ["GONE_PREFIX", "TierScan"]

log = logging.getLogger("ckptmgr")

GONE_PREFIX = "gone-"  # a slot set aside at start-up, being deleted by the sweeper
SWEEP_WAIT_S = 60.0  # close() waits at most this long for the sweeper (then the next start sweeps)
_aside = itertools.count()


class TierScan:
    """The tier's start-up scan and its records of the root (see the module docstring); a
    base of :class:`~ckptmgr.storage.tier.LocalTier`, not used on its own."""

    path: str
    _fd: int
    _mu: threading.Lock
    _steps: dict[int, int]
    _root_id: str | None

    # LocalTier's, declared here for the scan
    _slot_fd: Callable[[int], int]
    _slot_fds: dict[int, int]
    remove_slot: Callable[[int], None]
    _adopting: dict[int, Pinning]  # slot index -> its adoption's progress

    _sweeper: threading.Thread | None = None  # deletes the slots set aside (made once; close waits for _swept) (_mu)
    _swept: threading.Event | None = None  # set when the sweeper ends (made with it, before it starts)  (_mu)
    _aside: tuple[int, list[str]] | None = None  # the sweeper's descriptor and names, until it starts  (_mu)
    _sweep_when_idle = False  # start the sweeper when no adoption runs                                (_mu)

    # ----------------------------------------------------------- the root's identity

    def bind(self, root_id: str) -> None:
        """Record that the slots belong to the root with identity ``root_id`` (before the
        first commit of this process)."""
        with self._mu:
            if self._root_id == root_id:
                return
        write_small(ROOT_ID, self._fd, root_id.encode("ascii"))
        with self._mu:
            self._root_id = root_id

    @property
    def bound(self) -> bool:
        with self._mu:
            return self._root_id is not None

    def _recorded_root_id(self) -> str | None:
        try:
            return read_small(ROOT_ID, self._fd, 256).decode("ascii").strip() or None
        except (OSError, UnicodeDecodeError, CkptError):
            return None

    def scan(self, slots: int, root_id: str | None, *, root_is_empty: bool = False,
             durable: set[int] | None = None) -> dict[int, Manifest]:
        """Committed steps left by an earlier process, by slot index (< ``slots``), when they
        belong to the root whose identity is ``root_id``; everything else is reset.

        The slots belong to the root when the identity recorded at their commit matches
        ``root_id``. A tier that never recorded one (the root's identity could not be written
        at its first commit) belongs only to a root that has no identity and no committed
        step (``root_is_empty``): a root that was deleted or replaced since has one or the
        other as soon as anything was committed to it.

        A slot that is not a private directory of this user, has no manifest or an unreadable
        one, or files that do not match it, is removed. So are slots beyond ``slots``, and, given
        ``durable`` (the root's committed steps), slots whose step was committed on the root
        once and is gone from it since: someone deleted it there, and it is not brought back.
        """
        recorded = self._recorded_root_id()
        adopt = (root_id is not None and recorded == root_id) or (recorded is None and root_id is None
                                                                  and root_is_empty)
        if recorded is not None and not adopt:
            log.info("local tier %s: its slots belong to another root (deleted or replaced since); "
                     "discarding them", self.path)
        found: dict[int, Manifest] = {}
        aside: list[str] = []  # set aside, for the sweeper
        for name in sorted(os.listdir(self._fd)):
            if name.startswith(GONE_PREFIX):
                aside.append(name)  # (an earlier start's, cut short)
                continue
            if not name.startswith("slot-"):
                continue
            index = int(name[5:]) if name[5:].isdigit() and len(name) == 7 else -1
            try:
                if index < 0 or index >= slots or not adopt:
                    raise UnsafePathError("not adopted")
                m = self._check_slot(index)
            except FileNotFoundError:
                continue
            except (OSError, CkptError, ValueError):
                aside += self._set_aside(name, index)
                continue
            if m is None:  # a slot of the dead process never committed (a save cut short, a spare):
                aside += self._set_aside(name, index)  # its memory goes back now, not at the next save into it
                continue
            if durable is not None and m.step not in durable and self._durable_step(index) == m.step:
                log.info("local tier %s: step %d was deleted from the root since it was written there; its copy "
                         "here is dropped, not written back", self.path, m.step)
                aside += self._set_aside(name, index)
                continue
            found[index] = m
            with self._mu:
                self._steps[m.step] = index
        if adopt and root_id is not None:
            with self._mu:
                self._root_id = root_id
        if aside:
            fd = os.dup(self._fd)  # the sweeper's own: close() may close the tier's before it ends
            with self._mu:
                self._aside = (fd, aside)  # (started by sweep_after_adoptions, or by close)
        return found

    def sweep_after_adoptions(self) -> None:
        """Start the sweeper of the slots the scan set aside once no adoption runs (now, when
        none does; else when the last one ends: :meth:`LocalTier.adopted`)."""
        with self._mu:
            self._sweep_when_idle = True
            idle = not self._adopting
        if idle:
            self.start_sweep()

    def start_sweep(self) -> None:
        """Start the sweeper of the slots the scan set aside, if it has not started."""
        with self._mu:
            aside, self._aside = self._aside, None
            if aside is None:
                return
            self._swept = swept = threading.Event()  # (close may wait before the thread has started)
            self._sweeper = sweeper = threading.Thread(target=self._sweep_and_tell, args=(swept, *aside),
                                                       name="ckptmgr-tier-sweep", daemon=True)
        sweeper.start()

    def _sweep_and_tell(self, swept: threading.Event, tier_fd: int, names: list[str]) -> None:
        """(the sweeper thread) :meth:`_sweep`, then set ``swept``."""
        try:
            self._sweep(tier_fd, names)
        finally:
            swept.set()

    def _set_aside(self, name: str, index: int) -> list[str]:
        """Rename slot directory ``name`` out of the slots' names, for the sweeper: its new
        name, or none when it was removed here instead (not a directory, or the rename failed)."""
        with self._mu:
            fd = self._slot_fds.pop(index, None)
        if fd is not None:
            os.close(fd)
        gone = f"{GONE_PREFIX}{index:02d}-{os.getpid()}-{next(_aside)}"
        try:
            if not stat.S_ISDIR(os.lstat(name, dir_fd=self._fd).st_mode):
                raise NotADirectoryError(name)
            os.rename(name, gone, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except FileNotFoundError:
            return []
        except OSError:
            self._discard(name, index)
            return []
        return [gone]

    def _sweep(self, tier_fd: int, names: list[str]) -> None:
        """(the sweeper thread) Delete the slot directories set aside, under the tier directory
        open as ``tier_fd`` (its own descriptor, closed here): their files, then them (a
        symlink or anything but a directory is unlinked, never followed)."""
        try:
            for name in names:
                try:
                    d = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=tier_fd)
                except NotADirectoryError:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=tier_fd)
                    continue
                except OSError:
                    continue
                try:
                    empty_dir(d)
                finally:
                    os.close(d)
                try:
                    os.rmdir(name, dir_fd=tier_fd)
                except OSError as exc:
                    log.warning("local tier %s: could not remove %s (%s)", self.path, name, exc)
        finally:
            os.close(tier_fd)

    def wait_sweep(self, timeout: float | None = None) -> bool:
        """Wait for the sweeper, at most ``timeout`` seconds (default :data:`SWEEP_WAIT_S`);
        True when it has ended (or none was started)."""
        with self._mu:
            swept = self._swept
        return swept is None or swept.wait(SWEEP_WAIT_S if timeout is None else timeout)

    def _check_slot(self, index: int) -> Manifest | None:
        d = self._slot_fd(index)
        try:
            raw = read_small(MANIFEST_NAME, d, MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return None
        where = f"{self.path}/slot-{index:02d}/{MANIFEST_NAME}"
        m = Manifest.from_bytes(raw, where=where)
        for fname, rec in m.files.items():
            st = os.stat(fname, dir_fd=d, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_size != rec.size:
                raise CheckpointCorruptError(f"{self.path}/slot-{index:02d}/{fname} does not match its manifest")
        return m

    def _durable_step(self, index: int) -> int | None:
        try:
            return marked_durable(self._slot_fd(index))
        except OSError:
            return None

    def mark_durable(self, index: int, step: int) -> None:
        """Record that slot ``index``'s step is committed on the durable root (a later start
        then never writes it back there if it is deleted from there). A failure is logged: the
        step would only be written back, as before."""
        try:
            write_small(DURABLE_MARK, self._slot_fd(index), str(step).encode("ascii"))
        except OSError as exc:
            log.warning("local tier %s: could not record that step %d is durable: %s", self.path, step, exc)

    def _discard(self, name: str, index: int) -> None:
        """Remove slot entry ``name`` (whatever it is; a symlink is removed, never followed)."""
        try:
            st = os.lstat(name, dir_fd=self._fd)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode) and index >= 0:
            with contextlib.suppress(OSError):
                self.remove_slot(index)
            return
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=self._fd)
