"""The host-memory guard: how much host memory staging slots may take without pushing the
node, or this process's cgroup, into the OOM killer.

Async checkpointing hurts most in host RAM: every slot holds one whole checkpoint image, and a
state staged into more slots than the machine has room for is killed at the first save, not
refused. So the slot pool (:mod:`ckptmgr.save.slots`) sizes its slots against what is
available *before* it allocates any:

* the node: ``MemAvailable`` from ``/proc/meminfo`` (what the kernel can hand out without
  swapping; pages of tmpfs files such as the local tier's count as used, not available);
* the cgroup (a container, a Slurm job, a systemd slice): for cgroup v2, ``memory.max`` less
  what the group uses (``memory.current`` less its reclaimable ``inactive_file`` page cache),
  for this process's group and every group above it; for cgroup v1, ``memory.limit_in_bytes``
  less ``memory.usage_in_bytes`` (less ``total_inactive_file``).

The smallest of these is the memory available. Of it, staging may use:

* :data:`DEFAULT_HOST_SHARE` (50%) with the default options (``StagingOptions(slots=None,
  max_host_bytes=None)``): the manager adds slots only while they all fit this share, and a
  state whose single slot does not fit it is refused before anything is allocated;
* :data:`MAX_HOST_SHARE` (90%) when the user sets ``slots`` or ``max_host_bytes`` (never more:
  the training process needs the rest).

Memory this process's slots hold already counts as available to them (it is theirs).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DEFAULT_HOST_SHARE", "MAX_HOST_SHARE", "HostMemory", "MemoryProbe", "allowed_bytes", "read_host_memory"]

DEFAULT_HOST_SHARE = 0.5  # share of available host memory the default slots may use, all together
MAX_HOST_SHARE = 0.9  # share any configuration may use (slots or max_host_bytes set by the user)

MEMINFO = "/proc/meminfo"  # where the node's MemAvailable is read (module attributes: tests point them elsewhere)
CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"

_NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages)


@dataclass(frozen=True)
class HostMemory:
    """Host memory this process may still allocate, and what bounds it.

    Attributes:
        available: bytes.
        source: what bounded it (``"MemAvailable"``, ``"cgroup v2 /path memory.max"``, ...),
            for messages.
    """

    available: int
    source: str

    def describe(self) -> str:
        return f"{self.available / 2**30:.2f} GiB available ({self.source})"


MemoryProbe = Callable[[], "HostMemory | None"]


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _meminfo_available(path: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    parts = line.split()
                    return int(parts[1]) * (1024 if len(parts) > 2 and parts[2] == "kB" else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _own_cgroups(path: str) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and cgroup v1 memory-controller path."""
    v2 = v1 = None
    try:
        with open(path) as f:
            for line in f:
                hier, _, rest = line.strip().partition(":")
                controllers, _, group = rest.partition(":")
                if hier == "0" and controllers == "":
                    v2 = group
                elif "memory" in controllers.split(","):
                    v1 = group
    except OSError:
        pass
    return v2, v1


def _group_dirs(mount: str, group: str) -> list[str]:
    """The directories of ``group`` and of every group above it, under ``mount``. In a
    container the process's own group is often the namespace root, mounted at ``mount``."""
    dirs = []
    parts = [p for p in group.split("/") if p]
    for i in range(len(parts), -1, -1):
        d = os.path.join(mount, *parts[:i])
        if os.path.isdir(d):
            dirs.append(d)
    return dirs or [mount]


def _cgroup_headroom(cgroup_root: str, self_cgroup: str) -> tuple[int, str] | None:
    v2, v1 = _own_cgroups(self_cgroup)
    best: tuple[int, str] | None = None

    def consider(room: int, source: str) -> None:
        nonlocal best
        if best is None or room < best[0]:
            best = (max(0, room), source)

    if v2 is not None:
        for d in _group_dirs(cgroup_root, v2):
            limit = _read_int(os.path.join(d, "memory.max"))
            used = _read_int(os.path.join(d, "memory.current"))
            if limit is None or used is None:
                continue
            used -= _stat_value(os.path.join(d, "memory.stat"), "inactive_file")
            consider(limit - max(0, used), f"cgroup v2 {d} memory.max")
    if v1 is not None:
        mount = os.path.join(cgroup_root, "memory")
        for d in _group_dirs(mount, v1):
            limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
            used = _read_int(os.path.join(d, "memory.usage_in_bytes"))
            if limit is None or used is None or limit >= _NO_LIMIT:
                continue
            used -= _stat_value(os.path.join(d, "memory.stat"), "total_inactive_file")
            consider(limit - max(0, used), f"cgroup v1 {d} memory.limit_in_bytes")
    return best


def read_host_memory(meminfo: str | None = None, cgroup_root: str | None = None,
                     self_cgroup: str | None = None) -> HostMemory | None:
    """The host memory this process may still allocate: the smallest of the node's
    ``MemAvailable`` and the headroom of each cgroup limit above this process. None when
    none of these can be read (not Linux): then nothing is guarded but ``max_host_bytes``.
    The paths default to :data:`MEMINFO`, :data:`CGROUP_ROOT` and :data:`SELF_CGROUP`.

    Example:
        >>> mem = read_host_memory()
        >>> mem is None or mem.available >= 0
        True
    """
    meminfo = MEMINFO if meminfo is None else meminfo
    found: list[tuple[int, str]] = []
    node = _meminfo_available(meminfo)
    if node is not None:
        found.append((node, "MemAvailable in " + meminfo))
    group = _cgroup_headroom(CGROUP_ROOT if cgroup_root is None else cgroup_root,
                             SELF_CGROUP if self_cgroup is None else self_cgroup)
    if group is not None:
        found.append(group)
    if not found:
        return None
    available, source = min(found)
    return HostMemory(available, source)


def allowed_bytes(memory: HostMemory | None, held: int, *, default: bool, max_host_bytes: int | None) -> int | None:
    """Host bytes all slots together may take: ``max_host_bytes`` when set, and never more
    than the share (:data:`DEFAULT_HOST_SHARE` for the default options, else
    :data:`MAX_HOST_SHARE`) of the memory available plus ``held`` (what the slots hold
    already), divided among the job's processes on this machine (:func:`processes_per_node`).
    None: no bound known.

    Example:
        >>> allowed_bytes(HostMemory(60 << 30, "test"), 4 << 30, default=True, max_host_bytes=None) == 32 << 30
        True
    """
    bounds = []
    if max_host_bytes is not None:
        bounds.append(max_host_bytes)
    if memory is not None:
        share = DEFAULT_HOST_SHARE if default and max_host_bytes is None else MAX_HOST_SHARE
        bounds.append(int((memory.available + held) * share / processes_per_node()))
    return min(bounds) if bounds else None


def processes_per_node() -> int:
    """The processes of this job that share this machine's memory and each stage a checkpoint:
    ``LOCAL_WORLD_SIZE`` as torchrun (and torchelastic) set it, else 1. Each gets an equal
    part of the share, so that all ranks of a node staging at once stay within it."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
