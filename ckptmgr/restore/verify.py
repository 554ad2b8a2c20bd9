"""Verification of a committed checkpoint against its manifest, reading every byte.

For each data file the manifest lists: the file exists, is a regular file (where the files
are local; a FIFO is never opened) and has the recorded size; its safetensors header agrees
with the manifest's tensor index (names, dtypes, shapes, offsets); and every checksum chunk
matches its CRC32C. Chunks are read in parallel on a private pool (a target's own I/O pool
must not be fed from outside its tasks), so verification runs at the storage's read
bandwidth. Nothing is written or changed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..errors import CkptError, StepNotFoundError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import FileRecord, Manifest
from ..format.naming import step_name
from ..storage import Target
from .preflight import check_regular, header_problems, local_path

__all__ = ["StepReport", "file_url", "verify_step"]


def file_url(target: Target, step: int, name: str) -> str:
    """How messages name a file of a step: ``<root>/step_<step>/<name>``."""
    return f"{target.url.rstrip('/')}/{step_name(step)}/{name}"


@dataclass
class StepReport:
    """What verifying one step found.

    Attributes:
        step: the step.
        files: data files checked.
        bytes: bytes read and checksummed.
        problems: one line per fault, naming the file (and byte range); empty when intact.
    """

    step: int
    files: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_step(target: Target, step: int, *, threads: int = 8, manifest: Manifest | None = None,
                on_bytes: Callable[[int], None] | None = None) -> StepReport:
    """Check every file of ``step`` on ``target`` against the manifest.

    Args:
        target: the checkpoint root.
        step: a committed step.
        threads: parallel chunk reads.
        manifest: the step's manifest when the caller has read it already.
        on_bytes: called (from worker threads) with the size of each chunk verified.

    Returns:
        The report; corruption is reported in it, not raised.

    Raises:
        StepNotFoundError: ``step`` is not committed.
        StorageError: the storage cannot be read at all.
    """
    report = StepReport(step)
    try:
        if manifest is None:
            manifest = Manifest.from_bytes(target.read_manifest(step), where=file_url(target, step, "manifest.json"))
    except StepNotFoundError:
        raise
    except CkptError as exc:
        report.problems.append(str(exc))
        return report
    if manifest.step != step:
        report.problems.append(f"{file_url(target, step, 'manifest.json')}: manifest field step: the manifest is "
                               f"for step {manifest.step}")
        return report
    lock = threading.Lock()

    def fault(fname: str, what: str) -> None:
        with lock:
            report.problems.append(f"{file_url(target, step, fname)}: {what}")

    def check_chunk(fname: str, rec: FileRecord, index: int, begin: int, end: int) -> None:
        buf = np.empty(end - begin, dtype=np.uint8)
        try:
            target.read_into(step, fname, begin, [buf])
        except (OSError, CkptError) as exc:
            fault(fname, f"bytes [{begin}, {end}) cannot be read ({exc})")
            return
        got = crc32c_hex(buf)
        if got != rec.crc32c[index]:
            fault(fname, f"bytes [{begin}, {end}) fail their checksum (CRC32C {got}, manifest {rec.crc32c[index]})")
        sub = rec.sub_chunk_size  # the finer checksums of multi-rank saves (reads of parts of a file)
        for b in range(begin, end, sub) if sub else ():
            got = crc32c_hex(buf[b - begin:b - begin + sub])
            if got != rec.sub_crc(b // sub):
                fault(fname, f"bytes [{b}, {min(b + sub, end)}) fail their sub-chunk checksum (CRC32C {got}, "
                      f"manifest {rec.sub_crc(b // sub)})")
        if on_bytes is not None:
            on_bytes(end - begin)

    chunks: list[tuple[str, FileRecord, int, int, int]] = []
    for fname, rec in sorted(manifest.files.items()):
        report.files += 1
        try:
            path = local_path(target, step, fname)
            if path is not None:
                check_regular(path, "it")
            size = target.file_size(step, fname)
        except FileNotFoundError:
            fault(fname, "missing")
            continue
        except CkptError as exc:
            fault(fname, str(exc))
            continue
        if size != rec.size:
            fault(fname, f"{size} bytes, the manifest records {rec.size}")
            continue
        head = np.empty(min(rec.header_size, size), dtype=np.uint8)
        try:
            target.read_into(step, fname, 0, [head])
        except (OSError, CkptError) as exc:
            fault(fname, f"its header cannot be read ({exc})")
            continue
        for p in header_problems(head.tobytes(), fname, manifest):
            fault(fname, p)
        for i, (b, e) in enumerate(chunk_ranges(rec.size, rec.chunk_size)):
            chunks.append((fname, rec, i, b, e))
            report.bytes += e - b
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckptmgr-verify") as pool:
        for f in [pool.submit(check_chunk, *c) for c in chunks]:
            f.result()
    report.problems.sort()
    return report

