"""What every command shares: the opened root, step resolution, output mode, exit codes.

Commands that only read (``ls``, ``inspect``, ``verify``, ``export``, ``prune --dry-run``)
open the root read-only, so storage creates, writes and cleans up nothing there, and they
work on roots this process cannot write to. A root that does not exist (a missing directory,
a missing bucket, an S3 prefix with nothing under it) is reported with exit code 3.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    CheckpointCorruptError,
    CkptError,
    ConfigError,
    StepNotFoundError,
    StorageError,
)
from ..format.manifest import Manifest
from ..options import S3Options
from ..restore.verify import file_url
from ..storage import Target, open_target
from ._exit import EXIT, CorruptFound, exit_code

__all__ = ["EXIT", "CorruptFound", "Ctx", "damaged", "exit_code", "manifests", "no_checkpoint", "peer_steps",
           "require_root", "tier_steps"]

def _storage_options(text: str | None) -> dict[str, Any] | None:
    text = text if text is not None else os.environ.get("CKPTMGR_STORAGE_OPTIONS")
    if not text:
        return None
    try:
        opts = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--storage-options is not valid JSON: {exc}") from exc
    if not isinstance(opts, dict):
        raise ConfigError("--storage-options must be a JSON object, e.g. "
                          '\'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'')
    return opts


def require_root(root: str, storage_options: dict[str, Any] | None) -> None:
    """Raise StepNotFoundError unless the object-store root ``root`` exists: its bucket and
    at least one object under its prefix (object stores have no empty directories). Looks
    only, creates nothing.

    Raises:
        StepNotFoundError: no such root.
        ConfigError: the URL or the storage options are unusable.
        StorageError: the storage cannot be asked.
    """
    if not isinstance(root, str) or not root:
        raise ConfigError(f"ROOT must be a non-empty path or URL, got {root!r}")
    import fsspec

    is_s3 = root.startswith(("s3://", "s3a://"))
    so = dict(storage_options or {})
    if is_s3:
        try:
            import s3fs  # noqa: F401
        except ImportError:
            raise ConfigError(f"{root!r} needs s3fs: pip install 'ckptmgr[s3]'") from None
        from ..storage.s3 import s3_storage_options

        so = s3_storage_options(so, S3Options())
    try:
        fs, path = fsspec.core.url_to_fs(root, **so)
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"cannot open checkpoint root {root!r}: {exc}") from exc
    except TypeError as exc:
        raise ConfigError(f"bad storage options for {root!r}: {exc}") from exc
    path = path.rstrip("/")
    fs.invalidate_cache()
    bucket = path.partition("/")[0]
    for what in ([bucket] if is_s3 and bucket != path else []) + [path]:
        try:  # info(), not exists(): exists() answers False when the storage cannot be reached
            fs.info(what)
        except FileNotFoundError:
            if what == bucket and is_s3:
                raise StepNotFoundError(f"no checkpoint root at {root!r}: bucket {bucket!r} does not exist "
                                        "(or these credentials cannot see it)") from None
            raise StepNotFoundError(f"no checkpoint root at {root!r} (nothing under that path)") from None
        except Exception as exc:  # the storage's client raises its own types (botocore, aiohttp, ...)
            raise StorageError(f"cannot reach checkpoint root {root!r}: {type(exc).__name__}: {exc}") from exc


@dataclass
class Ctx:
    """One command's view of its checkpoint root."""

    args: argparse.Namespace
    _target: Target | None = field(default=None, repr=False)

    @property
    def json(self) -> bool:
        return bool(getattr(self.args, "json", False))

    @property
    def show_progress(self) -> bool:
        return not (getattr(self.args, "quiet", False) or self.json)

    def storage_options(self) -> dict[str, Any] | None:
        return _storage_options(getattr(self.args, "storage_options", None))

    def target(self, root: str, *, read_only: bool = True) -> Target:
        """Open an existing ``root``, for reading only unless ``read_only=False``; nothing is
        created (not the root, not a bucket).

        A read-only target refuses a missing local root itself; an object store's bucket and
        prefix are looked up first (a read-only object-store target does not look), and so
        is a local root opened for writing (opening it would create it).

        Raises:
            StepNotFoundError: no such root (exit code 3).
        """
        so = self.storage_options()
        if "://" in root and not root.startswith("file://"):
            require_root(root, so)
        elif not read_only and not os.path.isdir(root.removeprefix("file://")):
            raise StepNotFoundError(f"no checkpoint root at {root!r} (not a directory)")
        self._target = open_target(root, so, read_only=read_only)
        return self._target

    def step(self, target: Target, text: str | None) -> int:
        """``None``/``'latest'`` -> the newest committed step; else the step number, which
        must be committed."""
        steps = target.list_steps()
        if text is None or text == "latest":
            if not steps:
                raise no_checkpoint(target, self.args.root)
            return steps[-1]
        try:
            step = int(text)
        except ValueError:
            raise ConfigError(f"STEP must be a step number or 'latest', got {text!r}") from None
        if step not in steps:
            near = ", ".join(map(str, steps[-5:])) or "none"
            raise StepNotFoundError(f"step {step} is not a committed checkpoint under {target.url} "
                                    f"(newest: {near})")
        return step

    def manifest(self, target: Target, step: int) -> Manifest:
        """The validated manifest of ``step``.

        Raises:
            CheckpointCorruptError: it is damaged, or belongs to another step.
            FormatVersionError: written by a newer format.
            StepNotFoundError: the step is gone.
        """
        where = file_url(target, step, "manifest.json")
        data = target.read_manifest(step)
        try:
            m = Manifest.from_bytes(data, where=where)
        except CkptError:
            raise
        except Exception as exc:  # untrusted bytes: whatever they break, the step is damaged
            raise damaged(target, step, exc) from exc
        if m.step != step:
            raise CheckpointCorruptError(f"{where}: the manifest is for step {m.step}")
        return m

    def close(self) -> None:
        if self._target is not None:
            self._target.close()
            self._target = None


