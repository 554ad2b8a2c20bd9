"""Option dataclasses: small, frozen, keyword-only, one per concern, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["WriteOptions"]


@dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """How checkpoint files are laid out and written.

    Attributes:
        max_file_bytes: a state larger than this is split into several safetensors files.
        chunk_size: bytes per checksum chunk and per parallel write or read task.
        io_threads: threads that write and read chunks in parallel.

    Example:
        >>> WriteOptions(io_threads=16).io_threads
        16
    """

    max_file_bytes: int = 4 << 30
    chunk_size: int = 16 << 20
    io_threads: int = 8

    def __post_init__(self) -> None:
        for name in ("max_file_bytes", "chunk_size", "io_threads"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"WriteOptions.{name} must be a positive int, got {value!r}")
        if self.chunk_size % 4096:
            raise ConfigError(f"WriteOptions.chunk_size must be a multiple of 4096, got {self.chunk_size}")
