"""Capture the files a library writes, so that ckptmgr stages and writes them instead.

Hugging Face's Trainer and accelerate write a checkpoint with plain calls: ``torch.save(obj,
path)`` for the optimizer, scheduler and RNG states, and safetensors' ``save_file(tensors,
path, metadata)`` for the weights. Inside :func:`capturing`, those calls made *by this thread*
for a path under the capture's directory are not executed: the object is handed to the
capture's :class:`~ckptmgr.integrations._fileset.FileSet`, which stages its tensors into
ckptmgr's reused host memory and writes the file later, in the background. Everything else
(other threads, other paths, JSON and tokenizer files) goes through untouched, so the
library's own code decides what a checkpoint holds, file by file, and ckptmgr decides only
how the bytes travel.

The patched names are installed while at least one capture is active (a reference count
under a lock) and delegate to the originals whenever the calling thread is not capturing:
another thread's ``torch.save`` during a capture behaves exactly as before.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ._fileset import FileSet

__all__ = ["capturing"]

_local = threading.local()  # .active: the FileSet this thread captures into, or None
_mu = threading.Lock()  # guards _installed and _depth
_installed: list[tuple[Any, str, Any]] = []  # (module, attribute, original)
_depth = 0  # active captures, over all threads


def _active() -> FileSet | None:
    return getattr(_local, "active", None)


def _inside(fs: FileSet, path: Any) -> str | None:
    """The name of ``path`` relative to the capture directory, or None when it is elsewhere
    or not a path (a file object)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    full = os.path.abspath(os.fspath(path))
    rel = os.path.relpath(full, fs.directory)
    if rel.startswith(os.pardir) or os.path.isabs(rel):
        return None
    return rel.replace(os.sep, "/")


def _torch_save(original: Any) -> Any:
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        fs = _active()
        name = _inside(fs, f) if fs is not None else None
        if fs is None or name is None or args or set(kwargs) - {"_use_new_zipfile_serialization"}:
            return original(obj, f, *args, **kwargs)  # type: ignore[no-any-return]
        fs.add_torch(name, obj)
        return None

    save.__wrapped__ = original  # type: ignore[attr-defined]
    return save


def _safetensors_save(original: Any) -> Any:
    def save_file(tensors: dict[str, torch.Tensor], filename: Any, metadata: dict[str, str] | None = None,
                  *args: Any, **kwargs: Any) -> None:
        fs = _active()
        name = _inside(fs, filename) if fs is not None else None
        if fs is None or name is None or args or kwargs:
            return original(tensors, filename, metadata, *args, **kwargs)  # type: ignore[no-any-return]
        fs.add_safetensors(name, tensors, metadata)
        return None

    save_file.__wrapped__ = original  # type: ignore[attr-defined]
    return save_file


def _targets() -> list[tuple[Any, str, Any]]:
    """(module, attribute, replacement factory) of every writer to capture that is imported."""
    out: list[tuple[Any, str, Any]] = [(torch, "save", _torch_save)]
    st = sys.modules.get("safetensors.torch")
    if st is not None:
        out.append((st, "save_file", _safetensors_save))
    # names bound at import time with ``from safetensors.torch import save_file as ...``
    for mod_name, attr in (("transformers.modeling_utils", "safe_save_file"),
                           ("accelerate.utils.other", "safe_save_file")):
        mod = sys.modules.get(mod_name)
        if mod is not None and hasattr(mod, attr):
            out.append((mod, attr, _safetensors_save))
    return out


def _install() -> None:
    global _depth
    with _mu:
        _depth += 1
        if _depth > 1:
            return
        for mod, attr, factory in _targets():
            original = getattr(mod, attr)
            _installed.append((mod, attr, original))
            setattr(mod, attr, factory(original))


def _uninstall() -> None:
    global _depth
    with _mu:
        _depth -= 1
        if _depth > 0:
            return
        while _installed:
            mod, attr, original = _installed.pop()
            setattr(mod, attr, original)


@contextlib.contextmanager
def capturing(fs: FileSet) -> Iterator[FileSet]:
    """Within the block, this thread's ``torch.save``/``save_file`` calls for paths under
    ``fs.directory`` add files to ``fs`` instead of writing them."""
    if _active() is not None:
        raise RuntimeError("a checkpoint capture is already active on this thread")
    _install()
    _local.active = fs
    try:
        yield fs
    finally:
        _local.active = None
        _uninstall()
