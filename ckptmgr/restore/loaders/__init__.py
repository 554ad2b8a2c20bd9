"""Loaders: bring a committed checkpoint's files into memory and rebuild its tensors."""

from __future__ import annotations

from .host import read_tensors
from .images import read_tensors_pinned
from .mapped import load_file, read_tensors_inplace
from .ring import PinnedRing, read_tensors_ring

__all__ = ["PinnedRing", "load_file", "read_tensors", "read_tensors_inplace", "read_tensors_pinned",
           "read_tensors_ring"]
