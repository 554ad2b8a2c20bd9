"""The manifest-last commit of object stores, fenced by the writer's claim. The removal of gone
writers' leftovers is in :mod:`.object_leftovers`.

An object store has no atomic rename, so a step's files go straight to ``step_<n>/`` and the
step exists once ``manifest.json`` does. Several processes may share the root, and a writer
may stall (SIGSTOP, a suspended VM, a long GC) for longer than its lease lives, so every write
is tied to the writer's *claim*, not to timing:

* the claim is a lease object (``writer.lease``) created with ``If-None-Match: *`` before
  anything is uploaded; it is renewed, and finally deleted, only with ``If-Match`` on the ETag
  this writer last got for it, so a writer whose claim was taken over learns it at its next
  renewal (412) and can neither steal the lease back nor delete the new writer's. A stale
  claim is taken over by a conditional delete on the ETag it was judged by (a lease gone
  meanwhile is not deleted again: another writer may have claimed the step), then a create,
  and only in a step without a manifest (a committed step is refused with its lease left to
  the clean-up's judgment: its writer may be about to renew it after its manifest write);
* each data object is named with the claim's token (``data-00000.<token>.safetensors``,
  recorded so in the manifest): no two claims ever write one key, so a committed step's
  objects are never rewritten, by a stale writer's single PUT or multipart upload alike;
* the commit checks the step's objects, renews the claim (``If-Match``: it is ours *now*),
  writes the manifest once (``If-None-Match: *``), and renews the claim again. Only when the
  second renewal succeeds is the step committed and the save reported durable: no one took
  the claim between the check and the manifest, and any later taker finds the manifest and
  backs off. When it fails, the save fails, and the writer keeps its manifest where it is
  still its own and names a complete step (every object there, with the size and, for its
  own, the ETag written): another process may have been told the step exists. Otherwise
  (an object is gone: a clean-up judged the writer gone and removed them; or, on a store
  without conditional writes, another writer holds the claim and cannot replace a manifest)
  it deletes its manifest (``If-Match`` on its ETag). A writer that, holding its claim
  throughout, finds a manifest written after its claim saw none replaces it in one PUT
  (``If-Match`` on its ETag; it was written by a writer that had lost the claim), and once
  committed removes the objects no live claim owns that its manifest does not name
  (:func:`.object_leftovers.remove_step_leftovers`);
  where it loses its claim instead and withdraws its own manifest, it writes the replaced one
  back (``If-None-Match``) if every file that one names is in place;
* an abort deletes only objects with this claim's token;
* start-up removes a gone writer's lease first (conditionally), then, where no manifest
  appeared meanwhile, the step's objects, and withdraws a manifest written after that look
  that names objects now gone; in a committed step it removes objects of claims that are no
  longer live and that the manifest does not name (:mod:`.object_leftovers`).

Stores without conditional writes (a generic fsspec filesystem; an S3 endpoint that answers
501 to, or ignores, ``If-Match``) get each condition as a read followed by the write, which
leaves a window of one round trip. docs/SECURITY.md says exactly what holds where.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from ...errors import StepExistsError, StorageError
from ...format.manifest import MANIFEST_NAME, Manifest
from ...format.naming import attempt_name, attempt_tag, lease_name, step_name
from ..lease import Lease, LeaseKeeper, current, release, writer_gone
from ..objects import ConditionFailed, ObjectStore, _etag, remove_if
from .object_leftovers import (
    manifest_names,
    not_a_lease,
    remove_object_leftovers,
    remove_step_leftovers,
    token_is,
)
from .rename import manifest_sizes

__all__ = ["ManifestLastCommit", "manifest_names", "remove_object_leftovers"]

log = logging.getLogger("ckptmgr")
_REPLACE_TRIES = 3


class _Lost(Exception):
    """This writer's claim is no longer its own."""


