"""GDS loader: kvikio reads a committed step's files straight into GPU memory, then what
landed is verified: the step's landing planned, then one plan of its checksum chunks run by
the read driver through :class:`~ckptmgr.restore.transports.gds.GdsTransport`.

The data never passes through host memory on its way in, so the checksums cannot be computed
as it is read: each chunk is read back from where it landed and checked (see the transport).
The restorer verifies a step's files before GDS reads land in a target's own tensors, so a
step that fails leaves the target as it was.
"""

from __future__ import annotations

from concurrent.futures import Executor

import torch

from ...format.manifest import Manifest
from ..read import Mismatch, plan_check, run
from ..transports.gds import GdsTransport
from .host import _build_views
from .landing import Landing, plan_landing
from .ring import entries_by_file

__all__ = ["read_tensors_gds"]


def read_tensors_gds(paths: dict[str, str], manifest: Manifest, device: torch.device, where: str,
                     dests: dict[str, torch.Tensor] | None = None, *, pool: Executor) -> dict[str, torch.Tensor]:
    """Every tensor of a committed step, read by kvikio straight into memory on ``device``
    (or into the matching tensors of ``dests``), then verified where it landed.

    The files have passed the preflight checks (regular, sized, headers matching the index).

    Raises:
        CheckpointCorruptError: a read came back short, or what landed fails a checksum.
        ConfigError: kvikio is not installed.
    """
    transport = GdsTransport(paths, pool=pool)  # (kvikio is there: before anything is allocated)
    entries = entries_by_file(manifest, where)
    landings: dict[str, Landing] = {
        fname: plan_landing(entries[fname], rec.header_size, rec.size - rec.header_size, device, dests)
        for fname, rec in manifest.files.items()}

    def message(m: Mismatch) -> str:
        return f"{where}: {m.file}: checksum mismatch in bytes [{m.begin}, {m.end}) of what GDS read"

    run(plan_check(manifest, where, dests=landings, message=message), transport)
    out: dict[str, torch.Tensor] = {}
    for landing in landings.values():
        out.update(landing.tensors())
    _build_views(manifest, out, where)
    return out
