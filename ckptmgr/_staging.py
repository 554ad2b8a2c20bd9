"""Staging: copy the planned tensors into host buffers that hold complete file images.

After :func:`stage` returns, each buffer is byte-for-byte the safetensors file to write
(header + data), and the caller's tensors may be mutated freely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._layout import ST_TO_DTYPE, FilePlan, Plan

__all__ = ["StagedFile", "stage", "stage_file"]


@dataclass
class StagedFile:
    name: str
    header_size: int
    image: torch.Tensor  # uint8, CPU, contiguous: the whole file


def _copy_into(image: torch.Tensor, plan: FilePlan) -> None:
    hs = len(plan.header)
    image[:hs].copy_(torch.frombuffer(bytearray(plan.header), dtype=torch.uint8))
    for t in plan.tensors:
        if t.end == t.begin:
            continue
        dst = image[hs + t.begin:hs + t.end]
        src = t.source
        if t.dtype == "U8" and src.dtype == torch.uint8:
            dst.copy_(src.reshape(-1))
        else:
            dst.view(ST_TO_DTYPE[t.dtype]).view(t.shape).copy_(src)


def stage_file(plan: FilePlan, image: torch.Tensor | None = None) -> StagedFile:
    """Copy one file's header and tensors into ``image`` (allocated when None)."""
    if image is None:
        image = torch.empty(plan.size, dtype=torch.uint8)
    _copy_into(image, plan)
    return StagedFile(plan.name, len(plan.header), image)


def stage(plan: Plan) -> list[StagedFile]:
    """Copy every file of the plan into fresh host buffers."""
    return [stage_file(f) for f in plan.files]
