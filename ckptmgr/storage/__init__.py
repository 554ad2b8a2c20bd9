"""Storage targets: where checkpoints are written, committed, listed, read and deleted.

``open_target(root, storage_options)`` picks the backend: a local or NFS path (POSIX,
rename commit) or any other fsspec URL (manifest-last commit).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import CkptError, ConfigError, StorageError
from ..options import S3Options
from .base import StepWriter, Target

__all__ = ["StepWriter", "Target", "open_target"]

log = logging.getLogger("ckptmgr")


def open_target(root: str, storage_options: dict[str, Any] | None = None, *,
                io_threads: int = 8, direct_io: bool = True, s3_options: S3Options | None = None,
                read_only: bool | None = False) -> Target:
    """Resolve ``root`` (a path or fsspec URL) to a storage target.

    Args:
        read_only: True opens the root for reading only: nothing is created (not the root,
            not a bucket), written, cleaned up or deleted, and write operations raise
            ConfigError. None decides: a local root that exists but that this process cannot
            write is opened read-only (logged); other roots are opened for writing (an
            object store cannot tell write access without writing: pass True for read-only
            credentials). False (the default) opens for writing.

    Raises:
        ConfigError: unknown protocol or bad storage options.
        StorageError: the root exists but cannot be used.
        StepNotFoundError: a read-only local root that does not exist.
    """
    if not isinstance(root, str) or not root:
        raise ConfigError(f"root must be a non-empty path or URL string, got {root!r}")
    if read_only not in (None, True, False):
        raise ConfigError(f"read_only must be None, True or False, got {read_only!r}")
    # A plain path (not "file:/x") needs no fsspec: a fresh process restoring from /dev/shm pays for every import
    if "://" not in root and "::" not in root and ":" not in root.split("/", 1)[0]:
        if s3_options is not None:
            raise ConfigError(f"s3_options were given for {root!r}, which is not an s3:// root")
        return _local(os.path.abspath(os.path.expanduser(root)), root, storage_options,
                      io_threads, direct_io, read_only)
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    is_s3 = root.startswith(("s3://", "s3a://"))
    if s3_options is not None and not is_s3:
        raise ConfigError(f"s3_options were given for {root!r}, which is not an s3:// root")
    if is_s3:
        try:
            import s3fs  # noqa: F401
        except ImportError:
            raise ConfigError(f"{root!r} needs s3fs: pip install 'ckptmgr[s3]'") from None
        from .s3 import s3_storage_options

        storage_options = s3_storage_options(storage_options, s3_options or S3Options())
    try:
        fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"cannot open checkpoint root {root!r}: {exc}") from exc
    except TypeError as exc:
        raise ConfigError(f"bad storage_options for {root!r}: {exc}") from exc
    except OSError as exc:
        raise StorageError(f"cannot open checkpoint root {root!r}: {exc}") from exc
    if isinstance(fs, LocalFileSystem):
        return _local(path, root, storage_options, io_threads, direct_io, read_only)
    from .fsspec import FsspecTarget
    from .s3 import S3Target, check_bucket_name

    if is_s3:
        check_bucket_name(path, root)
    try:
        if is_s3:
            return S3Target(fs, path, url=root, io_threads=io_threads, opts=s3_options or S3Options(),
                            read_only=bool(read_only))
        return FsspecTarget(fs, path, url=root, io_threads=io_threads, read_only=bool(read_only))
    except CkptError:
        raise
    except Exception as exc:  # the storage's client raises its own types (botocore, aiohttp, ...)
        raise StorageError(f"cannot open checkpoint root {root!r}: {type(exc).__name__}: {exc}") from exc


def _local(path: str, root: str, storage_options: dict[str, Any] | None, io_threads: int, direct_io: bool,
           read_only: bool | None) -> Target:
    if storage_options:
        raise ConfigError(f"storage_options {sorted(storage_options)} have no meaning for the local root {root!r}")
    from .local import LocalTarget

    if read_only is None:
        read_only = os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK)
        if read_only:
            log.info("opening %s read-only: this process cannot write to it", os.path.abspath(path))
    return LocalTarget(path, io_threads=io_threads, direct_io=direct_io, read_only=read_only)
