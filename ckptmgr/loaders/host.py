"""Host loader: parallel chunked reads into host memory, CRC32C-verified as they land.

Each file is read into one host buffer by chunk-sized tasks on the target's I/O threads;
every task checks its chunk's checksum, so verification runs in parallel with the reads.
Tensors are views into those buffers (no second copy); aliased tensors come back aliased.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._checksum import chunk_ranges, crc32c_hex
from .._layout import ST_TO_DTYPE
from .._manifest import FileRecord, Manifest
from ..errors import CheckpointCorruptError
from ..targets import Target

__all__ = ["assemble", "read_file_image", "read_tensors"]


def read_file_image(
    target: Target, step: int, name: str, rec: FileRecord, *, verify: bool
) -> torch.Tensor:
    """Read one data file into a host uint8 tensor, verifying each chunk."""
    where = f"{target.url}: step {step}, file {name}"
    try:
        size = target.file_size(step, name)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{where} is missing") from None
    if size != rec.size:
        raise CheckpointCorruptError(
            f"{where} has {size} bytes; the manifest says {rec.size} (truncated or overwritten)")
    image = torch.empty(rec.size, dtype=torch.uint8)
    arr = image.numpy()

    def task(i: int, b: int, e: int) -> None:
        target.read_into(step, name, b, arr[b:e])
        if verify and crc32c_hex(arr[b:e]) != rec.crc32c[i]:
            raise CheckpointCorruptError(f"{where}: checksum mismatch in bytes [{b}, {e})")

    futures = [target.io_pool.submit(task, i, b, e)
               for i, (b, e) in enumerate(chunk_ranges(rec.size, rec.chunk_size))]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    n = int.from_bytes(bytes(arr[:8]), "little") if rec.size >= 8 else -1
    if n + 8 != rec.header_size:
        raise CheckpointCorruptError(f"{where}: the safetensors header length does not match the manifest")
    return image


def _typed(raw: torch.Tensor, dtype: torch.dtype, shape: list[int], where: str) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if raw.numel() != math.prod(shape) * itemsize:
        raise CheckpointCorruptError(f"{where}: {raw.numel()} bytes do not hold a {dtype} tensor of shape {shape}")
    if raw.numel() and raw.data_ptr() % itemsize:
        raw = raw.clone()  # foreign files may leave tensors unaligned
    return raw.view(dtype).view(shape)


def _dtype(code: Any, where: str) -> torch.dtype:
    try:
        return ST_TO_DTYPE[code]
    except (KeyError, TypeError):
        raise CheckpointCorruptError(f"{where}: unknown dtype {code!r}") from None


def assemble(manifest: Manifest, images: dict[str, torch.Tensor], *, where: str,
             device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Build every tensor of the manifest's index from the file images.

    Stored tensors are views into the images (or copies on ``device``); views are rebuilt
    on top of their (moved) bases, so aliasing survives the move.
    """
    out: dict[str, torch.Tensor] = {}
    for name, e in manifest.tensors.items():
        if "file" not in e:
            continue
        rec = manifest.files[e["file"]]
        b, end = (int(x) for x in e["offsets"])
        lo, hi = rec.header_size + b, rec.header_size + end
        if not (0 <= b <= end and hi <= rec.size):
            raise CheckpointCorruptError(f"{where}: tensor {name!r} lies outside its file")
        t = _typed(images[e["file"]][lo:hi], _dtype(e["dtype"], where), list(e["shape"]), f"{where}: {name!r}")
        out[name] = t if device is None or device.type == "cpu" else t.to(device)
    views = {name: e for name, e in manifest.tensors.items() if "file" not in e}
    for name, e in views.items():  # an odd mixed-dtype span may need realigning first
        base = out.get(e["view_of"])
        if base is None:
            raise CheckpointCorruptError(f"{where}: view {name!r} of a tensor that is not stored")
        itemsize = torch.empty(0, dtype=_dtype(e["dtype"], where)).element_size()
        if (base.storage_offset() * base.element_size() + int(e["byte_offset"])) % itemsize:
            out[e["view_of"]] = base.clone()
    for name, e in views.items():
        base = out[e["view_of"]]
        dtype = _dtype(e["dtype"], where)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        shape, stride, offset = list(e["shape"]), list(e["stride"]), int(e["byte_offset"])
        if len(shape) != len(stride) or min(stride, default=0) < 0:
            raise CheckpointCorruptError(f"{where}: view {name!r} has a bad shape or stride")
        extent = 0 if 0 in shape else 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
        if offset < 0 or offset + extent * itemsize > base.numel() * base.element_size():
            raise CheckpointCorruptError(f"{where}: view {name!r} reaches outside its base")
        byte0 = base.storage_offset() * base.element_size() + offset
        view = torch.empty(0, dtype=dtype, device=base.device)
        view.set_(base.untyped_storage(), byte0 // itemsize, shape, stride)
        out[name] = view
    return out


def read_tensors(target: Target, step: int, manifest: Manifest, *, verify: bool = True,
                 device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Read, verify and assemble every tensor of a committed step."""
    images = {name: read_file_image(target, step, name, rec, verify=verify)
              for name, rec in manifest.files.items()}
    return assemble(manifest, images, where=f"{target.url}: step {step}", device=device)
