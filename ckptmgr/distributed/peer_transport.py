"""How the peer tier moves a shard between two ranks: ``torch.distributed`` point-to-point calls.

:class:`ShardMover` sends shards (a record, then the files' bytes) to ranks and receives shards
from ranks into this node's peer area (:class:`~ckptmgr.storage.peer_tier.PeerArea`), in one
call that every rank named on either side makes at the same time (the replication rounds and
the restore's fetches are lock-step). Each exchange is a header (step, record size, data size),
the record, then the bytes in pieces of ``chunk_bytes`` cut from the files' concatenated
stream, paced by ``max_bytes_per_s``. What a rank receives is untrusted: the header is bounded
before anything is allocated, the record is validated, and the copy is committed only when every
chunk matches the record's checksums; a refused shard's bytes are drained through one reused
buffer.

Transport (:class:`Transport`): ``dist.batch_isend_irecv`` on one process group, through one
device. Replication carries the arrays on the peer tier's gloo group (host memory, TCP): never
on the job's group nor through NCCL or any CUDA call, since the replication thread runs while
the training thread runs its own collectives (see :mod:`ckptmgr.distributed.replicate`). A
restore's fetches (:func:`restore_transport`) run on the caller's thread while every rank is
inside the restore, lock-step, with the rounds drained: they use the job's own group, through
GPU memory and NCCL when that group runs CUDA tensors on NCCL (at most ``RESTORE_GPU_BYTES``
of GPU memory and as much pinned host memory; segments of ``SEGMENT_BYTES``, host copies by
``COPY_METHOD`` on ``COPY_THREADS`` threads), else host memory on gloo.

Thread ownership: a mover is used by one thread at a time (the replication thread, or the
caller's during a restore after the rounds are drained); ``_mu`` guards only its counters.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CkptError, CkptTimeoutError, ConfigError
from ..format.schema import MAX_MANIFEST_BYTES
from ..storage.peer_tier import IncomingFile, PeerArea, ShardRecord, check_files
from .coordinator import Coordinator

__all__ = ["COPY_METHOD", "COPY_METHODS", "COPY_THREADS", "MAX_SHARD_BYTES", "RESTORE_GPU_BYTES", "SEGMENT_BYTES",
           "ShardMover", "Transport", "restore_transport", "split_copy"]

log = logging.getLogger("ckptmgr")
MAX_SHARD_BYTES = 1 << 44  # the most bytes a peer may announce for one shard (16 TiB)
RESTORE_GPU_BYTES = 256 << 20  # the most GPU memory a restore's NCCL transport stages through (and pinned host memory)
SEGMENT_BYTES = 4 << 20  # the most bytes of an array a restore moves per sub-round
COPY_METHODS = ("pinned", "pageable")  # how a CUDA transport moves a segment between a host array and the GPU
COPY_METHOD = "pinned"  # a restore's: through pinned staging (see Transport)
COPY_THREADS = 1  # a restore's threads per host copy of a segment into or out of pinned staging (1: the caller's)
COPY_PIECE_BYTES = 512 << 10  # the fewest bytes one thread of a split host copy moves
Sends = list[tuple[int, ShardRecord | None, dict[str, np.ndarray[Any, Any]]]]


def split_copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], threads: int,
               pool: ThreadPoolExecutor | None, timeout_s: float) -> None:
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


def _host_tensor(a: np.ndarray[Any, Any]) -> torch.Tensor:
    """The tensor sharing a host array's memory (read-only arrays too: only read through it)."""
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():  # (torch warns that writes through it would be undefined)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class Transport:
    """Point-to-point exchanges of host arrays on one process group, through one device.

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
      array. Staging on the GPU is two halves (the sub-round in flight and the next) of one
      device buffer of at most ``2 x (ranks sent to + ranks received from) x segment_bytes``
      bytes, made at the first exchange that needs it and reused, given back by
      :meth:`close`. How a segment crosses between host and GPU (``copy_method``):

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
        self._pool: ThreadPoolExecutor | None = None  # the host copies' threads ("pinned", copy_threads > 1)

    def __repr__(self) -> str:
        return f"Transport({dist.get_backend(self.group)}, {self.device})"

    def exchange(self, sends: list[tuple[int, np.ndarray[Any, Any]]],
                 recvs: list[tuple[int, np.ndarray[Any, Any]]]) -> None:
        """Send each (rank, bytes) and receive each (rank, buffer), all at once; every array
        is a contiguous uint8 array (received ones writable); empty ones are skipped (both
        ends agree on the size)."""
        g = self.coord.global_rank
        ops = [(True, g(r), a) for r, a in sends if a.size] + [(False, g(r), a) for r, a in recvs if a.size]
        seg = self.segment_bytes or max((a.size for _, _, a in ops), default=1)
        subs = max((-(-a.size // seg) for _, _, a in ops), default=0)
        if self.device.type == "cuda":
            self._reserve(2 * len(ops) * seg)
        pending: tuple[list[Any], list[tuple[np.ndarray[Any, Any], int]]] | None = None
        for j in range(subs):
            parts = [(send, peer, a[j * seg:(j + 1) * seg]) for send, peer, a in ops if a.size > j * seg]
            launched = self._launch(parts, (j % 2) * len(ops) * seg, seg)
            if pending is not None:
                self._finish(*pending)
            pending = launched
        if pending is not None:
            self._finish(*pending)

    def _copy(self, dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        """A host copy into or out of pinned staging, split across the copy threads."""
        if self.copy_threads > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(self.copy_threads - 1, thread_name_prefix="ckptmgr-peer-copy")
        split_copy(dst, src, self.copy_threads, self._pool,
                   self.timeout_s if self.timeout_s is not None else self.coord.timeout_s)

    def _launch(self, parts: list[tuple[bool, int, np.ndarray[Any, Any]]], base: int,
                seg: int) -> tuple[list[Any], list[tuple[np.ndarray[Any, Any], int]]]:
        """Start one sub-round: its works, and where its received segments land (CUDA: the
        host array and the staging offset it is copied back from)."""
        p2p: list[Any] = []
        landing: list[tuple[np.ndarray[Any, Any], int]] = []
        for k, (send, peer, a) in enumerate(parts):
            if self._dev is None:
                t = _host_tensor(a)
            else:
                at = base + k * seg
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

    GPU memory (CUDA): at most ``RESTORE_GPU_BYTES``, and ``2 x (ranks sent to + received
    from) x segment`` in an exchange, the segment being ``min(SEGMENT_BYTES,
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


def _pieces(files: list[np.ndarray[Any, Any]], size: int) -> list[list[np.ndarray[Any, Any]]]:
    """The files' bytes, concatenated, cut into pieces of ``size`` (:func:`_cut`): each piece as
    the list of the file parts it covers (both sides cut the same stream the same way)."""
    return [[files[k][at:at + n] for k, at, n in piece] for piece in _cut([a.size for a in files], size)]


def _cut(sizes: list[int], size: int) -> list[list[tuple[int, int, int]]]:
    """Files of ``sizes``, concatenated, cut into pieces of ``size``: each piece as (file index,
    offset in it, bytes) for each file part it covers."""
    out: list[list[tuple[int, int, int]]] = [[]]
    room = size
    for k, n_file in enumerate(sizes):
        at = 0
        while at < n_file:
            if room == 0:
                out.append([])
                room = size
            n = min(room, n_file - at)
            out[-1].append((k, at, n))
            at += n
            room -= n
    return [p for p in out if p]


class _Incoming(NamedTuple):
    """A shard being received from one rank: its record and slot (None: refused, its bytes
    dropped), its files, the data bytes it announced."""

    rec: ShardRecord | None
    slot: int | None
    files: list[IncomingFile]
    nbytes: int


class ShardMover:
    """Sends and receives shards (see the module docstring).

    Args:
        transport: the groups the bytes travel on.
        area: this node's peer area, where received shards land.
        node: this rank's node identity.
        chunk_bytes: bytes per piece.
        max_bytes_per_s: the most bytes per second this rank sends (None: no limit).
        io: the threads that check received copies' checksums.
    """

    def __init__(self, transport: Transport, area: PeerArea, node: str, chunk_bytes: int,
                 max_bytes_per_s: float | None, io: Any) -> None:
        self.transport, self.area, self.node, self.io = transport, area, node, io
        self.chunk_bytes, self.max_bytes_per_s = chunk_bytes, max_bytes_per_s
        self._mu = threading.Lock()
        self.counts: dict[str, float] = {"peer_bytes_sent": 0, "peer_bytes_received": 0, "peer_bad_copies": 0,
                                         "peer_transfer_s": 0.0}  # (_mu) peer_transfer_s: seconds moving bytes

    def stats(self) -> dict[str, float]:
        with self._mu:
            return dict(self.counts)

    def transfer(self, sends: Sends,
                 recvs: list[int], *, own_node_ok: bool) -> dict[int, tuple[ShardRecord | None, bool]]:
        """Send each (rank, record, files) (record None: tell the rank there is nothing);
        receive a shard from each rank of ``recvs`` into this node's peer area. Returns, per
        source, the record received (None: nothing, or refused) and whether the copy passed
        its checks and was committed. Every rank named on one side must name this rank on the
        other side in the same call."""
        t = self.transport
        heads = {s: np.zeros(3, dtype=np.int64) for s in recvs}
        t.exchange([(d, np.array([rec.step, len(rec.raw), sum(a.size for a in fs.values())] if rec is not None
                                 else [-1, 0, 0], dtype=np.int64).view(np.uint8)) for d, rec, fs in sends],
                   [(s, h.view(np.uint8)) for s, h in heads.items()])
        sends = [x for x in sends if x[1] is not None]
        for s, h in heads.items():
            if not 0 <= h[1] <= MAX_MANIFEST_BYTES or not 0 <= h[2] <= MAX_SHARD_BYTES:
                raise CkptError(f"rank {s} announced a shard record of {h[1]} bytes and {h[2]} data bytes")
        raws = {s: np.zeros(int(h[1]), dtype=np.uint8) for s, h in heads.items() if h[1]}
        t.exchange([(d, np.frombuffer(rec.raw, dtype=np.uint8).copy()) for d, rec, _ in sends if rec is not None],
                   list(raws.items()))
        incoming: dict[int, _Incoming] = {}
        out: dict[int, tuple[ShardRecord | None, bool]] = {}  # (also: the slots committed or aborted)
        try:
            try:
                for s in recvs:
                    incoming[s] = self._open(s, raws.get(s), int(heads[s][2]), own_node_ok)
                self._pump(sends, incoming)
                mapped = {s: [f.mapped() for f in inc.files] for s, inc in incoming.items() if inc.rec is not None}
            finally:
                for inc in incoming.values():
                    for f in inc.files:
                        f.close()
            for s, inc in incoming.items():
                rec, slot = inc.rec, inc.slot
                if rec is None or slot is None:
                    out[s] = (None, False)
                    continue
                bad = check_files(rec, dict(zip(rec.manifest.files, mapped[s], strict=True)), self.io)
                if bad is None:
                    self.area.commit(rec.rank, slot, rec)
                else:
                    self.area.abort(rec.rank, slot)
                    with self._mu:
                        self.counts["peer_bad_copies"] += 1
                    log.warning("peer tier: the copy of step %d of rank %d that rank %d sent fails its check (%s); "
                                "not kept", rec.step, rec.rank, s, bad)
                out[s] = (rec, bad is None)
        except BaseException:  # a slot taken and not settled is given back, emptied (never committed)
            for s, inc in incoming.items():
                if s not in out and inc.rec is not None and inc.slot is not None:
                    self.area.abort(inc.rec.rank, inc.slot)
            raise
        return out

    def _open(self, s: int, raw: np.ndarray[Any, Any] | None, nbytes: int, own_node_ok: bool) -> _Incoming:
        """Where the shard rank ``s`` announced (its record ``raw``, ``nbytes`` of data) lands:
        the files of a slot taken for it, or nowhere (refused: its bytes are received and
        dropped)."""
        rec: ShardRecord | None = None
        slot = None
        files: list[IncomingFile] = []
        if raw is not None:
            try:
                rec = ShardRecord.parse(raw.tobytes(), f"the shard record rank {s} sent")
                if not own_node_ok and rec.node == self.node:
                    raise CkptError(f"rank {s} sent a shard saved on this very node ({rec.node})")
                slot = self.area.take_slot(rec.rank)
                if slot is None:
                    raise CkptError(f"every slot of rank {rec.rank}'s shard here is held")
                files = list(self.area.receive(rec.rank, slot, rec).values())
            except (CkptError, OSError) as exc:
                log.warning("peer tier: the shard rank %d sent is not kept: %s", s, exc)
                if rec is not None and slot is not None:
                    self.area.abort(rec.rank, slot)
                rec, slot, files = None, None, []
            except BaseException:
                if rec is not None and slot is not None:
                    self.area.abort(rec.rank, slot)
                raise
        if sum(f.size for f in files) != nbytes:
            for f in files:
                f.close()
            if rec is not None and slot is not None:
                self.area.abort(rec.rank, slot)
            return _Incoming(None, None, [], nbytes)
        return _Incoming(rec, slot, files, nbytes)

    def _pump(self, sends: Sends, incoming: dict[int, _Incoming]) -> None:
        """Move the files' bytes, piece by piece, paced by ``max_bytes_per_s``. Each source's
        pieces are received into one buffer of ``chunk_bytes`` reused for all of them (never
        an allocation of the size a peer announced), then written into the files they belong
        to (:meth:`IncomingFile.write`); a refused shard's are dropped."""
        size = self.chunk_bytes
        out_pieces = [(d, _pieces(list(fs.values()), size)) for d, _, fs in sends]
        in_pieces = {s: _cut([f.size for f in inc.files] or [inc.nbytes], size) for s, inc in incoming.items()}
        scratch = {s: np.empty(min(size, inc.nbytes), dtype=np.uint8) for s, inc in incoming.items() if inc.nbytes}
        rounds = max([*(len(p) for _, p in out_pieces), *(len(p) for p in in_pieces.values())], default=0)
        start, sent = time.monotonic(), 0
        for i in range(rounds):
            tx: list[tuple[int, np.ndarray[Any, Any]]] = []
            rx: list[tuple[int, np.ndarray[Any, Any]]] = []
            for d, pieces in out_pieces:
                if i < len(pieces):
                    buf = pieces[i][0] if len(pieces[i]) == 1 else np.concatenate(pieces[i])
                    tx.append((d, buf))
                    sent += buf.size
            for s, cuts in in_pieces.items():
                if i < len(cuts):
                    rx.append((s, scratch[s][:sum(n for _, _, n in cuts[i])]))
            self.transport.exchange(tx, rx)
            for s, cuts in in_pieces.items():
                files = incoming[s].files
                if i < len(cuts) and files:
                    at = 0
                    for k, offset, n in cuts[i]:
                        files[k].write(offset, scratch[s][at:at + n])
                        at += n
            if self.max_bytes_per_s:  # pace: never ahead of the allowed rate
                ahead = sent / self.max_bytes_per_s - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
        with self._mu:
            self.counts["peer_bytes_sent"] += sent
            self.counts["peer_bytes_received"] += sum(inc.nbytes for inc in incoming.values())
            self.counts["peer_transfer_s"] += time.monotonic() - start
