"""The stager: copies planned tensors into a slot so that each segment is a file image.

GPU tensors are copied by DMA on one dedicated stream per device, ordered after the work
already queued on the caller's current stream (so the copy sees the finished values of the
step that produced them), all enqueued in one call per stream (``_foreach_copy_``: one GIL
round trip, not one per tensor behind the training thread's Python). CPU tensors are
copied in pieces by a few threads; torch's copy releases the GIL, so those threads run in
parallel with each other and with the caller.

:meth:`Stager.stage` returns once the copies are handed to the feeder thread, which enqueues
them; :meth:`StagingJob.wait_safe`
returns once every copy has read its source, after which the caller may change the state;
:meth:`StagingJob.wait` returns once every byte has *landed* in the slot. The two are the same
moment unless a device snapshot buffer is used (:mod:`ckptmgr.save.snapshot`): then the GPU
tensors are first copied into it, the state is safe to change after those device-to-device
copies, and the slot fills from the buffer afterwards. The job keeps the source tensors alive
until they have landed, so that freeing them cannot recycle their memory while a copy still
reads it.

A slot pinned in pieces (see :mod:`ckptmgr.save.buffers`) cannot take one device-to-host
copy across two pieces (CUDA refuses it), so a GPU tensor whose bytes straddle a piece
boundary is copied as flat byte ranges split there; a non-contiguous one is first made
contiguous on its device, as ``copy_`` itself would do.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _cuda
from .._threads import DaemonPool
from ..errors import CkptTimeoutError
from ..format.layout import ST_TO_DTYPE, Plan, StoredTensor
from .snapshot import DeviceBuffers, SnapshotPlan, buffer_view

__all__ = ["Stager", "StagingJob"]
LOOK_S = 0.02  # StagingJob.landed_or: this often it asks whether to give up

_PIECE = 8 << 20  # bytes per CPU copy task
_Pair = tuple[torch.Tensor, torch.Tensor]  # (destination, source)


def _dst_view(segment: torch.Tensor, header_size: int, t: StoredTensor) -> torch.Tensor:
    raw = segment[header_size + t.begin:header_size + t.end]
    return raw.view(ST_TO_DTYPE[t.dtype]).view(t.shape)


def _split_at(dst: torch.Tensor, src: torch.Tensor, begin: int, piece: int) -> list[_Pair]:
    """``(dst, src)`` as byte ranges that do not cross a multiple of ``piece`` (``dst`` starts at
    byte ``begin`` of its image)."""
    n = dst.numel() * dst.element_size()
    if piece <= 0 or n == 0 or begin // piece == (begin + n - 1) // piece:
        return [(dst, src)]
    d = dst.reshape(-1).view(torch.uint8)
    s = src.contiguous().reshape(-1).view(torch.uint8)
    out, pos = [], begin
    while pos < begin + n:
        end = min(begin + n, (pos // piece + 1) * piece)
        out.append((d[pos - begin:end - begin], s[pos - begin:end - begin]))
        pos = end
    return out


def _cpu_pieces(dst: torch.Tensor, src: torch.Tensor) -> list[_Pair]:
    """Split a CPU copy into flat byte pieces when both sides are contiguous."""
    if not src.is_contiguous() or src.numel() * src.element_size() <= _PIECE:
        return [(dst, src)]
    d = dst.reshape(-1).view(torch.uint8)
    s = src.reshape(-1).view(torch.uint8)
    return [(d[i:i + _PIECE], s[i:i + _PIECE]) for i in range(0, d.numel(), _PIECE)]


def _copy_all(pairs: list[_Pair]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


# dtypes that ``copy_`` copies and the one-kernel path of CUDA's ``_foreach_copy_`` does not
# (it is taken when all the pairs share a device, a dtype and strides: copies into a device
# snapshot buffer), as the dtype of their size that it does: the same bytes are copied
_AS_COPIED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64,
              torch.float8_e4m3fn: torch.uint8, torch.float8_e4m3fnuz: torch.uint8,
              torch.float8_e5m2: torch.uint8, torch.float8_e5m2fnuz: torch.uint8}


def _as_copied(dst: torch.Tensor, src: torch.Tensor) -> _Pair:
    like = _AS_COPIED.get(src.dtype)
    return (dst, src) if like is None or dst.dtype != src.dtype else (dst.view(like), src.view(like))


def _enqueue_copies(pairs: list[_Pair]) -> None:
    """Enqueue device copies on the current stream, all in one call: a ``copy_`` per pair
    gives the GIL up and takes it back once per pair, and while the training thread runs
    Python each taking waits for it (up to the 5 ms switch interval; 225 small copies took
    0.55-2.3 s beside a busy Python thread, one ``_foreach_copy_`` of them 0.4-9 ms)."""
    if pairs:
        pairs = [_as_copied(d, s) for d, s in pairs]
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs], non_blocking=True)


def _wait_events(done: _cuda.CopyDone, deadline: float | None, timeout: float | None, what: str) -> None:
    if deadline is None:
        done.synchronize()
        return
    while not done.query():
        if time.monotonic() > deadline:
            raise CkptTimeoutError(f"the {what} did not finish within {timeout} s")
        time.sleep(0.0005)


@dataclass
class _Enqueued:
    """What a staging task enqueued: the *landed* and *safe* events of its GPU copies (None:
    none; ``safe`` None: safe when landed) and the futures of its host-to-host copies."""

    done: _cuda.CopyDone | None = None
    safe: _cuda.CopyDone | None = None
    futures: list[Future[None]] = field(default_factory=list)
    keepalive: Any = None  # split copies' contiguous temporaries, until the copies land


class StagingJob:
    """The copies of one save: enqueued by the stager's feeder thread, and waitable until the
    state may change (*safe*) and until every byte is in the slot (*landed*).

    Written by whichever thread waits first (the training thread for *safe*, the local-commit
    or persist thread for *landed*): ``safe_at`` and ``finished_at`` only ever go from None to
    a time, and the values written are equivalent, so no lock is needed. ``enqueued`` is a
    future, resolved by the feeder thread once every copy is enqueued.
    """

    def __init__(self, enqueued: Future[_Enqueued] | None, keepalive: Any, *, snapshot_bytes: int = 0) -> None:
        self._enqueued = _resolved(_Enqueued()) if enqueued is None else enqueued
        self._keepalive: Any = keepalive
        self.snapshot_bytes = snapshot_bytes  # bytes copied through a device snapshot buffer
        self.setup_s = 0.0  # seconds the save spent making its slot or waiting while one was made (set once)
        self.finished_at: float | None = time.perf_counter() if enqueued is None else None
        self.safe_at: float | None = self.finished_at

    def _copies(self) -> _Enqueued | None:
        """What was enqueued, once all of it is; None before that and when the feeder failed
        (``_wait_enqueued`` raises its error)."""
        f = self._enqueued
        return f.result() if f.done() and f.exception() is None else None

    def _failed(self) -> bool:
        return self._enqueued.done() and self._enqueued.exception() is not None

    def done(self) -> bool:
        """True when every copy has landed (or failed)."""
        if self.finished_at is not None or self._failed():
            return True
        e = self._copies()
        return e is not None and all(f.done() for f in e.futures) and (e.done is None or e.done.query())

    def safe(self) -> bool:
        """True when every copy has read its source: the state may be changed."""
        if self.safe_at is not None or self._failed():
            return True
        e = self._copies()
        if e is None:
            return False
        if e.safe is None:
            return self.done()
        return all(f.done() for f in e.futures) and e.safe.query()

    def _wait_enqueued(self, timeout: float | None) -> _Enqueued:
        """Block until every copy is enqueued, raising the feeder's error if it had one."""
        done, _ = wait_futures([self._enqueued], timeout)
        if not done:
            raise CkptTimeoutError(f"the staging copies were not all enqueued within {timeout} s")
        return self._enqueued.result()

    @staticmethod
    def _wait_futures(futures: list[Future[None]], timeout: float | None) -> None:
        _, pending = wait_futures(futures, timeout)
        if pending:
            raise CkptTimeoutError(f"the staging copies did not finish within {timeout} s")
        for f in futures:
            f.result()

    @staticmethod
    def _left(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def wait_safe(self, timeout: float | None = None) -> None:
        """Block until every copy has read its source (then the state may be changed).

        Raises:
            CkptTimeoutError: copies still running after ``timeout`` seconds.
            Exception: the error of a failed copy.
        """
        if self.safe_at is not None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        e = self._wait_enqueued(timeout)
        if e.safe is None:
            self.wait(self._left(deadline))
            return
        self._wait_futures(e.futures, self._left(deadline))
        _wait_events(e.safe, deadline, timeout, "copies off the state's GPU tensors")
        self.safe_at = time.perf_counter()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every copy has landed.

        Raises:
            CkptTimeoutError: copies still running after ``timeout`` seconds.
            Exception: the error of a failed copy.
        """
        if self.finished_at is not None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        e = self._wait_enqueued(timeout)
        self._wait_futures(e.futures, self._left(deadline))
        if e.done is not None:
            _wait_events(e.done, deadline, timeout, "device-to-host copies")
        self.finished_at = time.perf_counter()
        if self.safe_at is None:
            self.safe_at = self.finished_at
        self._keepalive = e.keepalive = None  # the sources may be freed now

    def landed_or(self, given_up: Callable[[], bool], timeout: float) -> bool:
        """Wait until every copy has landed (True), or until ``given_up()`` is true, the copies
        failed or ``timeout`` seconds passed (False); ``given_up`` is asked every
        :data:`LOOK_S` seconds."""
        deadline = time.monotonic() + timeout
        while not given_up():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                self.wait(min(LOOK_S, left))
                return True
            except CkptTimeoutError:
                continue
            except Exception:
                return False
        return False


class Stager:
    """Copies plans into slots. Create it and call :meth:`stage` from the training thread.

    :meth:`stage` does only what must happen on the caller's thread at the moment of the
    save: it marks, on each device's current stream, the point the copies must come after,
    and makes any device snapshot buffer the save needs. Everything else (the per-tensor
    views and every copy) is enqueued by one *feeder* thread, in save order. The training
    thread thus never blocks on a full CUDA launch queue: a stream holds about a thousand
    pending operations, and the copies of a state of more tensors than that, queued behind
    the step still running, would otherwise hold the caller until that step ended, and then
    for as long as the first copies took to make room, with the GPU idle meanwhile.

    Args:
        copy_threads: threads for host-to-host copies.
        device_buffer_bytes: the device snapshot buffer's size per device (0: none; see
            :mod:`ckptmgr.save.snapshot`).
        daemon: False for ordinary worker threads, for owners that stop them at a known
            point (a Lightning plugin's teardown) and must leave no daemon thread behind.
    """

    def __init__(self, copy_threads: int, *, device_buffer_bytes: int = 0, daemon: bool = True) -> None:
        self._pool: DaemonPool | ThreadPoolExecutor = (
            DaemonPool(copy_threads, thread_name_prefix="ckptmgr-copy") if daemon
            else ThreadPoolExecutor(copy_threads, thread_name_prefix="ckptmgr-copy"))
        self._feeder: DaemonPool | ThreadPoolExecutor = (
            DaemonPool(1, thread_name_prefix="ckptmgr-stage") if daemon
            else ThreadPoolExecutor(1, thread_name_prefix="ckptmgr-stage"))
        self._threads = copy_threads
        self._streams: dict[torch.device, Any] = {}  # (training thread)
        self.buffers = DeviceBuffers(device_buffer_bytes)  # (training thread)

    def _stream(self, device: torch.device) -> Any:
        # Made on first use from the caller's thread; see _cuda.staging_stream.
        if device not in self._streams:
            self._streams[device] = _cuda.staging_stream(device)
        return self._streams[device]

    def reserve(self, plan: Plan) -> None:
        """Make the copy streams and allocate the device snapshot buffers ``plan`` needs now,
        so that the first save does not (nothing is copied). Making a stream can take a
        quarter of a second while the GPU has a long queue of work (measured on an H100)."""
        for device in dict.fromkeys(t.source.device for f in plan.files for t in f.tensors):
            if device.type == "cuda":
                self._stream(device)
        for device, n in self.buffers.plan(plan).needed.items():
            self.buffers.get(device, n, self._stream(device))

    def stage(self, plan: Plan, segments: list[torch.Tensor], piece: int = 0) -> StagingJob:
        """Start copying ``plan`` into ``segments`` (one per file): every copy is enqueued by
        the feeder thread, after the work queued on the caller's current streams when this is
        called (so the copies see the state as it is now). No device-to-host copy crosses a
        multiple of ``piece`` bytes of its segment (0: no limit).

        If anything fails once copies are enqueued, the ones already enqueued are waited for
        before the job reports the error: the slot may be reused after it.
        """
        snap = self.buffers.plan(plan)
        made = [self.buffers.get(d, n, self._stream(d)) for d, n in snap.needed.items()]  # every device
        if not all(made):
            snap = self.buffers.plan(plan)  # within what the devices had room for
        devices = list(dict.fromkeys(t.source.device for f in plan.files for t in f.tensors
                                     if t.source.device.type != "cpu"))
        ready = {d: _cuda.ready_event(d) for d in devices}  # where each device's copies start
        streams = {d: self._stream(d) for d in devices}
        buffers = {d: self.buffers.buffer(d) for d in snap.needed}
        enqueued = self._feeder.submit(self._enqueue, plan, segments, piece, snap, ready, streams, buffers)
        return StagingJob(enqueued, keepalive=plan, snapshot_bytes=snap.bytes)

    # ------------------------------------------------------------ feeder thread

    def _enqueue(self, plan: Plan, segments: list[torch.Tensor], piece: int, snap: SnapshotPlan,
                 ready: dict[torch.device, Any], streams: dict[torch.device, Any],
                 buffers: dict[torch.device, torch.Tensor]) -> _Enqueued:
        gpu: dict[torch.device, list[_Pair]] = defaultdict(list)
        through: dict[torch.device, list[_Pair]] = defaultdict(list)  # (buffer view, source)
        cpu: list[_Pair] = []
        for i, (f, seg) in enumerate(zip(plan.files, segments, strict=True)):
            hs = len(f.header)
            seg[:hs].copy_(torch.frombuffer(bytearray(f.header), dtype=torch.uint8))
            for t in f.tensors:
                if t.end == t.begin:
                    continue
                held = snap.through.get((i, hs + t.begin))
                if held is not None:
                    device, at = held
                    through[device].append((buffer_view(buffers[device], at, t), t.source))
                    continue
                pair = (_dst_view(seg, hs, t), t.source)
                if t.source.device.type == "cpu":
                    cpu.extend(_cpu_pieces(*pair))
                else:
                    gpu[t.source.device].extend(_split_at(*pair, hs + t.begin, piece))
        out = _Enqueued()
        used: list[Any] = []
        try:
            out.safe, out.done = self._enqueue_gpu(snap, gpu, through, segments, piece, ready, streams, buffers,
                                                   used)
            if cpu:
                self._submit_cpu(cpu, out.futures)
        except BaseException:
            try:  # the copies already enqueued land first (bounded, as Saver.save bounds its own wait)
                StagingJob(_resolved(_Enqueued(_cuda.CopyDone(used) if used else None, None, out.futures)),
                           None).wait(timeout=60)
            except BaseException:
                pass  # (the error raised is the first one)
            raise
        out.keepalive = (gpu, through)
        return out

    @staticmethod
    def _enqueue_gpu(snap: SnapshotPlan, gpu: dict[torch.device, list[_Pair]],
                     through: dict[torch.device, list[_Pair]], segments: list[torch.Tensor], piece: int,
                     ready: dict[torch.device, Any], streams: dict[torch.device, Any],
                     buffers: dict[torch.device, torch.Tensor],
                     used: list[Any]) -> tuple[_cuda.CopyDone | None, _cuda.CopyDone | None]:
        """Each device's stream: the copies into its buffer and the direct copies, the *safe*
        event, the drains from the buffer, the *landed* event. ``used`` collects the streams
        used so far (for the caller's clean-up)."""
        devices = list(dict.fromkeys([*through, *gpu]))
        if not devices:
            return None, None
        for device in devices:
            stream = streams[device]
            used.append(stream)
            stream.wait_event(ready[device])
            with torch.cuda.stream(stream):
                _enqueue_copies([*through.get(device, ()), *gpu.get(device, ())])
        safe = None
        if snap.runs:
            safe = _cuda.CopyDone(used)
            drains: dict[torch.device, list[_Pair]] = defaultdict(list)
            for r in snap.runs:
                src = buffers[r.device][r.at:r.at + r.end - r.begin]
                drains[r.device].extend(_split_at(segments[r.file][r.begin:r.end], src, r.begin, piece))
            for device, pairs in drains.items():
                with torch.cuda.stream(streams[device]):
                    _enqueue_copies(pairs)
        return safe, _cuda.CopyDone(used)

    def _submit_cpu(self, cpu: list[_Pair], futures: list[Future[None]]) -> None:
        total = sum(d.numel() * d.element_size() for d, _ in cpu)
        per_task = max(_PIECE, -(-total // self._threads))
        batch: list[_Pair] = []
        size = 0
        for pair in cpu:
            batch.append(pair)
            size += pair[0].numel() * pair[0].element_size()
            if size >= per_task:
                futures.append(self._pool.submit(_copy_all, batch))
                batch, size = [], 0
        if batch:
            futures.append(self._pool.submit(_copy_all, batch))

    def close(self, timeout: float | None = None) -> None:
        self.buffers.clear()
        for pool in (self._feeder, self._pool):  # (the feeder first: it submits to the copy pool)
            if isinstance(pool, DaemonPool):
                pool.stop(timeout=timeout)
            else:
                pool.shutdown(wait=True)


def _resolved(value: _Enqueued) -> Future[_Enqueued]:
    f: Future[_Enqueued] = Future()
    f.set_result(value)
    return f
