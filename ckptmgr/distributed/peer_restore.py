"""Restore from the peer tier: each rank's shard from its node's RAM, else a peer's, else durable.

Every rank calls :func:`restore_newest_peer` together (it is collective, like every restore):

1. *inventory*: every rank lists the copies in its node's peer area
   (:meth:`~ckptmgr.storage.peer_tier.PeerArea.copies`); the lists are gathered, so every
   rank knows which node holds which shard of which step;
2. the candidates, newest first, are the steps the durable target lists and the steps some
   node holds a shard of; a step restores from the peer tier when it was saved at this
   world size and every shard has a copy in some node's RAM or on the durable target;
3. *records*: one holder of each shard sends its record; the step's manifest is merged from
   them as the commit does (no read of the durable target when every shard has a copy);
4. *fetch*: rank r takes saved rank r's shard: a copy on its own node that passes its
   checksums, else one sent by a holding node (the next one when a copy fails its checks),
   received into memory on the transport's device (NCCL: straight into GPU memory) and
   verified there (:class:`~ckptmgr.distributed.peer_memory.Into`), else, saying why, from the
   durable target. The fetches run on the job's own process group
   (:func:`~ckptmgr.distributed.peer_transport.restore_transport`: NCCL through GPU memory
   when the group has it, else gloo), not on the peer tier's gloo group: every rank is here,
   on the caller's thread, with the rounds drained;
5. the step is then restored by the multi-rank restore (:func:`restore_from`), taking each
   rank's files from where step 4 found them (a fetched shard's tensors as views of the
   memory it landed in, :meth:`PeerSource.staged`: nothing read twice, nothing written to
   this node's RAM; the replaced node holds copies again from the next save's round); a
   step that fails on any rank is skipped on all of them, and the next older candidate is
   tried.

Steps older than the newest step no node holds any shard of come from the durable target as
before (the restorer's ``restore_newest``), with a warning saying why the peer tier could not serve.
"""

from __future__ import annotations

import logging
import os
import stat
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import wait as wait_futures
from typing import Any, NamedTuple

import numpy as np
import torch

from .._threads import DaemonPool
from ..errors import CheckpointCorruptError, CkptTimeoutError, SaveError, StepNotFoundError
from ..format.manifest import FileRecord, Manifest
from ..restore.loaders.host import _build_views
from ..restore.loaders.landing import Landing
from ..restore.loaders.ring import entries_by_file
from ..storage.peer_tier import Copy, ShardRecord
from ..storage.posix import preadv_into
from .coordinator import Coordinator, owner_of
from .peer_memory import Into
from .peer_mover import Received, ShardMover
from .peer_transport import Transport, restore_transport
from .replicate import Replicator
from .restore import RankMap, Restorer
from .restore import _manifest as durable_manifest  # rank 0 reads it, every rank gets it
from .restore import _restore as restore_from  # the multi-rank restore of a step, from a given source
from .save import RankPart
from .save import _merge as merge_parts  # the commit's merge of every rank's part into the step's manifest

__all__ = ["FETCH_PIECE_BYTES", "PeerSource", "restore_newest_peer"]

log = logging.getLogger("ckptmgr")
FETCH_PIECE_BYTES = 16 << 20  # bytes per exchange of a restore's fetch (each cut into the transport's segments)


