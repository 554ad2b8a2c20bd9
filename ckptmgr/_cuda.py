"""CUDA through the runtime: availability, pinning (cudaHostRegister/Unregister), and the
checked calls around them.

Every pinning and unpinning in ckptmgr goes through these functions, so tests can count
registrations by replacing them. Streams, events and synchronisation are used directly with
``torch.cuda`` where the copies are queued (the stager, the restore ring and its transport, the
landing, the in-place pieces, the snapshot buffer); docs/ARCHITECTURE.md lists them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "CopyDone",
    "available",
    "host_register",
    "host_unregister",
    "pinned_empty",
    "ready_event",
    "staging_stream",
]

_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the memory is a read-only mapping


def available() -> bool:
    """True when CUDA can be used in this process."""
    return torch.cuda.is_available()


def _check(rc: Any, what: str) -> None:
    code = int(rc)
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


def host_register(ptr: int, nbytes: int, *, read_only: bool = False) -> None:
    """Pin ``nbytes`` of existing host memory at ``ptr`` (a MAP_SHARED mapping or malloc'd
    memory; never a private file mapping, which would silently double memory). A read-only
    mapping needs ``read_only=True``."""
    flags = _REGISTER_PORTABLE | (_REGISTER_READ_ONLY if read_only else 0)
    _check(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags), "cudaHostRegister")


def host_unregister(ptr: int) -> None:
    """Unpin memory registered by :func:`host_register`, at the exact pointer registered."""
    _check(torch.cuda.cudart().cudaHostUnregister(ptr), "cudaHostUnregister")


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A fresh uint8 tensor in page-locked host memory."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def staging_stream(device: torch.device) -> Any:
    """A side stream on ``device`` for copies between host and device (from PyTorch's pool).

    Created from the caller's (main) thread: streams are per device, and creating them from
    a worker thread would bind them to whatever device that thread has current.
    """
    return torch.cuda.Stream(device=device)


def ready_event(device: torch.device) -> Any:
    """An event recorded now on ``device``'s current stream: work that waits for it comes
    after everything the caller has queued there so far."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


class CopyDone:
    """Marks the end of the copies enqueued on some streams; waitable from any thread."""

    def __init__(self, streams: list[Any]) -> None:
        self._events = []
        for s in streams:
            ev = torch.cuda.Event()
            ev.record(s)
            self._events.append(ev)

    def query(self) -> bool:
        return all(ev.query() for ev in self._events)

    def synchronize(self) -> None:
        for ev in self._events:
            ev.synchronize()
