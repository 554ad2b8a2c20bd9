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

:class:`Transport` carries the arrays on the peer tier's gloo group (host memory, TCP): never on
the job's group nor through NCCL or any CUDA call, since the replication thread runs while the
training thread runs its own collectives (see :mod:`ckptmgr.distributed.replicate`).

Thread ownership: a mover is used by one thread at a time (the replication thread, or the
caller's during a restore after the rounds are drained); ``_mu`` guards only its counters.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CkptError
from ..format.schema import MAX_MANIFEST_BYTES
from ..storage.peer_tier import PeerArea, ShardRecord, check_files
from .coordinator import Coordinator

__all__ = ["MAX_SHARD_BYTES", "ShardMover", "Transport"]

log = logging.getLogger("ckptmgr")
MAX_SHARD_BYTES = 1 << 44  # the most bytes a peer may announce for one shard (16 TiB)
Sends = list[tuple[int, ShardRecord | None, dict[str, np.ndarray[Any, Any]]]]


class Transport:
    """Point-to-point exchanges of host arrays over the peer tier's gloo group."""

    def __init__(self, coord: Coordinator, group: Any) -> None:
        self.coord, self.group = coord, group

    def exchange(self, sends: list[tuple[int, np.ndarray[Any, Any]]],
                 recvs: list[tuple[int, np.ndarray[Any, Any]]]) -> None:
        """Send each (rank, bytes) and receive each (rank, buffer), all at once; every array
        is a contiguous uint8 array (received ones writable). Each wait is bounded by the
        group's timeout (gloo raises when it passes)."""
        g = self.coord.global_rank
        works = [dist.isend(torch.from_numpy(a), dst=g(r), group=self.group) for r, a in sends]
        works += [dist.irecv(torch.from_numpy(a), src=g(r), group=self.group) for r, a in recvs]
        for w in works:
            if w is not None:
                w.wait()


def _pieces(files: list[np.ndarray[Any, Any]], size: int) -> list[list[np.ndarray[Any, Any]]]:
    """The files' bytes, concatenated, cut into pieces of ``size``: each piece as the list of
    the file parts it covers (both sides cut the same stream the same way)."""
    out: list[list[np.ndarray[Any, Any]]] = [[]]
    room = size
    for arr in files:
        at = 0
        while at < arr.size:
            if room == 0:
                out.append([])
                room = size
            n = min(room, arr.size - at)
            out[-1].append(arr[at:at + n])
            at += n
            room -= n
    return [p for p in out if p]


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
        incoming: dict[int, tuple[ShardRecord | None, int | None, list[np.ndarray[Any, Any]]]] = {}
        for s in recvs:
            rec: ShardRecord | None = None
            slot = None
            bufs: list[np.ndarray[Any, Any]] = []
            if s in raws:
                try:
                    rec = ShardRecord.parse(raws[s].tobytes(), f"the shard record rank {s} sent")
                    if not own_node_ok and rec.node == self.node:
                        raise CkptError(f"rank {s} sent a shard saved on this very node ({rec.node})")
                    slot = self.area.take_slot(rec.rank)
                    if slot is None:
                        raise CkptError(f"every slot of rank {rec.rank}'s shard here is held")
                    bufs = list(self.area.create(rec.rank, slot, rec).values())
                except (CkptError, OSError) as exc:
                    log.warning("peer tier: the shard rank %d sent is not kept: %s", s, exc)
                    if rec is not None and slot is not None:
                        self.area.abort(rec.rank, slot)
                    rec, slot, bufs = None, None, []
            if sum(b.size for b in bufs) != heads[s][2]:
                if rec is not None and slot is not None:
                    self.area.abort(rec.rank, slot)
                rec, slot, bufs = None, None, self._discard(int(heads[s][2]))
            incoming[s] = (rec, slot, bufs)
        self._pump(sends, incoming)
        out: dict[int, tuple[ShardRecord | None, bool]] = {}
        for s, (rec, slot, bufs) in incoming.items():
            if rec is None or slot is None:
                out[s] = (None, False)
                continue
            bad = check_files(rec, dict(zip(rec.manifest.files, bufs, strict=True)), self.io)
            if bad is None:
                self.area.commit(rec.rank, slot, rec)
            else:
                self.area.abort(rec.rank, slot)
                with self._mu:
                    self.counts["peer_bad_copies"] += 1
                log.warning("peer tier: the copy of step %d of rank %d that rank %d sent fails its check (%s); "
                            "not kept", rec.step, rec.rank, s, bad)
            out[s] = (rec, bad is None)
        return out

    def _discard(self, nbytes: int) -> list[np.ndarray[Any, Any]]:
        """Where the bytes of a refused shard go: one reused buffer of ``chunk_bytes``, never
        an allocation of the size a peer announced."""
        size = self.chunk_bytes
        scratch = np.empty(min(size, nbytes), dtype=np.uint8)
        return [scratch] * (nbytes // size) + ([scratch[:nbytes % size]] if nbytes % size else [])

    def _pump(self, sends: Sends,
              incoming: dict[int, tuple[ShardRecord | None, int | None, list[np.ndarray[Any, Any]]]]) -> None:
        """Move the files' bytes, piece by piece, paced by ``max_bytes_per_s``."""
        size = self.chunk_bytes
        out_pieces = [(d, _pieces(list(fs.values()), size)) for d, _, fs in sends]
        in_pieces = {s: _pieces(bufs, size) for s, (_, _, bufs) in incoming.items()}
        rounds = max([*(len(p) for _, p in out_pieces), *(len(p) for p in in_pieces.values())], default=0)
        start, sent = time.monotonic(), 0
        for i in range(rounds):
            tx: list[tuple[int, np.ndarray[Any, Any]]] = []
            rx: list[tuple[int, np.ndarray[Any, Any]]] = []
            scatter = []
            for d, pieces in out_pieces:
                if i < len(pieces):
                    buf = pieces[i][0] if len(pieces[i]) == 1 else np.concatenate(pieces[i])
                    tx.append((d, buf))
                    sent += buf.size
            for s, pieces in in_pieces.items():
                if i < len(pieces):
                    parts = pieces[i]
                    dst = parts[0] if len(parts) == 1 else np.empty(sum(p.size for p in parts), dtype=np.uint8)
                    rx.append((s, dst))
                    if len(parts) > 1:
                        scatter.append((dst, parts))
            self.transport.exchange(tx, rx)
            for dst, parts in scatter:
                at = 0
                for p in parts:
                    p[:] = dst[at:at + p.size]
                    at += p.size
            if self.max_bytes_per_s:  # pace: never ahead of the allowed rate
                ahead = sent / self.max_bytes_per_s - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
        with self._mu:
            self.counts["peer_bytes_sent"] += sent
            self.counts["peer_bytes_received"] += sum(b.size for _, _, bs in incoming.values() for b in bs)
            self.counts["peer_transfer_s"] += time.monotonic() - start
