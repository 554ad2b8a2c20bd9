"""The commit family: how the files of one save become a checkpoint, atomically.

A writer only writes bytes. Where they go, what claims the save while they are written, how
it is made visible and what an abort removes is decided by its commit strategy:

* :class:`~.rename.RenameCommit` (local and NFS roots, where a directory rename is atomic):
  files go to a fresh temporary directory ``.step_<n>.tmp-<hex>/`` beside the destination,
  claimed by its lock file; the commit writes ``manifest.json`` inside, fsyncs, and renames
  the directory to ``step_<n>/``. Never replaces a committed step.
* :class:`~.manifest_last.ManifestLastCommit` (object stores, which have no atomic rename):
  files go straight to the step's prefix, claimed by a ``writer.lease`` object; the commit
  checks that every file is there with its size, then writes ``manifest.json`` once.
* :class:`~.file.FileCommit` (one file at a user's path, a Lightning ``.ckpt``): a temporary
  beside the path, renamed over it (local), one PUT or multipart upload (object stores).
  Replaces what the path held.
* :class:`~.directory.DirectoryCommit` (a checkpoint directory in a library's naming): a
  temporary directory, its record written last, renamed to the final name; an existing
  directory of that name is renamed away first (or exchanged), never deleted first.

The multi-rank commit (every rank's files gathered, one rank commits) wraps these: for steps
in :mod:`ckptmgr.distributed.save`, for directories inside :class:`~.directory.DirectoryCommit`.

Each strategy removes at an abort only what its writer created, and knows its own leftovers,
swept once per root or directory: :func:`~.rename.remove_local_leftovers`,
:func:`~.object_leftovers.remove_object_leftovers`, :func:`~.file.remove_stale_temps`,
:func:`~.directory.remove_stale_temps` and :func:`~.directory.recover`. The names of the
temporaries of steps, files and directories, and their patterns, are in
:mod:`ckptmgr.format.naming` (the RAM tiers name their record temporaries themselves:
``storage/tier.py``, ``storage/peer_tier.py``); the leftovers named after
a dead writer's pid are found by :func:`dead_writers` alone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

from ..lease import process_alive

__all__ = ["dead_writers"]


def dead_writers(directory: str, pattern: re.Pattern[str]) -> Iterator[tuple[str, re.Match[str]]]:
    """``(path, match)`` of the entries of ``directory`` whose names ``pattern`` matches
    (group 1: the writer's pid) and whose writer process is gone; never a symlink, never
    this process's own."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = pattern.match(name)
        if m is None or int(m.group(1)) == os.getpid() or process_alive(int(m.group(1)), -1):
            continue
        path = os.path.join(directory, name)
        if not os.path.islink(path):
            yield path, m
