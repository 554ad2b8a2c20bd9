"""The leftovers of gone writers under an object-store root, and their removal: the sweep that
:class:`~.manifest_last.ManifestLastCommit` relies on (its module docstring says how a claim
works).

Per step, the sweep judges each lease by its heartbeat and removes a gone writer's lease first
(conditionally on the ETag it was judged by: a writer that renewed it meanwhile lives). Then:

* a step with a live writer and no manifest is left alone;
* a step without a manifest whose writers are all gone loses our objects and its directory
  marker, where no manifest appeared meanwhile. A manifest that appears *after* that look
  (a stalled writer's, written between the look and the deletes) is looked for again once
  the objects are deleted: one that names an object now missing is withdrawn (conditionally
  on its ETag). Its writer, if it checks its objects after the deletes, withdraws it itself;
  one it writes after the second look and dies before its check is left to the next start
  (below; docs/SECURITY.md states the window);
* a committed step loses the objects of claims that are no longer live that its manifest does
  not name (never a named one, whoever wrote it). One with no data object and no live claim
  has its manifest read and withdrawn if it names objects that are gone: a writer stalled past
  the stale time put it after an earlier clean-up removed its objects, and died before its
  own check.

A lease is removed only as it was listed and judged: one gone since the listing is not
deleted again (a writer may have claimed the step meanwhile).

Incomplete multipart uploads are aborted under steps with no live writer and for claims no
longer live. The commit runs the same per-step sweep on its own step after it replaced a
manifest written without the claim (:func:`remove_step_leftovers`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import posixpath
import time
from collections.abc import Callable

from ...errors import CkptError
from ...format.manifest import MANIFEST_NAME
from ...format.naming import attempt_tag, is_lease_name, is_our_file, parse_step_name, step_name
from ..lease import Lease, writer_gone
from ..objects import ObjectInfo, ObjectStore, _etag, remove_if, step_objects

__all__ = ["manifest_names", "not_a_lease", "remove_object_leftovers", "remove_step_leftovers", "token_is"]

log = logging.getLogger("ckptmgr")


def token_is(token: str) -> Callable[[bytes], bool]:
    """A check of a lease's bytes: it is the lease of the claim with ``token``."""
    def check(data: bytes) -> bool:
        lease = Lease.from_bytes(data)
        return lease is not None and lease.token == token
    return check


def not_a_lease(data: bytes) -> bool:
    """A check of an object at a lease's name: it holds no lease of ours."""
    return Lease.from_bytes(data) is None


def _judge(store: ObjectStore, rel: str, info: ObjectInfo, now: float,
           stale_after_s: float) -> tuple[Lease | None, bool]:
    """The lease at ``rel`` and whether its writer is gone."""
    try:
        lease = Lease.from_bytes(store.get(rel))
    except FileNotFoundError:
        return None, True
    stamp = info.mtime if info.mtime is not None else (lease.time if lease else None)
    return lease, writer_gone(lease, now - stamp if stamp is not None else float("inf"), stale_after_s)


def manifest_names(store: ObjectStore, rel: str) -> set[str] | None:
    """The data file names a committed manifest lists; None when it is gone or cannot be read
    as one (then nothing it might name is removed)."""
    try:
        return _names_in(store.get_manifest(rel))
    except (OSError, CkptError):
        return None


def _names_in(data: bytes) -> set[str] | None:
    """The data file names the manifest bytes ``data`` list (None: not a manifest's list)."""
    try:
        files = json.loads(data).get("files")
    except (ValueError, AttributeError, RecursionError):
        return None
    return {n for n in files if isinstance(n, str)} if isinstance(files, dict) else None


def _withdraw_if_incomplete(store: ObjectStore, d: str) -> bool:
    """After a gone writer's objects of step directory ``d`` were deleted (now, or by an
    earlier clean-up): a manifest there that names an object now missing is withdrawn (only
    as it was judged: its ETag, else its bytes). Returns whether one was."""
    key = f"{d}/{MANIFEST_NAME}"
    listing = store.listing(d + "/")
    info = listing.get(key)
    if info is None:
        return False
    try:
        data = store.get_manifest(key)
    except FileNotFoundError:
        return False
    except CkptError:  # (too large to be one of ours: not judged)
        return False
    names = _names_in(data)
    if names is None:
        return False  # (not one of ours to judge: left alone)
    missing = sorted(n for n in names if f"{d}/{n}" not in listing)
    if not missing or not remove_if(store, key, _etag(info.etag), data.__eq__):
        return False
    log.warning("withdrew %s/%s: it names objects that are gone (%s); its writer, judged gone, wrote it while or "
                "after its objects were removed", store.url, key, missing)
    return True