class PeerSource:
    """This rank's files of a step from the peer area (``local``: name -> path) or from memory
    (``images``: name -> the file's bytes, fetched from a peer and verified); any other file
    from the durable target."""

    def __init__(self, local: dict[str, str], durable: Any, url: str, io_pool: Any,
                 images: dict[str, torch.Tensor] | None = None) -> None:
        self._local, self._durable, self.url, self.io_pool = local, durable, url, io_pool
        self._images = images or {}

    def file_size(self, step: int, name: str) -> int:
        image = self._images.get(name)
        if image is not None:
            return image.numel()
        path = self._local.get(name)
        if path is None:
            return int(self._durable.file_size(step, name))
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorruptError(f"{path} is not a regular file")
        return st.st_size

    def read_into(self, step: int, name: str, offset: int, out: list[np.ndarray[Any, Any]]) -> None:
        image = self._images.get(name)
        if image is not None:
            if not 0 <= offset <= offset + sum(a.size for a in out) <= image.numel():
                raise CheckpointCorruptError(f"{self.url}: {name}: bytes from {offset} beyond its "
                                             f"{image.numel()}")
            at = offset
            for a in out:
                torch.from_numpy(a).copy_(image[at:at + a.size])
                at += a.size
            return
        path = self._local.get(name)
        if path is None:
            self._durable.read_into(step, name, offset, out)
            return
        d = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            preadv_into(os.path.basename(path), offset, out, dir_fd=d)
        finally:
            os.close(d)

    def path_of(self, step: int, name: str) -> str | None:
        if name in self._images:
            return None
        path = self._local.get(name)
        if path is not None:
            return path
        path_of = getattr(self._durable, "path_of", None)
        return path_of(step, name) if path_of is not None else None

    def staged(self, step: int, own: Manifest, device: torch.device, where: str) -> dict[str, torch.Tensor] | None:
        """The tensors of ``own`` (this rank's files of the step) as views of the fetched
        files' memory, when every one of them was fetched: verified as they arrived, nothing
        is read or copied again (the multi-rank restore then moves them into the target); a
        file fetched onto another device than ``device`` is copied there whole first. None
        when some file was not fetched, or ``device`` has no room for such a copy (the files
        are then read through :meth:`read_into`, as the restore decides)."""
        images = self._images
        if not own.files or any(f not in images for f in own.files):
            return None
        by_file = entries_by_file(own, where)
        out: dict[str, torch.Tensor] = {}
        for fname, rec in own.files.items():
            image = images[fname]
            if image.device != device:
                try:
                    image = image.to(device)
                except torch.OutOfMemoryError:
                    return None
            data = image[rec.header_size:]
            for e in by_file[fname]:
                if not 0 <= e.begin <= e.end <= data.numel():
                    raise CheckpointCorruptError(f"{where}: {fname}: tensor {e.name!r} at [{e.begin}, {e.end}) lies "
                                                 f"outside the file's {data.numel()} data bytes")
            out.update(Landing([], [(e, data[e.begin:e.end], False) for e in by_file[fname]]).tensors())
        _build_views(own, out, where)
        return out

    def steps(self) -> list[int]:
        return list(self._durable.list_steps())


def restore_newest_peer(rep: Replicator, restorer: Restorer, coord: Coordinator, durable: list[int], target: Any,
                        device: torch.device | None, loader: str, rank_map: RankMap | None = None,
                        step: int | None = None) -> Any:
    """The newest step complete across all ranks in some tier (or ``step``), each rank's shard
    taken from the nearest tier that verifies (see the module docstring)."""
    rep.drain(rep.opts.timeout_s)
    mine = [(c.record.step, c.rank, c.record.world) for c in rep.area.copies()]
    inventory = coord.all_gather((rep.node, mine), "the peer tier's inventory")
    holders: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))  # step -> shard -> ranks
    worlds: dict[int, set[int]] = defaultdict(set)
    seen_nodes: set[str] = set()
    for r, (node, copies) in enumerate(inventory):
        if node in seen_nodes:  # (ranks of one node list the same copies: its lowest rank speaks for it)
            continue
        seen_nodes.add(node)
        for s, shard, world in copies:
            holders[s][shard].append(r)
            worlds[s].add(world)
    durable_set = set(durable)
    candidates = sorted((durable_set | set(holders)) if step is None else {step}, reverse=True)
    for s in candidates:
        shards = holders.get(s, {})
        if not shards:
            older = [d for d in sorted(durable_set) if d <= s]
            warnings.warn(f"no node's RAM holds a shard of step {s} (more nodes were lost than the {rep.k} "
                          "replica(s) per shard cover, or the step was never replicated): restoring from the durable "
                          f"target {restorer.target.url}", RuntimeWarning, stacklevel=3)
            rep.count("peer_restore_durable")
            if step is not None and s not in durable_set:
                raise StepNotFoundError(f"step {s} is neither in the peer tier nor on {restorer.target.url}")
            return restorer.restore_newest(older, target, device, loader, rank_map)
        if worlds[s] != {coord.world}:
            warnings.warn(f"step {s} was saved by {sorted(worlds[s])} rank(s) and this job has {coord.world}: the "
                          "peer tier serves restores at the saved world size; trying the durable target",
                          RuntimeWarning, stacklevel=3)
            if s in durable_set:
                return restorer.restore_newest([d for d in sorted(durable_set) if d <= s], target,
                                           device, loader, rank_map)
            continue
        missing = [r for r in range(coord.world) if r not in shards]
        if missing and s not in durable_set:
            log.info("peer tier: step %d is not complete (no copy of the shards of ranks %s anywhere)", s, missing)
            continue
        try:
            return _restore_step(rep, restorer, coord, s, shards, s in durable_set, target, device, loader, rank_map)
        except (CheckpointCorruptError, StepNotFoundError) as exc:
            if step is not None:
                raise
            warnings.warn(f"skipping step {s}: {exc}", RuntimeWarning, stacklevel=3)
    raise StepNotFoundError(f"no step under {restorer.target.url} restores from any tier (tried {candidates})")


