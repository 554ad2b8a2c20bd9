"""Step naming: which names under a root are ours, and what they mean.

A committed checkpoint lives in ``step_<step, zero-padded to 12 digits>/`` so that names
sort; valid steps are ``0 <= step < MAX_STEP``. A local save in progress lives in
``.step_<step>.tmp-<16 hex>/`` beside it, held by the lock file
``.step_<step>.tmp-<16 hex>.lock``, and becomes the step by an atomic rename. On object
stores a save in progress is claimed by a lease object ``writer.lease`` (one per rank:
``data-r<rank>-writer.lease``) inside the step's prefix, and each data object carries its
writer's claim token (``data-00000.<16 hex>.safetensors``, :func:`attempt_name`), so that the
objects of one writer's attempt are never overwritten by another's. The root's identity is
``.ckptmgr-root-id``.

Only names that match these patterns exactly are ever listed, cleaned up or deleted;
anything else under the root is left alone.

Commits at a user's path (a Lightning ``.ckpt`` file, a library's checkpoint directory) have
temporaries of their own, named after their writer's pid (see the end of this module).
"""

from __future__ import annotations

import os
import re
import secrets
import urllib.parse

__all__ = [
    "DIR_OLD_RE",
    "DIR_TEMP_RE",
    "FILE_TEMP_RE",
    "LEASE_NAME",
    "MAX_STEP",
    "PROTECT_NAME",
    "ROOT_ID_NAME",
    "STEP_DIGITS",
    "attempt_name",
    "attempt_tag",
    "dir_old_name",
    "dir_temp_name",
    "file_temp_name",
    "is_lease_name",
    "is_our_file",
    "is_root_id_temp",
    "is_temp_lock_name",
    "is_temp_name",
    "lease_name",
    "new_root_id",
    "parse_root_id",
    "parse_step_name",
    "plain_name",
    "step_name",
    "temp_lock_name",
    "temp_name",
]

STEP_DIGITS = 12
MAX_STEP = 10**STEP_DIGITS  # steps are ints in [0, MAX_STEP): what 12-digit names order
PROTECT_NAME = "protected"  # marker file: the step is kept whatever the retention policy says
LEASE_NAME = "writer.lease"  # an object-store save in progress (its writer's identity and heartbeat)
ROOT_ID_NAME = ".ckptmgr-root-id"  # the root's random identity, written once with the first commit
_RANK = r"data-r\d{5}-"
_TAG = r"[0-9a-f]{16}"  # a writer's claim token (object stores)
_OUR_FILE_RE = re.compile(
    rf"manifest\.json|data-(r\d{{5}}-)?\d{{5,}}(\.{_TAG})?\.safetensors|protected|({_RANK})?writer\.lease")
_ATTEMPT_RE = re.compile(rf"(data-(?:r\d{{5}}-)?\d{{5,}})(?:\.({_TAG}))?\.safetensors")
_LEASE_RE = re.compile(rf"({_RANK})?writer\.lease")
_STEP_RE = re.compile(rf"step_(\d{{{STEP_DIGITS}}})")
_TEMP_RE = re.compile(rf"\.step_(\d{{{STEP_DIGITS}}})\.tmp-[0-9a-f]{{16}}")
_ROOT_ID_TEMP_RE = re.compile(r"\.ckptmgr-root-id\.tmp-[0-9a-f]{16}")
_TEMP_LOCK_RE = re.compile(rf"\.step_(\d{{{STEP_DIGITS}}})\.tmp-[0-9a-f]{{16}}\.lock")


def step_name(step: int) -> str:
    """Directory (or prefix) name of ``step``: ``step_000000001000``."""
    return f"step_{step:0{STEP_DIGITS}d}"


def parse_step_name(name: str) -> int | None:
    """The step a directory name stands for, or None when the name is not ours."""
    m = _STEP_RE.fullmatch(name)
    return None if m is None else int(m.group(1))


def temp_name(step: int) -> str:
    """A fresh name for the temporary directory of a local save in progress."""
    return f".{step_name(step)}.tmp-{secrets.token_hex(8)}"


def temp_lock_name(temp: str) -> str:
    """The lock file that the writer of temporary directory ``temp`` holds while it lives."""
    return temp + ".lock"


def is_temp_name(name: str) -> bool:
    """True for temporary directories that a save of ours created (exactly our pattern)."""
    return _TEMP_RE.fullmatch(name) is not None


def is_temp_lock_name(name: str) -> bool:
    """True for the lock file of one of our temporary directories."""
    return _TEMP_LOCK_RE.fullmatch(name) is not None


