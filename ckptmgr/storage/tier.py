"""The local tier: staging slots that are themselves committed checkpoints in tmpfs.

Layout, one directory per checkpoint root and user::

    <local_dir>/ckptmgr-<uid>-<hash of the root URL>/
        lock                 flock()ed by the one manager that owns the tier
        root                 the root URL, for people looking around
        slot-00/             one staging slot
            data-00000.safetensors ...   mapped MAP_SHARED and pinned in place
            manifest.json                present only while the slot holds a complete step

A slot's data files are written by the device-to-host copy itself. Once the copy has ended
and the checksums are computed, ``manifest.json`` is written (temporary name, then rename):
from then on the slot is a committed checkpoint that survives the process. Before a slot is
reused its manifest is removed first, so a slot without a manifest is never trusted.

The tier implements the read half of the :class:`~ckptmgr.storage.Target` protocol, so the
host loader restores from it exactly as from a durable root.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError, ConfigError, StepNotFoundError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..options import StagingOptions
from .local import preadv_into

__all__ = ["LocalTier", "TierBusyError", "open_local_tier", "tier_dir"]

log = logging.getLogger("ckptmgr")

_TMP_MANIFEST = ".manifest.json.tmp"


class TierBusyError(OSError):
    """Another live process owns the local tier of this root."""


def tier_dir(local_dir: str, root_url: str) -> str:
    """The tier directory of ``root_url`` for the current user."""
    key = hashlib.sha256(root_url.encode("utf-8")).hexdigest()[:16]
    return os.path.join(local_dir, f"ckptmgr-{os.getuid()}-{key}")


class LocalTier:
    """The tmpfs directory holding the slots of one checkpoint root."""

    def __init__(self, local_dir: str, root_url: str, io_pool: ThreadPoolExecutor) -> None:
        """Open (creating if needed) and lock the tier of ``root_url`` in ``local_dir``.

        Raises:
            TierBusyError: another process holds it.
            OSError: it cannot be created.
        """
        self.path = tier_dir(local_dir, root_url)
        self.url = f"local tier {self.path}"
        self.io_pool = io_pool
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise TierBusyError(f"{self.path} is in use by another process") from None
        with open(os.path.join(self.path, "root"), "w", encoding="utf-8") as f:
            f.write(root_url + "\n")
        self._mu = threading.Lock()
        self._steps: dict[int, int] = {}  # committed step -> slot index
        self.commit_pool = ThreadPoolExecutor(1, thread_name_prefix="ckptmgr-local")
        self.crc_pool = ThreadPoolExecutor(4, thread_name_prefix="ckptmgr-local-crc")

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def slot_dir(self, index: int) -> str:
        path = os.path.join(self.path, f"slot-{index:02d}")
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def file_path(self, index: int, name: str) -> str:
        return os.path.join(self.slot_dir(index), name)

    # ----------------------------------------------------------- commit state

    def scan(self, slots: int) -> dict[int, Manifest]:
        """Committed steps left by an earlier process, by slot index (< ``slots``).

        A slot with an unreadable manifest, or with files that do not match it, is reset.
        Slots beyond ``slots`` are removed.
        """
        found: dict[int, Manifest] = {}
        for name in sorted(os.listdir(self.path)):
            full = os.path.join(self.path, name)
            if not (name.startswith("slot-") and name[5:].isdigit() and os.path.isdir(full)):
                continue
            index = int(name[5:])
            if index >= slots:
                shutil.rmtree(full, ignore_errors=True)
                continue
            try:
                with open(os.path.join(full, MANIFEST_NAME), "rb") as f:
                    m = Manifest.from_bytes(f.read(), where=f"{full}/{MANIFEST_NAME}")
                for fname, rec in m.files.items():
                    if os.path.getsize(os.path.join(full, fname)) != rec.size:
                        raise CheckpointCorruptError(f"{full}/{fname} does not match its manifest")
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                self.invalidate(index)
                continue
            found[index] = m
            with self._mu:
                self._steps[m.step] = index
        return found

    def invalidate(self, index: int) -> None:
        """Make the slot's step invisible (its manifest goes first), before it is reused."""
        with self._mu:
            for step, i in list(self._steps.items()):
                if i == index:
                    del self._steps[step]
        for name in (MANIFEST_NAME, _TMP_MANIFEST):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.slot_dir(index), name))

    def commit(self, index: int, step: int, manifest: bytes) -> None:
        """Record the slot's content as committed ``step``."""
        d = self.slot_dir(index)
        tmp = os.path.join(d, _TMP_MANIFEST)
        with open(tmp, "wb") as f:
            f.write(manifest)
        os.rename(tmp, os.path.join(d, MANIFEST_NAME))
        with self._mu:
            self._steps[step] = index

    def steps(self) -> dict[int, int]:
        """Committed steps -> slot index."""
        with self._mu:
            return dict(self._steps)

    def remove_slot(self, index: int) -> None:
        """Delete the slot's files, its manifest first, then its directory."""
        self.invalidate(index)
        d = self.slot_dir(index)
        for name in os.listdir(d):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, name))
        with contextlib.suppress(OSError):
            os.rmdir(d)

    def close(self, *, remove: bool) -> None:
        """Give up ownership; with ``remove``, delete the tier directory if no slot is left."""
        self.commit_pool.shutdown(wait=True)
        self.crc_pool.shutdown(wait=True)
        if remove:
            for name in ("root", "lock"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.path, name))
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
        os.close(self._lock_fd)

    # ------------------------------------------------ read half of a Target

    def _slot_of(self, step: int) -> int:
        with self._mu:
            index = self._steps.get(step)
        if index is None:
            raise StepNotFoundError(f"step {step} is not in the {self.url}")
        return index

    def read_manifest(self, step: int) -> bytes:
        try:
            with open(os.path.join(self.slot_dir(self._slot_of(step)), MANIFEST_NAME), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise StepNotFoundError(f"step {step} is not in the {self.url}") from None

    def file_size(self, step: int, name: str) -> int:
        return os.stat(self.file_path(self._slot_of(step), name)).st_size

    def path_of(self, step: int, name: str) -> str:
        """Where data file ``name`` of committed ``step`` lies (for the in-place loader)."""
        return self.file_path(self._slot_of(step), name)

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
        preadv_into(self.file_path(self._slot_of(step), name), offset, out)


def open_local_tier(opts: StagingOptions, root: str, io_pool: ThreadPoolExecutor) -> LocalTier | None:
    """The local tier for ``root``, or None when it is off or cannot be used here.

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
    try:
        return LocalTier(opts.local_dir, root, io_pool)
    except TierBusyError as exc:
        log.warning("not using the local tier: %s (another manager has the same root open)", exc)
    except OSError as exc:
        log.warning("not using the local tier in %s: %s", opts.local_dir, exc)
    return None
