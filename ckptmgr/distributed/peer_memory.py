"""Where a restore's fetched shard lands in memory, and its check there.

A peer restore's fetch (:class:`~ckptmgr.distributed.peer_mover.ShardMover` with
:class:`Into`) receives a shard into one allocation on the transport's device (GPU memory over
NCCL, host memory over gloo), taken only once the shard's record has passed: each file on a
``FILE_ALIGN`` boundary (:func:`layout`; the bytes between zeroed), and, when a piece of the
byte stream spans two files, one scratch piece at the end (:class:`InMemory` receives each
piece in place, or through the scratch piece and then copies it). :func:`allocate` refuses what
this node has no memory for (:func:`available`). :func:`check` verifies the files where they
lie, by the read driver over :class:`~ckptmgr.restore.transports.memory.MemoryTransport`.

Thread ownership: everything here is used by the thread that runs the transfer (the caller's,
in a restore); the check's readers run on the pool it is given and end before it returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import CheckpointCorruptError, CkptError, CkptTimeoutError
from ..format.manifest import FileRecord
from ..restore.loaders import bounce
from ..restore.read import plan_check, run
from ..restore.transports.memory import MemoryTransport
from ..storage.peer_tier import ShardRecord
from .peer_transport import Buffer

__all__ = ["FILE_ALIGN", "InMemory", "Into", "allocate", "available", "check", "layout", "split"]

log = logging.getLogger("ckptmgr")


class Into(NamedTuple):
    """Where a restore's fetch lands a shard: in memory on ``device`` (the GPU the transport
    runs through: NCCL receives straight into it; else the host), not in the peer area.
    Only a shard whose files are exactly ``files`` (name -> record: the step's manifest's
    files of that rank) is taken; its bytes are allocated only then, whole (the host's when
    the device has no room for them)."""

    device: torch.device
    files: dict[str, FileRecord]


FILE_ALIGN = 4096  # where each file of a shard received into memory starts (its tensors as aligned as in the file)


def layout(sizes: list[int]) -> tuple[tuple[int, ...], int]:
    """Where each file of ``sizes`` starts in one allocation, each on a ``FILE_ALIGN`` boundary,
    and the allocation's size."""
    bases, at = [], 0
    for n in sizes:
        at = -(-at // FILE_ALIGN) * FILE_ALIGN
        bases.append(at)
        at += n
    return tuple(bases), at


def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """Fresh memory for a shard received into memory: on ``device``, else (no room there) the
    host's, if the host has that much available.

    Raises:
        CkptError: no memory for it (the shard is refused: its bytes are drained).
    """
    if device.type != "cpu":
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            log.info("peer tier: no room on %s for a shard of %d bytes; it is received into host memory", device,
                     nbytes)
    free = available()
    if free is not None and nbytes > free:
        raise CkptError(f"no memory for a shard of {nbytes} bytes (the host has {free} available)")
    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except (RuntimeError, MemoryError) as exc:  # (the host allocator's failure is a RuntimeError)
        raise CkptError(f"no memory for a shard of {nbytes} bytes: {exc}") from None


def available(meminfo: str = "/proc/meminfo", cgroup: str = "/proc/self/cgroup",
               cgroups: bytes = b"/sys/fs/cgroup") -> int | None:
    """The memory this process may still take, in bytes: the host's ``MemAvailable``, and, in
    a cgroup (v2) with a memory limit, what the limit leaves (``memory.max`` less
    ``memory.current``, the page cache it could drop, ``inactive_file``, not counted as
    taken), whichever is less; None where neither can be read. Each rank reads it for
    itself: ranks that fetch at once on one node may together take more."""
    found: list[int] = []
    try:
        with open(meminfo, "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(cgroup, "rb") as f:
            path = next((ln.strip()[3:] for ln in f if ln.startswith(b"0::")), None)
        if path is not None:
            d = os.path.join(cgroups, path.lstrip(b"/"))
            with open(os.path.join(d, b"memory.max"), "rb") as f:
                limit = f.read().strip()
            if limit != b"max":
                with open(os.path.join(d, b"memory.current"), "rb") as f:
                    used = int(f.read().strip())
                with contextlib.suppress(OSError, ValueError), open(os.path.join(d, b"memory.stat"), "rb") as f:
                    used -= next((int(ln.split()[1]) for ln in f if ln.startswith(b"inactive_file ")), 0)
                found.append(max(0, int(limit) - max(0, used)))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


class InMemory:
    """Where the pieces of a shard received into memory land: ``image``, each file at its base;
    a piece within one file straight into its place, one across files into the scratch piece
    at the image's end, from ``end`` (allocated with the image, reused: a piece is placed
    before the next is received), then copied."""

    def __init__(self, image: torch.Tensor, bases: tuple[int, ...], size: int, end: int) -> None:
        self.image = image
        self.view: Buffer = image if image.is_cuda else image.numpy()
        self.bases, self.size = bases, size
        self.scratch: Buffer | None = self.view[end:end + size] if image.numel() >= end + size else None
        self.queued = False  # (copies queued on the GPU's current stream, not yet synchronized)

    def into(self, cut: list[tuple[int, int, int]]) -> Buffer:
        """Where the piece ``cut`` (file index, offset in it, bytes; as :func:`_cut` gives) is received."""
        if len(cut) == 1:
            k, at, n = cut[0]
            return self.view[self.bases[k] + at:self.bases[k] + at + n]
        if self.scratch is None:
            raise AssertionError("a piece across files with no scratch piece allocated for it")
        return self.scratch[:sum(n for _, _, n in cut)]

    def place(self, cut: list[tuple[int, int, int]]) -> None:
        """Copy a piece received into the scratch buffer to its places (a GPU's copies run on
        the current stream, which the next receive into the scratch buffer waits on)."""
        if len(cut) == 1 or self.scratch is None:
            return
        at = 0
        for k, offset, n in cut:
            b = self.bases[k] + offset
            dst, src = self.view, self.scratch
            if isinstance(dst, torch.Tensor):
                assert isinstance(src, torch.Tensor)
                dst[b:b + n].copy_(src[at:at + n], non_blocking=True)
                self.queued = True
            else:
                assert isinstance(src, np.ndarray)
                dst[b:b + n] = src[at:at + n]
            at += n

    def settle(self) -> None:
        """Wait for the copies queued on the GPU (none on the host)."""
        if self.queued:
            torch.cuda.current_stream(self.image.device).synchronize()
            self.queued = False


def split(image: torch.Tensor, rec: ShardRecord, bases: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The record's files as the parts of ``image`` (each at its base, in record order)."""
    return {name: image[b:b + frec.size] for (name, frec), b in zip(rec.manifest.files.items(), bases, strict=True)}


def check(rec: ShardRecord, files: dict[str, torch.Tensor], pool: Any, where: str,
                     timeout_s: float) -> str | None:
    """None when ``files`` (in memory) match the record's checksums, else what does not (by
    the read driver, over :class:`~ckptmgr.restore.transports.memory.MemoryTransport`, its
    wait bounded by ``timeout_s``). A check that cannot run raises."""
    try:
        run(plan_check(rec.manifest, where), MemoryTransport(files, pool, bounce.THREADS, timeout_s=timeout_s,
                                                             pinned=lambda n: bounce.buffers(n, True)))
    except CkptTimeoutError:
        raise
    except CheckpointCorruptError as exc:
        return str(exc)
    return None
