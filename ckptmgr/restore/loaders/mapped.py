"""In-place loader: a safetensors file mapped where it lies, pinned there, copied to the GPU
with no second copy of the file in host memory.

A file in /dev/shm (the local tier, or any tmpfs) is already laid out for the GPU. It is
mapped read-only and MAP_SHARED (never a private mapping, which would double host memory):
the header is parsed and validated there, and the checksums of a ckptmgr step's file are
verified there. Its bytes go to one allocation per file on the device, of which the tensors
are views (or into a target's own tensors), read through small pinned buffers on several
threads and streams (:mod:`.bounce`: pinning a fresh mapping in place costs more than the copy
it enables; a file loaded again and again is pinned once by
:class:`~ckptmgr.restore.pinned.PinnedWeights`). A file on disk that is not in the page cache
is read by the same threads with ``O_DIRECT``, as the cold restore reads (no page-cache copy,
no page-cache pollution), unless its checksums are checked where it is mapped (those reads
share the page cache with the bounce readers'). Host memory grows by the mapping of pages
that already exist and the bounce buffers (one 64 MiB pinned block).

Without CUDA, or for ``device="cpu"``, the data region is copied once into memory the
result owns (a read-only mapping must never leak out as a writable tensor).

Reads any safetensors file, ours or anyone's: the header is validated (offsets inside the
file, sizes matching shapes and dtypes) before anything is allocated. A file of a ckptmgr
step (its directory's ``manifest.json`` lists it, with its size) is also verified against
the manifest's checksums, where its bytes lie, while the copies run.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import warnings
from concurrent.futures import Executor, Future
from typing import Any

import torch

from ... import _cuda
from ..._threads import collector_paused
from ...errors import CheckpointCorruptError
from ...format.checksum import chunk_ranges, crc32c_hex
from ...format.layout import ST_TO_DTYPE
from ...format.manifest import MANIFEST_NAME, FileRecord, Manifest, read_manifest_bytes
from ...format.schema import MAX_HEADER_BYTES
from ...format.tree import MAX_DIMS, MAX_FILE_BYTES
from ...storage.posix import direct_of
from ...storage.tier import ram_filesystem
from ..preflight import drain, verify_images
from .bounce import copy_through_bounce
from .host import _build_views
from .landing import Entry, lands_in_target, plan_landing
from .pieces import WAIT_S, checkers

__all__ = ["MappedFile", "load_file", "open_mapped", "read_tensors_inplace", "sibling_record",
           "submit_checks", "to_device", "wait_checks"]


class MappedFile:
    """A safetensors file mapped read-only; ``data`` is a uint8 view of its data region.

    ``identity`` is the mapped file's (device, inode, size, mtime in ns) when it was opened;
    ``in_ram``: it lives in a RAM filesystem (tmpfs, ramfs); ``fd``: with ``reads``, a
    descriptor of the file mapped (reads through it meet the same file, renamed over or not),
    open until :meth:`close`; else None."""

    def __init__(self, path: str, *, reads: bool = True) -> None:
        self.path = path
        self.fd: int | None = None
        self._registered: int | None = None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block the open
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointCorruptError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
            size = st.st_size
            if size < 8:
                raise CheckpointCorruptError(f"{path}: {size} bytes is too short for a safetensors file")
            self.identity = file_identity(st)
            self.in_ram = ram_filesystem(fd) is True
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        if reads:
            self.fd = fd
        else:
            os.close(fd)  # (the mapping keeps its own descriptor until it is closed)
        with warnings.catch_warnings():  # read-only by design; nothing writes through it
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.size = size
        try:
            self.entries, self.data_start = _parse(self.bytes, size, path)
        except BaseException:
            self.close()
            raise
        self.data = self.bytes[self.data_start:]

    def pin(self) -> None:
        """Pin the mapped range in place (read-only registration), once."""
        if self._registered is None and _cuda.available():
            ptr = self.bytes.data_ptr()
            _cuda.host_register(ptr, self.size, read_only=True)
            self._registered = ptr

    def unpin(self) -> None:
        if self._registered is not None:
            _cuda.host_unregister(self._registered)
            self._registered = None

    def close(self) -> None:
        """Unpin, then let the mapping go: it is unmapped, and its descriptor closed, at once
        where no view of it is left, else with the last one. Never closed by hand: a tensor
        made by ``torch.frombuffer`` does not hold the mapping's buffer, so an explicit
        ``mmap.close()`` would unmap memory that a view (a check still running) may read; the
        views hold the mapping object itself. Idempotent."""
        self.unpin()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        for name in ("bytes", "data", "_mm"):
            if hasattr(self, name):
                delattr(self, name)


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file's contents apart after a rewrite: (device, inode, size, mtime in ns)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _parse(buf: torch.Tensor, size: int, path: str) -> tuple[list[Entry], int]:
    """The entries of a safetensors header, every one checked before anything is allocated:
    the header length bounded, each dtype known, each shape at most MAX_DIMS ints in
    ``[0, MAX_FILE_BYTES]``, each ``data_offsets`` two ints inside the data region that span
    exactly dtype x shape bytes, and the entries tiling the data region (safetensors' rules)."""
    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    if n <= 0 or 8 + n > size or n > MAX_HEADER_BYTES:
        raise CheckpointCorruptError(f"{path}: header length {n} does not fit a {size}-byte file "
                                     f"(safetensors headers have at most {MAX_HEADER_BYTES} bytes)")
    try:
        header = json.loads(buf[8:8 + n].numpy().tobytes())
    except RecursionError:
        raise CheckpointCorruptError(f"{path}: the safetensors header is nested too deeply to be one") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"{path}: the safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{path}: the safetensors header is not a JSON object")
    data_len = size - 8 - n
    entries = []
    header.pop("__metadata__", None)
    for name, e in header.items():
        entries.append(_entry(name, e, data_len, path))
    pos = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):  # safetensors' own rule: no overlaps, no holes
        if e.begin != pos:
            what = "overlaps another tensor" if e.begin < pos else f"leaves a hole of {e.begin - pos} bytes before it"
            raise CheckpointCorruptError(f"{path}: tensor {e.name!r} at [{e.begin}, {e.end}) {what}")
        pos = e.end
    if pos != data_len:
        raise CheckpointCorruptError(f"{path}: the tensors cover {pos} bytes of a {data_len}-byte data region")
    return entries, 8 + n


