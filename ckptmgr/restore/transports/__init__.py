"""Transports: how the bytes of a read plan's chunks arrive in host memory
(:class:`~ckptmgr.restore.read.Transport`), or, for files already in memory, are checked
where they lie.

Each is imported when first named: a check run on :class:`PreadTransport` (``ckptmgr verify``)
needs no torch, which the direct and GDS transports import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .direct import DirectTransport
    from .gds import GdsTransport
    from .memory import MemoryTransport
    from .pread import PreadTransport, RingTransport
    from .ranged import RangedTransport

__all__ = ["DirectTransport", "GdsTransport", "MemoryTransport", "PreadTransport", "RangedTransport", "RingTransport"]

_MODULE = {"DirectTransport": ".direct", "GdsTransport": ".gds", "MemoryTransport": ".memory",
           "PreadTransport": ".pread", "RangedTransport": ".ranged", "RingTransport": ".pread"}


def __getattr__(name: str) -> Any:
    if name in _MODULE:
        return getattr(importlib.import_module(_MODULE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
