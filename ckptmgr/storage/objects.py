"""Object stores: the manifest-last commit, and the removal of leftovers of gone writers.

An object store has no atomic rename, so a step's files go straight to ``step_<n>/`` and the
step exists once ``manifest.json`` does. Several processes may share the root, so:

* a writer claims ``(step, its file prefix)`` with a lease object (``writer.lease``) created
  with ``If-None-Match: *`` before it uploads anything, and renews it while it writes; a
  second writer of the same step is refused up front (StepExistsError) instead of
  overwriting the first one's files;
* the commit lists the step's prefix and checks that every file of the manifest is there
  with its size (and, for this writer's own files, the ETag it got back), then writes the
  manifest once (``If-None-Match: *``): a file lost or replaced meanwhile fails the save
  instead of committing a step with missing data;
* an abort deletes only the files this writer uploaded, and none once another writer's
  manifest is there;
* start-up removes a manifest-less step's files only when every lease in it belongs to a gone
  writer (:func:`~ckptmgr.storage.lease.writer_gone`), and aborts incomplete multipart
  uploads only under such steps. Directory markers (``step_<n>/`` keys, or the empty
  prefixes some servers keep listing) are ours to remove under our step names, silently.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import StepExistsError, StorageError
from ..format.manifest import MANIFEST_NAME
from ..format.naming import is_lease_name, is_our_file, lease_name, parse_step_name, step_name
from .commit import manifest_sizes
from .lease import Lease, LeaseKeeper, current, release, writer_gone

__all__ = ["ManifestLastCommit", "ObjectInfo", "ObjectStore", "remove_object_leftovers", "step_objects"]

log = logging.getLogger("ckptmgr")


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    etag: str | None = None  # as the store reports it (quotes stripped); None where it has none
    mtime: float | None = None  # the store's last-modified time, seconds since the epoch


class ObjectStore(Protocol):
    """The few operations the commit needs, on keys relative to the root (``step_.../name``)."""

    url: str

    def listing(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every key under the root starting with ``prefix``, fresh (no cache), every page;
        directory markers appear as keys ending in ``/``."""

    def get(self, rel: str) -> bytes:
        """The object's bytes. Raises FileNotFoundError."""

    def exists(self, rel: str) -> bool:
        """Whether the object exists (one HEAD)."""

    def put(self, rel: str, data: bytes, *, if_absent: bool = False) -> str | None:
        """Write the object, returning its ETag where the store gives one. With ``if_absent``
        it is written only if no object has the key (raises FileExistsError otherwise)."""

    def remove(self, rels: list[str]) -> None:
        """Delete the objects (a key ending in ``/``: the directory marker, or the empty
        directory, where the store keeps one); missing ones are no error."""

    def uploads(self, prefix: str) -> list[tuple[str, str]]:
        """Incomplete multipart uploads under ``prefix``: (key, upload id); [] where none exist."""

    def abort_upload(self, rel: str, upload_id: str) -> None:
        """Abort one incomplete multipart upload."""


def step_objects(listing: dict[str, ObjectInfo]) -> dict[int, dict[str, ObjectInfo]]:
    """Group a root's listing by step: step -> {name in the step: info}. The marker of a step
    (``step_<n>/``) appears under the name ``""``; deeper keys keep their sub-path."""
    out: dict[int, dict[str, ObjectInfo]] = {}
    for key, info in listing.items():
        head, sep, rest = key.partition("/")
        step = parse_step_name(head)
        if step is not None and sep:
            out.setdefault(step, {})[rest] = info
    return out


def _etag(e: str | None) -> str | None:
    return e.strip('"') if e else None


