"""Object stores as the commit and the leftover sweep see them: the :class:`ObjectStore`
protocol (the S3 and fsspec targets implement it), a root's listing grouped by step, and the
conditional delete. The commit itself is :mod:`ckptmgr.storage.commit.manifest_last`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..format.naming import (
    parse_step_name,
)

__all__ = ["ConditionFailed", "ObjectInfo", "ObjectStore", "remove_if", "step_objects"]

log = logging.getLogger("ckptmgr")
_REPLACE_TRIES = 3


class ConditionFailed(OSError):
    """A conditional write or delete (``If-Match``) found the object changed or gone."""


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    etag: str | None = None  # as the store reports it (quotes stripped); None where it has none
    mtime: float | None = None  # the store's last-modified time, seconds since the epoch


class ObjectStore(Protocol):
    """The few operations the commit needs, on keys relative to the root (``step_.../name``)."""

    url: str

    @property
    def conditional(self) -> bool:
        """Whether the store honours ``If-Match`` on writes and deletes (else each condition
        is a read followed by the write)."""

    def listing(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every key under the root starting with ``prefix``, fresh (no cache), every page;
        directory markers appear as keys ending in ``/``."""

    def get(self, rel: str) -> bytes:
        """The object's bytes. Raises FileNotFoundError."""

    def get_manifest(self, rel: str) -> bytes:
        """A manifest's bytes, refused by its reported size before the body is read and never
        read past the limit (:func:`~ckptmgr.format.manifest.read_manifest_bytes`). Raises
        FileNotFoundError, CheckpointCorruptError (too large)."""

    def exists(self, rel: str) -> bool:
        """Whether the object exists (one HEAD)."""

    def put(self, rel: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str | None:
        """Write the object, returning its ETag where the store gives one. With ``if_absent``
        it is written only if no object has the key (raises FileExistsError otherwise); with
        ``if_match`` (only where :attr:`conditional`) only if its ETag is that one (raises
        ConditionFailed otherwise, or when it is gone)."""

    def remove(self, rels: list[str]) -> None:
        """Delete the objects (a key ending in ``/``: the directory marker, or the empty
        directory, where the store keeps one); missing ones are no error."""

    def remove_if(self, rel: str, etag: str) -> bool:
        """Delete the object only if its ETag is ``etag`` (only where :attr:`conditional`);
        False when it differs or the object is gone."""

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


def remove_if(store: ObjectStore, rel: str, etag: str | None, still: Callable[[bytes], bool]) -> bool:
    """Delete ``rel`` only if it is still what the caller saw: its ETag is ``etag`` (one
    conditional DELETE, where the store honours ``If-Match``), else its bytes satisfy
    ``still`` (a read, then the delete: a window of one round trip). Returns whether it was
    deleted (False: changed, or gone)."""
    if etag and store.conditional:
        return store.remove_if(rel, etag)
    try:
        data = store.get(rel)
    except FileNotFoundError:
        return False
    if not still(data):
        return False
    store.remove([rel])
    return True