def no_checkpoint(target: Target, root: str) -> StepNotFoundError:
    """The error for a root that holds no committed checkpoint (exit code 3), naming the
    checkpoint roots right under it when ``root`` is their parent directory."""
    local = root.removeprefix("file://")
    inner: list[str] = []
    if "://" not in local and os.path.isdir(local):
        for name in sorted(os.listdir(local))[:1000]:
            sub = os.path.join(local, name)
            try:
                if os.path.isdir(sub) and not os.path.islink(sub) and any(
                        n.startswith("step_") for n in os.listdir(sub)):
                    inner.append(name)
            except OSError:
                continue
    hint = f" (it holds checkpoint roots: {', '.join(inner[:10])}; name one of them)" if inner else ""
    return StepNotFoundError(f"no committed checkpoint under {target.url}{hint}")


def _has_tier(local_dir: str, root_url: str) -> bool:
    """Whether this user's local tier directory of ``root_url`` exists under ``local_dir``.

    Its name is :func:`ckptmgr.storage.tier.tier_dir`'s (``tests/test_cli_promises.py`` pins
    the two equal): the tier's module, made for saves, imports torch, and is imported only
    where there is a tier to read."""
    key = hashlib.sha256(root_url.encode("utf-8")).hexdigest()[:16]
    return os.path.lexists(os.path.join(local_dir, f"ckptmgr-{os.getuid()}-{key}"))


def tier_steps(local_dir: str, root_url: str, *, written_out: bool = True) -> dict[int, Manifest]:
    """The steps committed in this user's local tier of ``root_url`` on this node
    (:func:`ckptmgr.storage.tier.read_tier`; empty without ``local_dir`` or a tier)."""
    if not local_dir or not _has_tier(local_dir, root_url):
        return {}
    from ..storage.tier import read_tier

    return read_tier(local_dir, root_url, written_out=written_out)


def peer_steps(local_dir: str, root_url: str) -> dict[int, dict[int, int]]:
    """Step -> rank -> world size of the shards this node's peer area of ``root_url`` holds
    (:func:`ckptmgr.storage.peer_tier.read_peer`; it lies inside the local tier directory)."""
    if not local_dir or not _has_tier(local_dir, root_url):
        return {}
    from ..storage.peer_tier import read_peer

    return read_peer(local_dir, root_url)


def damaged(target: Target, step: int, exc: Exception) -> CheckpointCorruptError:
    """A failure that reading a step's untrusted contents raised, as that step's damage."""
    err = CheckpointCorruptError(f"{file_url(target, step, 'manifest.json')}: cannot be read "
                                 f"({type(exc).__name__}: {exc})")
    err.__cause__ = exc
    return err


def manifests(ctx: Ctx, target: Target, steps: list[int]) -> dict[int, Manifest | CkptError]:
    """Each step's manifest, or the error that reading it raised (so that one damaged step
    does not hide the others), read in parallel (one request each on object stores).

    Raises:
        StorageError: the storage failed (not a problem of one step).
    """
    def one(step: int) -> Manifest | CkptError:
        try:
            return ctx.manifest(target, step)
        except StorageError:
            raise
        except CkptError as exc:
            return exc
        except OSError as exc:  # this step's files only (permissions, a vanished file...)
            err = StorageError(f"{file_url(target, step, 'manifest.json')}: cannot be read: {exc}")
            err.__cause__ = exc
            return err

    with ThreadPoolExecutor(8, thread_name_prefix="ckptmgr-cli") as pool:
        return dict(zip(steps, pool.map(one, steps), strict=True))
