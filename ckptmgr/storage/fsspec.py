"""Any fsspec filesystem: files written in place, ``manifest.json`` written last as the commit.

Object stores have no atomic directory rename, so a step's files go straight to
``<root>/step_<n>/`` and the step exists only once its manifest does; the
:class:`~ckptmgr.storage.commit.manifest_last.ManifestLastCommit` strategy claims the step with a lease,
checks the files and writes the manifest once. A step prefix without a manifest is an
interrupted save (or delete), removed at a later start once its writer is provably gone.

Data objects carry the writer's claim token in their names (``data-00000.<token>.safetensors``),
so one writer never writes another's keys. On a generic fsspec filesystem "write only if
absent" is an existence check followed by the write, and the claim's conditions are reads
before writes (fsspec has no conditional write: :attr:`FsspecTarget.conditional` is False);
the S3 target uses the store's own (``If-None-Match``, ``If-Match``).
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from datetime import datetime
from typing import Any

import numpy as np

from .._threads import DaemonPool
from ..errors import CheckpointCorruptError, ConfigError, StepNotFoundError, StorageError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import MANIFEST_NAME, read_manifest_bytes
from ..format.naming import (
    MAX_STEP,
    PROTECT_NAME,
    ROOT_ID_NAME,
    attempt_tag,
    is_lease_name,
    is_our_file,
    new_root_id,
    parse_root_id,
    step_name,
)
from .commit.manifest_last import ManifestLastCommit, manifest_names, remove_object_leftovers
from .lease import LEASE_STALE_S, LeaseKeeper
from .objects import ObjectInfo, step_objects

__all__ = ["FsspecTarget", "check_step"]

log = logging.getLogger("ckptmgr")


def check_step(step: object) -> int:
    """``step`` as a valid step number. Raises ConfigError."""
    if type(step) is not int or not 0 <= step < MAX_STEP:
        raise ConfigError(f"step must be an int in [0, {MAX_STEP}), got {step!r}")
    return step


class _FsspecStepWriter:
    """Writes a step's files with ``fs.open``; the strategy commits or aborts."""

    progress: Callable[[int], None] | None = None  # (see StepWriter; never called: file objects buffer)

    def __init__(self, target: FsspecTarget, commit: ManifestLastCommit) -> None:
        self.target = target
        self.strategy = commit
        self.step = commit.step
        self.dir = target._step_dir(commit.step)
        self.location = commit.location

    def adopt(self, parts: list[tuple[str, list[str]]]) -> None:
        self.strategy.adopt(parts)  # every rank's files are in place already, under its claim's names

    def write_files(self, files: list[tuple[str, np.ndarray[Any, Any]]], chunk_size: int, *,
                    checksum: bool = True) -> list[tuple[str, ...]]:
        return list(self.target.io_pool.map(lambda f: self._write_file(f[0], f[1], chunk_size, checksum), files))

    def _write_file(self, name: str, data: np.ndarray[Any, Any], chunk_size: int,
                    checksum: bool = True) -> tuple[str, ...]:
        crcs = []
        name = self.strategy.object_name(name)
        with self.target.fs.open(posixpath.join(self.dir, name), "wb") as f:
            for b, e in chunk_ranges(data.size, chunk_size):
                chunk = data[b:e]
                f.write(memoryview(chunk))  # type: ignore[arg-type]
                if checksum:
                    crcs.append(crc32c_hex(chunk))
        self.strategy.wrote(name, data.size)
        return tuple(crcs)

    def commit(self, manifest: bytes) -> None:
        self.strategy.commit(manifest)

    def abort(self) -> None:
        self.strategy.abort()

    def close(self) -> None:
        self.strategy.close()


def _mtime(info: dict[str, Any]) -> float | None:
    for k in ("LastModified", "mtime", "created", "updated"):
        v = info.get(k)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


