"""How the peer tier's bytes travel between two ranks: ``torch.distributed`` point-to-point calls.

:class:`~ckptmgr.distributed.peer_mover.ShardMover` cuts a shard into exchanges; each runs on a
:class:`Transport`: ``dist.batch_isend_irecv`` on one process group, through one device.
Replication carries the arrays on the peer tier's gloo group (host memory, TCP): never on the
job's group nor through NCCL or any CUDA call, since the replication thread runs while
the training thread runs its own collectives (see :mod:`ckptmgr.distributed.replicate`). A
restore's fetches (:func:`restore_transport`) run on the caller's thread while every rank is
inside the restore, lock-step, with the rounds drained: they use the job's own group, through
GPU memory and NCCL when that group runs CUDA tensors on NCCL (at most ``RESTORE_GPU_BYTES``
of GPU memory and as much pinned host memory for what is sent; segments of ``SEGMENT_BYTES``,
host copies by ``COPY_METHOD`` on ``COPY_THREADS`` threads; what is received lands straight in
the GPU memory the fetch gives, with no staging), else host memory on gloo.

Thread ownership: a transport is used by one thread at a time (its mover's: the replication
thread, or the caller's during a restore after the rounds are drained).
"""

from __future__ import annotations

import datetime
import logging
import warnings
from concurrent.futures import Executor
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._threads import DaemonPool
from ..errors import CkptTimeoutError, ConfigError
from .coordinator import Coordinator

__all__ = ["COPY_METHOD", "COPY_METHODS", "COPY_THREADS", "RESTORE_GPU_BYTES", "SEGMENT_BYTES", "Buffer", "Transport",
           "restore_transport", "split_copy"]

log = logging.getLogger("ckptmgr")
RESTORE_GPU_BYTES = 256 << 20  # the most GPU memory a restore's NCCL transport stages through (and pinned host memory)
# (besides the fetched shards themselves, received into GPU memory of their own)
SEGMENT_BYTES = 16 << 20  # the most bytes of an array a restore moves per sub-round (a whole 16 MiB piece)
COPY_METHODS = ("pinned", "pageable")  # how a CUDA transport moves a segment between a host array and the GPU
COPY_METHOD = "pinned"  # a restore's: through pinned staging (see Transport)
COPY_THREADS = 4  # a restore's threads per host copy of a segment into or out of pinned staging (1: the caller's)
COPY_PIECE_BYTES = 512 << 10  # the fewest bytes one thread of a split host copy moves
Buffer = np.ndarray[Any, Any] | torch.Tensor  # what bytes are received into (see Transport.exchange)


