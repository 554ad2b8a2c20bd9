"""The local tier: a target in tmpfs whose files are the staging slots themselves.

The directory's layout and the read-only listing of its steps are in
:mod:`ckptmgr.storage.tier_layout`.

The device-to-host copy writes a slot's data files. Once the copy has ended the tier's
writer (:meth:`LocalTier.begin`) checksums them and writes ``manifest.json`` (temporary
name, then rename): from then on the slot is a committed checkpoint that survives the
process. Before a slot is reused, :meth:`LocalTier.claim` makes its step invisible and its
manifest is removed, so a slot without a manifest is never trusted.

Security: /dev/shm is shared by every user of the machine and the directory name is
predictable. The directory is created with mode 0700 and, before any use, checked with
lstat to be a real directory (not a symlink), owned by this user, and private; otherwise the
tier is not used. Everything inside is reached through directory file descriptors and
opened with O_NOFOLLOW, so a planted symlink is never followed. Slots are adopted at
start-up only when ``root-id`` matches the root's own identity
(:meth:`~ckptmgr.storage.Target.root_id`): a root deleted (``rm -rf``) or replaced since is
never resurrected from RAM.

Thread ownership: the commit map, the readers, the attached images and the adoptions in
progress are guarded by ``_mu``, which is never held across I/O nor across a wait. The
saver calls :meth:`claim`, :meth:`attach` and :meth:`detach` (its slot pool's lock may be
held: pool -> tier is the only lock order) and, for a slot adopted from an earlier process,
:meth:`adopting` then, from its adoption thread, :meth:`adopted`; restores call
:meth:`reading`, which yields the slot's images, pinned, or with the progress of their
pinning while the adoption still runs (:mod:`ckptmgr.storage.tier_pinning`: the restore copies
each piece once it is pinned). The start-up scan is :mod:`ckptmgr.storage.tier_scan`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # (the CLI reads a tier's listing without torch)
    import torch

from .._threads import DaemonPool
from ..errors import CheckpointCorruptError, ConfigError, StepNotFoundError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import MANIFEST_NAME
from ..format.schema import MAX_MANIFEST_BYTES
from ..options import StagingOptions
from .posix import preadv_into
from .private import NOFOLLOW as _NOFOLLOW
from .private import UnsafePathError as TierUnsafeError
from .private import empty_dir, open_private_dir, read_small, write_small
from .tier_layout import DURABLE_MARK, ROOT_ID, TMP_MANIFEST, ram_filesystem, read_tier, tier_dir
from .tier_pinning import Pinning, TierImages
from .tier_scan import GONE_PREFIX, TierScan

__all__ = ["LocalTier", "TierBusyError", "TierUnsafeError", "open_local_tier", "ram_filesystem", "read_tier",
           "tier_dir"]

log = logging.getLogger("ckptmgr")

ADOPTION_WAIT_S = 600.0  # at most this long, a read of a slot waits for its adoption's pinning (see LocalTier.reading)


class TierBusyError(OSError):
    """Another live process owns the local tier of this root."""


class _TierWriter:
    """Commits a slot whose files the staging copy has already written in place."""

    location = ""
    progress: Callable[[int], None] | None = None  # (see StepWriter; nothing is written here)

    def __init__(self, tier: LocalTier, step: int, index: int) -> None:
        self.tier, self.step, self.index = tier, step, index

    def adopt(self, parts: list[tuple[str, list[str]]]) -> None:
        raise ConfigError("the local tier holds one process's slots; it takes no other writer's files")

    def write_files(self, files: list[tuple[str, np.ndarray[Any, Any]]], chunk_size: int, *,
                    checksum: bool = True) -> list[tuple[str, ...]]:
        """The files are the slot's own mapped images already: only their checksums are computed."""
        if not checksum:
            return [() for _ in files]
        tasks = [(i, b, e) for i, (_, a) in enumerate(files) for b, e in chunk_ranges(a.size, chunk_size)]
        crcs = list(self.tier.io_pool.map(lambda t: crc32c_hex(files[t[0]][1][t[1]:t[2]]), tasks))
        out: list[list[str]] = [[] for _ in files]
        for (i, _, _), c in zip(tasks, crcs, strict=True):
            out[i].append(c)
        return [tuple(c) for c in out]

    def commit(self, manifest: bytes) -> None:
        self.tier.commit(self.index, self.step, manifest)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.tier.invalidate(self.index)

    def close(self) -> None:
        """Nothing to release: the slot is this process's own (its flock covers the tier)."""


