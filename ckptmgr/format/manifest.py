"""The manifest: the commit record of one checkpoint, written last.

``manifest.json`` holds the format version, step, wall time, library version, the typed
skeleton of the state, the tensor index, every file's size and per-chunk CRC32C checksums,
and the user's metadata. docs/FORMAT.md describes each field.

Its last member, ``"manifest_crc32c"``, is the CRC32C of every byte of the file before it, so
that a flipped digit anywhere (a step, an ``"epoch": 7`` in the metadata) is caught. A
manifest without it was written before the field existed and is read with every other check.
On read, a manifest is validated completely (:mod:`~ckptmgr.format.schema`) before anything
it names is trusted.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c

from ..errors import CheckpointCorruptError, FormatVersionError
from .schema import MAX_MANIFEST_BYTES, check_manifest

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "FileRecord", "Manifest", "check_manifest_size",
           "read_manifest_bytes"]

FORMAT_NAME = "ckptmgr"
FORMAT_VERSION = 2  # 2: multi-rank checkpoints (world_size, rank_states); single-process ones stay 1
MANIFEST_NAME = "manifest.json"
# The checksum member as the writer puts it: last, on its own line, so the bytes it covers are plain.
_CHECKSUM_TAIL = re.compile(rb',\n "manifest_crc32c": "([0-9a-f]{8})"\n\}\Z')


def check_manifest_size(size: int | None, where: str) -> None:
    """Refuse a manifest of more than MAX_MANIFEST_BYTES (docs/FORMAT.md), the one limit every
    reader applies: with the size the storage reports (stat, Content-Length) before anything is
    read, then with the length of what was read. ``None``: the storage reports no size.

    Raises:
        CheckpointCorruptError: ``size`` is over the limit.
    """
    if size is not None and size > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptError(f"{where}: the manifest has {size} bytes, more than the "
                                     f"{MAX_MANIFEST_BYTES} a manifest may have")


def read_manifest_bytes(size: int | None, read: Callable[[int], bytes], where: str) -> bytes:
    """A manifest's bytes, refused by ``size`` (what the storage reports; None if nothing) before
    they are read, then read with ``read(n)`` (at most ``n`` bytes): never more than
    MAX_MANIFEST_BYTES + 1 bytes in memory, whatever the storage holds or reported.

    Raises:
        CheckpointCorruptError: the manifest is larger than MAX_MANIFEST_BYTES.
    """
    check_manifest_size(size, where)
    data = read(MAX_MANIFEST_BYTES + 1)
    check_manifest_size(len(data), where)
    return data


def _crc(data: bytes) -> str:
    return f"{crc32c.crc32c(data):08x}"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


@dataclass(frozen=True)
class FileRecord:
    """Size and checksums of one data file. ``crc32c[i]`` covers bytes
    ``[i * chunk_size, (i + 1) * chunk_size)`` of the whole file, header included.

    Multi-rank saves also record finer checksums, so that a rank restoring at another layout
    verifies the parts of a file it reads without reading whole chunks: ``sub_crc32c`` is the
    8-hex-digit CRC32C of each ``sub_chunk_size`` bytes, concatenated (0 and "": none)."""

    size: int
    chunk_size: int
    crc32c: tuple[str, ...]
    header_size: int
    sub_chunk_size: int = 0
    sub_crc32c: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "header_size": self.header_size,
                               "chunk_size": self.chunk_size, "crc32c": list(self.crc32c)}
        if self.sub_chunk_size:
            out.update(sub_chunk_size=self.sub_chunk_size, sub_crc32c=self.sub_crc32c)
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> FileRecord:
        """A record from a validated manifest's ``files`` entry."""
        return cls(obj["size"], obj["chunk_size"], tuple(obj["crc32c"]), obj["header_size"],
                   obj.get("sub_chunk_size", 0), obj.get("sub_crc32c", ""))

    def sub_crc(self, index: int) -> str:
        """The checksum of sub-chunk ``index``."""
        return self.sub_crc32c[8 * index:8 * index + 8]


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
    checksummed: bool = field(default=True, compare=False)  # read back: it carried manifest_crc32c

    def to_bytes(self) -> bytes:
        """The manifest's bytes, ending with the checksum of everything before it."""
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
        body = json.dumps(obj, indent=1, allow_nan=False, ensure_ascii=False).encode("utf-8")
        assert body.endswith(b"\n}")
        head = body[:-2]
        return head + f',\n "manifest_crc32c": "{_crc(head)}"\n}}'.encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Manifest:
        """Parse and validate a manifest: its checksum, then every field (docs/FORMAT.md).

        Raises:
            CheckpointCorruptError: not a valid manifest; the message names the field.
            FormatVersionError: written by a newer format version.
        """
        check_manifest_size(len(data), where)
        try:
            obj = json.loads(data, parse_constant=_refuse_constant)
        except RecursionError:
            raise CheckpointCorruptError(f"{where}: the manifest is nested too deeply to be one") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(f"{where}: the manifest is not valid JSON ({exc})") from None
        if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
            raise CheckpointCorruptError(f"{where}: not a ckptmgr manifest")
        checksummed = "manifest_crc32c" in obj
        if checksummed:
            tail = _CHECKSUM_TAIL.search(data)
            if tail is None or tail.group(1).decode() != obj["manifest_crc32c"]:
                raise CheckpointCorruptError(f"{where}: manifest field manifest_crc32c: not the last member "
                                             "as ckptmgr writes it (the manifest was edited or damaged)")
            got = _crc(data[:tail.start()])
            if got != obj["manifest_crc32c"]:
                raise CheckpointCorruptError(f"{where}: manifest field manifest_crc32c: the manifest fails its "
                                             f"checksum (CRC32C {got}, recorded {obj['manifest_crc32c']}): it was "
                                             "damaged or edited")
        version = obj.get("format_version")
        if type(version) is not int or version < 1:
            raise CheckpointCorruptError(f"{where}: manifest field format_version: bad value {version!r:.40}")
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where}: written with format version {version}; this ckptmgr reads up to "
                f"{FORMAT_VERSION}. Upgrade ckptmgr to read it."
            )
        check_manifest(obj, where)
        return cls(step=obj["step"], state=obj["state"], tensors=obj["tensors"],
                   files={k: FileRecord.from_json(v) for k, v in obj["files"].items()},
                   metadata=obj["metadata"], time=float(obj["time"]), library_version=obj["library_version"],
                   protected=obj["protected"], format_version=version, world_size=obj.get("world_size", 1),
                   rank_states=obj.get("rank_states"), checksummed=checksummed)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())