def split_copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], threads: int,
               pool: Executor | None, timeout_s: float) -> None:
    """Copy ``src`` into ``dst`` (contiguous 1-D arrays of one size) in up to ``threads``
    contiguous pieces of at least ``COPY_PIECE_BYTES``: the first on the calling thread, the
    others on ``pool`` (numpy lets go of the GIL while it copies a large block, so the pieces
    run at once). Returns once every piece has landed, also when one failed (its error is
    raised then); a piece still running after ``timeout_s`` raises :class:`CkptTimeoutError`."""
    if dst.shape != src.shape:
        raise ValueError(f"a host copy of {src.size} bytes into {dst.size}")
    n = src.nbytes
    k = max(1, min(threads, n // COPY_PIECE_BYTES))
    if k == 1 or pool is None:
        np.copyto(dst, src)
        return
    cut = [n * i // k // 4096 * 4096 for i in range(k)] + [n]  # (page-aligned pieces)
    futs = [pool.submit(np.copyto, dst[cut[i]:cut[i + 1]], src[cut[i]:cut[i + 1]]) for i in range(1, k)]
    try:
        np.copyto(dst[:cut[1]], src[:cut[1]])
    finally:  # (never return while a piece may still write into dst)
        _, late = wait_futures(futs, timeout=timeout_s)
        if late:
            for f in late:  # (those not started yet never will)
                f.cancel()
            raise CkptTimeoutError(f"a host copy of {n} bytes in {k} pieces did not end within {timeout_s:g} s")
    for f in futs:
        f.result()


def _nbytes(a: Buffer) -> int:
    return a.size if isinstance(a, np.ndarray) else a.numel()


def _host_tensor(a: np.ndarray[Any, Any]) -> torch.Tensor:
    """The tensor sharing a host array's memory (read-only arrays too: only read through it)."""
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():  # (torch warns that writes through it would be undefined)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class Transport:
    """Point-to-point exchanges of host arrays (and receives into device memory) on one
    process group, through one device.

    Every array of an exchange is cut into segments of ``segment_bytes`` (None: sent whole);
    segment j of every array travels in sub-round j, one ``dist.batch_isend_irecv`` per
    sub-round, and sub-round j + 1 is launched before sub-round j is waited for (both ends of
    a pair cut an array of one size the same way, so the segments pair up).

    * ``device`` "cpu": the host arrays themselves are sent and received (gloo: host memory
      over TCP). The peer tier's replication always runs so, on its own gloo group; so does
      a restore's fetch on a job whose group has no NCCL, on that group. ``copy_method`` and
      ``copy_threads`` do not apply.
    * ``device`` CUDA (a restore's fetch on a job group whose CUDA backend is NCCL): a segment
      goes from the host array to the GPU, NCCL to the peer's GPU, then to the peer's host
      array, or, received into a CUDA tensor (a fetched shard's memory), straight into it,
      with no staging and no copy (the stream is synchronized before :meth:`exchange`
      returns). Staging on the GPU is two halves (the sub-round in flight and the next) of one
      device buffer of at most ``2 x (host arrays sent and received) x segment_bytes`` bytes,
      made at the first exchange that needs it and reused, given back by :meth:`close`. How
      a segment crosses between host and GPU (``copy_method``):

      - "pinned": through a pinned host buffer of the device buffer's size: host array ->
        pinned (a host copy) -> GPU (an asynchronous copy), and back the same way. A host
        copy is split across ``copy_threads`` threads (:func:`split_copy`; a pool of
        ``copy_threads - 1`` threads per transport, made when first needed, ended by
        :meth:`close`); the host copies of sub-round j + 1 overlap the transfer of
        sub-round j.
      - "pageable": no pinned staging: ``dev.copy_(host)`` and ``host.copy_(dev)`` straight
        between the host array and the GPU (CUDA stages pageable memory itself; each copy
        returns when it has landed).

      Copies run on the current CUDA stream (NCCL's stream waits on it). A sub-round's
      staging is reused two sub-rounds later, only after its transfers were waited for, its
      copies out of the GPU synchronized and its host copies joined.

    Every wait is bounded: by ``timeout_s`` when given (``Work.wait(timeout)``, which holds
    the calling thread until the transfer ends or raises when the time passes, for gloo and
    NCCL alike; a split host copy's pieces too), else by the group's own timeout (the host
    copies' pieces by ``coord.timeout_s``); the CUDA stream is synchronized only after those
    waits, when only local copies are left. Used by one thread at a time (see the module
    docstring); its staging and copy pool are that thread's.

    Raises:
        ConfigError: an unknown ``copy_method``, ``copy_threads`` below 1, or ``segment_bytes``
            below 1.
    """

    def __init__(self, coord: Coordinator, group: Any, device: torch.device | None = None, *,
                 segment_bytes: int | None = None, timeout_s: float | None = None,
                 copy_threads: int = COPY_THREADS, copy_method: str = COPY_METHOD) -> None:
        if copy_method not in COPY_METHODS:
            raise ConfigError(f"the peer tier's copy method {copy_method!r} is none of {COPY_METHODS}")
        if copy_threads < 1:
            raise ConfigError(f"the peer tier's host copies need at least one thread, not {copy_threads}")
        if segment_bytes is not None and segment_bytes < 1:
            raise ConfigError(f"the peer tier's transfers need segments of at least one byte, not {segment_bytes}")
        self.coord, self.group = coord, group
        self.device = device or torch.device("cpu")
        self.segment_bytes, self.timeout_s = segment_bytes, timeout_s
        self.copy_threads, self.copy_method = copy_threads, copy_method
        self._dev: torch.Tensor | None = None  # the staging buffers (CUDA only), two halves each
        self._pin: torch.Tensor | None = None  # (None with the "pageable" method)
        self._pool: DaemonPool | None = None  # the host copies' threads ("pinned", copy_threads > 1)

    def __repr__(self) -> str:
        return f"Transport({dist.get_backend(self.group)}, {self.device})"

    def exchange(self, sends: list[tuple[int, np.ndarray[Any, Any]]], recvs: list[tuple[int, Buffer]]) -> None:
        """Send each (rank, bytes) and receive each (rank, buffer), all at once; every array
        is a contiguous uint8 array (received ones writable); empty ones are skipped (both
        ends agree on the size). A buffer received into may also be a contiguous uint8 tensor
        in the memory the group carries (on this transport's GPU, or on the host with
        ``device`` "cpu"): the bytes land in it with no staging."""
        g = self.coord.global_rank
        ops = [(True, g(r), a) for r, a in sends if a.size] + [(False, g(r), a) for r, a in recvs if _nbytes(a)]
        seg = self.segment_bytes or max((_nbytes(a) for _, _, a in ops), default=1)
        subs = max((-(-_nbytes(a) // seg) for _, _, a in ops), default=0)
        staged = sum(1 for _, _, a in ops if isinstance(a, np.ndarray))  # (those that go through staging)
        if self.device.type == "cuda" and staged:
            self._reserve(2 * staged * seg)
        pending: tuple[list[Any], list[tuple[np.ndarray[Any, Any], int]]] | None = None
        for j in range(subs):
            parts = [(send, peer, a[j * seg:(j + 1) * seg]) for send, peer, a in ops if _nbytes(a) > j * seg]
            launched = self._launch(parts, (j % 2) * staged * seg, seg)
            if pending is not None:
                self._finish(*pending)
            pending = launched
        if pending is not None:
            self._finish(*pending)
        if self.device.type == "cuda" and staged < len(ops):  # (bytes landed in GPU memory: there once this returns)
            torch.cuda.current_stream(self.device).synchronize()

    def _copy(self, dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        """A host copy into or out of pinned staging, split across the copy threads."""
        if self.copy_threads > 1 and self._pool is None:
            self._pool = DaemonPool(self.copy_threads - 1, thread_name_prefix="ckptmgr-peer-stage")
        split_copy(dst, src, self.copy_threads, self._pool,
                   self.timeout_s if self.timeout_s is not None else self.coord.timeout_s)

    def _launch(self, parts: list[tuple[bool, int, Buffer]], base: int,
                seg: int) -> tuple[list[Any], list[tuple[np.ndarray[Any, Any], int]]]:
        """Start one sub-round: its works, and where its received segments land (CUDA: the
        host array and the staging offset it is copied back from)."""
        p2p: list[Any] = []
        landing: list[tuple[np.ndarray[Any, Any], int]] = []
        k = 0  # (the staging slot of the next array that goes through staging)
        for send, peer, a in parts:
            if isinstance(a, torch.Tensor):  # (received in place)
                if a.device != self.device or a.dtype != torch.uint8 or not a.is_contiguous():
                    raise ValueError(f"a peer tier transfer through {self.device} cannot receive into a {a.dtype} "
                                     f"tensor on {a.device}" + ("" if a.is_contiguous() else " (not contiguous)"))
                t = a
            elif self._dev is None:
                t = _host_tensor(a)
            else:
                at = base + k * seg
                k += 1
                t = self._dev[at:at + a.size]
                if not send:
                    landing.append((a, at))
                elif self._pin is None:  # "pageable": straight from the host array
                    t.copy_(_host_tensor(a))
                else:
                    self._copy(self._pin[at:at + a.size].numpy(), a)
                    t.copy_(self._pin[at:at + a.size], non_blocking=True)
            p2p.append(dist.P2POp(dist.isend if send else dist.irecv, t, peer, group=self.group))
        return [w for w in dist.batch_isend_irecv(p2p) if w is not None] if p2p else [], landing

    def _finish(self, works: list[Any], landing: list[tuple[np.ndarray[Any, Any], int]]) -> None:
        for w in works:
            if self.timeout_s is None:
                w.wait()
            elif w.wait(datetime.timedelta(seconds=self.timeout_s)) is False:
                raise CkptTimeoutError(f"a peer tier transfer on {self!r} did not end within {self.timeout_s:g} s")
        if self._dev is None:
            return
        if self._pin is None:  # "pageable": each copy returns when it has landed
            for a, at in landing:
                torch.from_numpy(a).copy_(self._dev[at:at + a.size])
        else:
            for a, at in landing:
                self._pin[at:at + a.size].copy_(self._dev[at:at + a.size], non_blocking=True)
        # (after the waits: only local copies are left; the sub-round's staging is free after this)
        torch.cuda.current_stream(self.device).synchronize()
        if self._pin is not None:
            for a, at in landing:
                self._copy(a, self._pin[at:at + a.size].numpy())

    def _reserve(self, nbytes: int) -> None:
        """Staging buffers of at least ``nbytes`` (CUDA)."""
        if self._dev is not None and self._dev.numel() >= nbytes:
            return
        self._dev = self._pin = None
        self._dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.copy_method == "pinned":
            self._pin = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def staging_bytes(self) -> int:
        """The GPU memory held now (the pinned host memory is the same amount with the
        "pinned" method, none with "pageable")."""
        return 0 if self._dev is None else self._dev.numel()

    def close(self) -> None:
        """Give the staging buffers and the copy threads back. No wait: an exchange that ended
        has synchronized and joined its copies already, and after one that failed (a peer
        gone, a timeout) the caching allocators keep the memory until the transfers queued on
        it end, without holding this thread."""
        self._dev = self._pin = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _backend_for(group: Any, device_type: str) -> str:
    """The backend ``group`` runs ``device_type`` tensors on ("gloo", "nccl", ...); "" when none.
    From the group's device map (``"cpu:gloo,cuda:nccl"``; ``"nccl"`` alone maps CUDA only,
    ``"gloo"`` alone both)."""
    try:
        config = str(dist.get_backend_config(group))
    except (ValueError, RuntimeError, AttributeError):  # (a group torch keeps no map of)
        config = str(dist.get_backend(group))
    if ":" not in config:
        return config
    for part in config.split(","):
        dev, _, backend = part.partition(":")
        if dev.strip() == device_type:
            return backend.strip()
    return ""


def restore_transport(coord: Coordinator, tier_group: Any, mode: str, timeout_s: float) -> tuple[Transport, str]:
    """The transport of a restore's fetches (every rank calls this together), and why it was
    chosen. ``mode`` "gloo": the peer tier's gloo group. Otherwise the job's own group: CUDA
    through NCCL when its CUDA backend is NCCL and CUDA is available, else host memory when it
    runs CPU tensors on gloo, else the peer tier's gloo group. The job's group is safe here,
    and only here: every rank is inside the restore, lock-step, on the caller's thread, with
    the replication rounds drained and no training collective in flight.

    GPU memory (CUDA) for staging: at most ``RESTORE_GPU_BYTES``, and ``2 x (host arrays sent
    and received) x segment`` in an exchange (a fetch's shard is received into GPU memory of
    its own, with no staging: see :class:`~ckptmgr.distributed.peer_memory.Into`), the segment
    being ``min(SEGMENT_BYTES,
    RESTORE_GPU_BYTES / (4 x (ranks - 1)))`` (rounded down to 4 KiB; every rank computes the
    same one, so the segments of a pair match); the same in pinned host memory with the
    "pinned" ``COPY_METHOD``, none with "pageable". With the 256 MiB cap a 64 MiB segment is
    kept whole up to 2 ranks and shrinks beyond (32 MiB at 3 ranks, 16 MiB at 5, about 9 MiB
    at 8); a 128 MiB one is cut to 64 MiB even at 2. Host copies: ``COPY_THREADS`` threads
    each. A first collective on the job's group
    (an all-reduce of one element) makes sure every rank has joined it before the batched
    point-to-point calls (NCCL asks for that).
    """
    seg = max(4096, min(SEGMENT_BYTES, RESTORE_GPU_BYTES // (4 * max(1, coord.world - 1))) // 4096 * 4096)
    if mode == "gloo":
        pick, why = "tier", "the peer tier's gloo group (PeerOptions(transport='gloo'))"
    elif _backend_for(coord.group, "cuda") == "nccl" and torch.cuda.is_available():
        pick, why = "cuda", "the job's process group (NCCL, through GPU memory)"
    elif _backend_for(coord.group, "cpu") == "gloo":
        pick, why = "cpu", "the job's process group (gloo)"
    else:
        pick, why = "tier", f"the peer tier's gloo group (the job's group runs {dist.get_backend(coord.group)})"
    picks = coord.all_gather(pick, "choosing the peer tier's restore transport")
    if len(set(picks)) > 1:  # (ranks that disagree would pair calls on different groups)
        pick, why = "tier", f"the peer tier's gloo group (the ranks' choices differ: {picks})"
    device = None
    if pick == "cuda":  # the group's own device when it was made with one, else this thread's current one
        bound = getattr(coord.group, "bound_device_id", None)
        device = bound if isinstance(bound, torch.device) else torch.device("cuda", torch.cuda.current_device())
    t = Transport(coord, tier_group if pick == "tier" else coord.group, device, segment_bytes=seg,
                  timeout_s=timeout_s, copy_threads=COPY_THREADS, copy_method=COPY_METHOD)
    one = torch.zeros(1, device=t.device)
    w = dist.all_reduce(one, group=t.group, async_op=True)
    if w is not None and w.wait(datetime.timedelta(seconds=timeout_s)) is False:
        raise CkptTimeoutError(f"joining {why} for the peer tier's restore took over {timeout_s:g} s")
    return t, why
