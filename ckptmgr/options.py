"""Option dataclasses: small, frozen, keyword-only, one per concern, validated on creation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["S3Options", "Schedule", "StagingOptions", "WriteOptions", "option_or_default"]


def option_or_default(value: Any, kind: type, name: str, default: Callable[[], Any] | None) -> Any:
    """``value``, or ``default()`` when it is None; ConfigError when it is of another type."""
    if value is None:
        return default() if default is not None else None
    if not isinstance(value, kind):
        raise ConfigError(f"{name} must be of type {kind.__name__}, got {type(value).__name__}: {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """How checkpoint files are laid out and written.

    Attributes:
        max_file_bytes: a state larger than this is split into several safetensors files.
        chunk_size: bytes per checksum chunk and per parallel write or read task.
        io_threads: threads that write and read in parallel; a large state is also split
            into up to this many files (of at least 64 MiB each) so that they can be
            written in parallel.
        direct_io: write the bulk of each large local file with O_DIRECT (bypassing the page
            cache) when the filesystem allows it; ignored elsewhere.
        gds: write local files through cuFile (kvikio, ``pip install 'ckptmgr[gds]'``). Needs
            a local or NFS root. Where kvikio cannot do I/O (no driver, or cuFile forced on a
            machine without GDS) the manager warns once and writes with POSIX I/O.

    Example:
        >>> WriteOptions(io_threads=16).io_threads
        16
    """

    max_file_bytes: int = 4 << 30
    chunk_size: int = 16 << 20
    io_threads: int = 8
    direct_io: bool = True
    gds: bool = False

    def __post_init__(self) -> None:
        for flag in ("direct_io", "gds"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"WriteOptions.{flag} must be a bool, got {getattr(self, flag)!r}")
        for name in ("max_file_bytes", "chunk_size", "io_threads"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"WriteOptions.{name} must be a positive int, got {value!r}")
        if self.chunk_size % 4096:
            raise ConfigError(f"WriteOptions.chunk_size must be a multiple of 4096, got {self.chunk_size}")


@dataclass(frozen=True, kw_only=True)
class StagingOptions:
    """How the state is copied off the training tensors, and how much host memory that takes.

    Each save copies the state into a *slot*: a host buffer that holds one complete
    checkpoint image. Slots are made at the first save (or by
    :meth:`CheckpointManager.prepare`) and reused; they are never allocated or pinned per save.

    Attributes:
        slots: how many checkpoints may be staged or in flight at once. None (the default):
            the manager sizes this itself. It starts with one slot, and when a save comes
            while every slot is still in use (saves come faster than the durable target
            absorbs them) it adds one rather than wait, up to 3, as long as all slots together
            fit 50% of the host memory available (``MemAvailable``, and the headroom of this
            process's cgroup: see :mod:`ckptmgr.save.memory`); it logs once what it did, with
            the numbers. A state whose one slot does not fit that share is refused with
            :class:`~ckptmgr.CapacityError` before anything is allocated. An int: exactly that
            many slots, made at the first save; 1 keeps host memory at one checkpoint; 2 lets
            a save stage while the previous one is still writing; 3, with the local tier,
            lets saves come faster than the durable target absorbs them without waiting (one
            slot being written, one holding the newest step, one filling; durable writes go to
            the newest step, see :class:`Schedule`). Configured slots (and ``max_host_bytes``)
            may use up to 90% of the available memory; more is refused before anything is
            allocated, never left to the OOM killer.
        on_busy: what ``save()`` does when every slot is still in use: ``"wait"`` for one to
            free up, or ``"skip"`` this save (it is logged and counted).
        busy_timeout: seconds ``save()`` waits for a free slot before raising
            :class:`~ckptmgr.CkptTimeoutError` (None: no limit).
        max_host_bytes: cap on host memory for all slots together; a state that would need
            more is refused before anything is copied. None: no cap but the guard's share of
            the available memory (see ``slots``).
        local_tier: keep each staged checkpoint as a complete, committed checkpoint in
            ``local_dir`` (a tmpfs such as /dev/shm), so a same-node restart restores from
            RAM. None (the default) uses it when ``local_dir`` exists and has room (and,
            with CUDA, is in RAM).
        local_dir: where local-tier slots live. With CUDA it must be in RAM (tmpfs, ramfs,
            hugetlbfs): the slots are pinned there, and Linux does not pin a disk file's pages.
        copy_threads: threads for host-to-host copies of CPU tensors.
        device_buffer_bytes: GPU memory, per device, for a snapshot of the state's GPU
            tensors on their own device. A save then copies them there first (device to
            device: a few ms for 5 GB), and the copy to the host slot runs from the buffer in
            the background. The state may change once the tensors that fit are in the buffer
            and those that did not fit have reached the host (``save()`` with ``block=True``
            returns then, ``handle.wait_staged()`` too); a save that comes before the previous
            one's copy from the buffer ended waits for it there. The buffer is allocated at
            the first save (or by :meth:`CheckpointManager.prepare`: call it after the first
            optimizer step, when the optimizer state exists), grown to what a save needs up
            to this size, and kept until the manager closes; a device without room for it is
            warned about once and copies straight to the host. 0 (the default): no extra GPU
            memory; the state may change once its copy to the host has landed.

    Example:
        >>> StagingOptions(slots=2, on_busy="skip").slots
        2
    """

    slots: int | None = None
    on_busy: str = "wait"
    busy_timeout: float | None = None
    max_host_bytes: int | None = None
    local_tier: bool | None = None
    local_dir: str = "/dev/shm"
    copy_threads: int = 4
    device_buffer_bytes: int = 0

    def __post_init__(self) -> None:
        if type(self.device_buffer_bytes) is not int or self.device_buffer_bytes < 0:
            raise ConfigError(f"StagingOptions.device_buffer_bytes must be an int >= 0, "
                              f"got {self.device_buffer_bytes!r}")
        for name in ("slots", "copy_threads"):
            value = getattr(self, name)
            if (value is not None or name != "slots") and (type(value) is not int or value <= 0):
                also = " or None" if name == "slots" else ""
                raise ConfigError(f"StagingOptions.{name} must be a positive int{also}, got {value!r}")
        if self.on_busy not in ("wait", "skip"):
            raise ConfigError(f"StagingOptions.on_busy must be 'wait' or 'skip', got {self.on_busy!r}")
        if self.busy_timeout is not None and (not isinstance(self.busy_timeout, (int, float))
                                              or self.busy_timeout < 0):
            raise ConfigError(f"StagingOptions.busy_timeout must be None or >= 0, got {self.busy_timeout!r}")
        if self.max_host_bytes is not None and (type(self.max_host_bytes) is not int or self.max_host_bytes <= 0):
            raise ConfigError(f"StagingOptions.max_host_bytes must be None or a positive int, "
                              f"got {self.max_host_bytes!r}")
        if self.local_tier not in (None, True, False):
            raise ConfigError(f"StagingOptions.local_tier must be None, True or False, got {self.local_tier!r}")
        if not isinstance(self.local_dir, str) or not self.local_dir:
            raise ConfigError(f"StagingOptions.local_dir must be a non-empty str, got {self.local_dir!r}")


@dataclass(frozen=True, kw_only=True)
class S3Options:
    """How checkpoints are uploaded to and read from S3 (roots ``s3://bucket/prefix``).

    Attributes:
        part_size: bytes per multipart part (grown when a file would need over 10,000
            parts). S3 needs at least 5 MiB, except for the last part.
        concurrency: requests in flight at once to the root (the parts of every file of a
            step, the ranged reads of a restore); botocore's connection pool is sized to match.
        adaptive_concurrency: when the store throttles (503 SlowDown, 429), shrink the number
            of requests in flight (halved per throttled window, grown back by one per window
            of successes, up to ``concurrency``) rather than retry at the same rate. False
            keeps ``concurrency`` fixed.
        max_attempts: tries per request before it fails the save (1: no retries).
        retry_deadline_s: no retry starts once this many seconds have passed since the
            first try of a request.
        base_delay_s: first backoff delay; it doubles per retry, up to ``max_delay_s``, and
            each delay is drawn uniformly below that bound (full jitter).
        max_delay_s: longest backoff delay.

    Example:
        >>> S3Options(part_size=64 << 20, concurrency=32).concurrency
        32
    """

    part_size: int = 32 << 20
    concurrency: int = 16
    adaptive_concurrency: bool = True
    max_attempts: int = 8
    retry_deadline_s: float = 120.0
    base_delay_s: float = 0.1
    max_delay_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("part_size", "concurrency", "max_attempts"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"S3Options.{name} must be a positive int, got {value!r}")
        for name in ("retry_deadline_s", "base_delay_s", "max_delay_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"S3Options.{name} must be a number >= 0, got {value!r}")
        if not isinstance(self.adaptive_concurrency, bool):
            raise ConfigError(f"S3Options.adaptive_concurrency must be a bool, got {self.adaptive_concurrency!r}")


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """How often each tier is written: the local tier (RAM, at copy speed) and the durable
    target (the disk or object store, as fast as it absorbs them).

    Every save lands in the local tier. A save is also written to the durable target when
    the schedule asks for it: its step is a multiple of ``durable_every``, or
    ``durable_every_s`` seconds have passed since the last save the schedule sent there.
    With neither set, every save is meant for the durable target. Durable writes never queue
    up: when they fall behind, the newest locally committed step is written next and the ones
    in between are superseded there (they stay in the local tier until their slots are
    reused, and ``SaveInfo.superseded_by`` says so). Without a local tier (``StagingOptions(
    local_tier=False)``, several ranks, or no room in ``local_dir``) every save is written to
    the durable target.

    **Budgets** instead of step counts: set ``max_overhead``, ``max_lost_s``,
    ``durable_max_lost_s`` or ``continuous`` and the manager picks the intervals itself from
    what it measures as training runs (the step time from the spacing of
    :meth:`~ckptmgr.CheckpointManager.should_save` calls, which the loop must then make once
    per step; the time each save adds to the loop; the durable write time and bandwidth),
    adapts them when these change, and :meth:`~ckptmgr.CheckpointManager.should_save` tells
    the loop when to save. ``stats()`` reports the intervals planned and achieved. The
    decisions are :class:`ckptmgr.save.budget.BudgetPlanner`'s (see docs/SCHEDULES.md).

    Attributes:
        local_every: :meth:`CheckpointManager.should_save` is True every this many steps
            (with a budget: never more often than this).
        durable_every: steps whose number is a multiple of this go to the durable target
            too (None: by time only, or every save when ``durable_every_s`` is None too).
        durable_every_s: a save goes to the durable target too when this many seconds have
            passed since the last one that did (None: by step number only).
        max_overhead: budget: saves may add at most this share of the step time to the
            training loop (0.01: 1%); the manager saves as often as that allows.
        max_lost_s: budget for the local tier: a crash of the process loses at most this many
            seconds of training (the local tier survives it on the node). With
            ``max_overhead`` too, the overhead budget wins, and a loss budget it cannot meet
            is logged once with the numbers.
        durable_max_lost_s: budget for the durable target: losing the node loses at most this
            many seconds of training. A save goes durable in time for its write (as long as
            the writes were measured to take) to end within the budget; when the writes take
            longer than the budget, every save goes durable as soon as the last write ended,
            and that is logged once.
        continuous: the durable target is written continuously: the next save goes durable as
            soon as the last durable write ended (and :meth:`~ckptmgr.CheckpointManager.
            should_save` asks for it then, within ``max_overhead`` when set).

    Example:
        >>> s = Schedule(local_every=50, durable_every=500)
        >>> [step for step in range(0, 1001, 50) if s.durable(step, None)]
        [0, 500, 1000]
        >>> Schedule(max_overhead=0.01, durable_max_lost_s=600).budget
        True
    """

    local_every: int = 1
    durable_every: int | None = None
    durable_every_s: float | None = None
    max_overhead: float | None = None
    max_lost_s: float | None = None
    durable_max_lost_s: float | None = None
    continuous: bool = False

    def __post_init__(self) -> None:
        for name in ("local_every", "durable_every"):
            value = getattr(self, name)
            if (value is not None or name == "local_every") and (type(value) is not int or value <= 0):
                raise ConfigError(f"Schedule.{name} must be a positive int, got {value!r}")
        for name in ("durable_every_s", "max_lost_s", "durable_max_lost_s"):
            s = getattr(self, name)
            if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0
                                  or s == float("inf")):
                raise ConfigError(f"Schedule.{name} must be a positive finite number of seconds, got {s!r}")
        o = self.max_overhead
        if o is not None and (isinstance(o, bool) or not isinstance(o, (int, float)) or not 0 < o < 1):
            raise ConfigError(f"Schedule.max_overhead must be a share of the step time in (0, 1), e.g. 0.01, got {o!r}")
        if not isinstance(self.continuous, bool):
            raise ConfigError(f"Schedule.continuous must be a bool, got {self.continuous!r}")
        if self.budget and (self.durable_every is not None or self.durable_every_s is not None):
            raise ConfigError("Schedule: durable_every/durable_every_s set the durable interval by hand; "
                              "durable_max_lost_s/continuous/max_overhead/max_lost_s let the manager pick it: not both")
        if self.continuous and self.durable_max_lost_s is not None:
            raise ConfigError("Schedule: continuous writes the durable target as often as it can; "
                              "durable_max_lost_s would only write it less often: pick one")

    @property
    def budget(self) -> bool:
        """True when the intervals are picked by the manager from a budget."""
        return (self.max_overhead is not None or self.max_lost_s is not None
                or self.durable_max_lost_s is not None or self.continuous)

    def should_save(self, step: int) -> bool:
        """True when ``step`` is one this schedule saves (to the local tier at least). With a
        budget, ask :meth:`CheckpointManager.should_save` instead: it measures."""
        return step % self.local_every == 0 or (self.durable_every is not None and step % self.durable_every == 0)

    def durable(self, step: int, since_durable_s: float | None) -> bool:
        """Whether a save of ``step`` goes to the durable target too; ``since_durable_s``:
        seconds since the last save that did (None: there was none in this process)."""
        if self.durable_every is None and self.durable_every_s is None:
            return True
        if self.durable_every is not None and step % self.durable_every == 0:
            return True
        return self.durable_every_s is not None and (since_durable_s is None or since_durable_s >= self.durable_every_s)
