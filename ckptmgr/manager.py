"""CheckpointManager: the one object users hold. It orchestrates; it owns no I/O.

save:    validate -> flatten -> plan -> Saver (stage; the persist thread writes and commits)
restore: discover -> manifest -> read + verify -> assemble -> unflatten -> apply to target

What each part owns is in docs/ARCHITECTURE.md: the :class:`~ckptmgr.save.saver.Saver` the
slots, the staging and the persist thread; the :class:`~ckptmgr.restore.restorer.Restorer`
the read side; the :class:`~ckptmgr.retention.deleter.Deleter` retention. The manager holds
no lock of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from . import __version__
from . import _lifecycle as lifecycle
from ._threads import collector_paused
from .distributed.coordinator import Coordinator, coordinator_for, rank_file_prefix, rank_prefix
from .distributed.peer_restore import restore_newest_peer
from .distributed.replicate import PeerOptions, start_peers
from .distributed.restore import RankRestore
from .distributed.save import CoordinatedCommit, fingerprints, share_of
from .errors import CkptTimeoutError, ConfigError, StepNotFoundError
from .format.layout import Plan, plan_layout
from .format.manifest import Manifest
from .format.naming import MAX_STEP
from .format.tree import decode_plain, encode_plain, flatten
from .handle import SaveHandle
from .options import S3Options, Schedule, StagingOptions, WriteOptions, option_or_default
from .restore.loaders import PinnedRing
from .restore.restorer import LOADERS, Restorer
from .retention import KeepAll, RetentionPolicy
from .retention.deleter import Deleter, StepGuard
from .save.budget import BudgetPlanner
from .save.persist import PersistJob, SaveInfo, StepCommit
from .save.saver import Saver
from .save.slots import AUTO_MAX_SLOTS
from .storage import Target, open_target
from .storage.cufile import enable_writer
from .storage.tier import LocalTier, open_local_tier

__all__ = ["CLOSE_TIMEOUT_S", "CheckpointManager"]

log = logging.getLogger("ckptmgr")

CLOSE_TIMEOUT_S = 600.0  # how long close(), ``with`` and the exit hook wait for pending writes by default


def _check_step(step: object, what: str = "step") -> None:
    if type(step) is not int or not 0 <= step < MAX_STEP:
        raise ConfigError(f"{what} must be an int in [0, 10**12) (what 12-digit step directory names order), "
                          f"got {step!r:.60} ({type(step).__name__})")


class CheckpointManager:
    """Saves training state as committed safetensors checkpoints and restores it.

    Each ``save`` copies the state off the caller's tensors, then writes and commits it in
    a background thread. A checkpoint is either complete and verified, or invisible.

    Args:
        root: a local or NFS path, or any fsspec URL (``s3://bucket/prefix``, ...).
        retention: which committed steps to keep (a :class:`~ckptmgr.RetentionPolicy`, e.g.
            ``AnyOf(KeepLatest(3), KeepEvery(1000))``). None keeps everything. Applied in the
            background after each commit; the newest step, protected steps and steps being
            restored are never deleted.
        storage_options: passed to fsspec for URL roots (credentials, endpoints, ...).
        write_options: file layout and I/O parallelism.
        staging: staging slots, backpressure and the local tier.
        s3_options: multipart upload and retries, for ``s3://`` roots.
        allow_pickle: store values of other types with pickle, and load them back. Loading
            pickle runs code from the checkpoint: only enable it for checkpoints you trust.
        process_group: with ``torch.distributed`` initialized, the ranks that checkpoint
            together (default: the world). Create the manager, and call ``save``, ``steps``
            and ``restore``, on every rank: each writes its share, the step commits once all
            are durable (see docs/DISTRIBUTED.md). Wrap per-rank values in :class:`PerRank`.
        coordination_timeout: seconds any agreement between ranks may take before
            :class:`CkptTimeoutError` (a dead rank never hangs the others).
        close_timeout: seconds :meth:`close` (and leaving a ``with`` block, and interpreter
            exit) waits for pending writes before giving up on them (default 600; None: no
            limit). What was given up is logged step by step; a hung write never keeps the
            process alive.
        read_only: True opens the root for reading only: ``steps``, ``metadata`` and
            ``restore`` work, nothing is created, cleaned up or written (not even a bucket),
            and ``save``, ``protect``, ``unprotect`` and ``apply_retention`` raise
            :class:`ConfigError`. None (the default) opens a local root that exists but is
            not writable by this process read-only, and any other root for writing (on an
            object store, pass True for read-only credentials). False always opens for writing.
        schedule: how often each tier is written (:class:`Schedule`): which saves go to the
            durable target too, and what :meth:`should_save` answers. None: every save goes
            to both tiers. Either way, durable writes that fall behind are coalesced to the
            newest locally committed step (see :class:`SaveHandle`).
        peers: in a multi-rank job, the peer tier (:class:`PeerOptions`): each rank's shard
            of every step is kept in its node's RAM and sent to k ranks on other nodes, so a
            restart after a lost node restores from RAM (see docs/DISTRIBUTED.md, "Peer tier").

    Example:
        >>> import torch
        >>> from ckptmgr import CheckpointManager
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> with CheckpointManager(tmp_path / "ckpt") as mgr:  # doctest: +SKIP
        ...     mgr.save(100, {"model": model, "optim": opt, "step": 100}).result()
        ...     state = mgr.restore(target={"model": model, "optim": opt, "step": 0})
        ...     state["step"]
        100
    """

    def __init__(
        self,
        root: str | Any,
        *,
        retention: RetentionPolicy | None = None,
        storage_options: dict[str, Any] | None = None,
        write_options: WriteOptions | None = None,
        staging: StagingOptions | None = None,
        s3_options: S3Options | None = None,
        allow_pickle: bool = False,
        process_group: Any = None,
        coordination_timeout: float = 600.0,
        close_timeout: float | None = CLOSE_TIMEOUT_S,
        read_only: bool | None = None,
        schedule: Schedule | None = None,
        peers: PeerOptions | None = None,
    ) -> None:
        retention = option_or_default(retention, RetentionPolicy, "retention", KeepAll)
        write_options = option_or_default(write_options, WriteOptions, "write_options", WriteOptions)
        staging = option_or_default(staging, StagingOptions, "staging", StagingOptions)
        s3_options = option_or_default(s3_options, S3Options, "s3_options", None)
        storage_options = option_or_default(storage_options, dict, "storage_options", None)
        if close_timeout is not None and (not isinstance(close_timeout, (int, float)) or isinstance(close_timeout, bool)
                                          or math.isnan(close_timeout) or close_timeout < 0):
            raise ConfigError(f"close_timeout must be None or a number >= 0, got {close_timeout!r}")
        self._opts = write_options
        self._allow_pickle = bool(allow_pickle)
        self._close_timeout = close_timeout
        self._closed = False
        self._target = open_target(str(root) if hasattr(root, "__fspath__") else root,
                                   storage_options, io_threads=write_options.io_threads,
                                   direct_io=write_options.direct_io, s3_options=s3_options,
                                   read_only=read_only)
        self.root = self._target.url
        self.read_only = self._target.read_only
        if write_options.gds and not self.read_only:
            enable_writer(self._target, self.root)
        self._coord = coordinator_for(process_group, coordination_timeout)
        self._peers = start_peers(peers, self._coord, staging.local_dir, self.root, write_options.chunk_size,
                                  self.read_only)
        if self._coord is not None or self.read_only:
            # one tier per node would be shared by its ranks; a reader writes nothing: none
            staging = dataclasses.replace(staging, local_tier=False)
        durable = self._start_up()  # the last listing save() relies on (it lists nothing)
        self._staging_opts = staging
        self._schedule: Schedule = option_or_default(schedule, Schedule, "schedule", Schedule)
        self._guard = StepGuard()
        self._deleter = Deleter(self._target, retention, self._guard, on_deleted=lambda s: self._saver.forget(s))
        self._tier = open_local_tier(staging, self.root)
        self._budget = BudgetPlanner(self._schedule, tiered=self._tier is not None) if self._schedule.budget else None
        self._saver = Saver(self._target, self._tier, staging, chunk_size=write_options.chunk_size,
                            deleter=self._deleter, guard=self._guard, durable=durable,
                            retention=self._coord is None or self._coord.is_leader)  # rank 0 decides retention
        # restore onto a GPU: up to 12 readers (16 read slower on an H200), each pinning a 16 MiB buffer
        # at its first use
        self._ring = PinnedRing(min(12, os.cpu_count() or 1), max(write_options.chunk_size, 16 << 20))
        self._restorer = Restorer(self._target, self._tier, self._guard, self._ring, self._allow_pickle,
                                  RankRestore(self._coord))
        lifecycle.close_at_exit(self)
        if self._tier is not None:  # slots an earlier process left committed: adopt, write out the newer
            root_id = self._target.root_id()  # (read only: a root gets its identity with its first commit)
            # (a step the listing skipped, unreadable now, is not "deleted from the root": its tier copy stays)
            unreadable = set(getattr(self._target, "skipped", {}))
            found = self._tier.scan(staging.slots or AUTO_MAX_SLOTS, root_id=root_id, root_is_empty=not durable,
                                    durable=set(durable) | unreadable)
            self._saver.adopt(found, set(durable), root_id, on_mapped=self._restorer.check_adopted)

    def _start_up(self) -> list[int]:
        """Remove leftovers of interrupted saves whose writers are gone, then list the
        committed steps; in a multi-rank job rank 0 does both and the others receive the
        listing (one LIST per start, whatever the number of ranks)."""
        c = self._coord
        durable: list[int] = []
        if c is None or c.is_leader:
            removed = self._target.cleanup()
            if removed:
                log.info("removed %d leftovers of interrupted saves under %s", len(removed), self.root)
            durable = self._target.list_steps()
        if c is not None:
            durable = c.broadcast(durable, "start-up (leftover cleanup and listing)")
        return durable

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise ConfigError(f"cannot {what}: the CheckpointManager for {self.root} is read-only")

    def stats(self) -> dict[str, float]:
        """Counters since the manager was created.

        Keys: ``saves`` (started), ``skips`` (dropped because every slot was busy),
        ``busy_waits`` and ``busy_wait_s`` (saves that waited for a free slot, and for how long),
        ``durable_superseded`` (steps committed in the local tier whose durable write a newer
        step took over: saves came faster than the target absorbs them), ``local_only``
        (steps the :class:`Schedule` kept in the local tier only),
        ``slot_allocations`` and ``slot_registrations`` (host buffers created and pinned;
        they stop growing after the first save of a state of fixed size),
        ``device_buffer_bytes`` (GPU memory held for snapshots, see
        ``StagingOptions.device_buffer_bytes``), ``deleted`` (steps removed by the retention
        policy), ``skipped_steps`` (see :meth:`skipped_steps`), ``slots`` (staging slots in
        the pool; the default options add some when saves come faster than the durable target
        absorbs them). With a budget :class:`Schedule`, once measured: ``budget_interval_steps``
        (the save interval planned now), ``budget_interval_s`` and ``budget_durable_interval_s``
        (achieved: mean seconds between saves, and between durable commits), ``budget_overhead``
        (achieved: the share of the loop's time saves added), ``budget_step_s``,
        ``budget_save_cost_s``, ``budget_durable_write_s``, ``budget_durable_bytes_per_s``.
        """
        budget = {} if self._budget is None else {f"budget_{k}": v for k, v in self._budget.stats().items()}
        peers = self._peers.stats() if self._peers is not None else {}
        return {**self._saver.stats(), "slots": len(self._saver.pool.slots), "deleted": len(self._deleter.deleted),
                "skipped_steps": len(self.skipped_steps()), **budget, **peers}

    def skipped_steps(self) -> dict[int, str]:
        """Steps under the root left alone, with why: those the last listing could not read
        (another user's, mode 000), and those retention could not judge or delete in its
        last attempt. Each is logged once as a warning; the other steps are listed,
        restored and deleted as usual."""
        return {**getattr(self._target, "skipped", {}), **self._deleter.skipped}

    # ---------------------------------------------------------------- save

    def save(self, step: int, state: Any, *, metadata: dict[str, Any] | None = None,
             block: bool = True, durable: bool | None = None) -> SaveHandle:
        """Checkpoint ``state`` as ``step``.

        The state is copied into a reusable host slot (device-to-host DMA for GPU tensors);
        the write and the commit continue in the background, and the returned handle reports
        them. ``save`` does no storage round trip: which steps exist is known from the
        manager's start-up listing and its own commits.

        Args:
            step: an int in ``[0, 10**12)``, not committed before.
            state: a nested structure of dicts, lists, tuples, tensors, numpy arrays,
                scalars, strings and objects with ``state_dict()``/``load_state_dict()``.
            metadata: user data stored in the manifest (JSON-like values).
            block: True (the default) returns once the copy has landed: the state may be
                changed right away. False returns as soon as the copies are enqueued, so
                they overlap the caller's next work; the caller must then call
                ``handle.wait_staged()`` before changing the state (e.g. before
                ``optimizer.step()``).
            durable: True writes this save to the durable target whatever the
                :class:`Schedule` says; False keeps it in the local tier only (written
                durably all the same where there is no local tier); None (the default):
                the schedule decides.

        Returns:
            The save's handle. With ``StagingOptions(on_busy="skip")`` and every slot busy,
            a handle with ``skipped=True``.

        Raises:
            ConfigError: ``step`` is not an int in ``[0, 10**12)`` (a bool is not a step),
                ``metadata`` is not a dict or ``block`` not a bool, or the manager is
                read-only; nothing has been staged.
            StepExistsError: ``step`` is committed or being saved.
            UnsupportedValueError: a value in ``state`` or ``metadata`` cannot be stored;
                nothing has been written.
            CapacityError: the state does not fit ``StagingOptions.max_host_bytes``.
            CkptTimeoutError: no slot became free within ``StagingOptions.busy_timeout``.
            SaveError: an earlier save failed and nobody has been told yet.
        """
        t0 = time.perf_counter()  # SaveInfo.blocked_s counts everything from here
        self._check_open()
        self._check_writable(f"save step {step!r}")
        _check_step(step)
        if metadata is not None and not isinstance(metadata, dict):
            raise ConfigError(f"metadata must be a dict, got {type(metadata).__name__}")
        if not isinstance(block, bool):
            raise ConfigError(f"block must be a bool, got {block!r}")
        if durable is not None and not isinstance(durable, bool):
            raise ConfigError(f"durable must be None or a bool, got {durable!r}")
        self._raise_unobserved()
        self._saver.check_new(step)
        meta_json = encode_plain(metadata or {}, what="metadata")
        skeleton, plan, sizes, fps = self._plan(state)
        manifest = Manifest(step=step, state=skeleton, tensors=plan.tensor_index(), files={},
                            metadata=meta_json, library_version=__version__)
        coord = self._coord
        join = None if coord is None else self._commit_for(coord, fps)
        if self._budget is None:
            return SaveHandle(self._saver.save(manifest, plan, sizes, block=block, t0=t0, commit=join,
                                               schedule=self._schedule, durable=durable))
        made = self._saver.pool.allocations
        t_call = time.perf_counter()
        ticket = self._saver.save(manifest, plan, sizes, block=block, t0=t0, commit=join, schedule=self._budget,
                                  durable=durable)
        if ticket.skipped:  # (nothing staged: no cost to measure, no write to wait for)
            return SaveHandle(ticket)
        allocated = self._saver.pool.allocations != made
        # a save that made its slot: the call was the allocation (the copies run on), paid once; with
        # block=True the call also waited for the copies, so it tells nothing apart
        self._budget.saved(step, allocated=allocated,
                           one_time_s=time.perf_counter() - t_call if allocated and not block else None)
        if durable:  # (asked for, past the planner: its durable interval counts from here too)
            self._budget.durable_asked(step)
        ticket.future.add_done_callback(lambda f: self._budget_done(step, t0, f))
        return SaveHandle(ticket)

    def _budget_done(self, step: int, t0: float, future: Any) -> None:
        """(the persist or local-commit thread, or the caller for a skip) Feed a save's outcome
        to the budget schedule; never raises."""
        try:
            info = None if future.cancelled() or future.exception() is not None else future.result()
            if self._budget is not None:
                if isinstance(info, SaveInfo):
                    self._budget.finished(step, durable=info.durable, nbytes=info.bytes, staged_at=t0 + info.staging_s,
                                          committed_at=t0 + info.total_s, local_s=info.local_s)
                else:
                    self._budget.finished(step, durable=False)
        except Exception as exc:  # bookkeeping only: the save's outcome is told on its handle
            log.debug("budget schedule: step %d: %s", step, exc)

    @property
    def schedule(self) -> Schedule:
        """The manager's :class:`Schedule` (``schedule.budget``: :meth:`should_save` measures
        and decides)."""
        return self._schedule

    def should_save(self, step: int) -> bool:
        """Whether the manager's :class:`Schedule` saves ``step`` (every step without one).

        With a budget schedule (``Schedule(max_overhead=...)``, ``max_lost_s``,
        ``durable_max_lost_s``, ``continuous``) call it once per step: the spacing of the
        calls is how the manager measures the step time, and the answer follows what it
        measured (see docs/SCHEDULES.md).

        Example:
            >>> for step in range(1, 1001):  # doctest: +SKIP
            ...     train_step()
            ...     if mgr.should_save(step):
            ...         mgr.save(step, state, block=False).wait_staged()
        """
        _check_step(step)
        if self._budget is not None:
            return self._budget.should_save(step)
        return self._schedule.should_save(step)

    def _commit_for(self, coord: Coordinator, fps: dict[str, str]) -> Callable[[PersistJob], StepCommit]:
        """How a multi-rank save's job is committed: every rank's agreement, after the peer
        tier's RAM copy where there is one."""
        peers, target = self._peers, self._target

        def make(job: PersistJob) -> StepCommit:
            commit: StepCommit = CoordinatedCommit(coord, target, fps, job)
            return commit if peers is None else peers.track(job, commit)
        return make

    def _plan(self, state: Any) -> tuple[Any, Plan, list[int], dict[str, str]]:
        """Skeleton, this rank's file plan, file sizes, and (multi-rank) the fingerprints of
        small replicated tensors that the commit compares across ranks."""
        c = self._coord
        skeleton, leaves = flatten(state, allow_pickle=self._allow_pickle, rank_prefix=rank_prefix(c.rank) if c else "")
        fps: dict[str, str] = {}
        if c is not None:  # this rank writes its own tensors and its share of the replicated ones
            fps = fingerprints(leaves)
            leaves = share_of(leaves, c.rank, c.world)
        plan = plan_layout(leaves, max_file_bytes=self._opts.max_file_bytes, files_hint=self._opts.io_threads,
                           metadata={"format": "pt", "ckptmgr_format_version": "1"},
                           file_prefix=rank_file_prefix(c.rank) if c else "data-")
        sizes = [f.size for f in plan.files]
        self._saver.pool.check_capacity(sizes)
        return skeleton, plan, sizes, fps

    def prepare(self, state: Any) -> None:
        """Reserve and pin the staging slots for ``state`` now, in the background, so that
        the first ``save()`` does not pay for it. Nothing is copied.

        Pinning runs in small pieces with pauses between them, so the training loop's GPU
        work goes on meanwhile. The next ``save()`` uses the reserved slots: if they are not
        ready yet it waits for them (even with ``on_busy="skip"``), and :meth:`wait` waits
        for them too.

        Raises:
            UnsupportedValueError: a value in ``state`` cannot be stored.
            CapacityError: the state does not fit ``StagingOptions.max_host_bytes``.
        """
        self._check_open()
        _, plan, sizes, _ = self._plan(state)
        self._saver.prepare(sizes, plan)

    def _raise_unobserved(self) -> None:
        deletion_error = self._deleter.take_error()
        if deletion_error is not None:
            raise deletion_error
        err = self._saver.take_failure()
        if err is not None:
            raise err

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save has committed (or failed), every :meth:`prepare`
        has finished, the peer tier's rounds for them have run (with :class:`PeerOptions`),
        and the deletions the retention policy decided after them are done.

        Raises:
            SaveError: a save failed and nobody has been told yet.
            StorageError: a retention deletion failed and nobody has been told yet.
            CkptTimeoutError: still pending after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._saver.wait(timeout)
        if self._peers is not None:  # (and their copies in the peer tier)
            self._peers.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._deleter.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._raise_unobserved()

    def flush(self, timeout: float | None = None) -> int | None:
        """Make the newest committed step durable now, if the local tier holds its only copy
        (the :class:`Schedule` or ``save(durable=False)`` kept it there), and wait for it and
        every other pending save, like :meth:`wait`.

        Returns:
            The step this call sent to the durable target, or None when the newest step was
            durable or on its way there already (or there is no local tier).

        Raises:
            SaveError: a save (this write included) failed and nobody has been told yet.
            CkptTimeoutError: still pending after ``timeout`` seconds.
            ConfigError: the manager is read-only or closed.
        """
        self._check_open()
        self._check_writable("flush")
        step = self._saver.flush()
        self.wait(timeout)
        # (a save that took the step's slot meanwhile supersedes the flush: then nothing was sent)
        return step if step is not None and self._saver.is_durable(step) else None

    def apply_retention(self) -> None:
        """Run the retention policy now and wait for its deletions (it also runs after every
        commit); for policies whose answer changes between commits.

        Raises:
            StorageError: a deletion failed.
            ConfigError: the manager is read-only.
        """
        self._check_open()
        self._check_writable("apply the retention policy")
        if self._coord is None or self._coord.is_leader:  # rank 0 decides retention
            self._deleter.schedule()
            self._deleter.drain(None)
        self._raise_unobserved()

    # ---------------------------------------------------------- protection

    def _set_protection(self, step: int, protected: bool) -> None:
        self._check_open()
        self._check_writable(f"{'protect' if protected else 'unprotect'} step {step!r}")
        _check_step(step)
        if self._saver.defer_protection(step, protected):  # applied when it commits
            return
        with self._guard.marking(step) as ok:
            if not ok:
                raise StepNotFoundError(f"step {step} under {self.root} is being deleted by the retention policy")
            self._target.set_protected(step, protected)

    def protect(self, step: int) -> None:
        """Keep ``step`` whatever the retention policy says, until :meth:`unprotect`.

        Recorded durably beside the checkpoint (a ``protected`` marker in its directory), so
        it holds for every later manager on this root. A step still being saved is protected
        as soon as it commits. Once this returns, retention never deletes the step (the
        deleter checks again right before each deletion).

        Raises:
            StepNotFoundError: ``step`` is neither committed on the root nor being saved, or
                retention is deleting it right now.
        """
        self._set_protection(step, True)

    def unprotect(self, step: int) -> None:
        """Let the retention policy decide about ``step`` again (from the next commit on).

        Raises:
            StepNotFoundError: ``step`` is neither committed on the root nor being saved.
        """
        self._set_protection(step, False)

    def is_protected(self, step: int) -> bool:
        """Whether ``step`` is protected from retention."""
        self._check_open()
        _check_step(step)
        return self._saver.protection_pending(step) or self._target.is_protected(step)

    # ------------------------------------------------------------- discover

    def steps(self) -> list[int]:
        """Committed steps, ascending, as the storage shows them now: the durable target's
        and, when there is one, the local tier's. In a multi-rank job, rank 0's listing."""
        self._check_open()
        if self._coord is not None:
            return self._coord.broadcast(sorted(self._committed_steps()) if self._coord.is_leader else [], "steps()")
        return sorted(self._committed_steps())

    def _committed_steps(self) -> set[int]:
        # the tier first: a step leaves it only once durable or superseded by a newer commit,
        # so the newest step listed never goes back while a save moves it between the two
        local = set(self._tier.steps()) if self._tier is not None else set()
        peers = set(self._peers.replicated()) if self._peers is not None else set()
        return set(self._target.list_steps()) | local | peers

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def _manifest(self, step: int, source: Target | LocalTier | None = None) -> Manifest:
        return self._restorer.manifest(step, source)

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The user metadata saved with ``step`` (default: the newest committed step).

        Raises:
            StepNotFoundError: no such committed step, or none at all.
        """
        step = self._resolve_step(step)
        meta = decode_plain(self._manifest(step).metadata)
        return meta if isinstance(meta, dict) else {}

    def _resolve_step(self, step: int | None) -> int:
        self._check_open()
        if step is None:
            latest = self.latest_step()
            if latest is None:
                raise StepNotFoundError(f"no committed checkpoint under {self.root}")
            return latest
        _check_step(step, "step (or None)")
        return step

    # -------------------------------------------------------------- restore

    def restore(self, step: int | None = None, *, target: Any = None,
                device: str | torch.device | None = None, loader: str = "auto",
                rank_map: Callable[[int, int], int] | None = None) -> Any:
        """Load a committed checkpoint.

        Args:
            step: the step to load; None loads the newest one that verifies, skipping (with
                one warning each) any newer one that is damaged or that another process
                deletes while it is read.
            target: a state of the same shape as the one saved. Its tensors are overwritten
                in place and its Stateful objects get ``load_state_dict``; the result mirrors
                ``target`` with the checkpoint's plain values. Every difference is reported
                before anything is read. Each stored tensor lands straight in the target
                tensor at its place (no second copy, on the GPU either), and only once every
                checksum of the step has passed: a step that fails leaves the target exactly
                as it was.
            device: where tensors go that have no target tensor to land in (default: CPU, or
                the GPU that ``target``'s tensors are on).
            loader: how files reach a GPU. ``"auto"``: from this process's pinned staging
                slot when it holds the step, else ``"ring"`` (parallel reads into a small
                reused pinned buffer, copies to the GPU overlapped with them); ``"host"`` on
                the CPU (scatter reads into each tensor's own memory). ``"inplace"`` pins
                local files where they lie (registering costs more than the ring's copy for a
                one-shot restore). ``"gds"``: kvikio reads into GPU memory (``pip install
                'ckptmgr[gds]'``; where it cannot do I/O, a warning and the ring); what
                landed is then read back to verify its checksums, so it is opt-in, never
                picked by ``"auto"``. Every loader verifies every checksum before the state
                is returned.
            rank_map: for a checkpoint saved by another number of ranks than restore it (a
                single process counts as one) that holds :class:`PerRank` values:
                ``rank_map(rank, saved_world_size)`` names the saved rank whose values this
                rank takes, e.g. ``lambda rank, saved: rank % saved``. Without it such a
                restore raises ConfigError naming the values. DTensors and replicated state
                need no mapping: they are resharded (see docs/DISTRIBUTED.md).

        Returns:
            The restored state.

        Raises:
            StepNotFoundError: no such committed step (or none at all), or ``step`` was
                deleted (by another process) while it was read.
            CheckpointCorruptError: ``step`` is damaged: its manifest, a file's size or
                header, or a checksum; the message names the step and the field or file.
                ``target`` has not been modified.
            StateMismatchError: ``target`` does not match; it has not been modified.
            ConfigError: PerRank values at another world size without ``rank_map``.
        """
        dev = torch.device(device) if device is not None else None
        if loader not in LOADERS:
            raise ConfigError(f"loader must be one of {', '.join(map(repr, LOADERS))}, got {loader!r}")
        if loader in ("inplace", "ring", "gds") and dev is None and target is None:
            raise ConfigError(f"loader={loader!r} loads onto a device: pass device= or a target")
        with collector_paused():  # (see _threads: the collector finds nothing to free in what a restore builds)
            if self._peers is not None and self._coord is not None:  # each rank's shard from the nearest tier
                self._check_open()
                durable = self._coord.broadcast(sorted(self._target.list_steps()) if self._coord.is_leader else [],
                                                "restore (the durable listing)")
                return restore_newest_peer(self._peers, self._restorer, self._coord, durable, target, dev, loader,
                                           rank_map, None if step is None else self._resolve_step(step))
            if step is not None:
                return self._restorer.restore_step(self._resolve_step(step), target, dev, loader, rank_map)
            if self._coord is None:
                self._check_open()
            return self._restorer.restore_newest(self.steps(), target, dev, loader, rank_map)

    # ------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"the CheckpointManager for {self.root} is closed")

    def close(self, timeout: float | None = None, *, flush: bool = True) -> None:
        """Wait for pending saves and deletions, then release slots and threads; bounded.

        With ``flush`` (the default), the newest committed step is made durable first if the
        local tier holds its only copy (see :meth:`flush`). Staging slots whose step is
        durable are freed. A local-tier step that never reached the durable target (its write
        failed or did not finish in time, or ``flush=False``) is kept in the local tier, and
        a warning says so: the next manager on this root, on this node, restores from it if
        it is newer and writes it out (``ckptmgr flush ROOT`` does that too); a reboot loses it.

        Interrupted while it waits for the writes (Ctrl-C), close() logs the steps not yet
        durable and what becomes of them, and re-raises; the manager then stays open, the
        writes go on, and interpreter exit (or another close()) waits for them again.

        Args:
            timeout: seconds to wait for pending writes and deletions (default: the
                manager's ``close_timeout``, 600 s unless set; ``math.inf``: no limit). Past
                it, the manager closes anyway: each step not yet durable is logged with what
                becomes of it, and the threads still writing are left to finish or die with
                the process (they never keep it alive).
            flush: make the newest step durable before closing (False: leave it where the
                schedule put it).

        Raises:
            SaveError: a save failed and nobody has been told yet.
            StorageError: a retention deletion failed and nobody has been told yet.
            CkptTimeoutError: writes or deletions were still running after ``timeout``; the
                manager is closed all the same.
        """
        if self._closed:
            return
        if timeout is None:
            timeout = self._close_timeout
        if timeout is not None and math.isinf(timeout):
            timeout = None
        deadline = None if timeout is None else time.monotonic() + timeout
        if flush and not self.read_only:
            try:
                self._saver.flush(failed_too=False)  # (a failed write was told already, and is kept)
            except Exception as exc:  # (the newest step stays in the local tier: said below)
                log.warning("could not make the newest step durable before closing: %s: %s", type(exc).__name__, exc)
        self._closed = True
        lifecycle.forget(self)
        self._restorer.cancel_checks()  # (of adopted slots: not needed any more)
        try:
            lost, kept = self._saver.close(timeout)  # (lost: still being written; kept: failed, in the tier)
        except BaseException:
            if not self._saver.closing:  # interrupted while waiting for the writes (logged): still open
                self._closed = False
                lifecycle.close_at_exit(self)
            raise
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            self._deleter.drain(left)
        except CkptTimeoutError:
            left = 0
        deleting = not self._deleter.close(left)
        hung = self._saver.hung
        if not hung:
            self._ring.close()
        if self._tier is not None:
            if kept:
                log.warning("steps %s were never written to %s; they stay only in the local tier %s (RAM: a reboot "
                            "loses them, another node does not see them) until the next start on this root, on "
                            "this node, writes them. To write them now: mgr.flush() or close(flush=True) before "
                            "closing, or `ckptmgr flush %s` on this node", kept, self.root, self._tier.path, self.root)
            self._tier.close(remove=not kept and not hung, wait=not hung)
        if not hung and not deleting:
            self._target.close()
        if self._peers is not None:
            self._peers.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._coord is not None:
            self._coord.destroy()
        for step, fate in lost.items():
            log.error("gave up waiting for the write of step %d to %s after %s s: it %s",
                      step, self.root, timeout, fate)
        self._raise_unobserved()
        if lost or deleting:
            what = [f"step {s} {fate}" for s, fate in lost.items()] + (["a retention deletion"] if deleting else [])
            raise CkptTimeoutError(f"closed the manager for {self.root} after {timeout} s with work unfinished: "
                                   + "; ".join(what))

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        # Failing already: finish what can be, log a save failure rather than replace the exception.
        try:
            self.close()
        except Exception as close_exc:
            log.error("while handling %s: %s", getattr(exc_type, "__name__", exc_type), close_exc)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r})"
