"""The peer area of a node's tier directory: copies of ranks' shards kept in RAM.

Layout, inside the node's tier directory of the root (see :func:`~ckptmgr.storage.tier.tier_dir`)::

    <local_dir>/ckptmgr-<uid>-<hash of the root URL>/     mode 0700, this user's only
        peer/                          mode 0700
            r00003/                    copies of the shard saved by rank 3
                s0/ s1/                one slot each: the shard's data files, and
                    record.json        the shard's record, written last (temporary name, then rename)

A *shard* is what one rank writes of a step (its ``data-r<rank>-*.safetensors`` files). Its
record is that rank's own manifest (state tree, tensor index, file sizes and CRC32C per
chunk) plus the job's world size and the node the shard came from. A node holds the shard
of each of its own ranks (copied from the staging slot) and the shards other nodes send it
(:mod:`ckptmgr.distributed.replicate`); both are kept the same way.

Rules, as in the local tier: a slot is overwritten only when it does not hold the newest
committed step of its shard ("never give up the newest"); its ``record.json`` is removed
before a byte of the new copy lands, so a slot without a record is never trusted; every
copy is checked against its record's checksums before it is restored or sent on.

Security: the directories are created 0700 and checked (lstat: a real directory of this
user, private) before use; everything inside is opened relative to directory descriptors
with O_NOFOLLOW; a record is untrusted input (validated as a manifest, its file names
checked against the rank's naming, its sizes bounded by the file found) before anything is
mapped.

Thread ownership: within one job, each shard directory has one writer (its rank for its
own node's copy; one receiving rank per other node); in a process the replication thread,
the copy thread and restores use a :class:`PeerArea`, and ``_mu`` guards the in-memory slot table and the leases of
slots being read or sent, never held across I/O.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointCorruptError, CkptError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import Manifest
from ..format.schema import MAX_MANIFEST_BYTES
from .posix import pwrite_all
from .private import NOFOLLOW, check_private_dir, empty_dir, open_private_dir, read_small, write_small
from .tier import tier_dir

__all__ = ["Copy", "IncomingFile", "PeerArea", "ShardRecord", "check_files", "read_peer"]

RECORD = "record.json"
_TMP_RECORD = ".record.json.tmp"
_SHARD_DIR = re.compile(r"r(\d{5})")
_SLOT_DIR = re.compile(r"s(\d)")


@dataclass(frozen=True)
class ShardRecord:
    """What a copy of one rank's shard of one step is: validated, never trusted raw."""

    step: int
    rank: int
    world: int
    node: str  # the node the shard was saved on
    manifest: Manifest  # the rank's own manifest: its files (sizes, checksums), tensors and state tree
    raw: bytes  # the record as stored and sent

    @classmethod
    def make(cls, manifest: Manifest, rank: int, world: int, node: str) -> ShardRecord:
        """The record of ``manifest`` (the rank's own: its files and tensors; its state tree
        names the replicated tensors other ranks hold, so it travels beside the manifest and is
        checked once the step's manifest is merged from every rank's record)."""
        body = json.dumps({"rank": rank, "world": world, "node": node, "state": manifest.state},
                          allow_nan=False).encode("utf-8")
        raw = len(body).to_bytes(4, "little") + body + dataclasses.replace(manifest, state=None).to_bytes()
        return cls(manifest.step, rank, world, node, manifest, raw)

    @classmethod
    def parse(cls, raw: bytes, where: str) -> ShardRecord:
        """Validate ``raw`` (a record read from RAM or received from a peer).

        Raises:
            CheckpointCorruptError: it is not a record of a shard as ckptmgr writes them.
        """
        if len(raw) < 4 or len(raw) > MAX_MANIFEST_BYTES:
            raise CheckpointCorruptError(f"{where}: a shard record of {len(raw)} bytes is not one")
        n = int.from_bytes(raw[:4], "little")
        try:
            head = json.loads(raw[4:4 + n])
            rank, world, node, state = int(head["rank"]), int(head["world"]), str(head["node"]), head["state"]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise CheckpointCorruptError(f"{where}: the shard record's head is not valid ({exc})") from None
        if not 0 <= rank < world or world > 1 << 20 or len(node) > 255:
            raise CheckpointCorruptError(f"{where}: the shard record names rank {rank} of {world}")
        m = dataclasses.replace(Manifest.from_bytes(raw[4 + n:], where=where), state=state)
        prefix = f"data-r{rank:05d}-"
        for name in m.files:
            if not (name.startswith(prefix) and name.endswith(".safetensors") and "/" not in name and len(name) < 128):
                raise CheckpointCorruptError(f"{where}: file {name!r:.80} is not a file of rank {rank}")
        return cls(m.step, rank, world, node, m, raw)


