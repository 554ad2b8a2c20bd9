"""Object-store loader: ranged reads of a step, landed on the device as the pinned ring's are.

An object store answers each request after a latency of its own and serves each connection at
some tens of MB/s, so a step is read fast only with many long ranges in flight: the read
driver's :class:`~ckptmgr.restore.transports.ranged.RangedTransport` sizes and counts its
ranges by the store's answers and fetches each byte once, into scratch memory it bounds
(256 MiB in flight). Each chunk, verified as it arrives, lands where the ring's would
(:mod:`~ckptmgr.restore.loaders.landing`: fresh device memory, spare device memory that moves
into the target's tensors only once the whole step has verified, or, for a caller that has
verified the step already, the target's own tensors), copied from the scratch by the
transport's thread that fetched it; the work already queued on the caller's stream is waited
for first. Host memory stays at the scratch's bound (one chunk where a chunk is larger),
whatever the step's size.

The headers come with the files' first ranges: each file's header bytes are kept as they land
and checked against the manifest once the step has been read, before anything moves into a
target (so the preflight need not fetch them first).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ...format.manifest import Manifest
from ..preflight import Source, check_header
from ..read import plan_check, run
from ..transports.ranged import RangedTransport
from .landing import Entry, Landing
from .ring import finish_landings, plan_landings

__all__ = ["read_tensors_store"]


class _Headed:
    """A file's landing that also keeps the file's header bytes (``[0, header_size)``, which
    the landing's spans leave out) as the chunks holding them land."""

    def __init__(self, landing: Landing, header_size: int) -> None:
        self.landing = landing
        self.header = np.zeros(header_size, dtype=np.uint8)

    def land(self, begin: int, data: torch.Tensor) -> None:
        n = self.header.size
        if begin < n:  # (chunks land from several threads at once, each its own bytes of the header)
            part = data[:n - begin].numpy()
            self.header[begin:begin + part.size] = part
        self.landing.land(begin, data)


def read_tensors_store(source: Source, step: int, manifest: Manifest, device: torch.device,
                       dests: dict[str, torch.Tensor] | None = None, *, through_device: bool = False,
                       entries: dict[str, list[Entry]] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of committed ``step`` of an object store (a source with ``read_tuner``)
    on ``device``, landed as :func:`~.ring.read_tensors_ring` lands it: fresh device memory;
    with ``through_device``, the tensors of ``dests`` through spare device memory once every
    chunk and header has verified; else straight into the usable tensors of ``dests``, which
    the caller allows only once it has verified the step. The files have passed the preflight
    checks of their sizes; their headers are checked here. ``entries``: the step's
    ``entries_by_file``, where the caller has them.

    Raises:
        CheckpointCorruptError: a chunk fails its checksum, a file ends early, or a header
            does not match the manifest (``dests`` untouched with ``through_device``).
        NoDeviceRoom: ``through_device`` and the step does not fit on the device (raised
            before anything is read).
    """
    where = f"{source.url}: step {step}"
    landings = plan_landings(manifest, device, where, dests, through_device, entries)
    headed = {fname: _Headed(landing, manifest.files[fname].header_size) for fname, landing in landings.items()}
    if device.type == "cuda":  # the copies run on the transport's threads: after what the caller queued
        torch.cuda.current_stream(device).synchronize()
    try:
        run(plan_check(manifest, where, dests=headed), RangedTransport(source, step))  # type: ignore[arg-type]
    except BaseException:
        if device.type == "cuda":  # (the copies queued end before the memory may go; never hiding the failure)
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(device)
        raise
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for fname, h in headed.items():
        check_header(h.header.tobytes(), fname, manifest, where)
    return finish_landings(manifest, device, landings, where, through_device)
