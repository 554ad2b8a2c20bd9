"""What a :meth:`CheckpointManager.save` hands to the :class:`~ckptmgr.save.saver.Saver`.

:func:`plan_state` flattens the state and lays this rank's tensors out into files (in a
multi-rank job, its own tensors and its share of the replicated ones, with the
fingerprints the commit compares across ranks). :func:`submit` builds the step's manifest
and the multi-rank commit (through the peer tier when there is one), queues the
save, and keeps the budget :class:`~ckptmgr.options.Schedule`'s bookkeeping: what each save
cost and when it became durable.

:func:`submit` runs on the caller's thread; the bookkeeping of a save's outcome
(:func:`_budget_done`) runs on the thread that completes its future (the persist or
local-commit thread); the :class:`~ckptmgr.save.budget.BudgetPlanner` has its own lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from . import __version__
from .distributed.coordinator import rank_file_prefix, rank_prefix
from .distributed.save import CoordinatedCommit, fingerprints, share_of
from .format.layout import Plan, plan_layout
from .format.manifest import Manifest
from .format.tree import encode_plain, flatten
from .parts import Parts
from .save.outcome import Ticket
from .save.persist import PersistJob, SaveInfo, StepCommit

__all__ = ["plan_state", "submit"]

log = logging.getLogger("ckptmgr")


def plan_state(p: Parts, state: Any) -> tuple[Any, Plan, list[int], dict[str, str]]:
    """Skeleton, this rank's file plan, file sizes, and (multi-rank) the fingerprints of
    small replicated tensors that the commit compares across ranks.

    Raises:
        UnsupportedValueError: a value in ``state`` cannot be stored.
        CapacityError: the state does not fit ``StagingOptions.max_host_bytes``.
    """
    c = p.coord
    skeleton, leaves = flatten(state, allow_pickle=p.allow_pickle, rank_prefix=rank_prefix(c.rank) if c else "")
    fps: dict[str, str] = {}
    if c is not None:  # this rank writes its own tensors and its share of the replicated ones
        fps = fingerprints(leaves)
        leaves = share_of(leaves, c.rank, c.world)
    plan = plan_layout(leaves, max_file_bytes=p.opts.max_file_bytes, files_hint=p.opts.io_threads,
                       metadata={"format": "pt", "ckptmgr_format_version": "1"},
                       file_prefix=rank_file_prefix(c.rank) if c else "data-")
    sizes = [f.size for f in plan.files]
    p.saver.pool.check_capacity(sizes)
    return skeleton, plan, sizes, fps


def submit(p: Parts, step: int, state: Any, metadata: dict[str, Any] | None, *, block: bool,
           durable: bool | None, t0: float) -> Ticket:
    """Plan ``state`` as ``step`` and queue it on the saver (the arguments are those of
    :meth:`CheckpointManager.save`, checked; ``t0``: when the call began). Returns the
    saver's ticket."""
    meta_json = encode_plain(metadata or {}, what="metadata")
    skeleton, plan, sizes, fps = plan_state(p, state)
    manifest = Manifest(step=step, state=skeleton, tensors=plan.tensor_index(), files={},
                        metadata=meta_json, library_version=__version__)
    join = None if p.coord is None else _commit_for(p, fps)
    budget = p.budget
    if budget is None:
        return p.saver.save(manifest, plan, sizes, block=block, t0=t0, commit=join, schedule=p.schedule,
                            durable=durable)
    try:
        ticket = p.saver.save(manifest, plan, sizes, block=block, t0=t0, commit=join, schedule=budget,
                              durable=durable, spare_after_copies=budget.schedule.max_overhead is not None)
    except BaseException:
        budget.abandoned(step)  # (the schedule may have sent it durable inside the call)
        raise
    if ticket.skipped:  # (nothing staged: no cost to measure, no write to wait for)
        return ticket
    # the seconds the save spent making its slot, or waiting while one was made in the background,
    # are a one-time cost, not what a save costs (a wait for a slot still being written out is)
    setup_s = ticket.staging.setup_s if ticket.staging is not None else 0.0
    budget.saved(step, allocated=setup_s > 1e-3, one_time_s=setup_s, started=t0)
    if durable:  # (asked for, past the planner: its durable interval counts from here too)
        budget.durable_asked(step, started=t0)
    ticket.future.add_done_callback(lambda f: _budget_done(p, step, t0, f))
    return ticket


def _commit_for(p: Parts, fps: dict[str, str]) -> Callable[[PersistJob], StepCommit]:
    """How a multi-rank save's job is committed: every rank's agreement, after the peer tier's
    RAM copy where there is one."""
    coord, peers, target = p.coord, p.peers, p.target
    assert coord is not None

    def make(job: PersistJob) -> StepCommit:
        commit: StepCommit = CoordinatedCommit(coord, target, fps, job)
        return commit if peers is None else peers.track(job, commit)
    return make


def _budget_done(p: Parts, step: int, t0: float, future: Any) -> None:
    """(the persist or local-commit thread, or the caller for a skip) Feed a save's outcome
    to the budget schedule; never raises."""
    try:
        info = None if future.cancelled() or future.exception() is not None else future.result()
        if p.budget is not None:
            if isinstance(info, SaveInfo):
                p.budget.finished(step, durable=info.durable, nbytes=info.bytes, staged_at=t0 + info.staging_s,
                                  committed_at=t0 + info.total_s, local_s=info.local_s)
            else:
                p.budget.finished(step, durable=False)
    except Exception as exc:  # bookkeeping only: the save's outcome is told on its handle
        log.debug("budget schedule: step %d: %s", step, exc)