@dataclass(frozen=True)
class Copy:
    """One committed copy in this node's peer area."""

    rank: int
    slot: int
    record: ShardRecord


class PeerArea:
    """The peer area of one root on this node (see the module docstring).

    Args:
        local_dir: the RAM directory holding the node's tier directories (``StagingOptions.local_dir``).
        root_url: the checkpoint root.
        slots: slots kept per shard (at least 2: one holds the newest copy while the next lands).
    """

    def __init__(self, local_dir: str, root_url: str, slots: int = 2, *, create: bool = True) -> None:
        top = tier_dir(local_dir, root_url)
        self.path = os.path.join(top, "peer")
        self.slots = max(2, slots)
        if not create:  # (to read only: a missing area is not made; FileNotFoundError)
            check_private_dir(os.lstat(top), top)
            check_private_dir(os.lstat(self.path), self.path)
        tfd = open_private_dir(top, None, top)
        try:
            self._fd = open_private_dir("peer", tfd, self.path)
        finally:
            os.close(tfd)
        self._mu = threading.Condition()
        self._leases: dict[tuple[int, int], int] = {}  # (rank, slot) -> reads in progress   (_mu)
        self._writing: set[tuple[int, int]] = set()  # slots being written (taken, not yet committed)  (_mu)
        self._newest: dict[int, int] = {}  # rank -> newest committed step written here          (_mu)

    def close(self) -> None:
        os.close(self._fd)

    def _dir(self, rank: int, slot: int | None = None) -> int:
        """An fd of the shard's (or one of its slots') directory, created and checked."""
        name = f"r{rank:05d}"
        fd = open_private_dir(name, self._fd, f"{self.path}/{name}")
        if slot is None:
            return fd
        try:
            return open_private_dir(f"s{slot}", fd, f"{self.path}/{name}/s{slot}")
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- reading

    def copies(self) -> list[Copy]:
        """Every committed copy here whose files match its record's sizes (not yet its checksums)."""
        out: list[Copy] = []
        for name in sorted(os.listdir(self._fd)):
            m = _SHARD_DIR.fullmatch(name)
            if m is None:
                continue
            rank = int(m.group(1))
            try:
                check_private_dir(os.lstat(name, dir_fd=self._fd), name)
                sfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW, dir_fd=self._fd)
            except OSError:
                continue
            try:
                for sname in sorted(os.listdir(sfd)):
                    sm = _SLOT_DIR.fullmatch(sname)
                    if sm is None:
                        continue
                    with contextlib.suppress(OSError, CkptError, ValueError):
                        rec = self._check(rank, int(sm.group(1)))
                        if rec is not None:
                            out.append(Copy(rank, int(sm.group(1)), rec))
            finally:
                os.close(sfd)
        return out

    def _check(self, rank: int, slot: int) -> ShardRecord | None:
        d = self._dir(rank, slot)
        try:
            try:
                raw = read_small(RECORD, d, MAX_MANIFEST_BYTES)
            except FileNotFoundError:
                return None
            rec = ShardRecord.parse(raw, f"{self.path}/r{rank:05d}/s{slot}/{RECORD}")
            if rec.rank != rank:
                raise CheckpointCorruptError(f"{self.path}/r{rank:05d}/s{slot} holds rank {rec.rank}'s shard")
            for fname, frec in rec.manifest.files.items():
                st = os.stat(fname, dir_fd=d, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_size != frec.size:
                    raise CheckpointCorruptError(f"{self.path}/r{rank:05d}/s{slot}/{fname} does not match its record")
            return rec
        finally:
            os.close(d)

    def path_of(self, copy: Copy, name: str) -> str:
        return os.path.join(self.path, f"r{copy.rank:05d}", f"s{copy.slot}", name)

    @contextlib.contextmanager
    def mapped(self, copy: Copy) -> Iterator[dict[str, np.ndarray[Any, Any]]]:
        """The copy's files, mapped copy-on-write (never written: the arrays may back tensors that
        are sent), held against reuse while the block runs."""
        key = (copy.rank, copy.slot)
        with self._mu:
            if key in self._writing:
                raise FileNotFoundError(f"{self.path_of(copy, '')} is being rewritten")
            self._leases[key] = self._leases.get(key, 0) + 1
        maps: list[mmap.mmap] = []
        try:
            d = self._dir(copy.rank, copy.slot)
            try:
                if read_small(RECORD, d, MAX_MANIFEST_BYTES) != copy.record.raw:  # (replaced since it was listed)
                    raise FileNotFoundError(f"{self.path_of(copy, RECORD)} holds another copy now")
                out = {}
                for name, frec in copy.record.manifest.files.items():
                    fd = os.open(name, os.O_RDONLY | NOFOLLOW, dir_fd=d)
                    try:
                        if os.fstat(fd).st_size != frec.size:
                            raise CheckpointCorruptError(f"{self.path_of(copy, name)} changed size while read")
                        size = frec.size
                        maps.append(mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else mmap.mmap(-1, 1))
                    finally:
                        os.close(fd)
                    out[name] = np.frombuffer(maps[-1], dtype=np.uint8, count=frec.size)
            finally:
                os.close(d)
            yield out
            del out
        finally:
            for mm in maps:
                with contextlib.suppress(BufferError):
                    mm.close()
            with self._mu:
                self._leases[key] -= 1
                self._mu.notify_all()

    def verify(self, copy: Copy, pool: Any = None) -> str | None:
        """None when every chunk of the copy matches its record's checksum, else what does not."""
        try:
            with self.mapped(copy) as files:
                return check_files(copy.record, files, pool)
        except (OSError, CkptError) as exc:
            return f"{type(exc).__name__}: {exc}"

    # ---------------------------------------------------------------- writing

    def take_slot(self, rank: int, wait_s: float = 0.0) -> int | None:
        """A slot of shard ``rank`` that may be overwritten now (its record removed already),
        or None while every slot holds the newest copy or is being read (waiting up to
        ``wait_s`` for a read to end)."""
        deadline = time.monotonic() + wait_s
        newest = {c.slot: c.record.step for c in self.copies() if c.rank == rank}
        keep = max(newest.values(), default=-1)
        with self._mu:
            while True:
                keep = max(keep, self._newest.get(rank, -1))
                free = [s for s in range(self.slots) if self._leases.get((rank, s), 0) == 0
                        and (rank, s) not in self._writing and (s not in newest or newest[s] != keep)]
                left = deadline - time.monotonic()
                busy = any(self._leases.get((rank, s), 0) or (rank, s) in self._writing for s in range(self.slots))
                if free or left <= 0 or not busy:
                    break
                self._mu.wait(left)
            if not free:
                return None
            slot = min(free, key=lambda s: (s in newest, newest.get(s, -1)))
            self._writing.add((rank, slot))  # until commit/abort
        try:
            d = self._dir(rank, slot)
            try:
                for name in (RECORD, _TMP_RECORD):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=d)
                empty_dir(d)
            finally:
                os.close(d)
        except BaseException:  # (the slot is not taken: not held as being written)
            with self._mu:
                self._writing.discard((rank, slot))
                self._mu.notify_all()
            raise
        return slot

    def create(self, rank: int, slot: int, record: ShardRecord) -> dict[str, np.ndarray[Any, Any]]:
        """The slot's files for ``record``, created at their sizes (tmpfs pages reserved) and
        mapped writable; the caller fills them, then :meth:`commit` or :meth:`abort`."""
        files = self.receive(rank, slot, record)
        try:
            return {name: f.mapped(writable=True) for name, f in files.items()}
        finally:
            for f in files.values():
                f.close()  # (a mapping keeps its own reference to the file)

    def receive(self, rank: int, slot: int, record: ShardRecord) -> dict[str, IncomingFile]:
        """The slot's files for ``record``, created at their sizes (tmpfs pages reserved), each
        open to be written through its descriptor (:class:`IncomingFile`); the caller writes
        them, closes them, then :meth:`commit` or :meth:`abort`."""
        d = self._dir(rank, slot)
        out: dict[str, IncomingFile] = {}
        try:
            for name, frec in record.manifest.files.items():
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | NOFOLLOW, 0o600, dir_fd=d)
                out[name] = IncomingFile(fd, frec.size, name)
                if frec.size:
                    os.posix_fallocate(fd, 0, frec.size)
        except BaseException:
            for f in out.values():
                f.close()
            raise
        finally:
            os.close(d)
        return out

    def commit(self, rank: int, slot: int, record: ShardRecord) -> None:
        d = self._dir(rank, slot)
        try:
            write_small(_TMP_RECORD, d, record.raw)
            os.rename(_TMP_RECORD, RECORD, src_dir_fd=d, dst_dir_fd=d)
        finally:
            os.close(d)
        with self._mu:
            self._newest[rank] = max(self._newest.get(rank, -1), record.step)
            self._writing.discard((rank, slot))
            self._mu.notify_all()

    def abort(self, rank: int, slot: int) -> None:
        with contextlib.suppress(OSError):
            d = self._dir(rank, slot)
            try:
                empty_dir(d)
            finally:
                os.close(d)
        with self._mu:
            self._writing.discard((rank, slot))
            self._mu.notify_all()

    def discard(self, copy: Copy) -> bool:
        """Remove ``copy``, one that failed its check (record first), so that its slot takes
        the next copy; not while its slot is being read or written, nor once it holds another
        copy. Returns whether it was removed."""
        key = (copy.rank, copy.slot)
        with self._mu:
            if self._leases.get(key, 0) or key in self._writing:
                return False
            self._writing.add(key)  # (until abort, below, or the release when it holds another copy)
        same = False
        try:
            d = self._dir(copy.rank, copy.slot)
            try:
                with contextlib.suppress(OSError, CkptError):
                    same = read_small(RECORD, d, MAX_MANIFEST_BYTES) == copy.record.raw
                if same:
                    os.unlink(RECORD, dir_fd=d)
            finally:
                os.close(d)
        finally:
            if same:
                self.abort(copy.rank, copy.slot)  # (empties the slot and releases it)
            else:
                with self._mu:
                    self._writing.discard(key)
                    self._mu.notify_all()
        return same

    def drop(self, rank: int) -> None:
        """Remove every copy of shard ``rank`` here (records first)."""
        for c in [c for c in self.copies() if c.rank == rank]:
            with self._mu:
                if self._leases.get((rank, c.slot), 0) or (rank, c.slot) in self._writing:
                    continue
                self._writing.add((rank, c.slot))
            self.abort(rank, c.slot)


