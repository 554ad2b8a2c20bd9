"""Object-store loader: ranged reads of a step, landed on the device as the pinned ring's are.

An object store answers each request after a latency of its own and serves each connection at
some tens of MB/s, so a step is read fast only with many long ranges in flight: the read
driver's :class:`~ckptmgr.restore.transports.ranged.RangedTransport` sizes and counts its
ranges by the store's answers and fetches each byte once, into scratch memory it bounds
(256 MiB in flight). Each chunk, verified as it arrives, lands where the ring's would
(:mod:`~ckptmgr.restore.loaders.landing`: fresh device memory, or spare device memory that
moves into the target's tensors only once the whole step has verified), copied from the
scratch by the transport's thread that fetched it. Host memory stays at the scratch's bound,
whatever the step's size.

A step read straight into a target's own tensors is not read here (a chunk that failed after
others landed would leave the target changed): without room beside the target on the device,
the restorer reads the step into fresh host memory instead (:func:`.host.read_tensors`), each
byte fetched once as well.
"""

from __future__ import annotations

import torch

from ...format.manifest import Manifest
from ..preflight import Source
from ..read import plan_check, run
from ..transports.ranged import RangedTransport
from .landing import Entry
from .ring import _finish, _plan_all

__all__ = ["read_tensors_store"]


def read_tensors_store(source: Source, step: int, manifest: Manifest, device: torch.device,
                       dests: dict[str, torch.Tensor] | None = None, *, through_device: bool = False,
                       entries: dict[str, list[Entry]] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of committed ``step`` of an object store (a source with ``read_tuner``)
    on ``device``: in fresh device memory, or, with ``through_device``, in the tensors of
    ``dests`` through spare device memory once every chunk has verified. The files have
    passed the preflight checks. ``entries``: the step's ``entries_by_file``, where the
    caller has them.

    Raises:
        CheckpointCorruptError: a chunk fails its checksum, or a file ends early (``dests``
            untouched).
        NoDeviceRoom: ``through_device`` and the step does not fit on the device (raised
            before anything is read).
    """
    where = f"{source.url}: step {step}"
    landings = _plan_all(manifest, device, where, dests if through_device else None, through_device, entries)
    try:
        run(plan_check(manifest, where, dests=landings), RangedTransport(source, step))  # type: ignore[arg-type]
    finally:  # the copies the transport's threads queued have run before anything is built or dropped
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return _finish(manifest, device, landings, where, through_device)
