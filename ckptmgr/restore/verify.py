"""Verification of a committed checkpoint against its manifest, reading every byte: plans of
checksum chunks with nowhere to land (:func:`~ckptmgr.restore.read.plan_check`), run by the
read driver over threaded reads into scratch buffers
(:class:`~ckptmgr.restore.transports.pread.PreadTransport`).

For each data file the manifest lists: the file exists, is a regular file (where the files
are local; a FIFO is never opened) and has the recorded size; its safetensors header agrees
with the manifest's tensor index (names, dtypes, shapes, offsets); and every checksum chunk
matches its CRC32C. Chunks are read in parallel on a private pool (a target's own I/O pool
must not be fed from outside its tasks), so verification runs at the storage's read
bandwidth. Nothing is written or changed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from ..errors import CkptError, StepNotFoundError
from ..format.manifest import Manifest
from ..format.naming import step_name
from ..storage import Target
from .preflight import Source, check_regular, header_problems, local_path
from .read import Bytes, ChecksumMismatchError, Chunk, Land, Mismatch, Transport, plan_check, run
from .transports.pread import PreadTransport

__all__ = ["StepReport", "file_url", "verify_files", "verify_step"]


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

    def message(m: Mismatch) -> str:
        kind = "sub-chunk checksum" if m.sub else "checksum"
        return f"{file_url(target, step, m.file)}: bytes [{m.begin}, {m.end}) fail their {kind} (CRC32C {m.got}, " \
               f"manifest {m.want})"

    def on_fault(c: Chunk, exc: BaseException) -> None:
        if not isinstance(exc, ChecksumMismatchError):
            fault(c.file, f"bytes [{c.begin}, {c.end}) cannot be read ({exc})")
            return
        with lock:
            report.problems.append(str(exc))

    readable: list[str] = []
    for fname, rec in sorted(manifest.files.items()):
        report.files += 1
        try:
            path = local_path(target, step, fname)
            if path is not None:
                check_regular(path, "it")
            size = target.file_size(step, fname, fresh=True)  # (a walk may come long after a listing)
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
        readable.append(fname)
        report.bytes += rec.size
    plan = plan_check(manifest, file_url(target, step, "").rstrip("/"), files=readable, subs=True, message=message)
    transport: Transport = PreadTransport(target, step, workers=threads)
    run(plan, transport if on_bytes is None else _Counted(transport, on_bytes), on_fault=on_fault)
    report.problems.sort()
    return report



class _Counted:
    """A transport that tells ``on_bytes`` the size of every chunk read and checked, whether
    it verified or not (the progress of ``ckptmgr verify``; a chunk that could not be read
    is not counted). The chunks land nowhere: no tensor is made."""

    def __init__(self, transport: Transport, on_bytes: Callable[[int], None]) -> None:
        self.transport = transport
        self.on_bytes = on_bytes

    def read(self, chunks: Sequence[Chunk], land: Land) -> None:
        def counted(c: Chunk, data: Bytes | Exception) -> None:
            land(c, data)  # (a checksum failure is reported by the run, not raised here)
            if not isinstance(data, Exception):
                self.on_bytes(c.size)

        self.transport.read(chunks, counted)


def verify_files(source: Source, step: int, manifest: Manifest, pool: Executor, workers: int, where: str) -> None:
    """Read every checksum chunk of ``step`` into scratch memory and check it, landing
    nothing: up to ``workers`` buffers of one chunk each (256 MiB in all at most), each held
    by one task on ``pool`` at a time.

    Raises:
        CheckpointCorruptError: the first chunk (in file order) that fails.
    """
    run(plan_check(manifest, where), PreadTransport(source, step, pool=pool, workers=workers))
