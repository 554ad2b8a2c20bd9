"""An optional snapshot of the state on its own GPU, so that a save stalls the training step
only for a device-to-device copy.

Without it, a GPU tensor is copied straight into its host slot, and the caller may change
the state only once that device-to-host copy has landed: 4.8 GB takes ~90 ms over PCIe, of
which the next forward and backward hide only part. With ``StagingOptions(
device_buffer_bytes=N)`` each device keeps one buffer of up to ``N`` bytes, and a save
enqueues on its staging stream:

1. the device-to-device copies of the GPU tensors that fit the buffer (HBM speed: a few ms
   for 5 GB);
2. the device-to-host copies of the GPU tensors that did not fit, as without a buffer;
3. the *safe* event: the state may be changed from here on;
4. the device-to-host copies from the buffer into the slot (the *drain*);
5. the *landed* event: the slot holds the whole image and may be committed.

Everything runs on the one staging stream per device, so stream order alone keeps the next
save's device-to-device copies from overwriting the buffer while the previous drain reads it.
The buffer is allocated while that stream is current, so the caching allocator never hands
its memory to work on another stream.

Layout. Tensors that are adjacent in a file image are adjacent in the buffer (a *run*), so a
drain is a few large copies rather than one per tensor; each run starts at a 256-byte
boundary plus the run's offset in its image modulo 256, which keeps every tensor aligned for
its dtype in the buffer as it is in the image. A tensor that does not fit where the buffer is
filled to goes straight to the host; later ones may still fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ..format.layout import ST_TO_DTYPE, Plan, StoredTensor

__all__ = ["DeviceBuffers", "Run", "SnapshotPlan", "plan_snapshot"]

log = logging.getLogger("ckptmgr")

_ALIGN = 256  # run starts in the buffer, in bytes (a multiple of every dtype's item size)


@dataclass
class Run:
    """Bytes ``[begin, end)`` of file image ``file`` held at ``[at, at + end - begin)`` of
    the buffer of ``device``."""

    device: torch.device
    file: int
    begin: int
    end: int
    at: int


@dataclass
class SnapshotPlan:
    """What one save copies through the device buffers."""

    # (file index, offset in its image) of each tensor held -> (device, offset in its buffer)
    through: dict[tuple[int, int], tuple[torch.device, int]] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    needed: dict[torch.device, int] = field(default_factory=dict)  # bytes used per device

    @property
    def bytes(self) -> int:
        return sum(r.end - r.begin for r in self.runs)


def plan_snapshot(plan: Plan, capacity: int, limits: dict[torch.device, int] | None = None) -> SnapshotPlan:
    """Place the GPU tensors of ``plan`` in buffers of ``capacity`` bytes per device, or of
    ``limits[device]`` where given (runs of tensors adjacent in their file image stay
    adjacent; see the module docstring)."""
    out = SnapshotPlan()
    if capacity <= 0:  # (the default: no buffer, and no work on the save path; limits only lower it)
        return out
    last: dict[torch.device, Run] = {}
    for i, f in enumerate(plan.files):
        hs = len(f.header)
        for t in f.tensors:  # (in file order, as the layout lays them out)
            device = t.source.device
            n = t.end - t.begin
            cap = capacity if limits is None else limits.get(device, capacity)
            if n == 0 or device.type == "cpu" or cap <= 0:
                continue
            begin = hs + t.begin
            run = last.get(device)
            if run is not None and run.file == i and run.end == begin and run.at + (begin - run.begin) + n <= cap:
                at = run.at + (begin - run.begin)
                run.end = begin + n
            else:
                used = out.needed.get(device, 0)
                at = -(-used // _ALIGN) * _ALIGN + begin % _ALIGN
                if at + n > cap:
                    continue  # straight to the host
                run = Run(device, i, begin, begin + n, at)
                out.runs.append(run)
                last[device] = run
            out.through[(i, begin)] = (device, at)
            out.needed[device] = max(out.needed.get(device, 0), at + n)
    return out


def buffer_view(buf: torch.Tensor, offset: int, t: StoredTensor) -> torch.Tensor:
    """The bytes of ``t`` at ``offset`` of ``buf``, viewed with its dtype and shape."""
    return buf[offset:offset + t.end - t.begin].view(ST_TO_DTYPE[t.dtype]).view(t.shape)


class DeviceBuffers:
    """One snapshot buffer per device, grown to what a save needs up to ``capacity`` bytes.

    Owned by the stager's caller, the training thread (``save()``, ``prepare()``, ``close()``);
    :meth:`allocated` may be read from any thread. Every use of a buffer's memory is enqueued
    on the staging stream of its device.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._limits: dict[torch.device, int] = {}  # devices that had no room for more: their size

    def plan(self, plan: Plan) -> SnapshotPlan:
        return plan_snapshot(plan, self.capacity, self._limits)

    def get(self, device: torch.device, nbytes: int, stream: Any) -> bool:
        """Make the buffer of ``device`` at least ``nbytes`` long; False when the device has
        no room for that (logged). The buffer then stays as it was, and this device's later
        plans fit in it (nothing when there is none): the buffer only ever speeds a save up,
        it never fails one. ``stream`` is the device's staging stream: a new buffer is
        allocated on it, so the caching allocator reuses its memory only in that stream's
        order (after the drains queued from the old one)."""
        old = self._buffers.get(device)
        if old is not None and old.numel() >= nbytes:
            return True
        try:
            with torch.cuda.stream(stream):
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError as exc:
            self._limits[device] = 0 if old is None else old.numel()
            log.warning("no room for a device snapshot buffer of %d bytes on %s (%s); %s", nbytes, device,
                        str(exc).splitlines()[0] if str(exc) else "out of memory",
                        "saves copy the tensors there straight to the host" if old is None else
                        f"saves keep the buffer of {old.numel()} bytes, and copy what does not fit straight "
                        "to the host")
            return False
        self._buffers[device] = buf  # the old one (if any) goes once its queued drains have read it
        return True

    def buffer(self, device: torch.device) -> torch.Tensor:
        return self._buffers[device]

    def allocated(self) -> int:
        """Bytes of device memory held by the buffers."""
        return sum(b.numel() for b in list(self._buffers.values()))

    def clear(self) -> None:
        self._buffers.clear()
