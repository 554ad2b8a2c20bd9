"""Multi-rank restore: each rank reads only its own files, replicated tensors are broadcast.

Rank 0 reads the manifest and broadcasts it (one read of the commit record, not one per
rank). Every rank then reads the files it wrote: its own tensors (PerRank, DTensor shards)
and its share of the replicated tensors, so the job reads every byte once. Each replicated
tensor is then broadcast from the rank that read it, over the job's process group (NCCL on
GPUs), straight into the target's tensor where there is one. The ranks agree at every step
where one could fail alone (target mismatch, a checksum), so they all raise the same error
and move to the same older step together.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import CheckpointCorruptError, CkptError, ConfigError, StateMismatchError, StepNotFoundError
from ..format.layout import ST_TO_DTYPE
from ..format.manifest import Manifest
from ..format.tree import unflatten
from ..restore.apply import apply_target, check_target, target_tensors
from ..restore.loaders.host import view_of
from .coordinator import Coordinator, owner_of

if TYPE_CHECKING:
    from ..restore.restorer import Restorer

__all__ = ["restore_newest_dist", "restore_step_dist"]

_OWN = re.compile(r"rank\d{5}/")  # a rank's own tensors (see coordinator.rank_prefix)


def _agree(coord: Coordinator, error: CkptError | None, what: str) -> None:
    """Raise on every rank if any rank failed: the same error type, naming the ranks."""
    errors = coord.all_gather(None if error is None else (type(error).__name__, str(error)), what)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not bad:
        return
    if error is not None and len(bad) == 1:
        raise error
    text = "; ".join(f"rank {r}: {msg}" for r, (_, msg) in bad)
    kinds = {k for _, (k, _) in bad}
    if kinds == {"StateMismatchError"}:
        raise StateMismatchError([f"rank {r}: {msg}" for r, (_, msg) in bad])
    if "StepNotFoundError" in kinds:
        raise StepNotFoundError(text)
    raise CheckpointCorruptError(text)


def _manifest(restorer: Restorer, coord: Coordinator, step: int) -> Manifest:
    raw: bytes | None = None
    err = ""
    if coord.is_leader:
        try:
            raw = restorer.target.read_manifest(step)
        except CkptError as exc:
            err = f"{type(exc).__name__}: {exc}"
    raw, err = coord.broadcast((raw, err), f"the manifest of step {step}")
    if raw is None:
        raise StepNotFoundError(err) if err.startswith("StepNotFound") else CheckpointCorruptError(err)
    m = Manifest.from_bytes(raw, where=f"{restorer.target.url}: step {step}")
    if m.world_size != coord.world:
        raise ConfigError(
            f"step {step} under {restorer.target.url} was saved by {m.world_size} rank(s); this job has "
            f"{coord.world}. Restoring at another world size is not supported yet.")
    return m


def restore_step_dist(restorer: Restorer, coord: Coordinator, step: int, target: Any,
                      device: torch.device | None, loader: str) -> Any:
    """Restore ``step`` on every rank of ``coord`` (all ranks call it together)."""
    m = _manifest(restorer, coord, step)
    assert m.rank_states is not None
    state = m.rank_states[coord.rank]
    mine = {f: rec for f, rec in m.files.items() if owner_of(f) == coord.rank}
    own = {n: e for n, e in m.tensors.items() if e.get("file") in mine}
    own.update({n: e for n, e in m.tensors.items() if e.get("view_of") in own})
    sub = Manifest(step=step, state=state, tensors=own, files=mine, metadata=m.metadata, time=m.time)
    dests: dict[str, torch.Tensor] = {}
    dtensors: dict[str, torch.Tensor] = {}  # the target's DTensors, by stored name of their shard
    error: CkptError | None = None
    try:
        if target is not None:
            from ..restore.restorer import _placeholders

            check_target(target, unflatten(state, _placeholders(m), allow_pickle=restorer.allow_pickle))
            dests = target_tensors(target, state, dtensors)
            if device is None:
                device = next((t.device for t in dests.values() if t.device.type == "cuda"), None)
    except CkptError as exc:
        error = exc
    _agree(coord, error, f"the target check of step {step}")
    dev = device or torch.device("cpu")
    if str(dev) == "cuda":  # no index: the current device
        dev = torch.device("cuda", torch.cuda.current_device())
    loaded: dict[str, torch.Tensor] = {}
    try:
        with restorer.guard.reading(step) as ok:
            if not ok:
                raise StepNotFoundError(f"step {step} is being deleted by the retention policy")
            loaded = restorer._load(restorer.target, step, sub, dev, loader, None,
                                    {k: v for k, v in dests.items() if k in own})
    except CkptError as exc:
        error = exc
    _agree(coord, error, f"reading step {step}")
    group = coord.tensor_group(dev)
    replicated = sorted(n for n, e in m.tensors.items() if "file" in e and not _OWN.match(n))
    for name in replicated:
        e = m.tensors[name]
        src = owner_of(e["file"])
        if src == coord.rank:
            buf = loaded[name]
        else:
            d = dests.get(name)
            shape, dtype = [int(x) for x in e["shape"]], ST_TO_DTYPE[e["dtype"]]
            usable = d is not None and d.is_contiguous() and d.device == dev and d.dtype == dtype and \
                list(d.shape) == shape
            buf = d if usable and d is not None else torch.empty(shape, dtype=dtype, device=dev)
        dist.broadcast(buf, src=coord.global_rank(src), group=group)
        loaded[name] = buf
    for name, e in m.tensors.items():
        if "view_of" in e and name not in loaded and e["view_of"] in loaded:
            loaded[name] = view_of(loaded[e["view_of"]], name, e, f"{restorer.target.url}: step {step}")
    for name, dt in dtensors.items():  # shards come back as the target's DTensors (optimizers need them)
        local = dt.to_local()  # type: ignore[attr-defined]
        if local.data_ptr() != loaded[name].data_ptr():
            local.copy_(loaded[name])
        loaded[name] = dt
    tree = unflatten(state, loaded, allow_pickle=restorer.allow_pickle)
    return tree if target is None else apply_target(target, tree)


def restore_newest_dist(restorer: Restorer, coord: Coordinator, candidates: list[int], target: Any,
                        device: torch.device | None, loader: str) -> Any:
    """The newest of rank 0's ``candidates`` that every rank reads and verifies."""
    import warnings

    if not candidates:
        raise StepNotFoundError(f"no committed checkpoint under {restorer.target.url}")
    for s in reversed(candidates):
        try:
            return restore_step_dist(restorer, coord, s, target, device, loader)
        except (CheckpointCorruptError, StepNotFoundError) as exc:
            warnings.warn(f"skipping step {s}: {exc}", RuntimeWarning, stacklevel=3)
    raise StepNotFoundError(f"no checkpoint under {restorer.target.url} verifies (tried steps {candidates})")
