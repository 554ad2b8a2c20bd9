"""CUDA through the runtime: availability, pinning (cudaHostRegister/Unregister), and the
checked calls around them.

Every pinning and unpinning in ckptmgr goes through these functions, so tests can count
registrations by replacing them. Streams, events and synchronisation are used directly with
``torch.cuda`` where the copies are queued (the stager, the restore ring and its transport, the
landing, the in-place pieces, the snapshot buffer); docs/ARCHITECTURE.md lists them.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import torch

__all__ = [
    "CopyDone",
    "Runtime",
    "available",
    "host_register",
    "host_unregister",
    "pinned_empty",
    "ready_event",
    "runtime",
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


class Runtime:
    """The CUDA runtime library PyTorch loaded, called through ctypes: the few calls of the
    bounce readers' copy loop (:mod:`ckptmgr.restore.loaders.bounce`). Each call releases the
    GIL for its whole length, where ``Tensor.copy_`` and ``Event`` hold it around theirs, so
    several readers queue their copies while the others read. The same loop outside the
    product, through these calls, took 0.199 s (0.182-0.214) for 4 GiB from /dev/shm where
    ``load_file`` with ``copy_`` took 0.221-0.258 s (H200,
    ``benchmarks/results/h200-2026-11-28-loader/call4/``). Pointers and stream handles are
    plain integers; every call is checked.
    """

    _MEMCPY_HOST_TO_DEVICE = 1
    _EVENT_DISABLE_TIMING = 2

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        lib.cudaEventRecord.argtypes = [vp, vp]
        lib.cudaEventSynchronize.argtypes = [vp]
        lib.cudaEventDestroy.argtypes = [vp]
        lib.cudaStreamSynchronize.argtypes = [vp]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._lib = lib

    def _ok(self, code: int, what: str) -> None:
        if code != 0:
            name = self._lib.cudaGetErrorString(code) or b"?"
            raise RuntimeError(f"{what} failed with CUDA error {code} ({name.decode(errors='replace')})")

    def set_device(self, index: int) -> None:
        """Make ``index`` the calling thread's device (threads start on device 0)."""
        self._ok(self._lib.cudaSetDevice(index), "cudaSetDevice")

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` from pinned host memory at ``src`` to ``dst`` on ``stream``."""
        self._ok(self._lib.cudaMemcpyAsync(dst, src, nbytes, self._MEMCPY_HOST_TO_DEVICE, stream),
                 "cudaMemcpyAsync")

    def new_event(self) -> int:
        """A fresh event without timing; give it back with :meth:`free_event`."""
        ev = ctypes.c_void_p()
        self._ok(self._lib.cudaEventCreateWithFlags(ctypes.byref(ev), self._EVENT_DISABLE_TIMING),
                 "cudaEventCreateWithFlags")
        return int(ev.value or 0)

    def record(self, event: int, stream: int) -> None:
        """Record ``event`` after the work queued on ``stream`` so far."""
        self._ok(self._lib.cudaEventRecord(event, stream), "cudaEventRecord")

    def wait_event(self, event: int) -> None:
        """Block until the work before ``event``'s last record has run."""
        self._ok(self._lib.cudaEventSynchronize(event), "cudaEventSynchronize")

    def free_event(self, event: int) -> None:
        self._ok(self._lib.cudaEventDestroy(event), "cudaEventDestroy")

    def sync_stream(self, stream: int) -> None:
        """Block until the work queued on ``stream`` has run."""
        self._ok(self._lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")


_RUNTIME: list[Runtime | None] = []  # [the runtime, or None where it is not found]; written once under _RUNTIME_LOCK
_RUNTIME_LOCK = threading.Lock()


def runtime() -> Runtime | None:
    """The CUDA runtime library this process loaded for PyTorch, or None: without CUDA, or
    where PyTorch links the runtime statically (callers then queue copies with ``torch``)."""
    with _RUNTIME_LOCK:
        if not _RUNTIME:
            _RUNTIME.append(_load_runtime())
        return _RUNTIME[0]


def _load_runtime() -> Runtime | None:
    if not available() or not torch.version.cuda:
        return None
    torch.cuda.init()  # (loads the runtime where PyTorch loads it lazily)
    name = f"libcudart.so.{torch.version.cuda.split('.')[0]}"
    try:  # only the library already loaded under that name: never a search, never a second runtime
        return Runtime(ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_NOW))
    except (OSError, AttributeError):  # not loaded under that name (linked statically), or a symbol missing
        return None