def _restore_step(rep: Replicator, restorer: Restorer, coord: Coordinator, s: int, shards: dict[int, list[int]],
                  on_durable: bool, target: Any, device: torch.device | None, loader: str,
                  rank_map: RankMap | None) -> Any:
    me = coord.rank
    copies = [c for c in rep.area.copies() if c.record.step == s]
    # 3. records: the first holder of each shard sends it (every rank gets all of them)
    mine = {c.rank: c.record.raw for c in copies if shards.get(c.rank, [None])[0] == me}
    got: dict[int, bytes] = {}
    for part in coord.all_gather(mine, f"the shard records of step {s}"):
        got.update(part)
    m = _manifest(restorer, coord, s, got, on_durable)
    # 4. fetch this rank's shard; its own copies here are checked beside the first round's transfers
    sources = [r for r in shards.get(me, []) if rep.nodes[r] != rep.node]
    mine_here = [c for c in copies if c.rank == me]
    own = _OwnCheck(rep, s, mine_here) if mine_here else None
    t1 = time.monotonic()
    try:
        with _Fetching(rep, coord, s, host=device is not None and device.type == "cpu") as fetching:
            fetched, failed = _fetch(rep, fetching, coord, s, shards, own=own, sources=sources,
                                     files={f: r for f, r in m.files.items() if owner_of(f) == me})
    finally:
        if own is not None:
            own.close()
    rep.count("peer_restore_fetch_s", time.monotonic() - t1)
    local = own.local if own is not None and own.local and fetched is None else {}
    images = fetched.files if fetched is not None else None
    why = own.why if own is not None else ""
    why = "; ".join(x for x in (why, failed) if x)
    if not local and images is None:
        why = why or "no node holds a copy of it"
        if on_durable:
            warnings.warn(f"step {s}: rank {me}'s shard is read from the durable target: {why}", RuntimeWarning,
                          stacklevel=4)
    fails = coord.all_gather(None if local or images is not None or on_durable else why,
                             f"fetching the shards of step {s}")
    bad_ranks = [r for r, f in enumerate(fails) if f]
    if bad_ranks:
        raise CheckpointCorruptError(f"step {s}: no verified copy of the shards of ranks {bad_ranks} in any tier")
    where = "own" if local else ("peer" if images is not None else "durable")
    rep.count(f"peer_restore_{where}")
    log.info("peer tier: step %d, rank %d: shard from %s", s, me, where)
    source = PeerSource(local, restorer.target, f"peer tier {rep.area.path}", rep.io, images)
    t2 = time.monotonic()
    try:
        with restorer.guard.reading(s):
            return restore_from(restorer, source, s, m, target, device, loader, rank_map, coord)
    finally:
        rep.count("peer_restore_load_s", time.monotonic() - t2)


def _manifest(restorer: Restorer, coord: Coordinator, s: int, raws: dict[int, bytes], on_durable: bool) -> Manifest:
    """The step's manifest: merged from every shard's record, else the durable target's."""
    if len(raws) == coord.world:
        recs = [ShardRecord.parse(raws[r], f"the shard record of rank {r} of step {s}") for r in range(coord.world)]
        parts = [RankPart(r.rank, r.step, state=r.manifest.state, tensors=r.manifest.tensors,
                          files={k: v.to_json() for k, v in r.manifest.files.items()}) for r in recs]
        try:
            merged = merge_parts(parts, recs[0].manifest)
        except SaveError as exc:  # (the same records on every rank: every rank raises this)
            raise CheckpointCorruptError(f"the peer tier's records of step {s} do not agree: {exc}") from None
        # every field checked as the durable commit's manifest is (the records' state trees too)
        return Manifest.from_bytes(merged.to_bytes(), where=f"the peer tier's records of step {s}")
    if not on_durable:
        raise CheckpointCorruptError(f"step {s}: shard records missing for ranks "
                                     f"{sorted(set(range(coord.world)) - set(raws))}")
    return durable_manifest(restorer, coord, s)


