"""The read side of the manager: which copy of a step to read, with which loader, and the
fallback to an older step when the newest does not verify.

A step is read from the local tier when a slot holds it (verified like any other copy; on a
mismatch the durable copy is read instead), else from the durable target under the
retention guard, so that the deleter cannot remove it mid-read. With CUDA, the slots a
manager adopts at start-up (an earlier process's, after a crash) are verified right then,
on the ring's threads while the saver pins them (:meth:`Restorer.check_adopted`): the first
restore that follows a restart waits for those checks and then only copies.

Every read of a step follows one order: the manifest (checksum and schema), the target
check, the preflight of every file (regular, sized, header equal to the index), then the
data. When tensors land in a target's own memory, no byte reaches it before every checksum
of the step has verified, so a step that fails leaves the target as it was: on a GPU with
room for the step, it lands in spare device memory (verified as it arrives) and then moves
into the target; from an object store, it is read by ranges sized by the store's answers
(each byte fetched once) into that spare device memory, else into fresh host memory the same
way; otherwise every checksum is verified first and the step lands in place. An object
store's headers come with each file's first range and are checked once the step has been
read into fresh or spare memory, before anything reaches a target; they are read beforehand
only where the step lands in place. Any problem with a step
is a :class:`CheckpointCorruptError` naming the step and the file; a step deleted while it
is read (by another process's retention) is a :class:`StepNotFoundError`. ``restore()``
without a step skips either kind, with one warning each, and reads the next older step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any, NoReturn, Protocol

import torch

from ..errors import CheckpointCorruptError, CkptError, ConfigError, StepNotFoundError, StorageError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.tree import unflatten
from ..retention.deleter import StepGuard
from ..storage import Target
from ..storage import cufile as _gds
from ..storage.tier import LocalTier
from ..storage.tier_pinning import PinningLost
from .loaders import PinnedRing, read_tensors, read_tensors_inplace, read_tensors_pinned, read_tensors_ring
from .loaders.gds import read_tensors_gds
from .loaders.landing import lands_in_target
from .loaders.ring import NoDeviceRoom, entries_by_file
from .loaders.store import read_tensors_store
from .preflight import check_regular, local_path, preflight, submit_image_checks, verify_images, wait_all
from .target import match_target
from .verify import verify_files

__all__ = ["LOADERS", "MultiRank", "Restorer"]

log = logging.getLogger("ckptmgr")
LOADERS = ("auto", "inplace", "ring", "host", "gds")
_CPU = torch.device("cpu")
_ADOPTED_CHECK_WAIT = 600.0  # seconds a restore waits for the checks of an adopted slot


class MultiRank(Protocol):
    """How steps written by several ranks are read, and how every rank of a job restores
    together. :mod:`ckptmgr.distributed.restore` provides it and the manager hands it to the
    :class:`Restorer`: the read path imports nothing of the multi-rank layer.

    ``coordinated`` is True in a multi-rank job: then :meth:`Restorer.restore_step` hands
    every step to :meth:`restore_step`, which every rank calls together and which is the
    fallback loop's agreement hook: the ranks agree on every failure, so each raises the
    same error and :meth:`Restorer.restore_newest` moves them all to the same older step.
    """

    coordinated: bool

    def restore_step(self, restorer: Restorer, step: int, target: Any, device: torch.device | None, loader: str,
                     rank_map: Any) -> Any:
        """Restore ``step`` on every rank of the job (all ranks call it together)."""
        ...

    def restore_solo(self, restorer: Restorer, source: Target | LocalTier, step: int, manifest: Manifest,
                     target: Any, device: torch.device | None, loader: str, rank_map: Any) -> Any:
        """Restore ``step``, written by several ranks, in this process alone."""
        ...


class Restorer:
    """Restores committed steps for one manager. Each call owns what it allocates, and
    borrows ring buffers from ``ring`` one lease at a time, so calls from several threads at
    once never share a buffer. The one state kept between calls is the checks started on
    adopted tier slots (:meth:`check_adopted`)."""

    def __init__(self, target: Target, tier: LocalTier | None, guard: StepGuard,
                 ring: PinnedRing, allow_pickle: bool, ranks: MultiRank | None = None) -> None:
        self.target = target
        self.ranks = ranks
        self.tier = tier
        self.guard = guard
        self.ring = ring
        self.allow_pickle = allow_pickle
        self._mu = threading.Lock()
        # step -> (its manifest, the checks of its adopted tier slot's images)      (guarded by _mu)
        self._adopted: dict[int, tuple[Manifest, list[Future[None]]]] = {}

    def check_adopted(self, manifest: Manifest, images: dict[str, torch.Tensor]) -> None:
        """Start verifying every checksum chunk of an adopted tier slot's file ``images``
        against its ``manifest``, on the ring's threads (called at start-up while the saver
        pins the images, which takes longer). The first restore of the step then waits for
        these checks instead of checking again, and copies straight into its target. Bytes
        of a committed slot change only after its step is invisible: the restore uses the
        checks only while the slot still holds this very manifest (its commit time too)."""
        if any(fname not in images or images[fname].numel() != rec.size for fname, rec in manifest.files.items()):
            return  # (a restore reports it, naming the file)
        where = f"{self.tier.url if self.tier is not None else 'local tier'}: step {manifest.step}"
        try:
            checks = submit_image_checks(images, manifest, self.ring.pool, where)
        except RuntimeError as exc:  # (a pool shut down meanwhile) the restore verifies instead
            log.debug("%s: checks at adoption not started: %s", where, exc)
            return
        with self._mu:
            self._adopted[manifest.step] = (manifest, checks)

    def cancel_checks(self) -> None:
        """Cancel the checks of adopted slots not started yet (the manager closes)."""
        with self._mu:
            adopted, self._adopted = list(self._adopted.values()), {}
        for _, checks in adopted:
            for fut in checks:
                fut.cancel()

    def _verified_at_adoption(self, step: int, manifest: Manifest, where: str) -> bool:
        """True when the adopted tier slot of ``step`` passed every check
        :meth:`check_adopted` started (waiting for those still running), for exactly this
        ``manifest``; False when there are none to trust (then the caller verifies). The
        checks serve the first restore of the step only (the one a restarted job makes
        right away): later ones verify again, as for any other slot.

        Raises:
            CheckpointCorruptError: a chunk failed its checksum.
        """
        checks = self._adopted_checks(step, manifest)
        return checks is not None and self._passed(checks, where)

    def _adopted_checks(self, step: int, manifest: Manifest) -> list[Future[None]] | None:
        """The checks :meth:`check_adopted` started for the adopted tier slot of ``step`` and
        exactly this ``manifest`` (taken: they serve one restore), running or done; None."""
        with self._mu:
            found = self._adopted.pop(step, None)
        return None if found is None or found[0] != manifest else found[1]

    @staticmethod
    def _passed(checks: list[Future[None]], where: str) -> bool:
        """Wait for ``checks`` (an adopted slot's): True when all passed, False when they did
        not end in time (cancelled: the caller verifies).

        Raises:
            CheckpointCorruptError: a chunk failed its checksum.
        """
        if futures_wait(checks, timeout=_ADOPTED_CHECK_WAIT).not_done:
            log.warning("%s: the checks of the adopted slot did not end within %s s; verifying again", where,
                        _ADOPTED_CHECK_WAIT)
            for fut in checks:
                fut.cancel()
            return False
        wait_all(checks)
        return not any(fut.cancelled() for fut in checks)

    def source_of(self, step: int) -> Target | LocalTier:
        if self.tier is not None and step in self.tier.steps():
            return self.tier
        return self.target

    def manifest(self, step: int, source: Target | LocalTier | None = None) -> Manifest:
        """The validated manifest of committed ``step``.

        Raises:
            StepNotFoundError: ``step`` is not committed in ``source``.
            CheckpointCorruptError: the manifest fails its checksum or its schema, or is not a regular file.
        """
        source = source or self.source_of(step)
        where = f"{source.url}: step {step}"
        path = local_path(source, step, MANIFEST_NAME)
        if path is not None:  # a FIFO planted as the manifest must not be opened
            try:
                check_regular(path, f"{where}: {MANIFEST_NAME}")
            except FileNotFoundError:
                raise StepNotFoundError(f"step {step} is not committed under {source.url}") from None
        m = Manifest.from_bytes(source.read_manifest(step), where=where)
        if m.step != step:
            raise CheckpointCorruptError(f"{where}: manifest field step: the manifest is for step {m.step}")
        return m

    def restore_newest(self, candidates: list[int], target: Any, device: torch.device | None, loader: str,
                       rank_map: Any = None) -> Any:
        """The newest of ``candidates`` that verifies, warning once about each newer one that does not
        (damaged, or deleted by another process while it was read). The one fallback loop of
        single- and multi-rank restores: in a multi-rank job every rank runs it over rank 0's
        listing and the ranks agree on each step's outcome (:class:`MultiRank`)."""
        if not candidates:
            raise StepNotFoundError(f"no committed checkpoint under {self.target.url}")
        for s in reversed(candidates):
            try:
                return self.restore_step(s, target, device, loader, rank_map)
            except (CheckpointCorruptError, StepNotFoundError) as exc:
                warnings.warn(f"skipping step {s}: {exc}", RuntimeWarning, stacklevel=3)
        raise StepNotFoundError(f"no checkpoint under {self.target.url} verifies (tried steps {candidates})")

    def restore_step(self, step: int, target: Any, device: torch.device | None, loader: str,
                     rank_map: Any = None) -> Any:
        """Restore ``step``: from this process's local tier when it holds a copy that
        verifies, else from the durable target.

        Raises:
            StepNotFoundError: not committed, or deleted while it was read.
            CheckpointCorruptError: the step is damaged; the target (if any) is unchanged.
        """
        if self.ranks is not None and self.ranks.coordinated:
            return self.ranks.restore_step(self, step, target, device, loader, rank_map)
        tier_error: CkptError | None = None
        if self.tier is not None and step in self.tier.steps():
            try:
                with self.tier.reading(step) as images:  # the slot is not reused meanwhile
                    try:
                        return self._read_step(self.tier, step, target, device, loader, images, rank_map)
                    except PinningLost as exc:  # (an adoption that fails, stops or stalls: its copies ended)
                        if self.tier.closed:  # (stopped by the manager's close(): no file is read any more)
                            raise ConfigError(f"{self.tier.url}: closed while step {step} was restored from it; "
                                              "the restore did not finish") from exc
                        log.warning("%s: %s; step %d is read from its files", self.tier.url, exc, step)
                    return self._read_step(self.tier, step, target, device, loader, None, rank_map)
            except (CheckpointCorruptError, StepNotFoundError) as exc:
                if step not in self.target.list_steps():
                    raise
                tier_error = exc
        with self.guard.reading(step) as ok:
            if not ok:
                raise StepNotFoundError(f"step {step} under {self.target.url} is being deleted by the retention policy")
            out = self._read_step(self.target, step, target, device, loader, None, rank_map)
        if tier_error is not None:
            log.warning("restore: the local tier copy of step %d does not verify (%s); read %s instead",
                        step, tier_error, self.target.url)
        return out

    def _read_step(self, source: Target | LocalTier, step: int, target: Any, device: torch.device | None,
                   loader: str, images: dict[str, torch.Tensor] | None, rank_map: Any = None) -> Any:
        """One read of ``step`` from ``source``, with every failure turned into one of our errors."""
        try:
            manifest = self.manifest(step, source)  # StepNotFoundError: not committed there (any more)
        except CheckpointCorruptError as exc:
            _raise_naming_step(exc, source.url, step)
        try:
            return self._restore_from(source, step, manifest, target, device, loader, images, rank_map)
        except StepNotFoundError as exc:  # its directory went away after the manifest was read
            raise StepNotFoundError(f"step {step} under {source.url} was deleted while it was read") from exc
        except CheckpointCorruptError as exc:  # (storage names files by path; the user asked for a step)
            _raise_naming_step(exc, source.url, step)
        except CkptError:
            raise
        except FileNotFoundError as exc:  # a file vanished: deleted by someone, or never there
            if self._committed(source, step):
                raise CheckpointCorruptError(f"{source.url}: step {step}: {exc.filename or exc} is missing") from exc
            raise StepNotFoundError(f"step {step} under {source.url} was deleted while it was read") from exc
        except OSError as exc:
            if local_path(source, step, MANIFEST_NAME) is not None:  # a local file that cannot be read
                raise CheckpointCorruptError(f"{source.url}: step {step} cannot be read: {exc}") from exc
            raise StorageError(f"{source.url}: step {step} cannot be read: {exc}") from exc

    def _committed(self, source: Target | LocalTier, step: int) -> bool:
        steps = source.steps() if isinstance(source, LocalTier) else source.list_steps()
        return step in steps

    def read(self, source: Target | LocalTier, step: int, manifest: Manifest, device: torch.device,
             loader: str, images: dict[str, torch.Tensor] | None, dests: dict[str, torch.Tensor] | None,
             verified: bool = False) -> dict[str, torch.Tensor]:
        """Read every tensor of ``step`` (preflight first); when any lands in ``dests``, every
        checksum is verified before the first byte lands (``verified``: the caller did, as a
        multi-rank restore at the saved layout does on a GPU without room for the rank's part
        beside the target). Without ``dests``, each byte is read once, into fresh memory on
        ``device``, every chunk verified as it lands."""
        where = f"{source.url}: step {step}"
        if loader == "auto":
            loader = self.auto_loader(source, device, pinned=images is not None)
        if loader == "gds":
            loader = self._gds_or_ring(source)
        if loader == "inplace" and images is None and getattr(source, "path_of", None) is None:
            raise ConfigError(f"loader='inplace' needs files on a local filesystem; {source.url} is not")
        if loader == "inplace" and images is None and not all(local_path(source, step, n) for n in manifest.files):
            loader = "host"  # (files of a source partly held in memory, as a peer restore's fetched shard)
        store = getattr(source, "read_tuner", None) is not None  # an object store (read by ranges, not the ring)
        if loader == "ring" and not store and any(r.chunk_size > self.ring.slot_bytes for r in manifest.files.values()):
            loader = "host"  # chunks larger than the ring's buffers: read them whole
        use_images = loader == "inplace" and images is not None
        by_file = entries_by_file(manifest, where)  # (built once: the ring's loaders plan from them too)
        entries = [e for file in by_file.values() for e in file]
        # from an object store into fresh or spare memory, the headers come with the files' first
        # ranges and are checked once the step is read, before anything reaches a target: no
        # request for them first (landing in place, they are read first below)
        later = store and loader in ("host", "ring") and not verified
        preflight(source, step, manifest, where, images if use_images else None, headers=not later)
        adopted: list[Future[None]] | None = None  # an adopted slot's checks, still running
        if use_images and isinstance(source, LocalTier) and not verified:
            adopted = self._adopted_checks(step, manifest)
            if adopted is not None and (all(f.done() for f in adopted) or dests is None or device.type != "cuda"):
                verified, adopted = self._passed(adopted, where), None
        direct = lands_in_target(entries, dests, _CPU if loader == "host" else device) and not verified
        paths = {name: local_path(source, step, name) or "" for name in manifest.files}
        # Into a target on a GPU: land through spare device memory when it fits (each chunk
        # verified as it arrives, the target changed only after all verified); else verify
        # every chunk first, then land in place.
        through = direct and device.type == "cuda"
        if use_images and images is not None:  # already pinned where it lies, or being pinned by its adoption
            # (then the bounce readers read what the adoption has not reached from the slot's files)
            slot_files = paths if isinstance(source, LocalTier) else None
            if through:
                # (a slot adopted at start-up whose checks still run: the copies go beside them
                # into spare device memory, moved into the target once they all passed)
                with contextlib.suppress(NoDeviceRoom):
                    return read_tensors_pinned(images, manifest, device, self.ring, where, dests, through_device=True,
                                               entries=by_file, checks=adopted, files=slot_files)
            if adopted is not None:  # no room beside the target: the checks first, then in place
                verified = self._passed(adopted, where)
                direct = direct and not verified
            if direct:
                verify_images(images, manifest, self.ring.pool, where)
            return read_tensors_pinned(images, manifest, device, self.ring, where, dests, verified=direct or verified,
                                       entries=by_file, files=slot_files)
        if loader == "inplace":
            return read_tensors_inplace(paths, manifest, device, source.io_pool, where, dests)
        if loader == "gds":
            if direct:
                verify_files(source, step, manifest, self.ring.pool, self.ring.threads, where)
            return read_tensors_gds(paths, manifest, device, where, dests, pool=self.ring.pool)
        if loader == "ring" and store:
            # an object store onto a device: ranges sized and counted by the store's answers, each
            # byte fetched once, landed as the ring's
            if through:
                with contextlib.suppress(NoDeviceRoom):
                    return read_tensors_store(source, step, manifest, device, dests, through_device=True,
                                              entries=by_file)
            if direct:  # no room beside the target: headers and checksums first, then in place (fetched twice)
                preflight(source, step, manifest, where)
                verify_files(source, step, manifest, self.ring.pool, self.ring.threads, where)
            return read_tensors_store(source, step, manifest, device, dests, entries=by_file)
        if loader == "ring":
            if through:
                with contextlib.suppress(NoDeviceRoom):
                    return read_tensors_ring(source, step, manifest, device, self.ring, dests, through_device=True,
                                             entries=by_file)
            if direct:
                verify_files(source, step, manifest, self.ring.pool, self.ring.threads, where)
            return read_tensors_ring(source, step, manifest, device, self.ring, dests, entries=by_file)
        if direct and store:
            # an object store: each byte fetched once, into fresh memory, verified as it lands
            # (the headers checked there); the target changes only after (finish copies it in),
            # as if checked first
            return read_tensors(source, step, manifest, device=device)
        if direct:
            verify_files(source, step, manifest, source.io_pool, _workers(source.io_pool), where)
        return read_tensors(source, step, manifest, device=device, dests=dests)

    def auto_loader(self, source: Target | LocalTier, device: torch.device, *, pinned: bool) -> str:
        """The loader ``loader="auto"`` means for ``source`` and ``device``: always one that
        verifies every checksum as the data passes through host memory.

        Measured on an H200, 4 GiB: from this process's pinned staging slot 0.09 s; from
        /dev/shm through the ring 0.13 s, in place 0.27 s (most of it registering the
        mapping), so the ring serves one-shot restores. GDS is never chosen here: its reads
        bypass host memory, so their checksums cost a read back from the GPU; it stays
        opt-in (``loader="gds"``).
        """
        if device.type == "cpu":
            return "host"
        if pinned:
            return "inplace"
        return "ring"

    @staticmethod
    def _gds_or_ring(source: Target | LocalTier) -> str:
        path = getattr(source, "path", None)
        if path is None or getattr(source, "path_of", None) is None:
            raise ConfigError(f"loader='gds' needs files on a local filesystem; {source.url} is not")
        _gds.kvikio_module()  # raises, naming the extra to install
        status = _gds.probe(path)
        if status.usable:
            return "gds"
        warnings.warn(f"loader='gds': {status}; reading through the pinned ring instead", RuntimeWarning,
                      stacklevel=5)
        return "ring"

    def _restore_from(self, source: Target | LocalTier, step: int, manifest: Manifest, target: Any,
                      device: torch.device | None, loader: str, images: dict[str, torch.Tensor] | None,
                      rank_map: Any = None) -> Any:
        if manifest.world_size > 1:  # written by several ranks: assembled whole (docs/DISTRIBUTED.md)
            if self.ranks is None:
                raise ConfigError(f"{source.url}: step {step} was written by {manifest.world_size} ranks; "
                                  "this restorer has no multi-rank reader")
            return self.ranks.restore_solo(self, source, step, manifest, target, device, loader, rank_map)
        plan = None
        if target is not None:
            # every difference is reported before a byte lands in the target's tensors
            plan = match_target(target, manifest.state, manifest.tensors, allow_pickle=self.allow_pickle)
            if device is None:
                device = plan.device
        if device is not None and str(device) == "cuda":  # no index: the current device
            device = torch.device("cuda", torch.cuda.current_device())  # compares equal to its tensors' device
        tensors = self.read(source, step, manifest, device or _CPU, loader, images,
                             plan.dests if plan is not None else None)
        if plan is not None:  # the bytes are in the target's tensors: copy what is not, load Stateful objects
            return plan.finish(tensors)
        return unflatten(manifest.state, tensors, allow_pickle=self.allow_pickle)


def _raise_naming_step(exc: CheckpointCorruptError, url: str, step: int) -> NoReturn:
    """Raise ``exc`` as it is when its message names ``step``, else the same error with the
    root and the step in front."""
    if f"step {step}" in str(exc):
        raise exc
    raise CheckpointCorruptError(f"{url}: step {step}: {exc}") from exc


def _workers(pool: Any) -> int:
    return int(getattr(pool, "_max_workers", 8))
