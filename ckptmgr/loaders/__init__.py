"""Loaders: bring a committed checkpoint's files into memory and rebuild its tensors."""

from __future__ import annotations

from .host import read_tensors

__all__ = ["read_tensors"]
