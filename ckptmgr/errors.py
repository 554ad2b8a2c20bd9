"""The errors ckptmgr raises.

Every class derives from :class:`CkptError` and from the builtin exception a caller
would already catch, so ``except FileNotFoundError`` keeps working::

    CkptError(Exception)
    ├── ConfigError(ValueError)                  bad argument or option, raised up front
    │   └── UnsupportedValueError(TypeError)     a state leaf that cannot be stored
    ├── StateMismatchError(ValueError)           checkpoint and restore target disagree
    ├── StepNotFoundError(FileNotFoundError)     no such committed step
    ├── StepExistsError(FileExistsError)         the step is already committed
    ├── CheckpointCorruptError(ValueError)       checksum, size or header mismatch
    ├── FormatVersionError(ValueError)           written by a newer, unknown format
    ├── StorageError(OSError)                    the target cannot be reached or written
    ├── SaveError(RuntimeError)                  a save failed; ``__cause__`` says why
    │   └── SaveSkippedError                     the save was skipped: every slot was busy
    ├── CapacityError(MemoryError)               the state does not fit the host-memory cap
    └── CkptTimeoutError(TimeoutError)           a wait ran past its timeout
"""

from __future__ import annotations

__all__ = [
    "CapacityError",
    "CheckpointCorruptError",
    "CkptError",
    "CkptTimeoutError",
    "ConfigError",
    "FormatVersionError",
    "SaveError",
    "SaveSkippedError",
    "StateMismatchError",
    "StepExistsError",
    "StepNotFoundError",
    "StorageError",
    "UnsupportedValueError",
]


class CkptError(Exception):
    """Root of every error raised by ckptmgr."""


class ConfigError(CkptError, ValueError):
    """An argument or option is invalid. Raised before any work starts."""


class UnsupportedValueError(CkptError, TypeError):
    """A value in the state cannot be stored.

    The message names the path to the value, e.g. ``state["optim"]["state"][3]["foo"]``.
    Nothing has been written when this is raised.
    """

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class StateMismatchError(CkptError, ValueError):
    """The restore target does not match the checkpoint.

    Attributes:
        problems: every difference found (missing keys, unexpected keys, shape or dtype
            differences), one line each.
    """

    def __init__(self, problems: list[str]) -> None:
        head = f"the restore target does not match the checkpoint ({len(problems)} problem"
        head += "s):" if len(problems) != 1 else "):"
        super().__init__("\n  ".join([head, *problems]))
        self.problems = problems


class StepNotFoundError(CkptError, FileNotFoundError):
    """The requested step is not committed under the root."""


class StepExistsError(CkptError, FileExistsError):
    """The step is already committed; committed checkpoints are never overwritten."""


class CheckpointCorruptError(CkptError, ValueError):
    """A checkpoint's bytes do not match its manifest (checksum, size or header)."""


class FormatVersionError(CkptError, ValueError):
    """The checkpoint was written with a format version this library cannot read."""


class StorageError(CkptError, OSError):
    """The storage target cannot be reached, listed or written."""


class SaveError(CkptError, RuntimeError):
    """A save failed. The original exception is the ``__cause__``."""


class CkptTimeoutError(CkptError, TimeoutError):
    """A wait ran past its timeout. The operation itself may still complete."""


class SaveSkippedError(SaveError):
    """The save was skipped because every staging slot was busy (``on_busy="skip"``).

    Raised only by ``SaveHandle.result()`` of that save; a skip is never reported elsewhere.
    """


class CapacityError(CkptError, MemoryError):
    """The state needs more host memory for staging than ``StagingOptions.max_host_bytes``.

    Raised by ``save()`` before anything is copied.
    """