class ManifestLastCommit:
    """Object stores: files in place under a lease; ``manifest.json`` written last, once."""

    location = ""  # files go straight to the step's prefix

    def __init__(self, store: ObjectStore, step: int, prefix: str, keeper: LeaseKeeper, stale_after_s: float,
                 on_commit: Callable[[], object] | None = None) -> None:
        self.store = store
        self.step = step
        self._on_commit = on_commit  # run once the files are checked, before the manifest is written
        self.dir = step_name(step)
        self._manifest = f"{self.dir}/{MANIFEST_NAME}"
        self._lease_key = f"{self.dir}/{lease_name(prefix)}"
        self._keeper = keeper
        self._mu = threading.Lock()  # guards _written, _lease_etag, _held
        self._written: dict[str, tuple[int, str | None]] = {}  # name -> (size, etag) uploaded by us
        self._lease = current()
        self._lease_etag: str | None = None
        self._held = False
        self._checked = False  # the commit's check found the lease ours
        try:
            self._claim(stale_after_s)
            # Asked only once the claim is held: a writer gives its claim up after writing its
            # manifest, so a commit before this claim is seen here (asked beside the claim, a
            # commit landing between the two went unseen and this writer overwrote its files).
            if store.exists(self._manifest):
                self.close()
                raise StepExistsError(f"step {step} is already committed at {store.url}")
        except BaseException:
            release(self._lease)
            raise
        keeper.add(self)

    def _claim(self, stale_after_s: float) -> None:
        try:
            etag = self.store.put(self._lease_key, self._lease.to_bytes(), if_absent=True)
        except FileExistsError:
            other, age = self._read_lease()
            if other is not None and other.token == self._lease.token:  # a retry after a lost answer
                with self._mu:
                    self._held = True
                return
            if not writer_gone(other, age, stale_after_s):
                who = f"{other.host} pid {other.pid}" if other is not None else "an unknown writer"
                raise StepExistsError(
                    f"step {self.step} is being written to {self.store.url} by another process ({who}, "
                    f"heartbeat {age:.0f} s ago)") from None
            log.info("taking over step %d under %s from a gone writer", self.step, self.store.url)
            self.store.remove([self._lease_key])
            try:
                etag = self.store.put(self._lease_key, self._lease.to_bytes(), if_absent=True)
            except FileExistsError:
                raise StepExistsError(f"step {self.step} is being written to {self.store.url} by another "
                                      "process (it claimed the step just now)") from None
        with self._mu:
            self._lease_etag, self._held = _etag(etag), True

    def _read_lease(self, with_age: bool = True) -> tuple[Lease | None, float]:
        """The lease now in the store and the age of its heartbeat (inf when it vanished;
        0 unless ``with_age``)."""
        info = self.store.listing(self._lease_key).get(self._lease_key) if with_age else None
        try:
            data = self.store.get(self._lease_key)
        except FileNotFoundError:
            return None, float("inf")
        lease = Lease.from_bytes(data)
        if not with_age:
            return lease, 0.0
        stamp = info.mtime if info is not None and info.mtime is not None else (lease.time if lease else None)
        return lease, (time.time() - stamp) if stamp is not None else float("inf")

    def refresh(self) -> None:
        with self._mu:
            if not self._held:
                return
            self._lease = self._lease.refreshed()
            data = self._lease.to_bytes()
        etag = self.store.put(self._lease_key, data)
        with self._mu:
            self._lease_etag = _etag(etag)

    def wrote(self, name: str, size: int, etag: str | None = None) -> None:
        with self._mu:
            self._written[name] = (size, _etag(etag))

    def check(self, sizes: dict[str, int]) -> None:
        """Every file of the manifest is in the step's prefix with its size; ours with our ETag;
        our lease is still ours.

        Raises:
            StorageError: a file is missing or not what was written, or the claim was lost.
        """
        listing = self.store.listing(self.dir + "/")
        with self._mu:
            written, lease_etag = dict(self._written), self._lease_etag
        for name, size in sizes.items():
            info = listing.get(f"{self.dir}/{name}")
            if info is None:
                raise StorageError(f"{self.store.url}/{self.dir}/{name} is missing: step {self.step} not committed")
            mine = written.get(name)
            if info.size != size or (mine is not None and mine[1] and info.etag and _etag(info.etag) != mine[1]):
                raise StorageError(f"{self.store.url}/{self.dir}/{name} is not the {size}-byte object this save "
                                   f"wrote (another writer replaced it?): step {self.step} not committed")
        info = listing.get(self._lease_key)
        if info is not None and lease_etag and info.etag:
            ours = _etag(info.etag) == lease_etag
        else:
            lease, _ = self._read_lease(with_age=False) if info is not None else (None, 0.0)
            ours = lease is not None and lease.token == self._lease.token
        if not ours:
            raise StorageError(f"the claim on step {self.step} under {self.store.url} was taken over by another "
                               "process (this writer stalled past the lease's lifetime): not committed")
        with self._mu:
            self._checked = True

    def commit(self, manifest: bytes) -> None:
        self.check(manifest_sizes(manifest))
        if self._on_commit is not None:
            self._on_commit()
        try:
            self.store.put(self._manifest, manifest, if_absent=True)
        except FileExistsError:
            # Written already: by us, when an earlier attempt succeeded but its answer was
            # lost; by someone else otherwise.
            if self.store.get(self._manifest) != manifest:
                raise StepExistsError(f"step {self.step} is already committed at {self.store.url}") from None
        self.close()

    def abort(self) -> None:
        try:
            with self._mu:
                written = dict(self._written)
                self._written.clear()
            if written:
                listing = self.store.listing(self.dir + "/")
                if f"{self._manifest}" in listing:
                    return  # committed by another writer: what is there is now theirs
                ours = [f"{self.dir}/{n}" for n, (_, etag) in written.items()
                        if f"{self.dir}/{n}" in listing
                        and (etag is None or listing[f"{self.dir}/{n}"].etag is None
                             or _etag(listing[f"{self.dir}/{n}"].etag) == etag)]
                self.store.remove(ours)
        except Exception as exc:
            log.warning("could not remove the files of a failed save of step %d under %s (%s: %s); the next "
                        "start removes them", self.step, self.store.url, type(exc).__name__, exc)
        finally:
            self.close()

    def close(self) -> None:
        """Release the lease (delete it while it is still ours)."""
        self._keeper.remove(self)
        release(self._lease)
        with self._mu:
            held, self._held = self._held, False
            checked = self._checked
        if not held:
            return
        try:
            if not checked:  # (the commit's check has just seen that the lease is ours)
                lease, _ = self._read_lease(with_age=False)
                if lease is None or lease.token != self._lease.token:
                    return
            self.store.remove([self._lease_key])
        except Exception as exc:
            log.info("could not release the lease %s/%s (%s); it expires", self.store.url, self._lease_key, exc)


    def __del__(self) -> None:  # dropped without commit/abort/close: its lease (if left) is a gone writer's
        if hasattr(self, "_lease"):
            release(self._lease)


