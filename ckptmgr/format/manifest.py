"""The manifest: the commit record of one checkpoint, written last.

``manifest.json`` holds the format version, step, wall time, library version, the typed
skeleton of the state, the tensor index, every file's size and per-chunk CRC32C checksums,
and the user's metadata. docs/FORMAT.md describes each field.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointCorruptError, FormatVersionError

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "FileRecord", "Manifest"]

FORMAT_NAME = "ckptmgr"
FORMAT_VERSION = 2  # 2: multi-rank checkpoints (world_size, rank_states); single-process ones stay 1
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class FileRecord:
    """Size and checksums of one data file. ``crc32c[i]`` covers bytes
    ``[i * chunk_size, (i + 1) * chunk_size)`` of the whole file, header included."""

    size: int
    chunk_size: int
    crc32c: tuple[str, ...]
    header_size: int

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "header_size": self.header_size,
                "chunk_size": self.chunk_size, "crc32c": list(self.crc32c)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> FileRecord:
        rec = cls(int(obj["size"]), int(obj["chunk_size"]), tuple(obj["crc32c"]),
                  int(obj["header_size"]))
        expected = -(-rec.size // rec.chunk_size) if rec.chunk_size > 0 else -1
        if rec.chunk_size <= 0 or len(rec.crc32c) != expected:
            raise ValueError(f"{len(rec.crc32c)} checksums for {rec.size} bytes in chunks of {rec.chunk_size}")
        return rec


@dataclass
class Manifest:
    step: int
    state: Any  # typed JSON skeleton (see format.tree)
    tensors: dict[str, dict[str, Any]]
    files: dict[str, FileRecord]
    metadata: Any = None  # typed JSON of the user's metadata
    time: float = field(default_factory=time.time)
    library_version: str = ""
    protected: bool = False
    format_version: int = 1
    world_size: int = 1  # ranks that wrote it
    rank_states: list[Any] | None = None  # every rank's skeleton (``state`` is rank 0's)

    def to_bytes(self) -> bytes:
        multi = self.world_size > 1
        obj = {
            "format": FORMAT_NAME,
            "format_version": 2 if multi else self.format_version,
            "step": self.step,
            "time": self.time,
            "library_version": self.library_version,
            "protected": self.protected,
            "files": {k: v.to_json() for k, v in self.files.items()},
            "tensors": self.tensors,
            "state": self.state,
            "metadata": self.metadata,
        }
        if multi:
            obj["world_size"] = self.world_size
            obj["rank_states"] = self.rank_states
        return json.dumps(obj, indent=1, allow_nan=False, ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Manifest:
        """Parse and validate a manifest.

        Raises:
            CheckpointCorruptError: not a valid manifest.
            FormatVersionError: written by a newer format version.
        """
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(f"{where}: the manifest is not valid JSON ({exc})") from exc
        if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
            raise CheckpointCorruptError(f"{where}: not a ckptmgr manifest")
        version = obj.get("format_version")
        if not isinstance(version, int) or version < 1:
            raise CheckpointCorruptError(f"{where}: bad format_version {version!r}")
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where}: written with format version {version}; this ckptmgr reads up to "
                f"{FORMAT_VERSION}. Upgrade ckptmgr to read it."
            )
        try:
            files = {str(k): FileRecord.from_json(v) for k, v in obj["files"].items()}
            m = cls(step=int(obj["step"]), state=obj["state"], tensors=dict(obj["tensors"]),
                    files=files, metadata=obj.get("metadata"), time=float(obj["time"]),
                    library_version=str(obj.get("library_version", "")),
                    protected=bool(obj.get("protected", False)), format_version=version,
                    world_size=int(obj.get("world_size", 1)), rank_states=obj.get("rank_states"))
            if m.world_size > 1 and (not isinstance(m.rank_states, list) or len(m.rank_states) != m.world_size):
                raise ValueError(f"{m.world_size} ranks but {len(m.rank_states or [])} rank states")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{where}: malformed manifest ({exc!r})") from exc
        for name, entry in m.tensors.items():
            if not isinstance(entry, dict) or ("file" in entry and entry["file"] not in m.files):
                raise CheckpointCorruptError(f"{where}: tensor {name!r} has a bad index entry")
            if "file" not in entry and entry.get("view_of") not in m.tensors:
                raise CheckpointCorruptError(f"{where}: tensor {name!r} has a bad index entry")
        for fname in m.files:
            if "/" in fname or "\\" in fname or fname.startswith("."):
                raise CheckpointCorruptError(f"{where}: bad file name {fname!r}")
        return m

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())
