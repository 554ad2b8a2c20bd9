"""ckptmgr: checkpoint PyTorch training without stalling it.

>>> from ckptmgr import CheckpointManager

The errors are imported with the package; every other public name is imported the first
time it is used (``from ckptmgr import CheckpointManager``, ``ckptmgr.KeepLatest``), so that
importing ``ckptmgr`` (and running ``ckptmgr --version``) does not import torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("ckptmgr")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

from .errors import (
    CapacityError,
    CheckpointCorruptError,
    CkptError,
    CkptTimeoutError,
    ConfigError,
    FormatVersionError,
    SaveError,
    SaveSkippedError,
    StateMismatchError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
    UnsupportedValueError,
)

if TYPE_CHECKING:  # the names below are imported on first use (__getattr__)
    from .distributed.replicate import PeerOptions
    from .format.tree import PerRank
    from .handle import SaveHandle, SaveInfo
    from .manager import CheckpointManager
    from .options import S3Options, Schedule, StagingOptions, WriteOptions
    from .restore.loaders import load_file
    from .restore.pinned import PinnedWeights, pin_file
    from .retention import (
        AnyOf,
        KeepAll,
        KeepBest,
        KeepEvery,
        KeepEverySeconds,
        KeepLatest,
        RetentionPolicy,
        StepInfo,
    )

_LAZY = {
    **dict.fromkeys(["PeerOptions"], ".distributed.replicate"),
    **dict.fromkeys(["PerRank"], ".format.tree"),
    **dict.fromkeys(["SaveHandle", "SaveInfo"], ".handle"),
    **dict.fromkeys(["CheckpointManager"], ".manager"),
    **dict.fromkeys(["S3Options", "Schedule", "StagingOptions", "WriteOptions"], ".options"),
    **dict.fromkeys(["load_file"], ".restore.loaders"),
    **dict.fromkeys(["PinnedWeights", "pin_file"], ".restore.pinned"),
    **dict.fromkeys(["AnyOf", "KeepAll", "KeepBest", "KeepEvery", "KeepEverySeconds", "KeepLatest",
                     "RetentionPolicy", "StepInfo"], ".retention"),
}


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562); it is then a plain module attribute."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AnyOf",
    "CapacityError",
    "CheckpointCorruptError",
    "CheckpointManager",
    "CkptError",
    "CkptTimeoutError",
    "ConfigError",
    "FormatVersionError",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepEverySeconds",
    "KeepLatest",
    "PeerOptions",
    "PerRank",
    "PinnedWeights",
    "RetentionPolicy",
    "S3Options",
    "SaveError",
    "SaveHandle",
    "SaveInfo",
    "SaveSkippedError",
    "Schedule",
    "StagingOptions",
    "StateMismatchError",
    "StepExistsError",
    "StepInfo",
    "StepNotFoundError",
    "StorageError",
    "UnsupportedValueError",
    "WriteOptions",
    "__version__",
    "load_file",
    "pin_file",
]
