"""Copies from file images already pinned in this process: its staging slot, or a local-tier
slot it adopted at start-up, straight to where they land at the link's speed, each chunk
verified where it lies by the ring's threads while the copies run (:func:`read_tensors_pinned`).

A slot its adoption is still pinning is copied chunk by chunk from the front, each once its
piece is pinned, while the adoption registers the next. But a registration keeps the driver
from running other CUDA calls, the restore's copies among them: after a SIGKILL, a restore
started at once moved 4.83 GB only as fast as the adoption pinned it, and its copies ran
after the pinning rather than beside it (H200: the pinning ended 0.21 s after the open and the
restore 0.32 s after it, in two calls; 0.28 and 0.40 s in a third;
``benchmarks/results/h200-2026-11-28-tierends/``). So a restore that starts
while much is left to pin holds the adoption after its current piece
(:meth:`~ckptmgr.storage.tier_pinning.Pinning.holding`), copies the chunks pinned so far from
the front, and has the bounce readers (:mod:`.bounce`) read the rest from the slot's files,
from their far end, into pinned buffers and copy it from there; the two sides meet
(:class:`~.bounce.Ends` gives each piece to one side), and the adoption goes on afterwards.
Whatever reads it, every byte lands by the same landing plan and is verified by the same
checks.
"""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import Future
from typing import NamedTuple

import torch

from ... import _cuda
from ...errors import CheckpointCorruptError
from ...format.checksum import chunk_ranges
from ...format.manifest import Manifest
from ...storage.posix import open_regular
from ...storage.tier_pinning import Pinning, TierImages
from ..preflight import drain, submit_image_checks, wait_all
from . import bounce
from .bounce import Ends, Piece, Readers, Source
from .landing import Entry, Landing
from .ring import PinnedRing, finish_landings, plan_landings

__all__ = ["BACK_FROM_BYTES", "read_tensors_pinned"]

log = logging.getLogger("ckptmgr")

# A restore holds the adoption and starts the bounce readers only while more than this is left
# to pin; less is pinned sooner than the readers' pinned block is allocated in a fresh process
# (about 0.024 s for its 64 MiB: benchmarks/probes/pinned_alloc.py).
BACK_FROM_BYTES = 256 << 20


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
    :data:`BACK_FROM_BYTES` remain to be pinned, the adoption is held after its current
    piece, the chunks pinned so far are copied from the front, and the bounce readers
    (:func:`~.bounce.start_readers`) read the rest from the files, from their far end, until
    the two meet; the adoption goes on once the copies have ended.

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
    back: _Back | None = None  # the bounce readers from the far end, if started
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
                    and pinning.pinning.unpinned(manifest.files) > BACK_FROM_BYTES):
                back = _from_the_back(manifest, files, images, landings, device, pinning.pinning, opened, where)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                _front(manifest, images, landings, pinning, back)
            if back is not None:
                back.readers.wait()
                if stream is not None:
                    stream.synchronize()
                opened.close()  # (the copies have ended: the adoption goes on, the descriptors go)
            wait_all(checks)
            if started is not None and any(f.cancelled() for f in checks):  # (not all of them ran)
                checks = submit_image_checks(images, manifest, ring.pool, where)
                wait_all(checks)
        finally:  # whatever happened: the copies and the started checks end before the images or the
            # memory the copies write may go, then the descriptors and the hold go; each step runs
            # whether or not one before it raised (an ExitStack unwinds them last to first)
            with contextlib.ExitStack() as cleanup:
                cleanup.callback(drain, checks)
                cleanup.push(opened)
                if back is not None:
                    cleanup.callback(back.readers.drain)
                if stream is not None:
                    cleanup.callback(stream.synchronize)
    return finish_landings(manifest, device, landings, where, through_device)


class _Back(NamedTuple):
    """The bounce readers started from the far end, what they share with the front, the step's
    pieces and its chunks' (see :func:`_pieces`)."""

    readers: Readers
    ends: Ends
    pieces: list[Piece]
    chunks: list[tuple[str, int]]


def _pieces(manifest: Manifest) -> tuple[list[Piece], list[tuple[str, int]]]:
    """The step's files cut into the bounce readers' pieces, no piece across two checksum
    chunks (source ``k``: the ``k``-th file), and each checksum chunk, in order, as (file,
    the index of the piece after its last)."""
    pieces: list[Piece] = []
    chunks: list[tuple[str, int]] = []
    for k, (fname, rec) in enumerate(manifest.files.items()):
        for b, e in chunk_ranges(rec.size, rec.chunk_size):
            pieces += [Piece(k, pb, min(pb + bounce.PIECE_BYTES, e)) for pb in range(b, e, bounce.PIECE_BYTES)]
            chunks.append((fname, len(pieces)))
    return pieces, chunks


def _from_the_back(manifest: Manifest, files: dict[str, str], images: dict[str, torch.Tensor],
                   landings: dict[str, Landing], device: torch.device, pinning: Pinning,
                   opened: contextlib.ExitStack, where: str) -> _Back | None:
    """Hold the adoption (``pinning``) and start the bounce readers on the step's pieces from
    the last one back (their descriptors and the hold released by ``opened``); None where a
    file does not open as the image it should be, or the readers do not start (nothing held
    then: the front copies it all, as without readers)."""
    mine = contextlib.ExitStack()
    try:
        sources = []
        for fname in manifest.files:
            fd = open_regular(files[fname])
            mine.callback(os.close, fd)
            st = os.fstat(fd)
            if st.st_size != images[fname].numel():
                raise OSError(f"{st.st_size} bytes where the mapped image has {images[fname].numel()}")
            if pinning.identities.get(fname, (st.st_dev, st.st_ino)) != (st.st_dev, st.st_ino):
                raise OSError(f"{files[fname]} is not the file the image maps (replaced)")
            sources.append(Source(fd, files[fname], landings[fname]))
        pieces, chunks = _pieces(manifest)
        ends = Ends(len(pieces))
        mine.enter_context(pinning.holding())
        readers = bounce.start_readers(sources, pieces, device, take=ends.back)
    except Exception as exc:  # (a file gone or replaced, no pinned memory for the readers: go on without)
        mine.close()
        log.warning("%s: the slot's files are not read beside its pinning (%s: %s); the restore waits for "
                    "the pinning", where, type(exc).__name__, exc)
        return None
    except BaseException:
        mine.close()
        raise
    opened.push(mine.pop_all())
    return _Back(readers, ends, pieces, chunks)


def _front(manifest: Manifest, images: dict[str, torch.Tensor], landings: dict[str, Landing],
           pinning: TierImages | None, back: _Back | None) -> None:
    """Copy the images chunk by chunk from the front, each once it is pinned; with ``back``
    (the adoption held), only the chunks pinned already that its readers have not taken (it
    stops at the first chunk not pinned, or where they meet)."""
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
    assert pinning.pinning is not None
    ends, pieces = back.ends, back.pieces
    for fname, end in back.chunks:
        if pinning.pinning.upto(fname) < pieces[end - 1].end:
            return  # (never waits: the adoption is held, the readers take the rest)
        got = ends.front(end)
        if not got:
            return  # (the readers took the rest)
        b, e = pieces[got.start].begin, pieces[got.stop - 1].end
        landings[fname].land(b, images[fname][b:e])
        if got.stop < end:
            return
