"""Step naming: which names under a root are ours, and what they mean.

A committed checkpoint lives in ``step_<step, zero-padded to 12 digits>/`` so that names
sort. A local save in progress lives in ``.step_<step>.tmp-<hex>/`` beside it and becomes
the step by an atomic rename. Only names that match these patterns are ever listed,
cleaned up or deleted; anything else under the root is left alone.
"""

from __future__ import annotations

import re
import secrets

__all__ = [
    "MAX_STEP",
    "PROTECT_NAME",
    "ROOT_ID_NAME",
    "STEP_DIGITS",
    "is_our_file",
    "is_temp_name",
    "parse_step_name",
    "step_name",
    "temp_name",
]

STEP_DIGITS = 12
MAX_STEP = 10**STEP_DIGITS  # steps are ints in [0, MAX_STEP): what 12-digit names order
ROOT_ID_NAME = ".ckptmgr-root-id"  # the root's random identity, written once with the first commit
PROTECT_NAME = "protected"  # marker file: the step is kept whatever the retention policy says
_OUR_FILE_RE = re.compile(r"manifest\.json|data-(r\d{5}-)?\d{5,}\.safetensors|protected")
_STEP_RE = re.compile(rf"step_(\d{{{STEP_DIGITS},}})")
_TEMP_RE = re.compile(rf"\.step_(\d{{{STEP_DIGITS},}})\.tmp-[0-9a-f]{{8,32}}")


def step_name(step: int) -> str:
    """Directory (or prefix) name of ``step``: ``step_000000001000``."""
    return f"step_{step:0{STEP_DIGITS}d}"


def parse_step_name(name: str) -> int | None:
    """The step a directory name stands for, or None when the name is not ours."""
    m = _STEP_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_name(step) == name else None


def temp_name(step: int) -> str:
    """A fresh name for the temporary directory of a save in progress."""
    return f".{step_name(step)}.tmp-{secrets.token_hex(8)}"


def is_temp_name(name: str) -> bool:
    """True for temporary directories that a save of ours created."""
    return _TEMP_RE.fullmatch(name) is not None


def is_our_file(name: str) -> bool:
    """True for the names ckptmgr writes inside a step directory."""
    return _OUR_FILE_RE.fullmatch(name) is not None