def _sweep_step(store: ObjectStore, step: int, objs: dict[str, ObjectInfo], now: float, stale_after_s: float,
                removed: list[str]) -> tuple[set[str], bool]:
    """One step's leftovers (see the module's docstring), appended to ``removed``. Returns the
    tokens of its live claims and whether it has a live writer and no manifest."""
    d = step_name(step)
    tokens: set[str] = set()
    fenced = []
    for n, info in sorted(objs.items()):
        if not is_lease_name(n):
            continue
        lease, gone = _judge(store, f"{d}/{n}", info, now, stale_after_s)
        if not gone:
            tokens.add(lease.token if lease is not None else "")
            continue
        # A gone writer's claim goes first, and only as judged: one that renewed it lives.
        if lease is not None and not remove_if(store, f"{d}/{n}", _etag(info.etag), token_is(lease.token)):
            tokens.add(lease.token)
            continue
        if lease is None:  # gone since the listing, or not a lease: removed only as listed (a new claim's stays)
            remove_if(store, f"{d}/{n}", _etag(info.etag), not_a_lease)
        fenced.append(n)
    committed = MANIFEST_NAME in objs
    if tokens and not committed:
        return tokens, True
    if not committed and store.exists(f"{d}/{MANIFEST_NAME}"):  # committed just now
        return tokens, False
    if committed:
        removed += [f"{store.url}/{d}/{n}" for n in fenced]
        # A manifest without a data object beside it and no live claim: one a writer stalled past
        # the stale time put after a clean-up removed its objects, then died before its own check.
        if not tokens and not any(n.startswith("data-") and not is_lease_name(n) for n in objs):
            if _withdraw_if_incomplete(store, d):
                removed.append(f"{store.url}/{d}/{MANIFEST_NAME}")
            return tokens, False
        tagged = {n: attempt_tag(n) for n in objs if attempt_tag(n) is not None}
        stray = {n for n, t in tagged.items() if t not in tokens}
        if stray and (fenced or tokens or len(set(tagged.values())) > 1):
            names = manifest_names(store, f"{d}/{MANIFEST_NAME}")
            doomed = sorted(stray - names) if names is not None else []
            store.remove([f"{d}/{n}" for n in doomed])
            removed += [f"{store.url}/{d}/{n}" for n in doomed]
        return tokens, False
    ours = sorted(f"{d}/{n}" for n in objs if is_our_file(n) and not is_lease_name(n))
    store.remove(ours)
    # A writer stalled before its manifest write may have written it since the look above.
    if ours and _withdraw_if_incomplete(store, d):
        removed.append(f"{store.url}/{d}/{MANIFEST_NAME}")
    foreign = sorted(n for n in objs if n and not is_our_file(n))
    if foreign:
        log.warning("left %s/%s in place: it holds objects ckptmgr did not write (%s)", store.url, d, foreign)
    else:
        store.remove([f"{d}/"])  # the directory marker, where the server keeps one
    if ours or fenced:
        removed.append(f"{store.url}/{d}")
    return tokens, False


def remove_step_leftovers(store: ObjectStore, step: int, stale_after_s: float) -> list[str]:
    """The sweep of :func:`remove_object_leftovers` for one step (its uploads aside). Returns
    what was removed."""
    removed: list[str] = []
    objs = step_objects(store.listing(step_name(step) + "/")).get(step, {})
    if objs:
        _sweep_step(store, step, objs, time.time(), stale_after_s, removed)
    return removed


def remove_object_leftovers(store: ObjectStore, stale_after_s: float) -> list[str]:
    """Remove, under the root: the steps without a manifest whose writers are all gone (their
    leases first, conditionally, then, if no manifest appeared meanwhile, our objects and the
    directory marker, and a manifest that appeared after that look naming objects now gone);
    leases of gone writers left in committed steps, and the objects of claims that are no
    longer live that the step's manifest does not name; incomplete multipart uploads under
    steps with no live writer or of claims no longer live. Returns what was removed; a
    failure is logged and the rest goes on."""
    removed: list[str] = []
    uploads = store.uploads("step_")  # before the objects: an upload's lease was created before it
    groups = step_objects(store.listing("step_"))
    now = time.time()
    busy: set[int] = set()  # steps with a live writer
    unsure: set[int] = set()  # steps that could not be examined
    live: dict[int, set[str]] = {}  # step -> tokens of its live claims
    for step, objs in sorted(groups.items()):
        try:
            live[step], writing = _sweep_step(store, step, objs, now, stale_after_s, removed)
            if writing:
                busy.add(step)
        except OSError as exc:
            unsure.add(step)
            log.warning("could not remove the leftovers of step %d under %s (%s: %s)", step, store.url,
                        type(exc).__name__, exc)
    for key, upload_id in uploads:
        head, _, name = key.partition("/")
        owner = parse_step_name(head)
        if owner is None or not is_our_file(name) or posixpath.basename(name) != name:
            continue
        tag = attempt_tag(name)
        if owner in unsure or (tag is None and owner in busy) or (tag is not None and tag in live.get(owner, ())):
            continue  # a live claim's (or an untagged upload beside a live writer, or cannot tell)
        with contextlib.suppress(FileNotFoundError):
            try:
                store.abort_upload(key, upload_id)
                removed.append(f"{store.url}/{key} (incomplete upload)")
            except OSError as exc:
                log.warning("could not abort the incomplete upload of %s/%s (%s)", store.url, key, exc)
    return removed