def _is_int(v: Any, hi: int) -> bool:
    return type(v) is int and 0 <= v <= hi


def _entry(name: str, e: Any, data_len: int, path: str) -> Entry:
    what = f"{path}: tensor {name[:100]!r}"
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
        raise CheckpointCorruptError(f"{what}: a header entry needs dtype, shape and data_offsets, got {str(e)[:100]}")
    dtype = ST_TO_DTYPE.get(e["dtype"]) if isinstance(e["dtype"], str) else None
    if dtype is None:
        raise CheckpointCorruptError(f"{what}: unknown dtype {str(e['dtype'])[:40]!r}")
    shape, offsets = e["shape"], e["data_offsets"]
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_int(s, MAX_FILE_BYTES) for s in shape)):
        raise CheckpointCorruptError(f"{what}: the shape must be at most {MAX_DIMS} ints in [0, {MAX_FILE_BYTES}], "
                                     f"got {str(shape)[:100]}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x, MAX_FILE_BYTES) for x in offsets)):
        raise CheckpointCorruptError(f"{what}: data_offsets must be two ints >= 0, got {str(offsets)[:100]}")
    begin, end = offsets
    if not begin <= end <= data_len or end - begin != math.prod(shape) * dtype.itemsize:
        raise CheckpointCorruptError(f"{what} has bad offsets {[begin, end]} for {e['dtype']}{shape} in a data "
                                     f"region of {data_len} bytes")
    return Entry(name, dtype, tuple(shape), begin, end)


def open_mapped(path: str, *, reads: bool = True) -> MappedFile:
    """Map ``path`` and validate its header (``reads``: keep a descriptor to read the file
    through, :attr:`MappedFile.fd`).

    Raises:
        CheckpointCorruptError: not a valid safetensors file.
        FileNotFoundError: no such file.
    """
    return MappedFile(path, reads=reads)


def to_device(mf: MappedFile, device: torch.device, dests: dict[str, torch.Tensor] | None = None, *,
              cold_reads: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of ``mf`` on ``device`` (or in the matching tensors of ``dests``): one
    fresh allocation per file at most, through pinned bounce buffers (:mod:`.bounce`) where
    ``mf`` has a descriptor to read, else straight from the mapping, pinned whole.
    ``cold_reads``: a file on disk that is not in the page cache is read with ``O_DIRECT``
    (only where nothing else reads it: checks of its mapping would read the disk again)."""
    landing = plan_landing(mf.entries, mf.data_start, mf.size - mf.data_start, device, dests)
    if device.type != "cuda":
        landing.land(0, mf.bytes)
        return landing.tensors()
    if mf.fd is not None:
        first = mf.data_start - mf.data_start % mmap.PAGESIZE  # (the header is not read again)
        direct = direct_of(mf.fd, mf.path) if cold_reads and not mf.in_ram else None
        try:
            copy_through_bounce(mf.fd, first, mf.size, landing, device, mf.path, direct=direct)
        finally:
            if direct is not None:
                direct.close()
        return landing.tensors()
    mf.pin()
    try:
        landing.land(0, mf.bytes)
        torch.cuda.current_stream(device).synchronize()
    finally:
        mf.unpin()
    return landing.tensors()


def sibling_record(mf: MappedFile) -> FileRecord | None:
    """The checksums of ``mf`` when it is a data file of a ckptmgr step: the ``manifest.json``
    beside it (a regular file, not followed through a link, validated) lists it by name with
    its size. None for any other file (no manifest there, or one that is not valid or does
    not list it).

    Raises:
        CheckpointCorruptError: the manifest lists the file with another size.
    """
    where = os.path.join(os.path.dirname(mf.path), MANIFEST_NAME)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        manifest = Manifest.from_bytes(read_manifest_bytes(st.st_size, lambda n: os.read(fd, n), where),
                                       where=where)
    except (CheckpointCorruptError, OSError, ValueError):
        return None
    finally:
        os.close(fd)
    rec = manifest.files.get(os.path.basename(mf.path))
    if rec is not None and rec.size != mf.size:
        raise CheckpointCorruptError(f"{mf.path} has {mf.size} bytes; {where} says {rec.size}")
    return rec


def submit_checks(mf: MappedFile, rec: FileRecord, pool: Executor) -> list[Future[str | None]]:
    """Start checking every checksum chunk of ``mf`` where it lies, one task per chunk on
    ``pool``; each returns None, or what failed. Wait for them with :func:`wait_checks`
    before the mapping goes."""
    whole = mf.bytes.numpy()

    def check(i: int, b: int, e: int) -> str | None:
        if crc32c_hex(whole[b:e]) != rec.crc32c[i]:
            return f"{mf.path}: checksum mismatch in bytes [{b}, {e})"
        return None  # (raised by the waiting thread: an exception here would keep the mapping with its traceback)

    futures: list[Future[str | None]] = []
    try:
        for i, (b, e) in enumerate(chunk_ranges(rec.size, rec.chunk_size)):
            futures.append(pool.submit(check, i, b, e))
    except BaseException:
        drain(futures)
        raise
    return futures


def wait_checks(checks: list[Future[str | None]]) -> None:
    """Wait for every check of :func:`submit_checks`.

    Raises:
        CheckpointCorruptError: the first chunk (in file order) that failed.
        TimeoutError: a check still running after :data:`.pieces.WAIT_S` seconds.
    """
    errors = [f.exception(timeout=WAIT_S) for f in checks]  # (each waits for its chunk)
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:  # (not a mismatch: the pool shut down, an interrupt)
        raise failed
    bad = next((msg for f in checks if (msg := f.result()) is not None), None)
    if bad is not None:
        raise CheckpointCorruptError(bad)


def load_file(path: str | os.PathLike[str], device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file (written by ckptmgr or by anyone).

    The file is mapped and its header validated before anything is allocated. On a CUDA
    device the bytes go to one allocation on the GPU, of which the tensors are views, read on
    several threads through small reusable pinned buffers, each copied on a stream of its own
    while the next is read (no second copy of the file in host memory); a file on disk that
    is not in the page cache is read with ``O_DIRECT``. To load one file
    many times, pin it once with :func:`ckptmgr.pin_file`. Without CUDA or for the CPU the
    data is copied once. A data file of a ckptmgr step (listed in the ``manifest.json``
    beside it) is verified against its checksums while the copies run; any other
    safetensors file has none to check.

    Args:
        path: the ``.safetensors`` file.
        device: where the tensors go (default: CPU).

    Returns:
        Tensor name -> tensor, in the file's order.

    Raises:
        CheckpointCorruptError: the file is not a valid safetensors file, or fails the
            checksums of its step's manifest.

    Example:
        >>> tensors = ckptmgr.load_file("/dev/shm/model.safetensors", device="cuda")  # doctest: +SKIP
    """
    with collector_paused():
        mf = open_mapped(os.fspath(path))
        checks: list[Future[str | None]] = []
        try:
            rec = sibling_record(mf)
            if rec is not None:
                checks = submit_checks(mf, rec, checkers())
            out = to_device(mf, torch.device(device) if device is not None else torch.device("cpu"),
                            cold_reads=rec is None)
            wait_checks(checks)
            return out
        finally:
            drain(checks)
            mf.close()


def read_tensors_inplace(paths: dict[str, str], manifest: Manifest, device: torch.device, io_pool: Any,
                         where: str, dests: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a committed step whose files are ``paths`` (file name -> path), on
    ``device`` (or in the matching tensors of ``dests``), through the in-place path.

    Each file's checksums are verified on ``io_pool`` where the file lies: while its copy
    runs into fresh memory, or, when tensors land in ``dests``, for every file before the
    first copy (a step that fails leaves the target as it was). A mismatch fails before
    anything is returned.

    Raises:
        CheckpointCorruptError: a file does not match the manifest.
    """
    mapped: dict[str, MappedFile] = {}
    try:
        for fname, rec in manifest.files.items():
            mf = mapped[fname] = open_mapped(paths[fname])
            if mf.size != rec.size:
                raise CheckpointCorruptError(f"{where}: {fname} has {mf.size} bytes; the manifest says {rec.size}")
        direct = lands_in_target([e for mf in mapped.values() for e in mf.entries], dests, device)
        if direct:
            verify_images({f: mf.bytes for f, mf in mapped.items()}, manifest, io_pool, where)
        out: dict[str, torch.Tensor] = {}
        for fname, rec in manifest.files.items():
            mf = mapped[fname]
            whole = mf.bytes.numpy()
            checks = [] if direct else [io_pool.submit(crc32c_hex, whole[b:e])
                                        for b, e in chunk_ranges(rec.size, rec.chunk_size)]
            tensors = to_device(mf, device, dests)
            bad = [i for i, (f, c) in enumerate(zip(checks, rec.crc32c, strict=False)) if f.result() != c]
            if bad:
                b = bad[0] * rec.chunk_size
                raise CheckpointCorruptError(
                    f"{where}: {fname}: checksum mismatch in bytes [{b}, {min(b + rec.chunk_size, rec.size)})")
            out.update(tensors)
    finally:
        for mf in mapped.values():
            mf.close()
    _build_views(manifest, out, where)
    return out
