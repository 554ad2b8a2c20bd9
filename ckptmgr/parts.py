"""The parts a :class:`~ckptmgr.CheckpointManager` is made of, and how they are opened.

:func:`open_parts` checks and defaults the manager's options, opens the durable target,
joins the job's ranks (and the peer tier), removes the leftovers of interrupted saves and
lists the committed steps (rank 0 only, in a multi-rank job), and wires the staging
pool's :class:`~ckptmgr.save.saver.Saver`, the retention
:class:`~ckptmgr.retention.deleter.Deleter` and the
:class:`~ckptmgr.restore.restorer.Restorer` together. :func:`adopt_leftovers` then hands
the slots an earlier process left committed in the local tier to the saver.

Nothing here runs after the manager is built: :class:`Parts` is the manager's, written
while it is built and never replaced (each part owns its own state and its own lock).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from .distributed.coordinator import Coordinator, coordinator_for
from .distributed.replicate import PeerOptions, Replicator, start_peers
from .distributed.restore import RankRestore
from .errors import ConfigError
from .options import S3Options, Schedule, StagingOptions, WriteOptions, option_or_default
from .restore.loaders import PinnedRing
from .restore.restorer import Restorer
from .retention import KeepAll, RetentionPolicy
from .retention.deleter import Deleter, StepGuard
from .save.budget import BudgetPlanner
from .save.saver import Saver
from .save.slots import AUTO_MAX_SLOTS
from .storage import Target, open_target
from .storage.cufile import enable_writer
from .storage.tier import LocalTier, open_local_tier

__all__ = ["Parts", "adopt_leftovers", "open_parts"]

log = logging.getLogger("ckptmgr")


@dataclass
class Parts:
    """What a manager is made of (see docs/ARCHITECTURE.md for what each owns)."""

    opts: WriteOptions
    allow_pickle: bool
    close_timeout: float | None
    target: Target  # the durable target
    coord: Coordinator | None  # the job's ranks; None in a single process
    peers: Replicator | None  # the peer tier (PeerOptions), multi-rank only
    staging: StagingOptions  # as given, without a local tier where there must be none
    schedule: Schedule
    guard: StepGuard
    deleter: Deleter
    tier: LocalTier | None  # the /dev/shm local tier
    budget: BudgetPlanner | None  # with a budget Schedule
    saver: Saver
    ring: PinnedRing
    restorer: Restorer
    durable: list[int]  # the committed steps the start-up listing found

    @property
    def root(self) -> str:
        return self.target.url


def open_parts(root: str | Any, *, retention: RetentionPolicy | None, storage_options: dict[str, Any] | None,
               write_options: WriteOptions | None, staging: StagingOptions | None, s3_options: S3Options | None,
               allow_pickle: bool, process_group: Any, coordination_timeout: float, close_timeout: float | None,
               read_only: bool | None, schedule: Schedule | None, peers: PeerOptions | None) -> Parts:
    """Check the manager's options and open its parts (the arguments are the manager's).

    Raises:
        ConfigError: an option is of the wrong type or out of range.
    """
    retention = option_or_default(retention, RetentionPolicy, "retention", KeepAll)
    write_options = option_or_default(write_options, WriteOptions, "write_options", WriteOptions)
    staging = option_or_default(staging, StagingOptions, "staging", StagingOptions)
    s3_options = option_or_default(s3_options, S3Options, "s3_options", None)
    storage_options = option_or_default(storage_options, dict, "storage_options", None)
    if close_timeout is not None and (not isinstance(close_timeout, (int, float)) or isinstance(close_timeout, bool)
                                      or math.isnan(close_timeout) or close_timeout < 0):
        raise ConfigError(f"close_timeout must be None or a number >= 0, got {close_timeout!r}")
    target = open_target(str(root) if hasattr(root, "__fspath__") else root,
                         storage_options, io_threads=write_options.io_threads,
                         direct_io=write_options.direct_io, s3_options=s3_options,
                         read_only=read_only)
    if write_options.gds and not target.read_only:
        enable_writer(target, target.url)
    coord = coordinator_for(process_group, coordination_timeout)
    peer_tier = start_peers(peers, coord, staging.local_dir, target.url, write_options.chunk_size, target.read_only)
    if coord is not None or target.read_only:
        # one tier per node would be shared by its ranks; a reader writes nothing: none
        staging = dataclasses.replace(staging, local_tier=False)
    durable = _start_up(target, coord)  # the last listing save() relies on (it lists nothing)
    plan: Schedule = option_or_default(schedule, Schedule, "schedule", Schedule)
    guard = StepGuard()
    saver: Saver | None = None  # (the deleter tells the saver of a deleted step; made right below)
    deleter = Deleter(target, retention, guard, on_deleted=lambda s: saver.forget(s) if saver is not None else None)
    tier = open_local_tier(staging, target.url)
    saver = Saver(target, tier, staging, chunk_size=write_options.chunk_size, deleter=deleter, guard=guard,
                  durable=durable, retention=coord is None or coord.is_leader)  # rank 0 decides retention
    # (one process only: ranks whose slots are made at different times must not disagree on a step)
    budget = BudgetPlanner(plan, tiered=tier is not None,
                           making=saver.pool.making if coord is None else None) if plan.budget else None
    # restore onto a GPU: up to 12 readers (16 read slower on an H200), each pinning a 16 MiB buffer
    # at its first use
    ring = PinnedRing(min(12, os.cpu_count() or 1), max(write_options.chunk_size, 16 << 20))
    restorer = Restorer(target, tier, guard, ring, bool(allow_pickle), RankRestore(coord))
    return Parts(write_options, bool(allow_pickle), close_timeout, target, coord, peer_tier, staging, plan, guard,
                 deleter, tier, budget, saver, ring, restorer, durable)


def _start_up(target: Target, coord: Coordinator | None) -> list[int]:
    """Remove leftovers of interrupted saves whose writers are gone, then list the
    committed steps; in a multi-rank job rank 0 does both and the others receive the
    listing (one LIST per start, whatever the number of ranks). A read-only manager does
    neither: it saves nothing, and what it reads it lists when asked."""
    durable: list[int] = []
    if (coord is None or coord.is_leader) and not target.read_only:  # (a reader saves nothing: no listing)
        removed = target.cleanup()
        if removed:
            log.info("removed %d leftovers of interrupted saves under %s", len(removed), target.url)
        durable = target.list_steps()
    if coord is not None:
        durable = coord.broadcast(durable, "start-up (leftover cleanup and listing)")
    return durable


def adopt_leftovers(p: Parts) -> None:
    """Slots an earlier process left committed in the local tier: adopt them, and write out
    those newer than the durable target's steps."""
    if p.tier is None:
        return
    root_id = p.target.root_id()  # (read only: a root gets its identity with its first commit)
    # (a step the listing skipped, unreadable now, is not "deleted from the root": its tier copy stays)
    unreadable = set(getattr(p.target, "skipped", {}))
    found = p.tier.scan(p.staging.slots or AUTO_MAX_SLOTS, root_id=root_id, root_is_empty=not p.durable,
                        durable=set(p.durable) | unreadable)
    try:
        p.saver.adopt(found, set(p.durable), root_id, on_mapped=p.restorer.check_adopted)
    finally:  # (an adoption that failed too: else the slots set aside would wait for the exit's close)
        p.tier.sweep_after_adoptions()  # what the scan set aside is freed once the adopted slots are pinned
