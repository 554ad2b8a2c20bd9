"""Transports: how the bytes of a read plan's chunks arrive in host memory
(:class:`~ckptmgr.restore.read.Transport`)."""

from __future__ import annotations

from .direct import DirectTransport
from .gds import GdsTransport
from .pread import PreadTransport, RingTransport

__all__ = ["DirectTransport", "GdsTransport", "PreadTransport", "RingTransport"]
