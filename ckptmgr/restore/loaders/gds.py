"""GDS loader: kvikio reads a committed step's files straight into GPU memory, then what
landed is verified.

kvikio is imported through :mod:`ckptmgr.storage.cufile`, which also probes (in a child
process with a time limit) whether kvikio can do I/O on this machine at all.

The data never passes through host memory on its way in, so the checksums cannot be computed
as it is read. Once every read has landed, each checksum chunk is read back from where it
landed (device-to-host, in chunk-sized pieces, on the caller's pool) and its CRC32C is
checked: what is returned is what the manifest recorded. The restorer verifies a step's files
before GDS reads land in a target's own tensors, so a step that fails leaves the target as it was.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor

import torch

from ...errors import CheckpointCorruptError
from ...format.checksum import chunk_ranges, crc32c_hex
from ...format.manifest import Manifest
from ...storage.cufile import kvikio_module
from ..preflight import run_all
from .host import _build_views
from .landing import Landing, plan_landing
from .ring import entries_by_file

__all__ = ["read_tensors_gds"]


def _buffer(t: torch.Tensor) -> object:
    """What kvikio accepts for ``t``: the tensor itself on a GPU, a numpy view on the host."""
    return t if t.device.type == "cuda" else t.numpy()


def _read_header(path: str, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.pread(fd, n, 0)
    finally:
        os.close(fd)
    return data


def _verify_landed(fname: str, header: bytes, landing: Landing, manifest: Manifest, pool: Executor,
                   where: str) -> None:
    """Check every checksum chunk of ``fname`` against what landed (and its header bytes)."""
    rec = manifest.files[fname]

    def check(i: int, b: int, e: int) -> None:
        host = torch.empty(e - b, dtype=torch.uint8)
        head = min(e, rec.header_size)
        if b < head:
            host[:head - b] = torch.frombuffer(bytearray(header[b:head]), dtype=torch.uint8)
        if e > rec.header_size:
            start = max(b, rec.header_size)
            landing.gather(start, host[start - b:])
        if crc32c_hex(host.numpy()) != rec.crc32c[i]:
            raise CheckpointCorruptError(f"{where}: {fname}: checksum mismatch in bytes [{b}, {e}) "
                                         "of what GDS read")

    run_all(pool, check, [(i, b, e) for i, (b, e) in enumerate(chunk_ranges(rec.size, rec.chunk_size))])


def read_tensors_gds(paths: dict[str, str], manifest: Manifest, device: torch.device, where: str,
                     dests: dict[str, torch.Tensor] | None = None, *, pool: Executor) -> dict[str, torch.Tensor]:
    """Every tensor of a committed step, read by kvikio straight into memory on ``device``
    (or into the matching tensors of ``dests``), then verified where it landed.

    The files have passed the preflight checks (regular, sized, headers matching the index).

    Raises:
        CheckpointCorruptError: a read came back short, or what landed fails a checksum.
        ConfigError: kvikio is not installed.
    """
    kvikio = kvikio_module()
    out: dict[str, torch.Tensor] = {}
    entries = entries_by_file(manifest, where)
    for fname, rec in manifest.files.items():
        path = paths[fname]
        landing = plan_landing(entries[fname], rec.header_size, rec.size - rec.header_size, device, dests)
        f = kvikio.CuFile(path, "r")
        try:
            futures = [(b, e, f.pread(_buffer(dst), e - b, b)) for b, e, dst in landing.spans]
            short = [(b, e, n) for b, e, fut in futures if (n := fut.get()) != e - b]
        finally:
            f.close()
        if short:
            b, e, n = short[0]
            raise CheckpointCorruptError(f"{where}: {fname}: read {n} of the {e - b} bytes at offset {b}")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _verify_landed(fname, _read_header(path, rec.header_size), landing, manifest, pool, where)
        out.update(landing.tensors())
    _build_views(manifest, out, where)
    return out
