"""Copies from file images already pinned in this process: its staging slot, or a local-tier
slot it adopted at start-up, straight to where they land at the link's speed, each chunk
verified where it lies by the ring's threads while the copies run (:func:`read_tensors_pinned`).

A slot its adoption is still pinning is copied chunk by chunk from the front, each once its
piece is pinned, while the adoption registers the next. Pinning a mapping in place runs at
about half the link's speed, so a restore that starts while much is left to pin also starts
the bounce readers (:mod:`.bounce`) on the slot's files from their far end: they read the
pieces the adoption has not reached into pinned buffers and copy them from there, and the
two sides meet (:class:`~.bounce.Ends` gives each piece to one side). Whatever reads it,
every byte lands by the same landing plan and is verified by the same checks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import Future

import torch

from ... import _cuda
from ...errors import CheckpointCorruptError
from ...format.checksum import chunk_ranges
from ...format.manifest import Manifest
from ...storage.tier_pinning import TierImages
from ..preflight import drain, submit_image_checks, wait_all
from . import bounce
from .bounce import Ends, Piece, Readers, Source
from .landing import Entry, Landing
from .ring import PinnedRing, finish_landings, plan_landings

__all__ = ["BACK_FROM_BYTES", "read_tensors_pinned"]

log = logging.getLogger("ckptmgr")

# A restore starts the bounce readers from the far end only while more than this is left to pin:
# their pinned block costs about 0.024 s to allocate in a fresh process
# (benchmarks/probes/pinned_alloc.py), the time the adoption pins about 0.7 GB in.
BACK_FROM_BYTES = 1 << 30


def read_tensors_pinned(images: dict[str, torch.Tensor], manifest: Manifest, device: torch.device,
                        ring: PinnedRing, where: str, dests: dict[str, torch.Tensor] | None = None, *,
                        verified: bool = False, through_device: bool = False,
                        entries: dict[str, list[Entry]] | None = None,
                        checks: list[Future[None]] | None = None,
                        files: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a step whose file images are already in pinned host memory (this
    process's staging slot, or a local-tier slot it adopted): copied straight from there.

    The copies are queued from the calling thread on a stream of their own, chunk by chunk
    (an image is pinned in pieces of whole chunks, so no copy crosses two), while the ring's
    threads verify every chunk where it lies; both only read the images, which the caller
    holds against reuse. The step thus moves at the link's speed with the checksums beside
    it rather than in front of it. Where the bytes land is decided as for
    :func:`read_tensors_ring`: fresh memory, which a failed step simply drops; or, with
    ``through_device``, spare device memory that moves into ``dests`` only once every chunk
    has verified. Straight into ``dests`` (neither), every chunk is verified before the first
    copy, unless ``verified``: the caller did, where they lie, before this call.

    ``checks``: checks of these images already started (an adopted slot's, see
    :meth:`~ckptmgr.restore.restorer.Restorer.check_adopted`), waited for instead of checking
    again.

    Images of a local-tier slot still being pinned by its adoption (a
    :class:`~ckptmgr.storage.tier_pinning.TierImages` with its ``pinning``) are copied under a
    copy lease, each chunk once the adoption has pinned its piece (the copies of piece k run
    while piece k+1 is registered); the rules above about where bytes land are the same.
    With ``files`` (file name -> the path of the slot's file), while more than
    :data:`BACK_FROM_BYTES` remain to be pinned, the bounce readers
    (:func:`~.bounce.start_readers`) meanwhile read the files from their far end, pieces the
    adoption has not reached, and the two meet: pinning a mapping in place runs at about half
    the link's speed, and the readers add their own (:data:`BACK_FROM_BYTES`).

    Raises:
        CheckpointCorruptError: an image does not match the manifest, or a chunk fails its
            checksum (``dests`` untouched).
        NoDeviceRoom: ``through_device`` and the step does not fit on the device.
        PinningLost: the adoption will not pin the images in time (its copies have ended;
            what landed in ``dests``, if anything, is verified bytes of this step).
    """
    for fname, rec in manifest.files.items():
        image = images.get(fname)
        if image is None or image.numel() != rec.size:
            raise CheckpointCorruptError(f"{where}: the staged image of {fname} does not match the manifest")
    landings = plan_landings(manifest, device, where, dests, through_device, entries)
    in_place = not through_device and any(landing.into_target for landing in landings.values())
    pinning: TierImages | None = None  # (a slot its adoption still pins: copied under a copy lease)
    lease: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if isinstance(images, TierImages) and images.pinning is not None:
        pinning, lease = images, images.pinning.copying()
    started, checks = checks, []
    stream = None
    back: tuple[Readers, Ends, list[Piece]] | None = None  # the bounce readers from the far end, if started
    opened = contextlib.ExitStack()  # (their descriptors)
    with lease:  # no registration is undone until the copies have ended
        try:
            if started is not None:
                checks = list(started)
            elif not verified:
                checks = submit_image_checks(images, manifest, ring.pool, where)
            if in_place:  # straight into the target: every chunk verified first
                wait_all(checks)
            if device.type == "cuda":
                stream = _cuda.staging_stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))  # after the work queued on what it writes
            if (pinning is not None and pinning.pinning is not None and files is not None
                    and pinning.pinning.unpinned() > BACK_FROM_BYTES):
                back = _from_the_back(manifest, files, landings, device, opened, where)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                _front(manifest, images, landings, pinning, back)
            if back is not None:
                back[0].wait()
            wait_all(checks)
            if started is not None and any(f.cancelled() for f in checks):  # (not all of them ran)
                checks = submit_image_checks(images, manifest, ring.pool, where)
                wait_all(checks)
        finally:  # whatever happened: the copies and the started checks end before the images or the
            if stream is not None:  # memory the copies write may go
                stream.synchronize()
            if back is not None:
                back[0].drain()
            opened.close()
            drain(checks)
    return finish_landings(manifest, device, landings, where, through_device)