_CLOSE_WAIT_S = 1.0  # the most IncomingFile.close waits for a write that holds the descriptor


class IncomingFile:
    """A file of a peer-area slot being received, written through its descriptor with
    ``pwrite``: the kernel puts the bytes in the file's tmpfs pages as it writes them, where a
    copy into a fresh shared mapping faults every page in first (1 GiB on the CPU machine:
    3.1-3.4 GB/s by ``pwrite`` into a preallocated file, 1.2-1.5 GB/s copied into its mapping;
    the peer fetch on 2 x H100 moved 1.2-1.3 GB/s per rank that way). Then mapped read-only
    for its checks (:meth:`mapped`). Written by one thread (the mover's writer); mapped and
    closed by the receiving thread once it has joined the writes. A write and closing the
    descriptor exclude each other (``_cond``), so that a write that outlived its join never
    reaches a descriptor number the process has since reused: :meth:`close` waits for a
    running write at most ``_CLOSE_WAIT_S``, then leaves the close to that write, which closes
    the descriptor as it ends (each side decides under the lock: neither can miss the other)."""

    def __init__(self, fd: int, size: int, name: str) -> None:
        self.fd: int | None = fd  # (_cond; read without it by the receiving thread, once the writes are joined)
        self.size = size
        self.name = name
        self._cond = threading.Condition()  # guards fd, _writing and _closing
        self._writing = False  # a write is in its pwrite (the descriptor in use without the lock)
        self._closing = False  # close came during that write: the write closes the descriptor as it ends

    def write(self, offset: int, data: np.ndarray[Any, Any]) -> None:
        """Write ``data`` (contiguous uint8) at ``offset``, inside the file's size.

        Raises:
            CkptError: the bytes would not fit in the file, or it is closed.
            OSError: the write failed (ENOSPC: the tmpfs is full).
        """
        n = data.size
        with self._cond:
            fd = self.fd
            if fd is None or self._closing or not 0 <= offset <= offset + n <= self.size:
                raise CkptError(f"peer area file {self.name}: {n} bytes at {offset} do not fit its "
                                f"{self.size} bytes, or it is closed")
            self._writing = True
        try:
            pwrite_all(fd, data, offset)
        finally:
            self._write_ended()

    def _write_ended(self) -> None:
        with self._cond:
            self._writing = False
            try:
                if self._closing:  # (close came during the write and left the descriptor to it)
                    self._close_fd()
            finally:
                self._cond.notify_all()

    def mapped(self, *, writable: bool = False) -> np.ndarray[Any, Any]:
        """The file's bytes, mapped shared (no second copy in memory): read-only unless
        ``writable``."""
        if self.fd is None:
            raise CkptError(f"peer area file {self.name} is closed")
        if not self.size:
            return np.empty(0, dtype=np.uint8)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return np.frombuffer(mmap.mmap(self.fd, self.size, prot=prot), dtype=np.uint8)

    def close(self) -> None:
        """Close the descriptor (idempotent): at once, or, while a write runs, as that write
        ends (waiting for it at most ``_CLOSE_WAIT_S``)."""
        with self._cond:
            if self._writing:
                self._closing = True  # (seen by the write as it ends, under this lock)
                if not self._cond.wait_for(lambda: not self._writing, timeout=_CLOSE_WAIT_S):
                    return  # (the write closes it)
            self._close_fd()

    def _close_fd(self) -> None:  # (under _cond)
        self._closing = False
        fd, self.fd = self.fd, None  # (forgotten first: Linux frees the number even when close fails)
        if fd is not None:
            os.close(fd)