class FsspecTarget:
    """A checkpoint root on any fsspec filesystem (object stores, memory, ...).

    Args:
        read_only: never create, write or delete anything (not even the root or bucket);
            write operations raise ConfigError.
    """

    lease_stale_s = LEASE_STALE_S  # a writer's heartbeat older than this proves it gone

    def __init__(self, fs: Any, path: str, *, url: str, io_threads: int = 8, read_only: bool = False) -> None:
        self.fs = fs
        self.path = path.rstrip("/")
        self.url = url
        self.read_only = read_only
        if not read_only:
            self._make_root()
        self.io_pool: Executor = DaemonPool(io_threads, thread_name_prefix="ckptmgr-io")
        self.keeper = LeaseKeeper(url, self.lease_stale_s / 5)
        self._mu = threading.Lock()  # guards _root_id and _listed
        self._root_id: str | None = None
        # (step, name) -> size of each object of a committed step, from the last listing of the steps
        self._listed: dict[tuple[int, str], int] = {}

    @property
    def conditional(self) -> bool:
        """False: fsspec has no conditional writes, so the claim's conditions are reads before
        writes (see :mod:`ckptmgr.storage.commit.manifest_last`)."""
        return False

    def _make_root(self) -> None:
        try:
            self.fs.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot use checkpoint root {self.url!r}: {exc}") from exc

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ConfigError(f"cannot {what}: the checkpoint root {self.url} is open read-only")

    def _step_dir(self, step: int) -> str:
        return posixpath.join(self.path, step_name(step))

    # ------------------------------------------------------ the object store

    def _full(self, rel: str) -> str:
        return posixpath.join(self.path, rel)

    def listing(self, prefix: str) -> dict[str, ObjectInfo]:
        head = prefix.rpartition("/")[0]
        search = self._full(head) if head else self.path
        self.fs.invalidate_cache(self.path)
        try:
            found = self.fs.find(search, maxdepth=None if head else 2, withdirs=True, detail=True)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise StorageError(f"cannot list checkpoint root {self.url!r}: {exc}") from exc
        out = {}
        base = self.path + "/"
        for p, info in found.items():
            rel = p.rstrip("/").removeprefix(base)
            if p.rstrip("/") == self.path or rel == p.rstrip("/"):
                continue
            if info.get("type") == "directory":
                rel += "/"
            if rel.startswith(prefix):
                out[rel] = ObjectInfo(int(info.get("size") or 0), info.get("ETag"), _mtime(info))
        return out

    def get(self, rel: str) -> bytes:
        data: bytes = self.fs.cat_file(self._full(rel))
        return data

    def get_manifest(self, rel: str) -> bytes:
        """The manifest ``rel``, refused by its size before it is read, and read bounded
        (:func:`~ckptmgr.format.manifest.read_manifest_bytes`). Raises FileNotFoundError."""
        full = self._full(rel)
        with self.fs.open(full, "rb") as f:
            size = getattr(f, "size", None)  # (buffered remote files know it; a local opener does not)
            return read_manifest_bytes(self.fs.size(full) if size is None else size, f.read, f"{self.url}/{rel}")

    def exists(self, rel: str) -> bool:
        self.fs.invalidate_cache(posixpath.dirname(self._full(rel)))
        return bool(self.fs.exists(self._full(rel)))

    def put(self, rel: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str | None:
        if if_match is not None:
            raise ValueError(f"{self.url}: no conditional writes on this filesystem")
        if if_absent and self.exists(rel):
            raise FileExistsError(f"{self.url}/{rel} exists")
        self.fs.pipe_file(self._full(rel), data)
        return None

    def remove(self, rels: list[str]) -> None:
        for rel in rels:
            if rel.endswith("/"):  # a directory: only if empty, where the filesystem has them
                with contextlib.suppress(OSError):
                    self.fs.rmdir(self._full(rel).rstrip("/"))
                continue
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._full(rel))

    def remove_if(self, rel: str, etag: str) -> bool:
        raise ValueError(f"{self.url}: no conditional deletes on this filesystem")

    def uploads(self, prefix: str) -> list[tuple[str, str]]:
        return []

    def abort_upload(self, rel: str, upload_id: str) -> None:
        """Nothing to abort: a generic fsspec filesystem has no multipart uploads (``uploads()``
        lists none)."""

    # ----------------------------------------------------------- the target

    def list_steps(self) -> list[int]:
        committed = {s: objs for s, objs in step_objects(self.listing("step_")).items() if MANIFEST_NAME in objs}
        # what file_size answers without asking the store: the sizes of data objects whose names
        # carry their writer's claim token (a name without one may be written again, with another size)
        listed = {(s, name): info.size for s, objs in committed.items() for name, info in objs.items()
                  if info.size > 0 and attempt_tag(name) is not None}
        with self._mu:
            self._listed = listed
        return sorted(committed)

    def cleanup(self) -> list[str]:
        if self.read_only:
            return []
        return remove_object_leftovers(self, self.lease_stale_s)

    def root_id(self, create: bool = False) -> str | None:
        """The root's identity (written once, with the first commit); None when it has none."""
        with self._mu:
            if self._root_id is not None:
                return self._root_id
        try:
            found = parse_root_id(self.get(ROOT_ID_NAME))
        except FileNotFoundError:
            found = None
        if found is None and create and not self.read_only:
            new = new_root_id()
            try:
                self.put(ROOT_ID_NAME, new.encode("ascii") + b"\n", if_absent=True)
                found = new
            except FileExistsError:  # written by another process meanwhile
                found = parse_root_id(self.get(ROOT_ID_NAME))
        with self._mu:
            self._root_id = found
        return found

    def _strategy(self, step: int, prefix: str) -> ManifestLastCommit:
        check_step(step)
        self._check_writable(f"save step {step}")
        return ManifestLastCommit(self, step, prefix, self.keeper, self.lease_stale_s,
                                  on_commit=lambda: self.root_id(create=True))

    def begin(self, step: int, prefix: str = "") -> _FsspecStepWriter:
        return _FsspecStepWriter(self, self._strategy(step, prefix))

    def read_manifest(self, step: int) -> bytes:
        try:
            return self.get_manifest(f"{step_name(check_step(step))}/{MANIFEST_NAME}")
        except FileNotFoundError:
            raise StepNotFoundError(f"step {step} is not committed under {self.url}") from None

    def file_size(self, step: int, name: str, *, fresh: bool = False) -> int:
        """The size of ``name`` in ``step``: unless ``fresh``, as the last listing of the steps
        had it where it listed the object and its name carries its writer's claim token (a
        committed step's objects are never rewritten, and a step saved again names new
        objects), else asked of the store. Either way the size is checked against the manifest
        before anything is read, and a read past the object's end fails; a restore saves a
        request per file before its first byte."""
        with self._mu:
            size = None if fresh else self._listed.get((step, name))
        return self._stat_size(step, name) if size is None else size

    def _stat_size(self, step: int, name: str) -> int:
        return int(self.fs.size(posixpath.join(self._step_dir(step), name)))

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
        path = posixpath.join(self._step_dir(step), name)
        size = sum(a.size for a in out)
        data = np.frombuffer(self.fs.cat_file(path, start=offset, end=offset + size), dtype=np.uint8)
        if data.size != size:
            raise CheckpointCorruptError(f"{path} ended early, at byte {offset + data.size}")
        pos = 0
        for a in out:
            a[:] = data[pos:pos + a.size]
            pos += a.size

    def delete(self, step: int) -> None:
        self._check_writable(f"delete step {step}")
        d = step_name(check_step(step))
        named = manifest_names(self, f"{d}/{MANIFEST_NAME}")
        self.remove([f"{d}/{MANIFEST_NAME}"])  # first: from here on the step is gone
        objs = step_objects(self.listing(d + "/")).get(step, {})
        # A writer may claim the step again as soon as its manifest is gone: its lease and the
        # objects of its claim (named with its token, in no manifest deleted here) stay.
        writing = any(is_lease_name(n) for n in objs)
        doomed = sorted(n for n in objs if is_our_file(n) and not is_lease_name(n)
                        and (attempt_tag(n) is None or not writing or (named is not None and n in named)))
        self.remove([f"{d}/{n}" for n in doomed])
        foreign = sorted(n for n in objs if n and not is_our_file(n))
        if foreign:
            log.warning("left %s/%s in place: it holds objects ckptmgr did not write (%s)", self.url, d, foreign)
        elif not writing:
            self.remove([f"{d}/"])  # the directory marker, where the store keeps one

    def set_protected(self, step: int, protected: bool) -> None:
        self._check_writable(f"change the protection of step {step}")
        d = step_name(check_step(step))
        if not self.exists(f"{d}/{MANIFEST_NAME}"):
            raise StepNotFoundError(f"step {step} is not committed under {self.url}")
        if protected:
            self.put(f"{d}/{PROTECT_NAME}", b"")
        else:
            self.remove([f"{d}/{PROTECT_NAME}"])

    def is_protected(self, step: int) -> bool:
        return self.exists(f"{step_name(check_step(step))}/{PROTECT_NAME}")

    def close(self) -> None:
        self.keeper.close()
        self.io_pool.shutdown(wait=True)