class LocalTier(TierScan):
    """The tmpfs directory holding the slots of one checkpoint root: a target whose writes
    are already in place and whose reads may be served from this process's pinned mappings."""

    def __init__(self, local_dir: str, root_url: str) -> None:
        """Open (creating if needed), verify and lock the tier of ``root_url`` in ``local_dir``.

        Raises:
            TierBusyError: another process holds it.
            TierUnsafeError: it exists and is not this user's private directory.
            OSError: it cannot be created.
        """
        self.path = tier_dir(local_dir, root_url)
        self.url = f"local tier {self.path}"
        self._fd = open_private_dir(self.path, None, self.path)
        try:
            self._lock_fd = os.open("lock", os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600, dir_fd=self._fd)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self._lock_fd)
                raise TierBusyError(f"{self.path} is in use by another process") from None
            write_small("root", self._fd, (root_url + "\n").encode("utf-8"))
        except BaseException:
            os.close(self._fd)
            raise
        self._mu = threading.Lock()
        self._steps: dict[int, int] = {}  # committed step -> slot index       (guarded by _mu)
        self._readers: Counter[int] = Counter()  # slot index -> reads in progress  (_mu)
        self._images: dict[int, dict[str, torch.Tensor]] = {}  # pinned mappings  (_mu)
        self._slot_fds: dict[int, int] = {}  # slot index -> directory fd          (_mu)
        self._root_id: str | None = None  # the root the slots belong to            (_mu)
        self._adopting: dict[int, Pinning] = {}  # slot index -> its adoption's progress, until it ends  (_mu)
        self._closed = False  # close() began                                          (_mu)
        self.on_read_done: Callable[[], None] | None = None  # told when a read lease ends (no lock held)
        self.io_pool: Executor = DaemonPool(4, thread_name_prefix="ckptmgr-local")  # checksums and reads

    def free_bytes(self) -> int:
        st = os.fstatvfs(self._fd)
        return st.f_bavail * st.f_frsize

    def _slot_fd(self, index: int) -> int:
        with self._mu:
            fd = self._slot_fds.get(index)
        if fd is None:
            fd = open_private_dir(f"slot-{index:02d}", self._fd, f"{self.path}/slot-{index:02d}")
            with self._mu:
                if index in self._slot_fds:  # opened twice at once: keep one
                    os.close(fd)
                    fd = self._slot_fds[index]
                else:
                    self._slot_fds[index] = fd
        return fd

    def open_file(self, index: int, name: str, nbytes: int, *, create: bool) -> int:
        """An fd of slot ``index``'s data file ``name`` (never through a symlink), read-write;
        with ``create`` truncated and its ``nbytes`` of tmpfs pages reserved (ENOSPC here, not
        SIGBUS later). The caller closes it.

        Raises:
            OSError: it cannot be created, or (without ``create``) it is not a regular file of
                ``nbytes`` bytes.
        """
        d = self._slot_fd(index)
        flags = os.O_RDWR | _NOFOLLOW | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(name, flags, 0o600, dir_fd=d)
        try:
            if create:
                os.posix_fallocate(fd, 0, nbytes)
            else:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
                    raise OSError(errno.EINVAL, f"{self.path}/slot-{index:02d}/{name} is not a file of {nbytes} bytes")
        except BaseException:
            os.close(fd)
            if create:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=d)
            raise
        return fd

    def remove_file(self, index: int, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._slot_fd(index))

    # ----------------------------------------------------------- commit state

    def claim(self, index: int) -> bool:
        """Make slot ``index``'s step invisible before the slot is reused; False while a
        restore reads it. No I/O: the caller removes the manifest with :meth:`invalidate`."""
        with self._mu:
            if self._readers[index]:
                return False
            self._steps = {s: i for s, i in self._steps.items() if i != index}
            return True

    def invalidate(self, index: int) -> None:
        """Forget the slot's step and remove its manifest (first, before its data changes)."""
        with self._mu:
            self._steps = {s: i for s, i in self._steps.items() if i != index}
        d = self._slot_fd(index)
        for name in (MANIFEST_NAME, TMP_MANIFEST, DURABLE_MARK):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=d)

    def begin(self, step: int, index: int) -> _TierWriter:
        """The writer that commits slot ``index`` as ``step``."""
        return _TierWriter(self, step, index)

    def commit(self, index: int, step: int, manifest: bytes) -> None:
        """Record the slot's content as committed ``step`` (manifest written, then renamed)."""
        d = self._slot_fd(index)
        write_small(TMP_MANIFEST, d, manifest)
        os.rename(TMP_MANIFEST, MANIFEST_NAME, src_dir_fd=d, dst_dir_fd=d)
        with self._mu:
            self._steps[step] = index

    def steps(self) -> dict[int, int]:
        """Committed steps -> slot index."""
        with self._mu:
            return dict(self._steps)

    def holds(self, index: int) -> int | None:
        """The committed step slot ``index`` holds, or None."""
        with self._mu:
            return next((s for s, i in self._steps.items() if i == index), None)

    def attach(self, index: int, images: dict[str, torch.Tensor]) -> None:
        """This process has slot ``index``'s files mapped and pinned as ``images``."""
        with self._mu:
            self._images[index] = images

    def detach(self, index: int) -> None:
        with self._mu:
            self._images.pop(index, None)

    def adopting(self, index: int, images: dict[str, torch.Tensor],
                 identities: dict[str, tuple[int, int]] | None = None) -> Pinning:
        """Slot ``index``, adopted from an earlier process, has its files mapped as ``images``
        (``identities``: each mapped file's device and inode) and is being pinned in the
        background: the adoption thread reports its progress on the
        :class:`~ckptmgr.storage.tier_pinning.Pinning` returned, which :meth:`reading` hands
        to restores until :meth:`adopted`."""
        pinning = Pinning(index, images, identities)
        with self._mu:
            self._adopting[index] = pinning
        return pinning

    def stop_holds(self) -> None:
        """The manager closes: no restore's hold parks an adoption any more (see
        :meth:`~ckptmgr.storage.tier_pinning.Pinning.stopping`)."""
        with self._mu:
            adopting = list(self._adopting.values())
        for pinning in adopting:
            pinning.stopping()

    def adopted(self, index: int) -> None:
        """The background adoption of slot ``index`` ended (pinned and attached, or not)."""
        with self._mu:
            pinning = self._adopting.pop(index, None)
            sweep = self._sweep_when_idle and not self._adopting
        if pinning is not None:
            pinning.end()
        if sweep:
            self.start_sweep()  # (the slots set aside at start: their freeing no longer slows the pinning)

    @contextlib.contextmanager
    def reading(self, step: int, *, adoption_wait: float | None = None) -> Iterator[TierImages | None]:
        """Hold ``step``'s slot against reuse while it is read.

        Yields the slot's file images (file name -> uint8 CPU tensor of the whole file) when
        this process has them mapped and pinned, or being pinned by the slot's adoption,
        else None (then read through :meth:`read_into`). Pinned images are registered in
        pieces that are whole numbers of the manifest's checksum chunks: copy them chunk by
        chunk (never across a chunk). While the slot's adoption runs, the images come with
        its progress (:attr:`TierImages.pinning`): copy a chunk only once
        :meth:`TierImages.wait` says it is pinned, under a copy lease; the wait ends
        ``adoption_wait`` seconds (None: :data:`ADOPTION_WAIT_S`) after this call at the
        latest, with :class:`~ckptmgr.storage.tier_pinning.PinningLost`: then read the
        files, and verify them.

        Raises:
            StepNotFoundError: the tier does not hold ``step``.
        """
        budget = ADOPTION_WAIT_S if adoption_wait is None else adoption_wait
        with self._mu:
            index = self._steps.get(step)
            if index is None:
                raise StepNotFoundError(f"step {step} is not in the {self.url}")
            self._readers[index] += 1
            pinning = self._adopting.get(index)
            images = self._images.get(index) if pinning is None else pinning.images
        try:
            out = TierImages(images) if images is not None else None
            if out is not None and pinning is not None:
                out.pinning, out.deadline, out.budget = pinning, time.monotonic() + budget, budget
                pinning.hurry.set()  # a restore waits for the slot: the adoption pins without pauses
            yield out
        finally:
            with self._mu:
                self._readers[index] -= 1
            if self.on_read_done is not None:  # a save may be waiting for this slot
                self.on_read_done()

    @property
    def closed(self) -> bool:
        """:meth:`close` began: the tier's files are not read any more."""
        with self._mu:
            return self._closed

    def remove_slot(self, index: int) -> None:
        """Delete the slot's files, its manifest first, then its directory."""
        self.invalidate(index)
        empty_dir(self._slot_fd(index))
        with self._mu:
            fd = self._slot_fds.pop(index, None)
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(f"slot-{index:02d}", dir_fd=self._fd)

    def close(self, *, remove: bool, wait: bool = True) -> None:
        """Give up ownership; with ``remove``, delete the tier directory if no slot is left.
        ``wait=False`` (a write is still hung on a slot): only stop the threads; the files,
        descriptors and lock stay as they are until the process ends."""
        with self._mu:
            self._closed = True
        self.io_pool.shutdown(wait=wait, cancel_futures=True)
        with self._mu:
            adopting, self._adopting = list(self._adopting.values()), {}
        for pinning in adopting:  # (no read waits for an adoption of a closed tier)
            pinning.end()
        self.start_sweep()  # (if no adoption ended to start it)
        if not wait:
            return
        with self._mu:
            fds, self._slot_fds = list(self._slot_fds.values()), {}
        for fd in fds:
            os.close(fd)
        self.wait_sweep()  # (the slots set aside at start: else the next start sweeps them)
        if remove and not any(n.startswith(("slot-", GONE_PREFIX)) for n in os.listdir(self._fd)):
            for name in ("root", ROOT_ID, "lock"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self._fd)
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
        os.close(self._lock_fd)
        os.close(self._fd)

    # ------------------------------------------------ read half of a Target

    def _slot_of(self, step: int) -> int:
        with self._mu:
            index = self._steps.get(step)
        if index is None:
            raise StepNotFoundError(f"step {step} is not in the {self.url}")
        return index

    def read_manifest(self, step: int) -> bytes:
        try:
            return read_small(MANIFEST_NAME, self._slot_fd(self._slot_of(step)), MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise StepNotFoundError(f"step {step} is not in the {self.url}") from None

    def file_size(self, step: int, name: str, *, fresh: bool = False) -> int:  # (always fresh)
        st = os.stat(name, dir_fd=self._slot_fd(self._slot_of(step)), follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(f"{self.url}: step {step}: {name} is not a regular file")
        return st.st_size

    def path_of(self, step: int, name: str) -> str:
        """Where data file ``name`` of committed ``step`` lies (for the in-place loader)."""
        return os.path.join(self.path, f"slot-{self._slot_of(step):02d}", name)

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
        preadv_into(name, offset, out, dir_fd=self._slot_fd(self._slot_of(step)))


def open_local_tier(opts: StagingOptions, root: str) -> LocalTier | None:
    """The local tier for ``root``, or None when it is off or cannot be used here.

    With CUDA, ``local_dir`` must be in RAM (a tmpfs such as /dev/shm): the tier's files are
    the staging buffers, pinned for the copies from the GPU.

    Raises:
        ConfigError: ``local_tier=True`` where there is no usable ``local_dir``.
    """
    if opts.local_tier is False:
        return None
    usable = sys.platform.startswith("linux") and os.path.isdir(opts.local_dir)
    if not usable:
        if opts.local_tier:
            raise ConfigError(f"StagingOptions(local_tier=True) needs Linux and an existing local_dir; "
                              f"{opts.local_dir!r} is not a directory here")
        return None
    from .. import _cuda  # (a manager's tier only: listing one needs no CUDA, nor torch)

    if _cuda.available() and ram_filesystem(opts.local_dir) is False:
        why = (f"{opts.local_dir!r} is not in RAM (tmpfs, ramfs or hugetlbfs): Linux refuses to pin a disk "
               "file's pages, and the tier's files must be pinned for copies from the GPU")
        if opts.local_tier:
            raise ConfigError(f"StagingOptions(local_tier=True): {why}")
        log.warning("not using the local tier: %s", why)
        return None
    try:
        return LocalTier(opts.local_dir, root)
    except TierBusyError as exc:
        log.warning("not using the local tier: %s (another manager has the same root open)", exc)
    except TierUnsafeError as exc:
        log.warning("not using the local tier: %s; another user may have created it to hijack this job's "
                    "checkpoints (remove it, or set StagingOptions(local_dir=...) to a private directory)", exc)
    except OSError as exc:
        log.warning("not using the local tier in %s: %s", opts.local_dir, exc)
    return None
