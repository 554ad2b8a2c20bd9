"""ckptmgr: checkpoint PyTorch training without stalling it.

>>> from ckptmgr import CheckpointManager
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

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
from .format.tree import PerRank
from .handle import SaveHandle, SaveInfo
from .manager import CheckpointManager
from .options import S3Options, Schedule, StagingOptions, WriteOptions
from .restore.loaders import load_file
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
    "PerRank",
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
]
