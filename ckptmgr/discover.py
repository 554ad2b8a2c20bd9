"""Which steps a manager sees, which one a call means, and the route a restore takes.

The committed steps are the durable target's, the local tier's and (with a peer tier) the
peer tier's; in a multi-rank job rank 0 lists them and the others receive its listing, so
that every rank means the same step. A restore goes through the peer tier when the job
has one (each rank's shard from the nearest tier), else to the
:class:`~ckptmgr.restore.restorer.Restorer`: one step, or the newest that verifies.

Everything here runs on the caller's thread and holds no state of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._threads import collector_paused
from .distributed.peer_restore import restore_newest_peer
from .errors import ConfigError, StepNotFoundError
from .format.naming import MAX_STEP
from .parts import Parts
from .restore.restorer import LOADERS

__all__ = ["check_step", "committed_steps", "listed_steps", "resolve_step", "restore_device", "route_restore"]


def check_step(step: object, what: str = "step") -> None:
    """Raise ConfigError unless ``step`` is a step number (an int in ``[0, 10**12)``)."""
    if type(step) is not int or not 0 <= step < MAX_STEP:
        raise ConfigError(f"{what} must be an int in [0, 10**12) (what 12-digit step directory names order), "
                          f"got {step!r:.60} ({type(step).__name__})")


def committed_steps(p: Parts) -> set[int]:
    """This process's view of the committed steps, in every tier."""
    # the tier first: a step leaves it only once durable or superseded by a newer commit,
    # so the newest step listed never goes back while a save moves it between the two
    local = set(p.tier.steps()) if p.tier is not None else set()
    peers = set(p.peers.replicated()) if p.peers is not None else set()
    return set(p.target.list_steps()) | local | peers


def listed_steps(p: Parts) -> list[int]:
    """The committed steps, ascending; in a multi-rank job, rank 0's listing."""
    c = p.coord
    if c is not None:
        return c.broadcast(sorted(committed_steps(p)) if c.is_leader else [], "steps()")
    return sorted(committed_steps(p))


def resolve_step(p: Parts, step: int | None) -> int:
    """``step`` checked, or (None) the newest committed step.

    Raises:
        StepNotFoundError: ``step`` is None and no step is committed.
        ConfigError: ``step`` is not a step number.
    """
    if step is None:
        steps = listed_steps(p)
        if not steps:
            raise StepNotFoundError(f"no committed checkpoint under {p.root}")
        return steps[-1]
    check_step(step, "step (or None)")
    return step


def restore_device(target: Any, device: str | torch.device | None, loader: str) -> torch.device | None:
    """The device a restore was asked for, once ``loader`` is checked against it.

    Raises:
        ConfigError: an unknown loader, or one that loads onto a device with neither
            ``device`` nor a ``target``.
    """
    dev = torch.device(device) if device is not None else None
    if loader not in LOADERS:
        raise ConfigError(f"loader must be one of {', '.join(map(repr, LOADERS))}, got {loader!r}")
    if loader in ("inplace", "ring", "gds") and dev is None and target is None:
        raise ConfigError(f"loader={loader!r} loads onto a device: pass device= or a target")
    return dev


def route_restore(p: Parts, step: int | None, target: Any, dev: torch.device | None, loader: str,
            rank_map: Callable[[int, int], int] | None) -> Any:
    """Restore as :meth:`CheckpointManager.restore` does (whose arguments these are, the
    device from :func:`restore_device`), the manager checked open."""
    with collector_paused():  # (see _threads: the collector finds nothing to free in what a restore builds)
        if p.peers is not None and p.coord is not None:  # each rank's shard from the nearest tier
            durable = p.coord.broadcast(sorted(p.target.list_steps()) if p.coord.is_leader else [],
                                        "restore (the durable listing)")
            return restore_newest_peer(p.peers, p.restorer, p.coord, durable, target, dev, loader,
                                       rank_map, None if step is None else resolve_step(p, step))
        if step is not None:
            return p.restorer.restore_step(resolve_step(p, step), target, dev, loader, rank_map)
        return p.restorer.restore_newest(listed_steps(p), target, dev, loader, rank_map)