class ManifestLastCommit:
    """Object stores: files under this claim's own names; ``manifest.json`` written last, once,
    between two renewals of the claim (see the module's docstring)."""

    def __init__(self, store: ObjectStore, step: int, prefix: str, keeper: LeaseKeeper, stale_after_s: float,
                 on_commit: Callable[[], object] | None = None) -> None:
        self.store = store
        self.step = step
        self._on_commit = on_commit  # run once the files are checked, before the manifest is written
        self._stale_after_s = stale_after_s
        self.dir = step_name(step)
        self._manifest = f"{self.dir}/{MANIFEST_NAME}"
        self._lease_key = f"{self.dir}/{lease_name(prefix)}"
        self._keeper = keeper
        self._mu = threading.Lock()  # guards _written, _lease, _lease_etag, _held, _lost, _tags, _left
        self._renew_mu = threading.Lock()  # one renewal at a time (each is conditional on the last one's ETag)
        self._written: dict[str, tuple[int, str | None]] = {}  # object name -> (size, etag) uploaded by us
        self._tags: dict[str, str] = {}  # other ranks' files adopted: plain name -> their claim's token
        self._lease = current()
        self.tag = self._lease.token  # in the name of every object this claim writes
        self.location = self.tag  # (what the other ranks of a multi-rank save are told)
        self._lease_etag: str | None = None
        self._held = False
        self._lost = False
        self._left = False  # our manifest may be in the store (kept, or a retraction failed): keep our objects
        self._replaced: bytes | None = None  # the manifest ours replaced (commit's thread only)
        try:
            self._claim(stale_after_s)
            # Asked only once the claim is held: a writer gives its claim up after writing its
            # manifest, so a commit before this claim is seen here.
            if store.exists(self._manifest):
                self.close()
                raise StepExistsError(f"step {step} is already committed at {store.url}")
        except BaseException:
            release(self._lease)
            raise
        keeper.add(self)

    def object_name(self, name: str) -> str:
        """The object name this claim writes data file ``name`` under."""
        return attempt_name(name, self.tag)

    def _claim(self, stale_after_s: float) -> None:
        try:
            etag = self.store.put(self._lease_key, self._lease.to_bytes(), if_absent=True)
        except FileExistsError:
            other, age, other_etag = self._read_lease()
            if other is not None and other.token == self._lease.token:  # a retry after a lost answer
                with self._mu:
                    self._lease_etag, self._held = other_etag, True
                return
            if not writer_gone(other, age, stale_after_s):
                who = f"{other.host} pid {other.pid}" if other is not None else "an unknown writer"
                raise StepExistsError(
                    f"step {self.step} is being written to {self.store.url} by another process ({who}, "
                    f"heartbeat {age:.0f} s ago)") from None
            # Never in a committed step: its writer may have stalled after its manifest write, before
            # the renewal that keeps the step; the clean-up judges that lease (not removed here).
            if self.store.exists(self._manifest):
                raise StepExistsError(f"step {self.step} is already committed at {self.store.url}") from None
            # Taken over only as it was judged: a writer that renewed it meanwhile keeps it.
            if other is not None and not remove_if(self.store, self._lease_key, other_etag, token_is(other.token)):
                raise StepExistsError(f"step {self.step} is being written to {self.store.url} by another "
                                      "process (it renewed its claim just now)") from None
            if other is None and other_etag is not None:  # not a lease: removed only as listed
                remove_if(self.store, self._lease_key, other_etag, not_a_lease)
            log.info("taking over step %d under %s from a gone writer", self.step, self.store.url)
            try:
                etag = self.store.put(self._lease_key, self._lease.to_bytes(), if_absent=True)
            except FileExistsError:
                raise StepExistsError(f"step {self.step} is being written to {self.store.url} by another "
                                      "process (it claimed the step just now)") from None
        with self._mu:
            self._lease_etag, self._held = _etag(etag), True

    def _read_lease(self) -> tuple[Lease | None, float, str | None]:
        """The lease now in the store, the age of its heartbeat (inf when it vanished) and its
        ETag as listed."""
        info = self.store.listing(self._lease_key).get(self._lease_key)
        try:
            data = self.store.get(self._lease_key)
        except FileNotFoundError:
            return None, float("inf"), None
        lease = Lease.from_bytes(data)
        stamp = info.mtime if info is not None and info.mtime is not None else (lease.time if lease else None)
        return lease, (time.time() - stamp) if stamp is not None else float("inf"), \
            _etag(info.etag) if info is not None else None

    def _renew(self) -> None:
        """Rewrite the lease with a fresh heartbeat if it is still ours: ``If-Match`` on the
        ETag of our last write of it (else: read, check the token, write). Raises _Lost."""
        with self._renew_mu:
            with self._mu:
                if self._lost or not self._held:
                    raise _Lost
                lease, etag = self._lease.refreshed(), self._lease_etag
            try:
                if etag and self.store.conditional:
                    new = self.store.put(self._lease_key, lease.to_bytes(), if_match=etag)
                else:
                    try:
                        now = Lease.from_bytes(self.store.get(self._lease_key))
                    except FileNotFoundError:
                        now = None
                    if now is None or now.token != lease.token:
                        raise ConditionFailed(f"{self.store.url}/{self._lease_key} is not ours")
                    new = self.store.put(self._lease_key, lease.to_bytes())
            except ConditionFailed:
                with self._mu:
                    self._lost, self._held = True, False
                self._keeper.remove(self)
                raise _Lost from None
            with self._mu:
                self._lease, self._lease_etag = lease, _etag(new)

    def refresh(self) -> None:
        try:
            self._renew()
        except _Lost:
            with self._mu:
                lost = self._lost
            if lost:
                log.warning("the claim on step %d under %s was taken over by another process (this writer "
                            "stalled past the lease's lifetime): the save will fail", self.step, self.store.url)

    def _hold(self, when: str) -> None:
        """Renew the claim now. Raises StorageError when it was taken over."""
        try:
            self._renew()
        except _Lost:
            raise StorageError(f"{self._taken_over(when)}: not committed") from None

    def _taken_over(self, when: str) -> str:
        return (f"the claim on step {self.step} under {self.store.url} was taken over by another process {when} "
                "(this writer stalled past the lease's lifetime)")

    def wrote(self, name: str, size: int, etag: str | None = None) -> None:
        """Record an object this claim wrote, by its object name (:meth:`object_name`)."""
        with self._mu:
            self._written[name] = (size, _etag(etag))

    def adopt(self, parts: list[tuple[str, list[str]]]) -> None:
        """Other ranks' files of this step, as ``(their claim's token, plain names)``: the
        manifest names them with that token."""
        with self._mu:
            for tag, names in parts:
                for name in names:
                    if tag:
                        attempt_name(name, tag)  # (raises ValueError on anything but a token and a data name)
                        self._tags[name] = tag

    def _named(self, manifest: bytes) -> bytes:
        """``manifest`` with every data file under its object name."""
        m = Manifest.from_bytes(manifest, where=f"{self.store.url}/{self._manifest} (being committed)")
        with self._mu:
            tags = dict(self._tags)
        names = {n: n if attempt_tag(n) is not None else attempt_name(n, tags.get(n, self.tag)) for n in m.files}
        if all(k == v for k, v in names.items()):
            return manifest
        tensors = {k: {**e, "file": names[e["file"]]} if "file" in e else e for k, e in m.tensors.items()}
        return dataclasses.replace(m, files={names[k]: v for k, v in m.files.items()}, tensors=tensors).to_bytes()

    def check(self, sizes: dict[str, int]) -> None:
        """Every file of the manifest (by object name) is in the step's prefix with its size;
        ours with our ETag.

        Raises:
            StorageError: a file is missing or not what was written.
        """
        wrong = self._unlike(sizes)
        if wrong is not None:
            raise StorageError(f"{wrong}: step {self.step} not committed")

    def _unlike(self, sizes: dict[str, int]) -> str | None:
        """What in the step's prefix is not as :meth:`check` wants it (None: all is). Raises
        what the listing raises."""
        listing = self.store.listing(self.dir + "/")
        with self._mu:
            written = dict(self._written)
        for name, size in sizes.items():
            info = listing.get(f"{self.dir}/{name}")
            if info is None:
                return f"{self.store.url}/{self.dir}/{name} is missing"
            mine = written.get(name)
            if info.size != size or (mine is not None and mine[1] and info.etag and _etag(info.etag) != mine[1]):
                return f"{self.store.url}/{self.dir}/{name} is not the {size}-byte object this save wrote"
        return None

    def commit(self, manifest: bytes) -> None:
        manifest = self._named(manifest)
        self.check(manifest_sizes(manifest))
        self._hold("before the commit")
        if self._on_commit is not None:
            self._on_commit()
        try:
            etag = self._write_manifest(manifest)
        except BaseException:  # (a PUT whose answer was lost may have landed: keep what it names)
            self._keep_if_ours(manifest)
            raise
        try:
            self._renew()
        except _Lost:
            # Not durable: the claim was not held throughout. The step stays if it is complete.
            raise StorageError(f"{self._taken_over('while it wrote its manifest')}: "
                               f"{self._settle(manifest, etag)}") from None
        except BaseException:  # the renewal failed otherwise (a timeout, a reset): not known to be
            self._keep_if_ours(manifest)  # lost, and our manifest names these objects
            raise
        self.close()
        if self._replaced is not None:  # the objects the replaced manifest named are no one's now
            try:
                remove_step_leftovers(self.store, self.step, self._stale_after_s)
            except Exception as exc:
                log.warning("could not remove the objects of the manifest replaced in step %d under %s (%s: %s); "
                            "the next start removes them", self.step, self.store.url, type(exc).__name__, exc)

    def _settle(self, manifest: bytes, etag: str | None) -> str:
        """After our claim was found taken over past our manifest's write: keep the manifest
        where it is still ours and names a complete step (another process may have been told
        the step exists), unless the store cannot let the writer holding the claim now replace
        it; withdraw it otherwise. Returns what became of it, for the error."""
        try:
            if self.store.get_manifest(self._manifest) != manifest:
                return "not committed; the manifest there is no longer this writer's"
            wrong = self._unlike(manifest_sizes(manifest))
            other = wrong is None and not self.store.conditional and self._read_lease()[0] is not None
        except FileNotFoundError:
            return "not committed; its manifest is gone"
        except Exception as exc:
            with self._mu:
                self._left = True
            return (f"not durable; its manifest was left in place, as it could not be checked "
                    f"({type(exc).__name__}: {exc})")
        if wrong is None and not other:
            with self._mu:
                self._left = True
            return ("not durable; its manifest was kept, as every file it names is in place (the step may "
                    "have been seen as committed; a writer that holds the claim now may replace it)")
        why = (f"a file it names is gone ({wrong})" if wrong is not None else
               "another writer holds the claim, and this store has no conditional writes to replace it")
        try:
            gone = remove_if(self.store, self._manifest, etag, lambda d: d == manifest)
        except Exception as exc:
            gone = False
            log.warning("could not withdraw the manifest of step %d under %s (%s: %s)", self.step,
                        self.store.url, type(exc).__name__, exc)
        with self._mu:
            self._left = not gone and self._still_ours(manifest)
        back = self._put_back(self._replaced) if gone and self._replaced is not None else ""
        return f"not committed; its manifest {'was withdrawn' if gone else 'could not be withdrawn'}: {why}{back}"

    def _put_back(self, replaced: bytes) -> str:
        """After withdrawing our manifest, which had replaced ``replaced`` (written without the
        claim): that one is written back (``If-None-Match``) where every file it names is still
        in place, as the step may have been seen committed with it. Returns what became of it,
        for the error."""
        try:
            wrong = self._unlike(manifest_sizes(replaced))
            if wrong is None:
                self.store.put(self._manifest, replaced, if_absent=True)
                log.warning("step %d under %s: put back the manifest this writer had replaced (every file it "
                            "names is in place)", self.step, self.store.url)
                return "; the manifest it had replaced was put back (every file it names is in place)"
        except FileExistsError:
            return "; a manifest was written there meanwhile"
        except Exception as exc:
            log.warning("could not put back the manifest replaced in step %d under %s (%s: %s)", self.step,
                        self.store.url, type(exc).__name__, exc)
            return f"; the manifest it had replaced could not be put back ({type(exc).__name__}: {exc})"
        return f"; the manifest it had replaced was not put back: {wrong}"

    def _keep_if_ours(self, manifest: bytes) -> None:
        """After a failure from the manifest's write on: keep the data objects (abort leaves
        them) while a manifest of ours may name them."""
        left = self._still_ours(manifest)
        with self._mu:
            self._left = left

    def _still_ours(self, manifest: bytes) -> bool:
        try:
            return self.store.get_manifest(self._manifest) == manifest
        except Exception:
            return True  # cannot tell: keep the objects it may name

    def _write_manifest(self, manifest: bytes) -> str | None:
        """Write the manifest once; returns its ETag. A manifest already there is ours (an
        earlier attempt whose answer was lost), or was written after our claim saw none by a
        writer that had lost the claim: replaced in one PUT (``If-Match`` on its ETag), where
        the store's conditions prove that our claim was held throughout. Raises
        StepExistsError otherwise."""
        for _ in range(_REPLACE_TRIES):
            try:
                return _etag(self.store.put(self._manifest, manifest, if_absent=True))
            except FileExistsError:
                pass
            info = self.store.listing(self._manifest).get(self._manifest)
            try:
                there = self.store.get_manifest(self._manifest)
            except FileNotFoundError:
                continue  # withdrawn meanwhile
            if there == manifest:
                return _etag(info.etag) if info is not None else None
            if not self.store.conditional or info is None or not info.etag:
                break  # (without conditions, our claim's continuity is not proven: never delete it)
            self._hold("before it replaced a manifest written without the claim")
            try:  # one PUT on the ETag it was read by: the step is never without a manifest
                etag = self.store.put(self._manifest, manifest, if_match=_etag(info.etag))
            except ConditionFailed:
                continue  # replaced or withdrawn meanwhile: look again
            self._replaced = there
            log.warning("step %d under %s: replaced a manifest written by a writer that had lost its claim on the "
                        "step", self.step, self.store.url)
            return _etag(etag)
        raise StepExistsError(f"step {self.step} under {self.store.url} has a manifest that this writer did not "
                              "write and cannot prove was written without the claim: not committed")

    def abort(self) -> None:
        try:
            with self._mu:
                written = sorted(self._written)
                self._written.clear()
                left = self._left
            if written and not left:  # (names with our token: no other writer's, committed or not)
                self.store.remove([f"{self.dir}/{n}" for n in written])
        except Exception as exc:
            log.warning("could not remove the files of a failed save of step %d under %s (%s: %s); the next "
                        "start removes them", self.step, self.store.url, type(exc).__name__, exc)
        finally:
            self.close()

    def close(self) -> None:
        """Release the lease: delete it if it is still ours (``If-Match`` on its ETag)."""
        self._keeper.remove(self)
        release(self._lease)
        with self._renew_mu, self._mu:
            held, self._held = self._held, False
            etag, token = self._lease_etag, self._lease.token
        if not held:
            return
        try:
            remove_if(self.store, self._lease_key, etag, token_is(token))
        except Exception as exc:
            log.info("could not release the lease %s/%s (%s); it expires", self.store.url, self._lease_key, exc)

    def __del__(self) -> None:  # dropped without commit/abort/close: its lease (if left) is a gone writer's
        if hasattr(self, "_lease"):
            release(self._lease)
