"""Putting a complete checkpoint directory under its final name, also over an existing one,
so that the final name never stands empty; and where the temporaries live.

:func:`replace_dir` installs a finished temporary directory as ``final``:

* ``final`` absent: one ``rename``;
* ``final`` present (the same step saved again): an atomic exchange of the two names
  (Linux ``renameat2(RENAME_EXCHANGE)``), after which the temporary name holds the old copy,
  which is then deleted. A crash at any point leaves the old or the new directory under
  ``final``; what is left under a temporary name is swept at the next start;
* where the exchange is not available (another OS, a file system without it): the old copy
  is renamed away to ``.ckptmgr-<pid>-<hex>.old-<final, quoted>``, the new one renamed in,
  then the old one deleted. Until the second rename ``final`` is missing; :func:`recover`,
  run at start-up and before discovery, renames the old copy back when its writer is gone
  and ``final`` is still missing (and deletes it when ``final`` is there).

Temporaries (saves being written, old copies, directories being deleted) go into a
*scratch* directory on the same file system: the checkpoints' own directory where the
library's discovery matches names by a fixed prefix (the Trainer's ``checkpoint-<n>``), or
the directory above it where discovery takes every entry (accelerate's automatic naming sorts
all of ``checkpoints/`` by the first number in each name): :func:`scratch_dir`.

Self-contained (no other ckptmgr module but the liveness check and fsync) so that it can move
as a unit.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import secrets
import shutil
import urllib.parse

from ckptmgr.storage.lease import process_alive
from ckptmgr.storage.posix import fsync_dir

__all__ = ["OLD_RE", "exchange", "old_name", "recover", "replace_dir", "scratch_dir"]

log = logging.getLogger("ckptmgr")

OLD_RE = re.compile(r"^\.ckptmgr-(\d+)-([0-9a-f]{8,40})\.old-(.+)$")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_NAME_MAX = 255
_exchange_fn: object = None  # the libc function once looked up; False where there is none


def _renameat2() -> object:
    global _exchange_fn
    if _exchange_fn is None:
        fn: object = False
        if hasattr(os, "uname") and os.uname().sysname == "Linux":
            try:
                f = ctypes.CDLL(None, use_errno=True).renameat2
                f.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                f.restype = ctypes.c_int
                fn = f
            except (OSError, AttributeError):  # glibc < 2.28, musl without it
                fn = False
        _exchange_fn = fn
    return _exchange_fn


def exchange(a: str, b: str) -> bool:
    """Swap the directory entries ``a`` and ``b`` atomically (both must exist, on one file
    system). False where the OS or the file system cannot, with nothing changed.

    Raises:
        OSError: any other failure of the exchange.
    """
    fn = _renameat2()
    if not fn:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:  # type: ignore[operator]
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")


def old_name(scratch: str, final: str, pid: int | None = None) -> str:
    """The name ``final``'s old copy takes in ``scratch`` while a replacement is renamed in.

    Raises:
        OSError: ``final`` is not under ``scratch``, or the name would be too long.
    """
    rel = os.path.relpath(final, scratch)
    if rel.startswith(".." + os.sep) or rel in (".", "..") or os.path.isabs(rel):
        raise OSError(errno.EXDEV, f"{final} is not under the scratch directory {scratch}")
    pid = os.getpid() if pid is None else pid
    name = f".ckptmgr-{pid}-{secrets.token_hex(8)}.old-{urllib.parse.quote(rel, safe='')}"
    if len(os.fsencode(name)) > _NAME_MAX:
        raise OSError(errno.ENAMETOOLONG, f"{final}: name too long to be replaced safely")
    return os.path.join(scratch, name)


def replace_dir(temp: str, final: str, *, scratch: str | None = None, use_exchange: bool = True) -> None:
    """Install the complete directory ``temp`` as ``final`` (fsynced), replacing any
    directory there without ever leaving ``final`` missing but for a state :func:`recover`
    repairs (see the module docstring). ``scratch`` (default: ``temp``'s directory) receives
    the old copy when the exchange is not available; ``final`` must lie under it.

    Raises:
        OSError: a rename failed; ``final`` then still holds the old directory.
    """
    temp, final = os.path.abspath(temp), os.path.abspath(final)
    scratch = os.path.abspath(scratch) if scratch is not None else os.path.dirname(temp)
    parent = os.path.dirname(final)
    dirs = {parent, os.path.dirname(temp)}
    if not os.path.lexists(final):
        os.rename(temp, final)
        for d in dirs:
            fsync_dir(d)
        return
    log.warning("checkpoint %s exists; replacing it with the new save", final)
    if use_exchange and exchange(temp, final):  # temp now holds the old copy
        for d in dirs:
            fsync_dir(d)
        shutil.rmtree(temp, ignore_errors=True)
        return
    away = old_name(scratch, final)
    os.rename(final, away)
    try:
        fsync_dir(scratch)
        os.rename(temp, final)
    except BaseException:  # (final is missing until the new copy is in: put the old one back)
        os.rename(away, final)
        raise
    for d in dirs:
        fsync_dir(d)
    shutil.rmtree(away, ignore_errors=True)


def recover(scratch: str) -> list[str]:
    """Finish the replacements in ``scratch`` that a crash interrupted: an old copy whose
    writer process is gone goes back under its final name if that name is missing, and is
    deleted otherwise. Returns the final paths restored."""
    restored: list[str] = []
    try:
        names = os.listdir(scratch)
    except OSError:
        return restored
    for name in names:
        m = OLD_RE.match(name)
        if m is None or int(m.group(1)) == os.getpid() or process_alive(int(m.group(1)), -1):
            continue
        path = os.path.join(scratch, name)
        rel = urllib.parse.unquote(m.group(3))
        parts = rel.split("/")
        if os.path.islink(path) or os.path.isabs(rel) or any(p in ("", ".", "..") for p in parts):
            continue  # not a name this module made
        final = os.path.join(scratch, *parts)
        if os.path.lexists(final):  # the new copy got in: the old one is garbage
            shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            os.rename(path, final)
        except OSError as exc:  # another process restored it first, or the parent went away
            log.warning("could not restore %s as %s: %s", path, final, exc)
            continue
        fsync_dir(os.path.dirname(final))
        log.warning("restored %s, left missing by a save that was interrupted while replacing it", final)
        restored.append(final)
    return restored


def scratch_dir(parent: str, *, outside: bool = False) -> str:
    """Where the temporaries for checkpoints in ``parent`` go: ``parent`` itself, or with
    ``outside`` (a library whose discovery takes every entry of ``parent``) the directory
    above it, when that is on the same file system (else ``parent``, with a warning)."""
    parent = os.path.abspath(parent)
    if not outside:
        return parent
    above = os.path.dirname(parent)
    try:
        same = os.stat(above).st_dev == os.stat(parent).st_dev
    except OSError:
        same = False
    if not same:
        log.warning("%s is a mount point: temporaries go inside it, where the library's own discovery may "
                    "see them", parent)
        return parent
    return above
