"""The peer tier: each rank's shard of a step copied to RAM on its node and sent to k peers.

After ``save()`` has staged a rank's shard (the copy the training step already pays), two
background threads of that rank take over; the training thread never waits for them:

* the *copy* thread copies the shard from the staging slot into the rank's slot of its
  node's peer area (:class:`~ckptmgr.storage.peer_tier.PeerArea`), checksumming each chunk
  of the copy, and commits it there. The persist thread waits for this copy (not the
  training thread) before the durable commit releases the staging slot;
* the *replication* thread runs one *round* per save, on every rank in the same order: it
  sends the newest copy it has not sent yet to its k peers and receives its sources'
  copies into the peer area, each checked against its record's CRC32C before it is
  committed there, then all ranks exchange receipts, so every rank knows which steps are
  *replicated* (every rank's shard has k confirmed copies on other nodes).

Peers (:func:`peers_of`): the nodes are ordered by their lowest rank; replica j of a rank
goes to the rank at the same place on the j-th next node, so no replica shares a node with
its source and each rank sends and receives about k shards per round.

Transport: ``torch.distributed`` point-to-point calls on one gloo group the replicator creates
at manager start, from the training thread, in the same order on every rank (as every group
must be made): headers, records, receipts and the bytes all travel on it (host memory over
TCP). Traffic is paced: pieces of ``chunk_bytes``, and at most ``max_bytes_per_s`` when set.

Threads and collectives (the rules that keep a GPU job from deadlocking):

* the replication thread runs collectives on the peer tier's own gloo group only, never on
  the job's group (the training thread's: DDP's all-reduces, the user's barriers) nor on the
  coordinator's groups (the save's agreements run on the persist thread). Two threads issuing
  collectives on one group interleave them in different orders on different ranks;
* no NCCL: an NCCL communicator driven from a background thread while the training thread
  runs its own NCCL collectives can deadlock. NCCL kernels block until the peer's kernel
  runs, a rank may launch the two communicators' kernels in the other order than its peer,
  and any CUDA call that synchronizes the device (a ``cudaMalloc`` of the caching allocator,
  a copy on the default stream the training thread also uses) then waits on a kernel that
  waits on it. The shard is in host memory already, so gloo moves it without a GPU hop;
  ``PeerOptions(transport="nccl")`` is refused;
* the background threads launch no CUDA work and allocate no GPU memory: the copy thread
  reads the pinned staging slot with numpy after :meth:`~ckptmgr.save.staging.StagingJob.wait`
  (which only queries the staging engine's CUDA events, as the persist thread does);
* every wait has a timeout: rounds and copies ``PeerOptions.timeout_s`` (the gloo group's
  timeout too), :meth:`Replicator.drain` and :meth:`Replicator.close` the caller's.

Thread ownership: ``_mu`` guards the round queue, the copies made, the receipts and the
counters; the replication group is used by the replication thread only, except by
:func:`~ckptmgr.distributed.peer_restore.restore_newest_peer` (training thread) after
:meth:`Replicator.drain`, which also fetches over the job's own group there (every rank inside
the restore, lock-step, no training collective in flight: the one place NCCL may carry shards).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.distributed as dist

from .._threads import DaemonPool
from ..errors import CkptError, CkptTimeoutError, ConfigError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import FileRecord, Manifest
from ..save.persist import PersistJob, StepCommit
from ..storage import StepWriter, Target
from ..storage.peer_tier import Copy, PeerArea, ShardRecord
from .coordinator import Coordinator
from .peer_mover import ShardMover
from .peer_transport import Transport

__all__ = ["NODE_ENV", "PeerOptions", "Replicator", "peers_of", "start_peers"]

log = logging.getLogger("ckptmgr")
NODE_ENV = "CKPTMGR_NODE"  # the node identity, when PeerOptions(node=None); default: the hostname


@dataclass(frozen=True)
class PeerOptions:
    """The peer tier of a multi-rank job (see docs/DISTRIBUTED.md, "Peer tier").

    Args:
        replicas: k, the copies of each rank's shard kept in other nodes' RAM.
        node: this process's node identity (ranks with the same one share a node and its RAM);
            None: the ``CKPTMGR_NODE`` environment variable, else the hostname.
        local_dir: the RAM directory of the node's peer area; None: ``StagingOptions.local_dir``.
        slots: copies kept per shard on a node (at least 2: the newest stays while the next lands).
        chunk_bytes: bytes sent per piece by the replication rounds (a restore's fetches move
            pieces of ``peer_restore.FETCH_PIECE_BYTES``).
        max_bytes_per_s: the most bytes per second a rank sends (None: no limit).
        transport: where a restore fetches shards from peers. "auto": on the job's own
            process group, through GPU memory and NCCL when that group runs CUDA tensors on
            NCCL, else host memory on gloo (see
            :func:`~ckptmgr.distributed.peer_transport.restore_transport`); "gloo": on the
            peer tier's own gloo group. Replication always runs on the peer tier's gloo group
            (host bytes over TCP). "nccl" is refused: NCCL driven from the replication thread
            while training runs NCCL collectives can deadlock (see the module docstring).
        timeout_s: how long one round, or one exchange of a restore, may take.
    """

    replicas: int = 1
    node: str | None = None
    local_dir: str | None = None
    slots: int = 2
    chunk_bytes: int = 16 << 20
    max_bytes_per_s: float | None = None
    transport: str = "auto"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if type(self.replicas) is not int or self.replicas < 1:
            raise ConfigError(f"PeerOptions.replicas must be an int >= 1, got {self.replicas!r}")
        if type(self.slots) is not int or self.slots < 2:
            raise ConfigError(f"PeerOptions.slots must be an int >= 2, got {self.slots!r}")
        if type(self.chunk_bytes) is not int or self.chunk_bytes < 4096:
            raise ConfigError(f"PeerOptions.chunk_bytes must be an int >= 4096, got {self.chunk_bytes!r}")
        if self.transport == "nccl":
            raise ConfigError("PeerOptions.transport='nccl' is not supported: NCCL collectives from the peer "
                              "tier's background thread can deadlock against the training loop's NCCL "
                              "collectives; the default, 'auto', replicates on gloo and fetches a "
                              "restore's shards over NCCL when the job's group has it")
        if self.transport not in ("auto", "gloo"):
            raise ConfigError(f"PeerOptions.transport must be 'auto' or 'gloo', got {self.transport!r}")
        if self.max_bytes_per_s is not None and not self.max_bytes_per_s > 0:
            raise ConfigError(f"PeerOptions.max_bytes_per_s must be None or > 0, got {self.max_bytes_per_s!r}")

    def node_name(self) -> str:
        return self.node or os.environ.get(NODE_ENV) or socket.gethostname()


def peers_of(nodes: list[str], k: int) -> tuple[dict[int, list[int]], str]:
    """Rank -> the ranks holding its k replicas, given every rank's node, and why fewer than
    k when there are fewer than k + 1 nodes ("" otherwise)."""
    order: list[str] = []
    members: dict[str, list[int]] = collections.defaultdict(list)
    for r, n in enumerate(nodes):
        if n not in members:
            order.append(n)
        members[n].append(r)
    kk = min(k, len(order) - 1)
    why = "" if kk == k else (f"{len(order)} node(s) ({', '.join(order)}) hold at most {kk} replica(s) on other "
                              f"nodes; {k} asked for")
    out: dict[int, list[int]] = {}
    for i, n in enumerate(order):
        for place, r in enumerate(members[n]):
            out[r] = [members[order[(i + j) % len(order)]][place % len(members[order[(i + j) % len(order)]])]
                      for j in range(1, kk + 1)]
    return out, why


class Replicator:
    """One rank's side of the peer tier (see the module docstring)."""

    def __init__(self, opts: PeerOptions, coord: Coordinator, local_dir: str, root_url: str, chunk_size: int) -> None:
        self.opts, self.coord, self.chunk_size = opts, coord, chunk_size
        self.node = opts.node_name()
        self.nodes: list[str] = coord.all_gather(self.node, "peer tier start-up (node identities)")
        self.dests, why = peers_of(self.nodes, opts.replicas)
        self.sources = [s for s, ds in self.dests.items() if coord.rank in ds]
        self.k = len(self.dests[coord.rank])
        if why:
            log.warning("peer tier: %s; a step counts as replicated with %d", why, self.k)
        timeout = datetime.timedelta(seconds=opts.timeout_s)
        ranks = [coord.global_rank(r) for r in range(coord.world)]
        self.meta = coord._run("creating the peer tier's groups", lambda: dist.new_group(ranks, backend="gloo",
                                                                                         timeout=timeout))
        where = opts.local_dir or local_dir
        try:
            area: PeerArea | None = PeerArea(where, root_url, opts.slots)
            problem = ""
        except OSError as exc:  # (not private, not there, full): every rank must hear of it, or rounds hang
            area, problem = None, f"rank {coord.rank} (node {self.node}): {where}: {exc}"
        problems = [p for p in coord.all_gather(problem, "peer tier start-up (RAM directories)") if p]
        if problems or area is None:
            dist.destroy_process_group(self.meta)
            if area is not None:
                area.close()
            raise ConfigError("the peer tier cannot keep shards in RAM: " + "; ".join(problems) +
                              " (set PeerOptions(local_dir=...) to a private directory in RAM on every node)")
        self.area = area
        self.io = DaemonPool(4, thread_name_prefix="ckptmgr-peer-io")
        self.mover = ShardMover(Transport(coord, self.meta), self.area, self.node, opts.chunk_bytes,
                                opts.max_bytes_per_s, self.io)
        self._copier = DaemonPool(1, thread_name_prefix="ckptmgr-peer-copy")
        self._mu = threading.Condition()
        self._ticks: collections.deque[tuple[int, Future[None], float] | None] = collections.deque()
        self._busy = False
        self._sent = -1  # newest own step sent
        self._own: dict[int, int] = {}  # own step -> slot in the peer area
        self._replicated: dict[int, float] = {}  # step -> seconds from save() until replicated
        self._saved_at: dict[int, float] = {}  # step -> perf_counter() at its save()
        self._receipts: dict[int, dict[int, int]] = {}  # step -> shard rank -> confirmed copies
        self._error = ""
        self._received: dict[int, tuple[int, bool]] = {}  # (replication thread) this round's receipts
        self._found = self._complete_steps()  # steps an earlier run left complete in the nodes' RAM
        self.counts: dict[str, float] = {"peer_rounds": 0, "peer_copy_skips": 0}
        self._thread = threading.Thread(target=self._loop, name="ckptmgr-peer-replicate", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ save side (training thread)

    def track(self, job: PersistJob, inner: StepCommit) -> StepCommit:
        """Copy ``job``'s shard into the peer area once staged, and replicate it; return
        ``inner`` wrapped so that the durable commit (which releases the staging slot) waits
        for the copy, which training does not."""
        copied = self._copier.submit(self._copy, job)
        with self._mu:
            self._ticks.append((job.step, copied, job.t0))
            self._saved_at[job.step] = job.t0
            self._mu.notify_all()
        return _AfterCopy(inner, copied, self.opts.timeout_s)

    def _copy(self, job: PersistJob) -> None:
        """(copy thread) The staged shard into this rank's slot of the node's peer area."""
        job.staging.wait(self.opts.timeout_s)
        rank = self.coord.rank
        slot = self.area.take_slot(rank, wait_s=self.opts.timeout_s)  # (a round may still send from the other)
        if slot is None:
            with self._mu:
                self.counts["peer_copy_skips"] += 1
            log.info("peer tier: step %d is not copied: every slot of rank %d is held", job.step, rank)
            return
        try:
            images = [seg.numpy() for seg in job.slot.segments[:len(job.names)]]
            records = {name: FileRecord(a.size, self.chunk_size, (), hs)
                       for name, a, hs in zip(job.names, images, job.header_sizes, strict=True)}
            m = dataclasses.replace(job.manifest, files=records)
            shell = ShardRecord.make(m, rank, self.coord.world, self.node)
            dst = self.area.create(rank, slot, shell)
            tasks = [(i, b, e) for i, a in enumerate(images) for b, e in chunk_ranges(a.size, self.chunk_size)]

            def one(t: tuple[int, int, int]) -> str:
                i, b, e = t
                out = dst[job.names[i]][b:e]
                np.copyto(out, images[i][b:e])
                return crc32c_hex(out)

            crcs = list(self.io.map(one, tasks))
            joined: dict[int, list[str]] = collections.defaultdict(list)
            for (i, _, _), c in zip(tasks, crcs, strict=True):
                joined[i].append(c)
            m.files = {n: dataclasses.replace(r, crc32c=tuple(joined[i])) for i, (n, r) in enumerate(records.items())}
            self.area.commit(rank, slot, ShardRecord.make(m, rank, self.coord.world, self.node))
        except BaseException as exc:
            self.area.abort(rank, slot)
            log.warning("peer tier: step %d could not be copied to %s: %s: %s", job.step, self.area.path,
                        type(exc).__name__, exc)
            raise
        with self._mu:
            self._own[job.step] = slot

    # ------------------------------------------------------------ replication thread

    def _loop(self) -> None:
        while True:
            with self._mu:
                while not self._ticks:  # (idle until the next save: each wait bounded, then looked again)
                    self._mu.wait(60.0)
                tick = self._ticks.popleft()
                if tick is None:
                    self._mu.notify_all()
                    return
                self._busy = True
            try:
                if not self._error:
                    self._round(*tick)
            except Exception as exc:  # a peer died or the channel broke: replication stops (said once)
                with self._mu:
                    self._error = f"{type(exc).__name__}: {exc}"
                log.error("peer tier: replication stops (round of step %d): %s; saves go on to the durable target",
                          tick[0], self._error)
            finally:
                with self._mu:
                    self._busy = False
                    self._mu.notify_all()

    def _round(self, step: int, copied: Future[None], t0: float) -> None:
        with contextlib.suppress(Exception):  # (a failed copy was logged where it failed: nothing new to send)
            copied.result(timeout=self.opts.timeout_s)
        me = self.coord.rank
        with self._mu:
            fresh = {s: slot for s, slot in self._own.items() if s > self._sent}
        with contextlib.ExitStack() as held_open:  # the copies this rank could send, held against reuse
            held: dict[int, tuple[Copy, dict[str, np.ndarray[Any, Any]]]] = {}
            for c in self.area.copies():
                if c.rank == me and fresh.get(c.record.step) == c.slot:
                    try:
                        held[c.record.step] = (c, held_open.enter_context(self.area.mapped(c)))
                    except (OSError, CkptError) as exc:  # (rewritten since it was listed: not sent)
                        log.debug("peer tier: copy of step %d not sent: %s", c.record.step, exc)
            box: list[Any] = [None] * self.coord.world
            self.coord._run("the peer tier's round", lambda: dist.all_gather_object(box, sorted(held), group=self.meta))
            common = set.intersection(*(set(b) for b in box))  # every rank sends the same step: the newest all have
            if not common:
                self._exchange(None, None, None)
            else:
                copy, files = held[max(common)]
                self._exchange(copy.record, files, max(common))
                with self._mu:
                    self._sent = copy.record.step
                    self._own = {s: slot for s, slot in self._own.items() if s >= self._sent}
        got = self._receipts_round()
        now = time.perf_counter()
        with self._mu:
            self.counts["peer_rounds"] += 1
            for shard_step, shards in got.items():
                if len(shards) == self.coord.world and min(shards.values()) >= self.k:
                    self._replicated.setdefault(shard_step, now - self._saved_at.get(shard_step, now))
            self._saved_at = {s: t for s, t in self._saved_at.items() if s >= step - 1000}

    def _exchange(self, record: ShardRecord | None, files: dict[str, np.ndarray[Any, Any]] | None,
                  step: int | None) -> None:
        """Send ``record`` and its files to this rank's peers; receive its sources' shards
        into the peer area (kept only when they pass their checks): from each source its own
        shard of ``step`` (the round's), none when the round sends nothing."""
        expect = {s: (s, step) for s in self.sources} if step is not None else {}
        got = self.mover.transfer([(d, record, files or {}) for d in self.dests[self.coord.rank]], self.sources,
                                  own_node_ok=False, expect=expect)
        self._received = {s: (r.record.step, r.ok) for s, r in got.items() if r.record is not None}

    def _receipts_round(self) -> dict[int, dict[int, int]]:
        """Every rank's receipts of this round; returns step -> shard rank -> copies confirmed so far."""
        mine = self._received
        box: list[Any] = [None] * self.coord.world
        self.coord._run("the peer tier's receipts", lambda: dist.all_gather_object(box, mine, group=self.meta))
        with self._mu:
            for receipts in box:
                for shard, (shard_step, ok) in (receipts or {}).items():
                    if ok:
                        per = self._receipts.setdefault(int(shard_step), {})
                        per[int(shard)] = per.get(int(shard), 0) + 1
            for s in [s for s in self._receipts if s < max(self._receipts) - 64]:  # bounded history
                del self._receipts[s]
            return {s: dict(v) for s, v in self._receipts.items()}

    # ------------------------------------------------------------ state

    def _complete_steps(self) -> set[int]:
        """(start-up, every rank together) The steps of which the nodes' RAM holds every shard,
        saved at this world size."""
        mine = sorted({(c.record.step, c.rank) for c in self.area.copies() if c.record.world == self.coord.world})
        shards: dict[int, set[int]] = collections.defaultdict(set)
        for listed in self.coord.all_gather(mine, "peer tier start-up (the copies in RAM)"):
            for step, rank in listed:
                shards[step].add(rank)
        return {s for s, ranks in shards.items() if len(ranks) == self.coord.world}

    def replicated(self) -> list[int]:
        """Steps whose every shard has k confirmed copies on other nodes (this run), and the
        steps whose every shard an earlier run left in some node's RAM."""
        with self._mu:
            return sorted(set(self._replicated) | self._found)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every round queued so far has run.

        Raises:
            CkptTimeoutError: still running after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._mu:
            while self._ticks or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CkptTimeoutError(f"the peer tier's rounds were still running after {timeout} s")
                self._mu.wait(left)

    def count(self, key: str, n: float = 1, *, peak: bool = False) -> None:
        """Add ``n`` to counter ``key`` of :meth:`stats` (restores count where each shard came
        from, and what their fetches moved); ``peak``: keep the larger of the two instead."""
        with self._mu:
            old = self.counts.get(key, 0)
            self.counts[key] = max(old, n) if peak else old + n

    def stats(self) -> dict[str, float]:
        with self._mu:
            newest = max(set(self._replicated) | self._found, default=-1)
            moved = self.mover.stats()
            return {**self.counts, **moved, "peer_bad_copies": moved["peer_bad_copies"] +
                    self.counts.get("peer_bad_copies", 0), "peer_replicas": self.k, "peer_replicated_step": newest,
                    "peer_replicate_s": self._replicated.get(newest, float("nan")),
                    "peer_failed": float(bool(self._error))}

    def close(self, timeout: float | None) -> None:
        """Run the rounds queued (bounded by ``timeout``), then stop."""
        with self._mu:
            self._ticks.append(None)
            self._mu.notify_all()
        self._thread.join(timeout)
        self._copier.shutdown(wait=not self._thread.is_alive())
        self.io.shutdown(wait=False)
        if not self._thread.is_alive():
            self.area.close()
            try:
                dist.destroy_process_group(self.meta)
            except Exception as exc:  # the job may have torn the default group down first
                log.debug("destroying the peer tier's group: %s", exc)


def start_peers(opts: PeerOptions | None, coord: Coordinator | None, local_dir: str, root_url: str, chunk_size: int,
                read_only: bool) -> Replicator | None:
    """The peer tier of a manager, or None when ``opts`` is None or the manager only reads.

    Raises:
        ConfigError: ``opts`` is not a :class:`PeerOptions`, or there is no multi-rank job.
    """
    if opts is None or read_only:
        return None
    if not isinstance(opts, PeerOptions):
        raise ConfigError(f"peers must be a ckptmgr.PeerOptions or None, got {type(opts).__name__}")
    if coord is None:
        raise ConfigError("PeerOptions: the peer tier replicates the shards of a multi-rank job; initialize "
                          "torch.distributed with more than one rank (or pass peers=None)")
    return Replicator(opts, coord, local_dir, root_url, chunk_size)


class _AfterCopy(StepCommit):
    """``inner``, once the peer tier's copy of the job's shard has ended (or failed: logged by
    the copy, and the durable save goes on)."""

    def __init__(self, inner: StepCommit, copied: Future[None], timeout_s: float) -> None:
        self._inner = inner
        self._copied = copied
        self._timeout_s = timeout_s
        self.prefix = inner.prefix
        self.retryable = inner.retryable

    def _wait(self) -> None:
        try:
            self._copied.result(timeout=self._timeout_s)
        except Exception as exc:
            log.debug("peer tier: copy: %s", exc)

    def begin(self, target: Target, step: int) -> StepWriter:
        return self._inner.begin(target, step)

    def commit(self, writer: StepWriter, m: Manifest) -> None:
        self._wait()
        self._inner.commit(writer, m)

    def failed(self, writer: StepWriter | None, m: Manifest, error: BaseException) -> None:
        self._wait()
        self._inner.failed(writer, m, error)