class _Fetching:
    """(every rank together) The mover of a restore's fetches, made when first needed: only
    once some rank asks for a shard (every rank sees the same asks, so every rank makes it at
    the same point), over the restore's transport
    (:func:`~ckptmgr.distributed.peer_transport.restore_transport`: the job's own group). On
    exit its staging is given back and its counters are added to the replicator's
    (``peer_fetch_*``)."""

    def __init__(self, rep: Replicator, coord: Coordinator, s: int, *, host: bool = False) -> None:
        self.rep, self.coord, self.s = rep, coord, s
        self.host = host  # (a restore onto the host: shards fetched land in host memory whatever the transport)
        self._transport: Transport | None = None
        self._mover: ShardMover | None = None

    def mover(self) -> ShardMover:
        if self._mover is None:
            rep = self.rep
            self._transport, why = restore_transport(self.coord, rep.meta, rep.opts.transport, rep.opts.timeout_s)
            log.info("peer tier: step %d: shards are fetched over %s", self.s, why)
            self._mover = ShardMover(self._transport, rep.area, rep.node, FETCH_PIECE_BYTES, None,
                                     rep.io)  # (no pacing: no training runs beside a restore)
        return self._mover

    def __enter__(self) -> _Fetching:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._transport is None or self._mover is None:
            return
        staged = self._transport.staging_bytes()
        self._transport.close()
        got = self._mover.stats()
        for key, name in (("peer_bytes_sent", "peer_fetch_bytes_sent"), ("peer_bytes_received",
                          "peer_fetch_bytes_received"), ("peer_transfer_s", "peer_fetch_s"),
                          ("peer_check_s", "peer_fetch_check_s"), ("peer_write_wait_s", "peer_fetch_write_wait_s"),
                          ("peer_bad_copies", "peer_bad_copies")):
            self.rep.count(name, got[key])
        self.rep.count("peer_fetch_staging_bytes", staged, peak=True)


_PENDING = -1  # an ask that says "my own copy is still being checked": the rounds go on


class Fetched(NamedTuple):
    """A shard fetched from a peer: its record, and its files in memory (verified)."""

    record: ShardRecord
    files: dict[str, torch.Tensor]


def _fetch(rep: Replicator, fetching: _Fetching, coord: Coordinator, s: int, shards: dict[int, list[int]], *,
           own: _OwnCheck | None, sources: list[int], files: dict[str, FileRecord]) -> tuple[Fetched | None, str]:
    """Rounds in which each rank still needing its shard asks the next holding node for it;
    every rank serves what it is asked. A rank with copies of its own (``own``) asks nothing
    in the first round while they are checked, then waits for that check and asks only if
    none passed. The shard asked for lands in memory on the transport's device (its GPU with
    NCCL), not in the peer area: it must be the shard whose files are ``files`` (the step's
    manifest's). Returns the shard received and verified (or None), and why the copies tried
    were not usable."""
    me = coord.rank
    need, pending = own is None, own is not None
    tried = 0
    why: list[str] = []
    rounds = 0
    while True:
        if pending and rounds:
            pending = False
            need = own is not None and not own.passed()
        ask = sources[tried] if need and tried < len(sources) else (_PENDING if pending else None)
        asks = coord.all_gather(ask, f"asking for the shards of step {s}")
        rounds += 1
        if all(a is None for a in asks):
            return None, "; ".join(why)
        got = _serve(rep, fetching, coord, s, asks, [ask] if ask is not None and ask >= 0 else [], files)
        if ask is None or ask < 0:
            continue
        tried += 1
        rec = got.get(ask, Received(None, False, None))
        if rec.ok and rec.record is not None and rec.record.rank == me and rec.record.step == s and \
                rec.files is not None:
            return _finish(rep, fetching, coord, s, Fetched(rec.record, rec.files)), ""
        if rec.local:  # (no other node's copy would fare better here: no more asks)
            why.append(f"this node could not take the copy from node {rep.nodes[ask]}: {rec.local}")
            log.warning("peer tier: step %d, rank %d: %s; asking no other node", s, me, why[-1])
            need = False
            continue
        why.append(f"the copy on node {rep.nodes[ask]} " + ("fails its check" if rec.record is not None else
                                                              "could not be received"))
        log.warning("peer tier: step %d, rank %d: the copy from rank %d (node %s) is not usable; %s", s, me, ask,
                    rep.nodes[ask], "trying the next node" if tried < len(sources) else "no other node holds one")


