"""CheckpointManager: the one object users hold. It validates and orchestrates; it owns no I/O.

save:    validate -> save_request (flatten, plan, manifest) -> Saver (stage; the persist thread commits)
restore: validate -> discover (which step, which route) -> Restorer (read + verify) -> the target walk

Its parts are opened in :mod:`ckptmgr.parts` and closed in :mod:`ckptmgr.shutdown`. What each
owns is in docs/ARCHITECTURE.md: the :class:`~ckptmgr.save.saver.Saver` the slots, the staging
and the persist thread; the :class:`~ckptmgr.restore.restorer.Restorer` the read side; the
:class:`~ckptmgr.retention.deleter.Deleter` retention. The manager holds no lock of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from . import _lifecycle as lifecycle
from .discover import check_step, listed_steps, resolve_step, restore_device, route_restore
from .distributed.replicate import PeerOptions
from .errors import ConfigError, StepNotFoundError
from .format.manifest import Manifest
from .format.tree import decode_plain
from .handle import SaveHandle
from .options import S3Options, Schedule, StagingOptions, WriteOptions
from .parts import Parts, adopt_leftovers, open_parts
from .retention import RetentionPolicy
from .save_request import plan_state, submit
from .shutdown import begin_close, close_parts, raise_unobserved, wait_pending
from .storage import Target
from .storage.tier import LocalTier

__all__ = ["CLOSE_TIMEOUT_S", "CheckpointManager"]

log = logging.getLogger("ckptmgr")

CLOSE_TIMEOUT_S = 600.0  # how long close(), ``with`` and the exit hook wait for pending writes by default


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
            nothing is listed until one of them asks (opening sends no request to an object
            store), and ``save``, ``protect``, ``unprotect`` and ``apply_retention`` raise
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
        self._p: Parts = open_parts(root, retention=retention, storage_options=storage_options,
                                    write_options=write_options, staging=staging, s3_options=s3_options,
                                    allow_pickle=allow_pickle, process_group=process_group,
                                    coordination_timeout=coordination_timeout, close_timeout=close_timeout,
                                    read_only=read_only, schedule=schedule, peers=peers)
        self._closed = False
        self.root = self._p.root
        self.read_only = self._p.target.read_only
        # (the parts the rest of the package and its tests reach through the manager)
        self._target, self._tier, self._saver = self._p.target, self._p.tier, self._p.saver
        self._ring, self._restorer = self._p.ring, self._p.restorer
        lifecycle.close_at_exit(self)
        adopt_leftovers(self._p)

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
        p = self._p
        budget = {} if p.budget is None else {f"budget_{k}": v for k, v in p.budget.stats().items()}
        peers = p.peers.stats() if p.peers is not None else {}
        return {**p.saver.stats(), "slots": len(p.saver.pool.slots), "deleted": len(p.deleter.deleted),
                "skipped_steps": len(self.skipped_steps()), **budget, **peers}

    def skipped_steps(self) -> dict[int, str]:
        """Steps under the root left alone, with why: those the last listing could not read
        (another user's, mode 000), and those retention could not judge or delete in its
        last attempt. Each is logged once as a warning; the other steps are listed,
        restored and deleted as usual."""
        return {**getattr(self._target, "skipped", {}), **self._p.deleter.skipped}

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
        check_step(step)
        if metadata is not None and not isinstance(metadata, dict):
            raise ConfigError(f"metadata must be a dict, got {type(metadata).__name__}")
        if not isinstance(block, bool):
            raise ConfigError(f"block must be a bool, got {block!r}")
        if durable is not None and not isinstance(durable, bool):
            raise ConfigError(f"durable must be None or a bool, got {durable!r}")
        raise_unobserved(self._p)
        self._saver.check_new(step)
        return SaveHandle(submit(self._p, step, state, metadata, block=block, durable=durable, t0=t0))

    @property
    def schedule(self) -> Schedule:
        """The manager's :class:`Schedule` (``schedule.budget``: :meth:`should_save` measures
        and decides)."""
        return self._p.schedule

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
        check_step(step)
        if self._p.budget is not None:
            return self._p.budget.should_save(step)
        return self._p.schedule.should_save(step)

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
        _, plan, sizes, _ = plan_state(self._p, state)
        self._saver.prepare(sizes, plan)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save has committed (or failed), every :meth:`prepare`
        has finished, the peer tier's rounds for them have run (with :class:`PeerOptions`),
        and the deletions the retention policy decided after them are done.

        Raises:
            SaveError: a save failed and nobody has been told yet.
            StorageError: a retention deletion failed and nobody has been told yet.
            CkptTimeoutError: still pending after ``timeout`` seconds.
        """
        wait_pending(self._p, timeout)

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
        if self._p.coord is None or self._p.coord.is_leader:  # rank 0 decides retention
            self._p.deleter.schedule()
            self._p.deleter.drain(None)
        raise_unobserved(self._p)

    # ---------------------------------------------------------- protection

    def _set_protection(self, step: int, protected: bool) -> None:
        self._check_open()
        self._check_writable(f"{'protect' if protected else 'unprotect'} step {step!r}")
        check_step(step)
        if self._saver.defer_protection(step, protected):  # applied when it commits
            return
        with self._p.guard.marking(step) as ok:
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
        check_step(step)
        return self._saver.protection_pending(step) or self._target.is_protected(step)

    # ------------------------------------------------------------- discover

    def steps(self) -> list[int]:
        """Committed steps, ascending, as the storage shows them now: the durable target's
        and, when there is one, the local tier's. In a multi-rank job, rank 0's listing."""
        self._check_open()
        return listed_steps(self._p)

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
        return resolve_step(self._p, step)

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
        dev = restore_device(target, device, loader)
        self._check_open()
        return route_restore(self._p, step, target, dev, loader, rank_map)

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
        timeout, deadline = begin_close(self._p, self._p.close_timeout if timeout is None else timeout,
                                        flush and not self.read_only)
        self._closed = True
        lifecycle.forget(self)
        self._restorer.cancel_checks()  # (of adopted slots: not needed any more)
        try:
            close_parts(self._p, timeout, deadline)
        except BaseException:
            if not self._saver.closing:  # interrupted while waiting for the writes (logged): still open
                self._closed = False
                lifecycle.close_at_exit(self)
            raise

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
