"""GDS loader: kvikio reads a committed step's files straight into GPU memory.

kvikio is imported through :mod:`ckptmgr.storage.cufile`, which also probes (in a child
process with a time limit) whether kvikio can do I/O on this machine at all.
"""

from __future__ import annotations

import torch

from ...errors import CheckpointCorruptError
from ...format.manifest import Manifest
from ...storage.cufile import kvikio_module
from .host import _build_views
from .landing import plan_landing
from .mapped import check_header, open_mapped

__all__ = ["read_tensors_gds"]


def _buffer(t: torch.Tensor) -> object:
    """What kvikio accepts for ``t``: the tensor itself on a GPU, a numpy view on the host."""
    return t if t.device.type == "cuda" else t.numpy()


def read_tensors_gds(paths: dict[str, str], manifest: Manifest, device: torch.device, where: str,
                     dests: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a committed step, read by kvikio straight into memory on ``device``
    (or into the matching tensors of ``dests``).

    The data never passes through host memory, so the per-chunk checksums cannot be
    computed on the way: each file's size and header are checked against the manifest, and
    every read must return every byte.

    Raises:
        CheckpointCorruptError: a file does not match the manifest.
        ConfigError: kvikio is not installed.
    """
    kvikio = kvikio_module()
    out: dict[str, torch.Tensor] = {}
    for fname, rec in manifest.files.items():
        path = paths[fname]
        mf = open_mapped(path)  # only the header is read
        try:
            check_header(mf, manifest, fname, rec.size, where)
            landing = plan_landing(mf.entries, mf.data_start, mf.size - mf.data_start, device, dests)
        finally:
            mf.close()
        f = kvikio.CuFile(path, "r")
        try:
            futures = [(b, e, f.pread(_buffer(dst), e - b, b)) for b, e, dst in landing.spans]
            short = [(b, e, n) for b, e, fut in futures if (n := fut.get()) != e - b]
        finally:
            f.close()
        if short:
            b, e, n = short[0]
            raise CheckpointCorruptError(f"{where}: {fname}: read {n} of the {e - b} bytes at offset {b}")
        out.update(landing.tensors())
    _build_views(manifest, out, where)
    return out