def read_peer(local_dir: str, root_url: str) -> dict[int, dict[int, int]]:
    """Step -> saved rank -> world size of the shards this node's peer area holds for
    ``root_url`` (read only; empty when there is none, or it is not this user's private
    directory)."""
    try:
        area = PeerArea(local_dir, root_url, create=False)
    except OSError:
        return {}
    try:
        out: dict[int, dict[int, int]] = {}
        for c in area.copies():
            out.setdefault(c.record.step, {})[c.rank] = c.record.world
        return out
    finally:
        area.close()


def check_files(record: ShardRecord, files: dict[str, np.ndarray[Any, Any]], pool: Any = None) -> str | None:
    """None when ``files`` match the record's sizes and checksums, else the first mismatch."""
    tasks = []
    for name, frec in record.manifest.files.items():
        arr = files.get(name)
        if arr is None or arr.size != frec.size:
            return f"{name}: {0 if arr is None else arr.size} bytes, the record says {frec.size}"
        ranges = chunk_ranges(frec.size, frec.chunk_size)
        if len(ranges) != len(frec.crc32c):
            return f"{name}: {len(frec.crc32c)} checksums for {len(ranges)} chunks"
        tasks += [(name, i, b, e, frec.crc32c[i]) for i, (b, e) in enumerate(ranges)]

    def one(t: tuple[str, int, int, int, str]) -> str | None:
        name, i, b, e, want = t
        got = crc32c_hex(files[name][b:e])
        return None if got == want else f"{name}: chunk {i} (bytes {b}-{e}) has CRC32C {got}, the record says {want}"

    results = pool.map(one, tasks) if pool is not None else map(one, tasks)
    return next((r for r in results if r is not None), None)
