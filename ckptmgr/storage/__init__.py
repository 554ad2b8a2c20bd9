"""Storage targets: where checkpoints are written, committed, listed, read and deleted.

``open_target(root, storage_options)`` picks the backend: a local or NFS path (POSIX,
rename commit) or any other fsspec URL (manifest-last commit).
"""

from __future__ import annotations

from typing import Any

from ..errors import CkptError, ConfigError, StorageError
from ..options import S3Options
from .base import StepWriter, Target

__all__ = ["StepWriter", "Target", "open_target"]


def open_target(root: str, storage_options: dict[str, Any] | None = None, *,
                io_threads: int = 8, direct_io: bool = True, s3_options: S3Options | None = None) -> Target:
    """Resolve ``root`` (a path or fsspec URL) to a storage target.

    Raises:
        ConfigError: unknown protocol or bad storage options.
        StorageError: the root exists but cannot be used.
    """
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(root, str) or not root:
        raise ConfigError(f"root must be a non-empty path or URL string, got {root!r}")
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
        if storage_options:
            raise ConfigError(f"storage_options {sorted(storage_options)} have no meaning for the local root {root!r}")
        from .local import LocalTarget

        return LocalTarget(path, io_threads=io_threads, direct_io=direct_io)
    from .fsspec import FsspecTarget
    from .s3 import S3Target, check_bucket_name

    if is_s3:
        check_bucket_name(path, root)
    try:
        if is_s3:
            return S3Target(fs, path, url=root, io_threads=io_threads, opts=s3_options or S3Options())
        return FsspecTarget(fs, path, url=root, io_threads=io_threads)
    except CkptError:
        raise
    except Exception as exc:  # the storage's client raises its own types (botocore, aiohttp, ...)
        raise StorageError(f"cannot open checkpoint root {root!r}: {type(exc).__name__}: {exc}") from exc