def _serve(rep: Replicator, fetching: _Fetching, coord: Coordinator, s: int, asks: Sequence[int | None],
           recvs: list[int], files: dict[str, FileRecord] | None = None) -> dict[int, Received]:
    """One round (every rank together, on the same ``asks``): send this node's copy to each
    rank that asked this rank, receive from ``recvs`` this rank's shard of step ``s`` and
    no other (its files ``files``), into memory on the transport's device. A round in which
    nobody asks a rank for anything moves nothing and leaves the mover unmade (every rank
    decides so alike)."""
    if not any(a is not None and a >= 0 for a in asks):
        return {}
    serve = [r for r, a in enumerate(asks) if a == coord.rank]
    held = {c.rank: c for c in rep.area.copies() if c.record.step == s}
    with _Mapped(rep, [held.get(r) for r in serve]) as mapped:
        sends = [(r, c.record if c is not None else None, fs) for r, (c, fs) in zip(serve, mapped, strict=True)]
        mover = fetching.mover()
        return mover.transfer(sends, recvs, own_node_ok=True, expect=dict.fromkeys(recvs, (coord.rank, s)),
                              into=Into(torch.device("cpu") if fetching.host else mover.transport.device,
                                        files or {}))


def _finish(rep: Replicator, fetching: _Fetching, coord: Coordinator, s: int, found: Fetched) -> Fetched:
    """Serve the remaining rounds (other ranks may still be fetching), then return ``found``."""
    while True:
        asks = coord.all_gather(None, f"asking for the shards of step {s}")
        if all(a is None for a in asks):
            return found
        _serve(rep, fetching, coord, s, asks, [])


class _OwnCheck:
    """This rank's own copies of its shard, checked against their records in a thread of
    their own (each checks its chunks on the replicator's I/O threads), while the restore's
    first round moves other ranks' shards; a copy that fails is removed from the area (its
    slot free again for the next saves' copies: a bad copy of the newest step would otherwise
    hold its slot as the newest, and with the other slot busy no later save could be copied).
    :meth:`passed` waits for the answer (bounded by the peer tier's timeout); then ``local``
    names the files of the first copy that passed (empty: none did) and ``why`` says what
    failed. The thread (a daemon: a check
    stuck in I/O never holds the process at exit) is the only writer of both; they are read
    only once :meth:`passed` has returned."""

    def __init__(self, rep: Replicator, s: int, copies: list[Copy]) -> None:
        self.rep, self.s, self.copies = rep, s, copies
        self.local: dict[str, str] = {}
        self.why = ""
        self._pool = DaemonPool(1, thread_name_prefix="ckptmgr-peer-check")
        self._done = self._pool.submit(self._run)

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            for c in self.copies:
                bad = self.rep.area.verify(c, self.rep.io)
                if bad is None:
                    self.local = {n: self.rep.area.path_of(c, n) for n in c.record.manifest.files}
                    return
                self.why = f"its copy on this node ({self.rep.node}) fails its check: {bad}"
                log.warning("peer tier: step %d, rank %d: %s; removed", self.s, c.rank, self.why)
                self.rep.area.discard(c)  # (its slot free for later saves' copies)
        finally:
            self.rep.count("peer_restore_check_s", time.monotonic() - t0)

    def passed(self) -> bool:
        """Whether a copy passed (waits for the check; its error, if any, is raised here).

        Raises:
            CkptTimeoutError: the check still runs after the peer tier's timeout.
        """
        done, _ = wait_futures([self._done], timeout=self.rep.opts.timeout_s)
        if not done:
            raise CkptTimeoutError(f"checking this node's copy of step {self.s} took over "
                                   f"{self.rep.opts.timeout_s:g} s")
        self._done.result()
        return bool(self.local)

    def close(self) -> None:
        """Let the thread go, without waiting: after a fetch that returned, :meth:`passed` has
        joined the check already (a rank with a copy of its own always asks in the second
        round); after one that failed, a check still running ends on its own, unread."""
        self._pool.shutdown(wait=False)


class _Mapped:
    """The files of several copies, mapped for the time of a transfer (None stays None)."""

    def __init__(self, rep: Replicator, copies: list[Copy | None]) -> None:
        self.rep, self.copies = rep, copies
        self._stack: list[Any] = []

    def __enter__(self) -> list[tuple[Copy | None, dict[str, np.ndarray[Any, Any]]]]:
        out: list[tuple[Copy | None, dict[str, np.ndarray[Any, Any]]]] = []
        for c in self.copies:
            if c is None:
                out.append((None, {}))
                continue
            cm = self.rep.area.mapped(c)
            out.append((c, cm.__enter__()))
            self._stack.append(cm)
        return out

    def __exit__(self, *exc: object) -> None:
        for cm in reversed(self._stack):
            cm.__exit__(None, None, None)
