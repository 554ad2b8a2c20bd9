"""What the Hugging Face integrations share: their options, one writer per process with its
staging fence and multi-rank agreement, and retention over a library's checkpoint directories.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from dataclasses import dataclass

from ckptmgr.errors import CheckpointCorruptError, ConfigError
from ckptmgr.retention import KeepLatest, RetentionPolicy, StepInfo

from ._dirrecord import RECORD_NAME, committed_dirs, delete_dir, newest_verified, verify_dir
from ._dirreplace import recover
from ._dirwriter import DirectoryWriter, Pending
from ._fence import StagingFence

__all__ = ["AsyncSaveOptions", "Session", "apply_retention", "check_checkpoint", "default_policy", "latest_checkpoint"]

log = logging.getLogger("ckptmgr")


@dataclass(frozen=True, kw_only=True)
class AsyncSaveOptions:
    """How checkpoints are saved in the background.

    Attributes:
        retention: which committed checkpoints to keep (e.g. ``AnyOf(KeepLatest(3),
            KeepEvery(1000))``); None keeps what the library's own limit says
            (``save_total_limit``, ``total_limit``), or everything. Applied after each commit;
            the newest checkpoint, the best one and saves in flight are never deleted.
        overlap: True (the default) lets the copy off the training tensors run on into the
            next step, waited for right before the next ``optimizer.step()``; False waits
            for it inside the save call.
        slots: saves staged or being written at once (each slot holds one whole checkpoint
            in host memory, pinned where CUDA is).
        copy_threads: threads copying CPU tensors into the slot.
        io_threads: threads writing and hashing file chunks in parallel.
        chunk_size: bytes per write task and per CRC32C chunk.
        max_host_bytes: cap on the staging memory (None: no cap).
        verify_on_resume: check each checkpoint's checksums before resuming from it, and
            fall back to the previous one when damaged.
        timeout: seconds any wait (a free slot, the other ranks) may take.
    """

    retention: RetentionPolicy | None = None
    overlap: bool = True
    slots: int = 1
    copy_threads: int = 4
    io_threads: int = 8
    chunk_size: int = 64 << 20
    max_host_bytes: int | None = None
    verify_on_resume: bool = True
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.retention is not None and not isinstance(self.retention, RetentionPolicy):
            raise ConfigError(f"retention must be a RetentionPolicy or None, got {type(self.retention).__name__}")
        for name in ("slots", "copy_threads", "io_threads", "chunk_size"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ConfigError(f"AsyncSaveOptions.{name} must be a positive int, got {v!r}")
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or self.timeout <= 0:
            raise ConfigError(f"AsyncSaveOptions.timeout must be a positive number, got {self.timeout!r}")


class Session:
    """One writer, its fence and (in a multi-rank job) the ranks' agreement, made lazily on
    the first save (every rank saves the same steps, so collectives line up there)."""

    def __init__(self, options: AsyncSaveOptions) -> None:
        # every field belongs to the training thread (the writer's own state has its own lock)
        self.options = options
        self.writer: DirectoryWriter | None = None
        self.fence = StagingFence()
        self._pid: int | None = None
        self._nonce: str | None = None

    def start(self) -> DirectoryWriter:
        if self.writer is None:
            from ckptmgr.distributed.coordinator import coordinator_for

            coord = coordinator_for(None, self.options.timeout)
            o = self.options
            self.writer = DirectoryWriter(slots=o.slots, copy_threads=o.copy_threads, io_threads=o.io_threads,
                                          chunk_size=o.chunk_size, max_host_bytes=o.max_host_bytes,
                                          coordinator=coord, timeout=o.timeout)
            if coord is not None:  # one temporary directory per save for all ranks
                self._pid, self._nonce = coord.broadcast((os.getpid(), secrets.token_hex(6)), "checkpoint naming")
        return self.writer

    def token(self, step: int) -> tuple[str | None, int | None]:
        """The temporary directory's token and pid for ``step`` (None, None: single process)."""
        if self._nonce is None:
            return None, None
        return f"{self._nonce}{step:012x}", self._pid

    def guard(self, pending: Pending) -> None:
        """Hold the next optimizer step until ``pending``'s copies have landed (or wait now)."""
        if self.options.overlap:
            self.fence.arm(pending)  # the fence needs staged()/wait_staged() only
        else:
            pending.wait_staged(self.options.timeout)

    def wait(self, timeout: float | None = None) -> None:
        self.fence.wait()
        if self.writer is not None:
            self.writer.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        self.fence.wait()
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close(timeout)
            if writer.coordinator is not None:
                writer.coordinator.destroy()


def _step_info(step: int, path: str) -> StepInfo:
    try:
        with open(os.path.join(path, RECORD_NAME), "rb") as f:
            doc = json.loads(f.read(1 << 20))
        return StepInfo(step, float(doc["time"]), dict(doc.get("metadata") or {}))
    except (OSError, ValueError, KeyError, TypeError):
        return StepInfo(step, os.path.getmtime(path), {})


def apply_retention(parent: str, pattern: re.Pattern[str], policy: RetentionPolicy | None,
                    protect: set[int], scratch: str | None = None) -> list[int]:
    """Delete the committed directories under ``parent`` that ``policy`` drops, never the
    newest nor those in ``protect`` (renamed away into ``scratch`` first, default
    ``parent``); return the deleted steps."""
    if policy is None:
        return []
    dirs = committed_dirs(parent, pattern)
    steps = sorted(dirs)
    if len(steps) < 2:
        return []
    infos = [_step_info(s, dirs[s]) for s in steps]
    mask = policy.keep(infos)
    if len(mask) != len(steps):
        raise ConfigError(f"{policy!r} returned {len(mask)} decisions for {len(steps)} checkpoints")
    deleted = []
    for s, keep in zip(steps, mask, strict=True):
        if keep or s == steps[-1] or s in protect:
            continue
        log.info("retention: deleting %s", dirs[s])
        delete_dir(dirs[s], scratch)
        deleted.append(s)
    return deleted


def latest_checkpoint(parent: str, pattern: re.Pattern[str], *, verify: bool = True,
                      scratch: str | None = None) -> str | None:
    """The newest complete checkpoint directory under ``parent`` (verified against its record
    when it has one; damaged ones are skipped with a warning), or None. Replacements a crash
    interrupted in ``scratch`` (default ``parent``) are finished first."""
    recover(scratch if scratch is not None else parent)
    dirs = committed_dirs(parent, pattern)
    if not verify:
        return dirs[max(dirs)] if dirs else None
    found = newest_verified(dirs, log)
    return found[1] if found else None


def check_checkpoint(path: str, *, verify: bool = True) -> None:
    """Raise CheckpointCorruptError when ``path`` (a checkpoint the caller named) is damaged."""
    if verify and os.path.isdir(path):
        try:
            verify_dir(path)
        except CheckpointCorruptError as exc:
            raise CheckpointCorruptError(f"{exc}; resume from another checkpoint") from None


def default_policy(limit: int | None) -> RetentionPolicy | None:
    """The library's "keep the last N" as a policy (None or <= 0: keep everything)."""
    return KeepLatest(limit) if limit is not None and limit > 0 else None

