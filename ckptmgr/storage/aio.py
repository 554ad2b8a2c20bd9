"""Linux native asynchronous reads (``io_submit``): many direct reads in flight from one thread.

The kernel queues each submitted read and completes it without a thread of ours waiting in
it, so the queue stays full however slowly Python gets back to it. Measured on an H200
machine's disk, one thread keeping sixteen 512 KiB ``O_DIRECT`` reads in flight, each
submitted on its own, read a cold 4 GiB step in 1.43 s, where fastsafetensors' sixteen C++
threads took 1.52 s and sixteen Python threads issuing the same reads 2.10 s
(``benchmarks/results/h200-2026-11-23d`` and ``-23e``).

Used through the system call numbers of x86-64 and AArch64, with ctypes; elsewhere (or where
a container refuses ``io_setup``) :func:`open_context` returns ``None`` and callers read
another way.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from typing import Any, NamedTuple

__all__ = ["AioContext", "Completion", "open_context"]

# io_setup, io_destroy, io_getevents, io_submit
_CALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}.get(platform.machine())
_PREAD = 0  # IOCB_CMD_PREAD


class _Iocb(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class Completion(NamedTuple):
    tag: int  # as submitted
    result: int  # bytes read, or -errno


def _syscall(library: type[ctypes.CDLL]) -> Any:
    try:
        fn = library(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


# ``syscall`` called the usual way, letting other threads run meanwhile (for the calls that wait),
# and holding the GIL (for a submission: see AioContext)
_SYSCALL = _syscall(ctypes.CDLL) if _CALLS is not None else None
_SYSCALL_HELD = _syscall(ctypes.PyDLL) if _CALLS is not None else None


class AioContext:
    """One kernel AIO context of ``depth`` slots, used by one thread. Each read is submitted
    under a slot number (its tag), which is free again once its completion is reaped.

    A submission holds the GIL: released, it would hand the GIL to a thread of the caller's
    waiting for it (a restore's verifier threads, between their checksums and copies), and the
    read loop would wait to get it back, once per read. On H200 machines, submitting a 4 GiB
    step's 8196 reads took 0.149 s (0.121-0.190) holding it, 0.297 s (0.191-0.429) releasing it,
    in 32 and 20 restores (``benchmarks/results/h200-2026-11-23i/cold-read``); the restore as a
    whole gained from that only with the reaps kept in bunches (:mod:`~ckptmgr.restore.transports.direct`).
    An ``O_DIRECT`` submission to a local disk only queues the read (about 18 us each, there),
    but it can sleep: for a request slot while other processes load the device, for extent
    blocks of a file not yet mapped, or for the whole read where a filesystem does direct I/O
    synchronously; every thread of the caller's waits that long for the GIL. A reap, which
    waits for the disk, lets other threads run.
    """

    def __init__(self, ctx: ctypes.c_ulong, depth: int, syscall: Any, numbers: tuple[int, int, int, int],
                 held: Any = None) -> None:
        self.depth = depth
        self._ctx = ctx
        self._syscall = syscall
        self._held = held or syscall  # the same call, holding the GIL
        self._destroy, self._getevents, self._submit = numbers[1:]
        self._iocbs = (_Iocb * depth)()  # slot i's request; the kernel reads it at submission
        self._ptrs = (ctypes.POINTER(_Iocb) * depth)()
        self._one = []  # per slot: the one-element request list handed to io_submit
        for slot, cb in enumerate(self._iocbs):
            cb.data, cb.opcode = slot, _PREAD
            self._ptrs[slot] = ctypes.pointer(cb)
            self._one.append(ctypes.byref(self._ptrs, slot * ctypes.sizeof(ctypes.c_void_p)))
        self._events = (_Event * depth)()

    def submit_one(self, slot: int, fd: int, offset: int, nbytes: int, address: int) -> None:
        """Queue one read under ``slot`` (free: never submitted, or reaped): ``nbytes`` from
        ``offset`` of ``fd`` into memory at ``address``, which must stay valid until reaped.

        One read per system call: reads submitted together are merged by the block layer into
        requests of up to ``max_sectors_kb``, which a virtual disk serves fewer at a time.

        Raises:
            OSError: the kernel refused it.
        """
        cb = self._iocbs[slot]
        cb.fildes, cb.buf, cb.nbytes, cb.offset = fd, address, nbytes, offset
        while True:
            n = self._held(self._submit, self._ctx, 1, self._one[slot])  # (the GIL held: see the class)
            if n == 1:
                return
            err = ctypes.get_errno() if n < 0 else errno.EAGAIN
            if err != errno.EINTR:
                raise OSError(err, f"io_submit: {os.strerror(err)}")

    def reap(self, timeout: float, at_least: int = 1) -> list[Completion]:
        """The completions in once ``at_least`` of them are (all that are in then), or those in
        when ``timeout`` seconds have passed (maybe none)."""
        ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
        n = self._syscall(self._getevents, self._ctx, max(1, min(at_least, self.depth)), self.depth, self._events,
                          ctypes.byref(ts))
        if n < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                return []
            raise OSError(err, f"io_getevents: {os.strerror(err)}")
        events = self._events
        return [Completion(events[i].data, events[i].res) for i in range(n)]

    def close(self) -> None:
        """Destroy the context; the kernel first waits for every read still in flight. Once
        only: later calls do nothing."""
        if self._ctx.value:
            self._syscall(self._destroy, self._ctx)
            self._ctx.value = 0


def open_context(depth: int) -> AioContext | None:
    """A context for ``depth`` reads in flight, or ``None`` where this system has none to give
    (another OS or CPU, ``io_setup`` refused, or ``fs.aio-max-nr`` reached)."""
    if _CALLS is None or _SYSCALL is None:
        return None
    ctx = ctypes.c_ulong(0)
    if _SYSCALL(_CALLS[0], depth, ctypes.byref(ctx)) != 0:
        return None
    return AioContext(ctx, depth, _SYSCALL, _CALLS, _SYSCALL_HELD)
