"""Where a root's local tier lives, what its files are called, and the read-only listing of
its committed steps (for the CLI and other processes, while a job may own the tier).

Layout, one private directory per checkpoint root and user::

    <local_dir>/ckptmgr-<uid>-<hash of the root URL>/     mode 0700, owned by this user
        lock                 flock()ed by the one manager that owns the tier
        root                 the root URL, for people looking around
        root-id              the identity of the root these slots belong to
        slot-00/             one staging slot
            data-00000.safetensors ...   mapped MAP_SHARED and pinned in place by the saver
            manifest.json                present only while the slot holds a complete step
            durable                      the step, once it is committed on the durable root too

:class:`~ckptmgr.storage.tier.LocalTier` owns and writes such a directory; the functions here
only read it, and keep its security rules: a tier that is not this user's private directory is
never listed, and nothing inside is reached through a symlink.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys

from ..errors import CkptError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.schema import MAX_MANIFEST_BYTES
from .private import NOFOLLOW as _NOFOLLOW
from .private import check_private_dir, read_small

__all__ = ["DURABLE_MARK", "ROOT_ID", "TMP_MANIFEST", "marked_durable", "ram_filesystem", "read_tier", "tier_dir"]

TMP_MANIFEST = ".manifest.json.tmp"  # a slot's manifest being written (renamed to manifest.json)
DURABLE_MARK = "durable"  # the slot's step, written once the step is committed on the durable root
ROOT_ID = "root-id"  # the identity of the root the slots belong to


def tier_dir(local_dir: str, root_url: str) -> str:
    """The tier directory of ``root_url`` for the current user."""
    key = hashlib.sha256(root_url.encode("utf-8")).hexdigest()[:16]
    return os.path.join(local_dir, f"ckptmgr-{os.getuid()}-{key}")


def read_tier(local_dir: str, root_url: str, *, written_out: bool = True) -> dict[int, Manifest]:
    """The steps committed in this user's tier of ``root_url``, read only (the tier may belong
    to a running job), by step. Empty when there is no tier, or it is not a private directory
    of this user: another user's planted tier is never listed. ``written_out=False`` leaves out
    the steps whose slot records that they were committed on the root (since deleted there, by
    retention or by hand: never to be written back)."""
    path = tier_dir(local_dir, root_url)
    found: dict[int, Manifest] = {}
    try:
        check_private_dir(os.lstat(path), path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError:
        return found
    try:
        check_private_dir(os.fstat(fd), path)
        for name in sorted(os.listdir(fd)):
            if not (name.startswith("slot-") and name[5:].isdigit()):
                continue
            try:
                check_private_dir(os.lstat(name, dir_fd=fd), name)
                slot = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=fd)
                try:
                    m = Manifest.from_bytes(read_small(MANIFEST_NAME, slot, MAX_MANIFEST_BYTES),
                                            where=f"{path}/{name}/{MANIFEST_NAME}")
                    if not written_out and marked_durable(slot) == m.step:
                        continue
                finally:
                    os.close(slot)
            except (OSError, CkptError, ValueError):
                continue  # a slot being written, or reset: not a committed step
            found[m.step] = m
    finally:
        os.close(fd)
    return found


def marked_durable(slot_fd: int) -> int | None:
    """The step a slot's durable mark names (None: none, or unreadable)."""
    try:
        text = read_small(DURABLE_MARK, slot_fd, 32).decode("ascii").strip()
    except (OSError, ValueError, CkptError):
        return None
    return int(text) if text.isdigit() else None


_RAM_FS_MAGIC = frozenset({0x01021994, 0x858458F6, 0x958458F6})  # tmpfs, ramfs, hugetlbfs (linux/magic.h)


def ram_filesystem(path: str | int) -> bool | None:
    """True when ``path`` (or the open file descriptor ``path``) lies on a filesystem kept in
    RAM, False when on another, None when this cannot be told (not Linux, or statfs failed)."""
    if not sys.platform.startswith("linux"):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs; its first field is f_type
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.fstatfs(path, buf) if isinstance(path, int) else libc.statfs(os.fsencode(path), buf)
    if rc != 0:
        return None
    return (ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF) in _RAM_FS_MAGIC
