"""The command line's exit codes, and the error -> exit code mapping (imported by the entry
point before any command module, so it imports nothing heavy)."""

from __future__ import annotations

from ..errors import (
    CheckpointCorruptError,
    ConfigError,
    FormatVersionError,
    StepExistsError,
    StepNotFoundError,
    UnsupportedValueError,
)

__all__ = ["EXIT", "CorruptFound", "exit_code"]

EXIT = {
    "ok": 0,
    "corrupt": 1,  # verify found a fault, a read failed its checksum, a manifest is damaged
    "usage": 2,  # bad arguments or input (argparse uses 2 as well)
    "not_found": 3,  # no such root, step or file
    "exists": 4,  # the step or export directory already exists
    "storage": 5,  # the storage failed (I/O, permissions, network)
    "internal": 70,  # a bug in ckptmgr (CKPTMGR_DEBUG=1 shows the traceback)
    "interrupted": 130,
}


class CorruptFound(Exception):
    """Faults were found and reported already; carries the exit code they call for."""

    def __init__(self, code: int = EXIT["corrupt"]) -> None:
        super().__init__(code)
        self.code = code


def exit_code(exc: BaseException) -> int:
    """The documented exit code for an error."""
    if isinstance(exc, CheckpointCorruptError):
        return EXIT["corrupt"]
    if isinstance(exc, StepExistsError):
        return EXIT["exists"]
    if isinstance(exc, (StepNotFoundError, FileNotFoundError)):
        return EXIT["not_found"]
    if isinstance(exc, (ConfigError, UnsupportedValueError, FormatVersionError)):
        return EXIT["usage"]
    return EXIT["storage"]