def _chunk_pieces(manifest: Manifest) -> list[tuple[str, int, int]]:
    """Every checksum chunk of the step's files, in order, as (file, first piece, end piece)
    indices of :func:`_pieces`."""
    out, at = [], 0
    for fname, rec in manifest.files.items():
        for b, e in chunk_ranges(rec.size, rec.chunk_size):
            n = -(-(e - b) // bounce.PIECE_BYTES)
            out.append((fname, at, at + n))
            at += n
    return out


def _pieces(manifest: Manifest) -> list[Piece]:
    """The step's files cut into the bounce readers' pieces, no piece across two checksum
    chunks (source ``k``: the ``k``-th file)."""
    return [Piece(k, pb, min(pb + bounce.PIECE_BYTES, e))
            for k, rec in enumerate(manifest.files.values())
            for b, e in chunk_ranges(rec.size, rec.chunk_size)
            for pb in range(b, e, bounce.PIECE_BYTES)]


def _from_the_back(manifest: Manifest, files: dict[str, str], landings: dict[str, Landing], device: torch.device,
                   opened: contextlib.ExitStack, where: str) -> tuple[Readers, Ends, list[Piece]] | None:
    """Start the bounce readers on the step's pieces from the last one back (their
    descriptors closed by ``opened``); None where a file does not open (the front copies
    it all, as without readers)."""
    sources = []
    for fname in manifest.files:
        try:
            fd = os.open(files[fname], os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            log.warning("%s: %s does not open (%s); the restore waits for its pinning", where, files[fname], exc)
            return None
        opened.callback(os.close, fd)
        sources.append(Source(fd, files[fname], landings[fname]))
    pieces = _pieces(manifest)
    ends = Ends(len(pieces))
    return bounce.start_readers(sources, pieces, device, take=ends.back), ends, pieces


def _front(manifest: Manifest, images: dict[str, torch.Tensor], landings: dict[str, Landing],
           pinning: TierImages | None, back: tuple[Readers, Ends, list[Piece]] | None) -> None:
    """Copy the images chunk by chunk from the front, each once it is pinned; with ``back``,
    only the pieces its readers have not taken (it stops where they meet)."""
    if back is None:
        for fname, rec in manifest.files.items():
            pinned = rec.size if pinning is None else 0  # bytes of the image known to be pinned
            for b, e in chunk_ranges(rec.size, rec.chunk_size):
                if e > pinned:
                    assert pinning is not None
                    pinned = pinning.wait(fname, e)
                landings[fname].land(b, images[fname][b:e])
        return
    assert pinning is not None
    _, ends, pieces = back
    upto: dict[str, int] = {}  # file -> bytes of its image known to be pinned
    for fname, _, end in _chunk_pieces(manifest):
        got = ends.front(end)
        if not got:
            return  # (the readers took the rest)
        b, e = pieces[got.start].begin, pieces[got.stop - 1].end
        if e > upto.get(fname, 0):
            upto[fname] = pinning.wait(fname, e)
        landings[fname].land(b, images[fname][b:e])
        if got.stop < end:
            return
