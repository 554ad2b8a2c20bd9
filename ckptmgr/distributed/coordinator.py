"""Coordination of the ranks of a ``torch.distributed`` job.

The manager creates two gloo groups over the ranks of its process group, so coordination
works in NCCL jobs too and never queues behind the job's GPU collectives:

* the *control* group, used from the caller's thread in program order (start-up cleanup,
  discovery, restore agreement): every rank calls the manager in the same order, so the
  collectives line up;
* the *commit* group, used only by the persist thread, which handles saves one at a time in
  step order on every rank.

Every collective has the manager's timeout: a rank that died or never called ``save()``
turns into :class:`~ckptmgr.CkptTimeoutError` on the others, never a hang.

Before the groups are made, every rank checks in through the job's store, within
``JOIN_TIMEOUT_S`` (or the manager's timeout, if shorter): a manager created on some ranks
only (rank 0 listing steps, say) fails within that time with a :class:`~ckptmgr.ConfigError`
naming the ranks that never came, rather than after the full coordination timeout.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import CkptTimeoutError, ConfigError

__all__ = ["Coordinator", "coordinator_for", "owner_of", "rank_file_prefix", "rank_prefix"]

log = logging.getLogger("ckptmgr")
T = TypeVar("T")
JOIN_TIMEOUT_S = 60.0  # how long the first rank to create a manager waits for the others
_joins: dict[str, int] = {}  # managers created so far per group, the key of the next check-in; under _joins_lock
_joins_lock = threading.Lock()


def _join(ranks: list[int], rank: int, timeout_s: float) -> None:
    """Check in with the other ranks of a new manager, through the job's store.

    Raises:
        ConfigError: some ranks did not create a manager in time.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as exc:  # no store to check in with: the groups' own timeout applies
        log.debug("no store to check in with: %s", exc)
        return
    group_key = hashlib.sha256(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    with _joins_lock:
        n = _joins[group_key] = _joins.get(group_key, 0) + 1
    base = f"ckptmgr/join/{group_key}/{n}"
    me = dist.get_rank()
    store.set(f"{base}/rank{me}", "1")
    window = min(timeout_s, JOIN_TIMEOUT_S)
    try:
        store.wait([f"{base}/rank{r}" for r in ranks], datetime.timedelta(seconds=window))
        abandoned = store.check([f"{base}/abandoned"])
    except RuntimeError:  # the store's timeout (DistStoreError)
        store.set(f"{base}/abandoned", "1")  # ranks arriving later fail too, rather than hang
        abandoned = True
    if not abandoned:
        return
    missing = [r for r in ranks if not store.check([f"{base}/rank{r}"])]
    what = (f"ranks {missing} of its process group did not create one within {window:g} s" if missing else
            f"the other ranks stopped waiting for it: it came more than {window:g} s after the first")
    raise ConfigError(
        f"rank {rank} of {len(ranks)}: CheckpointManager was created on this rank, but {what}. "
        "In a torch.distributed job, create the "
        "manager on every rank of its process_group (default: every rank), at the same point of the program: "
        "save(), steps() and restore() are collective. To use a manager on some ranks only (e.g. rank 0 listing "
        "steps), make a group of them on every rank, g = torch.distributed.new_group([0]), and pass "
        "process_group=g where you create it.")


def rank_prefix(rank: int) -> str:
    """The name prefix of a rank's own tensors: ``rank00001/``."""
    return f"rank{rank:05d}/"


def rank_file_prefix(rank: int) -> str:
    """The prefix of the data files a rank writes: ``data-r00001-``."""
    return f"data-r{rank:05d}-"


def owner_of(file_name: str) -> int:
    """The rank that wrote ``file_name`` (0 for single-process files)."""
    if file_name.startswith("data-r") and file_name[6:11].isdigit():
        return int(file_name[6:11])
    return 0


class Coordinator:
    """The ranks of one manager, and the collectives it runs over them."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group = group  # the user's process group (NCCL or gloo): tensor broadcasts on the GPU
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout_s = timeout_s
        ranks = dist.get_process_group_ranks(group)
        _join(ranks, self.rank, timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.control = self._run("creating the coordination groups",
                                 lambda: dist.new_group(ranks, backend="gloo", timeout=timeout))
        self.commit = self._run("creating the coordination groups",
                                lambda: dist.new_group(ranks, backend="gloo", timeout=timeout))
        self._global = ranks  # group rank -> global rank, for broadcast sources

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def global_rank(self, group_rank: int) -> int:
        return int(self._global[group_rank])

    def _run(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RuntimeError as exc:  # gloo reports a timeout or a vanished peer as RuntimeError
            raise CkptTimeoutError(
                f"rank {self.rank}/{self.world}: {what} did not complete within {self.timeout_s:g} s "
                f"({exc}); a rank died, or did not make the same ckptmgr call") from exc

    def broadcast(self, value: T, what: str, *, group: Any = None) -> T:
        """``value`` of rank 0 on every rank."""
        box = [value if self.is_leader else None]
        grp = group or self.control
        self._run(what, lambda: dist.broadcast_object_list(box, src=self.global_rank(0), group=grp))
        return box[0]  # type: ignore[return-value]

    def all_gather(self, value: T, what: str, *, group: Any = None) -> list[T]:
        """Every rank's ``value``, in rank order, on every rank."""
        out: list[Any] = [None] * self.world
        grp = group or self.control
        self._run(what, lambda: dist.all_gather_object(out, value, group=grp))
        return out

    def barrier(self, what: str) -> None:
        self.all_gather(None, what)

    def tensor_group(self, device: torch.device) -> Any:
        """The group that broadcasts tensors on ``device``: the job's own for CUDA (NCCL),
        gloo for the CPU."""
        if device.type == "cuda" and dist.get_backend(self.group) != "gloo":
            return self.group
        return self.control

    def destroy(self) -> None:
        for g in (self.control, self.commit):
            try:
                dist.destroy_process_group(g)
            except Exception as exc:  # the job may have torn the default group down first
                log.debug("destroying a coordination group: %s", exc)


def coordinator_for(process_group: Any, timeout_s: float) -> Coordinator | None:
    """A coordinator when ``torch.distributed`` runs with more than one rank, else None.

    Raises:
        ConfigError: ``process_group`` was given but torch.distributed is not initialized.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ConfigError("process_group was given, but torch.distributed is not initialized")
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return None
    return Coordinator(group, timeout_s)
