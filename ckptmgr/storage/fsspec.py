"""Any fsspec filesystem: files written in place, ``manifest.json`` written last as the commit.

Object stores have no atomic directory rename, so a step's files go straight to
``<root>/step_<n>/`` and the step exists only once its manifest does. A step prefix without
a manifest is an interrupted save (or delete) and is removed at the next start.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import secrets
from concurrent.futures import Executor
from typing import Any

import numpy as np

from .._threads import DaemonPool
from ..errors import CheckpointCorruptError, StepExistsError, StepNotFoundError, StorageError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import MANIFEST_NAME
from ..format.naming import PROTECT_NAME, ROOT_ID_NAME, is_our_file, parse_step_name, step_name

__all__ = ["FsspecTarget"]

log = logging.getLogger("ckptmgr")


class _FsspecStepWriter:
    location = ""  # files are written in place; the manifest alone makes them a step

    def __init__(self, target: FsspecTarget, step: int, prefix: str = "") -> None:
        self.target = target
        self.step = step
        self.prefix = prefix
        self.dir = target._step_dir(step)
        fs = target.fs
        if fs.exists(posixpath.join(self.dir, MANIFEST_NAME)):
            raise StepExistsError(f"step {step} is already committed at {target.url}")
        if fs.exists(self.dir):  # leftovers of an interrupted save of this step (this rank's)
            target._remove_ours(self.dir, prefix)
        fs.makedirs(self.dir, exist_ok=True)

    def adopt(self, parts: list[tuple[str, list[str]]]) -> None:
        pass  # every rank's files are in place already

    def write_files(self, files: list[tuple[str, np.ndarray[Any, Any]]], chunk_size: int, *,
                    checksum: bool = True) -> list[tuple[str, ...]]:
        return list(self.target.io_pool.map(lambda f: self._write_file(f[0], f[1], chunk_size, checksum), files))

    def _write_file(self, name: str, data: np.ndarray[Any, Any], chunk_size: int,
                    checksum: bool = True) -> tuple[str, ...]:
        crcs = []
        with self.target.fs.open(posixpath.join(self.dir, name), "wb") as f:
            for b, e in chunk_ranges(data.size, chunk_size):
                chunk = data[b:e]
                f.write(memoryview(chunk))  # type: ignore[arg-type]
                if checksum:
                    crcs.append(crc32c_hex(chunk))
        return tuple(crcs)

    def commit(self, manifest: bytes) -> None:
        path = posixpath.join(self.dir, MANIFEST_NAME)
        if self.target.fs.exists(path):
            raise StepExistsError(f"step {self.step} is already committed at {self.target.url}")
        self.target.fs.pipe_file(path, manifest)

    def abort(self) -> None:
        try:
            self.target._remove_ours(self.dir, self.prefix)
        except Exception:
            pass  # garbage without a manifest; removed at the next start


class FsspecTarget:
    """A checkpoint root on any fsspec filesystem (object stores, memory, ...)."""

    def __init__(self, fs: Any, path: str, *, url: str, io_threads: int = 8) -> None:
        self.fs = fs
        self.path = path.rstrip("/")
        self.url = url
        try:
            fs.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot use checkpoint root {url!r}: {exc}") from exc
        self.io_pool: Executor = DaemonPool(io_threads, thread_name_prefix="ckptmgr-io")

    def _step_dir(self, step: int) -> str:
        return posixpath.join(self.path, step_name(step))

    def _entries(self) -> dict[int, bool]:
        """step -> has a manifest, for every step-named entry, listed without caches."""
        self.fs.invalidate_cache(self.path)
        try:
            found = self.fs.find(self.path, maxdepth=2, withdirs=True)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise StorageError(f"cannot list checkpoint root {self.url!r}: {exc}") from exc
        out: dict[int, bool] = {}
        prefix = self.path + "/"
        for p in found:
            rel = p.removeprefix(prefix).split("/")
            step = parse_step_name(rel[0])
            if step is not None:
                out[step] = out.get(step, False) or rel[1:] == [MANIFEST_NAME]
        return out

    def list_steps(self) -> list[int]:
        return sorted(s for s, committed in self._entries().items() if committed)

    def cleanup(self) -> list[str]:
        removed = []
        for step, committed in self._entries().items():
            if not committed:  # an interrupted save or delete of ours
                d = self._step_dir(step)
                if self._remove_ours(d):
                    removed.append(d)
        return removed

    def root_id(self, create: bool = False) -> str | None:
        """The root's identity (written once, never overwritten); None when it has none."""
        path = posixpath.join(self.path, ROOT_ID_NAME)
        try:
            data: bytes = self.fs.cat_file(path)
            return data.decode("ascii", "replace").strip() or None
        except FileNotFoundError:
            if not create:
                return None
        new = secrets.token_hex(16)
        self.fs.pipe_file(path, new.encode("ascii") + b"\n")
        return new

    def begin(self, step: int, prefix: str = "") -> _FsspecStepWriter:
        return _FsspecStepWriter(self, step, prefix)

    def read_manifest(self, step: int) -> bytes:
        try:
            data: bytes = self.fs.cat_file(posixpath.join(self._step_dir(step), MANIFEST_NAME))
        except FileNotFoundError:
            raise StepNotFoundError(f"step {step} is not committed under {self.url}") from None
        return data

    def file_size(self, step: int, name: str) -> int:
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
        d = self._step_dir(step)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(posixpath.join(d, MANIFEST_NAME))  # first: from here on the step is gone
        self._remove_ours(d)

    def _remove_ours(self, d: str, prefix: str = "") -> bool:
        """Remove our objects under step prefix ``d`` (those starting with ``prefix``); True
        when nothing else is left."""
        try:
            names = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(d, detail=False)]
        except FileNotFoundError:
            return True
        if prefix:
            names = [n for n in names if n.startswith(prefix)]
        ours = [posixpath.join(d, n) for n in names if is_our_file(n)]
        if ours:
            self.fs.rm(ours)
        others = [n for n in names if not is_our_file(n)]
        if others:
            log.warning("left %s in place: it holds objects ckptmgr did not write (%s)", d, sorted(others))
            return False
        with contextlib.suppress(FileNotFoundError, OSError):
            self.fs.rmdir(d)
        return True

    def set_protected(self, step: int, protected: bool) -> None:
        d = self._step_dir(step)
        if not self.fs.exists(posixpath.join(d, MANIFEST_NAME)):
            raise StepNotFoundError(f"step {step} is not committed under {self.url}")
        marker = posixpath.join(d, PROTECT_NAME)
        if protected:
            self.fs.pipe_file(marker, b"")
        else:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(marker)

    def is_protected(self, step: int) -> bool:
        self.fs.invalidate_cache(self._step_dir(step))
        return bool(self.fs.exists(posixpath.join(self._step_dir(step), PROTECT_NAME)))

    def close(self) -> None:
        self.io_pool.shutdown(wait=True)