def is_root_id_temp(name: str) -> bool:
    """True for the temporary file a root's identity is written to before it is linked in place."""
    return _ROOT_ID_TEMP_RE.fullmatch(name) is not None


def lease_name(prefix: str = "") -> str:
    """The lease object of the writer of files named ``<prefix>...`` (``""`` or ``data-r00001-``)."""
    name = f"{prefix}{LEASE_NAME}"
    if _LEASE_RE.fullmatch(name) is None:
        raise ValueError(f"no lease name for the file prefix {prefix!r}")
    return name


def is_lease_name(name: str) -> bool:
    """True for the lease objects of object-store saves in progress."""
    return _LEASE_RE.fullmatch(name) is not None


def attempt_name(name: str, tag: str) -> str:
    """The object name of data file ``name`` written under the claim whose token is ``tag``:
    ``data-00000.safetensors`` -> ``data-00000.<tag>.safetensors``.

    Raises:
        ValueError: ``name`` is not a plain data file name, or ``tag`` not 16 hex digits.
    """
    m = _ATTEMPT_RE.fullmatch(name)
    if m is None or m.group(2) is not None or re.fullmatch(_TAG, tag) is None:
        raise ValueError(f"no attempt name for {name!r} with tag {tag!r}")
    return f"{m.group(1)}.{tag}.safetensors"


def attempt_tag(name: str) -> str | None:
    """The claim token a data object's name carries; None for names without one (written
    before tokens existed, or by a local root)."""
    m = _ATTEMPT_RE.fullmatch(name)
    return None if m is None else m.group(2)


def plain_name(name: str) -> str:
    """Data object ``name`` without the claim token it may carry (the inverse of
    :func:`attempt_name`: ``data-00000.<tag>.safetensors`` -> ``data-00000.safetensors``);
    any other name as it is."""
    m = _ATTEMPT_RE.fullmatch(name)
    return name if m is None or m.group(2) is None else f"{m.group(1)}.safetensors"


def is_our_file(name: str) -> bool:
    """True for the names ckptmgr writes inside a step directory."""
    return _OUR_FILE_RE.fullmatch(name) is not None


_ROOT_ID_RE = re.compile(r"[0-9a-f]{32}")


def new_root_id() -> str:
    """A fresh random root identity (32 hex digits)."""
    return secrets.token_hex(16)


def parse_root_id(data: bytes) -> str | None:
    """The identity stored in a root's ``.ckptmgr-root-id``; None when it is not one."""
    text = data[:64].decode("ascii", "replace").strip()
    return text if len(data) <= 64 and _ROOT_ID_RE.fullmatch(text) else None


# ------------------------------------------------------------ temporaries at a user's path
# A one-file commit (a Lightning ``.ckpt``) writes ``.ckptmgr-<pid>-<12 hex>.partial`` beside
# its destination; a directory commit (a Hugging Face/accelerate checkpoint directory) writes
# ``.ckptmgr-<pid>-<8..40 hex>.partial/`` and moves an existing directory of the same name
# away to ``.ckptmgr-<pid>-<hex>.old-<final, quoted>`` while replacing it. Hidden, matching
# no library's checkpoint pattern, and named after their writer's pid: swept once it is gone.

FILE_TEMP_RE = re.compile(r"^\.ckptmgr-(\d+)-[0-9a-f]{12}\.partial$")
DIR_TEMP_RE = re.compile(r"^\.ckptmgr-(\d+)-([0-9a-f]{8,40})\.partial$")
DIR_OLD_RE = re.compile(r"^\.ckptmgr-(\d+)-([0-9a-f]{8,40})\.old-(.+)$")


def file_temp_name() -> str:
    """A fresh temporary name for a one-file commit (this process's pid)."""
    return f".ckptmgr-{os.getpid()}-{secrets.token_hex(6)}.partial"


def dir_temp_name(pid: int | None = None, token: str | None = None) -> str:
    """A fresh temporary directory name (``pid`` and ``token`` fixed for multi-rank saves)."""
    return f".ckptmgr-{os.getpid() if pid is None else pid}-{token or secrets.token_hex(8)}.partial"


def dir_old_name(rel: str, pid: int | None = None) -> str:
    """The name a directory ``rel`` (relative to the scratch directory) takes while a new
    copy replaces it."""
    pid = os.getpid() if pid is None else pid
    return f".ckptmgr-{pid}-{secrets.token_hex(8)}.old-{urllib.parse.quote(rel, safe='')}"