def _lease_gone(store: ObjectStore, rel: str, info: ObjectInfo, now: float, stale_after_s: float) -> bool:
    try:
        lease = Lease.from_bytes(store.get(rel))
    except FileNotFoundError:
        return True
    stamp = info.mtime if info.mtime is not None else (lease.time if lease else None)
    return writer_gone(lease, now - stamp if stamp is not None else float("inf"), stale_after_s)


def remove_object_leftovers(store: ObjectStore, stale_after_s: float) -> list[str]:
    """Remove, under the root, the steps without a manifest whose writers are all gone (our
    files, then leases, then the directory marker), leases of gone writers left in committed
    steps, and incomplete multipart uploads under steps with no live writer. Returns what
    was removed; a failure is logged and the rest goes on."""
    removed: list[str] = []
    uploads = store.uploads("step_")  # before the objects: an upload's lease was created before it
    groups = step_objects(store.listing("step_"))
    now = time.time()
    live: set[int] = set()
    for step, objs in sorted(groups.items()):
        d = step_name(step)
        try:
            leases = {n: i for n, i in objs.items() if is_lease_name(n)}
            gone = {n for n, i in leases.items() if _lease_gone(store, f"{d}/{n}", i, now, stale_after_s)}
            if MANIFEST_NAME in objs:
                if gone:
                    store.remove([f"{d}/{n}" for n in sorted(gone)])
                    removed += [f"{store.url}/{d}/{n}" for n in sorted(gone)]
                continue
            if len(gone) < len(leases) or store.exists(f"{d}/{MANIFEST_NAME}"):  # a live writer, or just committed
                live.add(step)
                continue
            ours = sorted(f"{d}/{n}" for n in objs if is_our_file(n) and not is_lease_name(n))
            store.remove(ours)
            store.remove([f"{d}/{n}" for n in sorted(leases)])
            foreign = sorted(n for n in objs if n and not is_our_file(n))
            if foreign:
                log.warning("left %s/%s in place: it holds objects ckptmgr did not write (%s)", store.url, d, foreign)
            else:
                store.remove([f"{d}/"])  # the directory marker, where the server keeps one
            if ours or leases:
                removed.append(f"{store.url}/{d}")
        except OSError as exc:
            live.add(step)
            log.warning("could not remove the leftovers of step %d under %s (%s: %s)", step, store.url,
                        type(exc).__name__, exc)
    for key, upload_id in uploads:
        head, _, name = key.partition("/")
        owner = parse_step_name(head)
        if owner is None or owner in live or not is_our_file(name) or posixpath.basename(name) != name:
            continue
        with contextlib.suppress(FileNotFoundError):
            try:
                store.abort_upload(key, upload_id)
                removed.append(f"{store.url}/{key} (incomplete upload)")
            except OSError as exc:
                log.warning("could not abort the incomplete upload of %s/%s (%s)", store.url, key, exc)
    return removed
