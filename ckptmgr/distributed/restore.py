"""Restore of a multi-rank checkpoint: by every rank of a job, at the world size it was saved
at or at another, or by a single process.

Rank 0 reads the manifest and broadcasts it (one read of the commit record, not one per
rank). Then every rank plans what it holds (:func:`_plan`): the replicated tensors, the
PerRank values of the saved rank it takes them from, and for every DTensor the box the
target places on it (the whole tensor where the target holds a plain tensor, or in a single
process), and checks the target before a byte is read.

* When every rank's boxes are the ones it saved (same world size, same layout), each rank
  reads exactly its own files, each byte once, with the manager's loaders (onto the GPU
  through the pinned ring, in place, or GDS) into fresh memory on the target's device, every
  chunk verified as it lands (:func:`_read_own`); once the ranks agree, the tensors are
  copied into the target's (:func:`_move_into`).
* Otherwise each rank reads, from whichever files hold them, only the checksum chunks that
  cover the bytes it needs (:mod:`.ranged`), verifies them, and assembles its shards
  (:mod:`.reshard`); a replicated tensor saved by rank ``r`` is read by rank ``r % world``.

Replicated tensors are then broadcast from the rank that read them, over the job's process
group (NCCL on GPUs), into the target's tensors where there are. The ranks agree at every
point where one could fail alone (the plan and the target check, the reads), so they all
raise the same error and fall back to the same older step together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..errors import CheckpointCorruptError, CkptError, ConfigError, StateMismatchError, StepNotFoundError
from ..format.layout import DTYPE_TO_ST, contiguous_stride
from ..format.manifest import Manifest
from ..format.tree import unflatten
from ..restore.loaders.host import view_of
from ..restore.preflight import Source, preflight
from ..restore.target import TargetPlan, match_target, survey_target
from ..restore.values import local_tensor
from ..restore.verify import verify_files
from .coordinator import Coordinator, owner_of
from .ranged import RangedReads, read_errors
from .reshard import Dest, box_for, box_of, fill, parse_placements, plan_dtensor, saved_boxes, stored, whole
from .skeletons import rank_view, tensor_names

__all__ = ["RankMap", "RankRestore"]

log = logging.getLogger("ckptmgr")
RankMap = Callable[[int, int], int]  # (this rank, the saved world size) -> the saved rank whose PerRank values it takes


class Restorer(Protocol):
    """What a multi-rank restore uses of the manager's restorer
    (:class:`ckptmgr.restore.restorer.Restorer`)."""

    target: Any  # the durable Target
    guard: Any  # the retention StepGuard
    allow_pickle: bool

    def read(self, source: Any, step: int, manifest: Manifest, device: torch.device, loader: str,
             images: dict[str, torch.Tensor] | None, dests: dict[str, torch.Tensor] | None,
             verified: bool = False) -> dict[str, torch.Tensor]: ...

    def restore_newest(self, candidates: list[int], target: Any, device: torch.device | None, loader: str,
                       rank_map: Any = None) -> Any: ...


def _agree(coord: Coordinator | None, error: CkptError | None, what: str) -> None:
    """Raise on every rank if any rank failed: the same error type, naming the ranks."""
    if coord is None:
        if error is not None:
            raise error
        return
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
    if kinds == {"ConfigError"}:
        raise ConfigError(text)
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
    if m.step != step:
        raise CheckpointCorruptError(f"{restorer.target.url}: step {step}: the manifest is for step {m.step}")
    return m


@dataclass
class _Plan:
    """What one rank restores of a step."""

    skeleton: Any
    replicated: list[str]  # stored names of the replicated tensors, sorted: the same list on every rank
    reader: dict[str, int]  # replicated stored name -> the rank that reads it
    per_rank: list[str]  # stored names of the PerRank tensors this rank takes
    views: list[str]  # names the tree refers to that are views of stored tensors
    dests: dict[str, Dest]  # DTensor key -> what this rank holds of it
    landing: dict[str, torch.Tensor] = field(default_factory=dict)  # stored name -> the target's tensor it lands in
    aligned: bool = False  # every box is the one this rank saved: read its own files as they are
    target: TargetPlan | None = None  # the match of the target: what finish() copies and loads
    touches: bool = False  # the target holds tensors where the checkpoint does: bytes land in it
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where this rank loads


def _rank_source(me: int, world: int, saved: int, rank_map: RankMap | None, paths: list[str], step: int) -> int:
    """The saved rank whose PerRank values rank ``me`` takes (see docs/DISTRIBUTED.md)."""
    if rank_map is not None and not callable(rank_map):
        raise ConfigError(f"rank_map must be a function (rank, saved_world_size) -> saved rank, got {rank_map!r}")
    if rank_map is None:
        if world == saved or not paths:
            return me if me < saved else 0
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        raise ConfigError(
            f"step {step} was saved by {saved} rank(s) and holds per-rank values ({shown}); this job has {world}. "
            "Say which saved rank's values each rank takes: restore(..., rank_map=lambda rank, saved_world: "
            "rank % saved_world), for example")
    src = rank_map(me, saved)
    if type(src) is not int or not 0 <= src < saved:
        raise ConfigError(f"rank_map({me}, {saved}) returned {src!r}; it must return a saved rank, 0 <= r < {saved}")
    return src


def _plan(m: Manifest, coord: Coordinator | None, target: Any, device: torch.device | None,
          rank_map: RankMap | None, allow_pickle: bool, where: str) -> _Plan:
    me, world = (coord.rank, coord.world) if coord is not None else (0, 1)
    states = m.rank_states if m.rank_states is not None else [m.state]
    saved = len(states)
    probe = rank_view(states, 0, where)  # the structure, to find the PerRank values
    src = _rank_source(me, world, saved, rank_map, probe.per_rank, m.step)
    view = rank_view(states, src, where) if src else probe
    skel = view.skeleton
    own_names = tensor_names(skel, per_rank=True)
    names = tensor_names(skel, per_rank=False) | own_names
    bases = {n: m.tensors.get(n, {}).get("view_of", n) for n in names}
    replicated = sorted({bases[n] for n in names if n not in own_names})
    per_rank = sorted({bases[n] for n in own_names})
    for n in sorted(names | set(replicated) | set(per_rank)):
        stored(m, n, where)  # every name the tree needs is in the index, inside its file
    survey = survey_target(target, skel) if target is not None else None  # what the target holds where
    originals = survey.dtensors if survey is not None else {}
    params = survey.params if survey is not None else {}
    if device is None:  # where the target's tensors are (the first on a GPU), else the host
        device = (survey.device if survey is not None else None) or torch.device("cpu")
    meshes: dict[tuple[int, ...], Any] = {}
    problems: list[str] = []
    dests: dict[str, Dest] = {}
    for key, sd in view.dtensors.items():
        shape, dtype, shards = saved_boxes(m, sd, where)
        before = len(problems)
        d = _dest(key, sd.path, shape, dtype, originals.get(key), params.get(key), device, coord, saved,
                  sd.nodes[0], meshes, problems)
        if len(problems) == before:  # a target of another global shape: reported below, with the rest
            plan_dtensor(d, shards, me, world == saved, sd.nodes[0]["placements"], where)
        dests[key] = d
    plan = _Plan(skel, replicated, {n: owner_of(m.tensors[n]["file"]) % world for n in replicated}, per_rank,
                 sorted(n for n in names if "view_of" in m.tensors[n]), dests, device=device)
    plan.aligned = world == saved and src == me and all(d.own for d in dests.values())
    if survey is not None:
        # the index the skeleton refers to: the stored tensors, and each DTensor key as the local
        # shape this rank restores of it
        index: dict[str, Any] = {n: m.tensors[n] for n in names | set(replicated) | set(per_rank)}
        for key, d in dests.items():
            local = d.local_shape if d.box is not None else tuple(local_tensor(d.target).shape)  # type: ignore[arg-type]
            index[key] = {"dtype": DTYPE_TO_ST[d.dtype], "shape": list(local)}
        try:
            plan.target = match_target(target, skel, index, allow_pickle=allow_pickle)
        except StateMismatchError as exc:
            problems += [p for p in exc.problems if p not in problems]
        if problems:
            raise StateMismatchError(problems)
        assert plan.target is not None
        plan.landing = plan.target.dests
        plan.touches = bool(survey.tensors)
    return plan


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and hasattr(t, "placements") and hasattr(t, "device_mesh")


def _dest(key: str, path: str, shape: tuple[int, ...], dtype: torch.dtype, t: torch.Tensor | None,
          param: torch.Tensor | None, device: torch.device, coord: Coordinator | None, saved: int,
          node: dict[str, Any], meshes: dict[tuple[int, ...], Any], problems: list[str]) -> Dest:
    """What this rank holds of a saved DTensor: the target's layout there, the layout of the
    parameter an optimizer moment belongs to, or (no target tensor) the saved placements on
    the job's ranks; in a single process, the whole tensor."""
    full = ((0,) * len(shape), shape)
    if t is not None:
        if tuple(t.shape) != shape:
            problems.append(f"{path}: the target's global shape is {list(t.shape)}, the checkpoint's {list(shape)}")
        if _is_dtensor(t):
            local = local_tensor(t)
            return Dest(key, path, shape, dtype, box_of(t), local.device, target=t, mesh=t.device_mesh,  # type: ignore[attr-defined]
                        placements=tuple(t.placements))  # type: ignore[attr-defined]
        return Dest(key, path, shape, dtype, full, t.device, target=t)
    if param is not None and tuple(param.shape) == shape:
        if _is_dtensor(param):
            box = box_of(param)
            if box is not None:
                return Dest(key, path, shape, dtype, box, local_tensor(param).device, mesh=param.device_mesh,  # type: ignore[attr-defined]
                            placements=tuple(param.placements))  # type: ignore[attr-defined]
        else:
            return Dest(key, path, shape, dtype, full, param.device)
    if coord is None:
        return Dest(key, path, shape, dtype, full, device)
    placements = parse_placements(node.get("placements", []))
    mesh_shape = tuple(node.get("mesh", []))
    if placements is None or not mesh_shape:
        raise ConfigError(f"{path} was saved with placements {node.get('placements')}: restore it into a target "
                          "DTensor of the same layout")
    if len(mesh_shape) == 1:
        mesh_shape = (coord.world,)
    elif coord.world != saved:
        raise ConfigError(f"{path} was saved on a {list(mesh_shape)} mesh; at another world size, restore it into "
                          "a target that holds a DTensor there (its mesh and placements say where each shard goes)")
    mesh = meshes.get(mesh_shape)
    if mesh is None:
        mesh = meshes[mesh_shape] = _mesh(coord, device, mesh_shape)
    return Dest(key, path, shape, dtype, box_for(shape, mesh, placements), device, mesh=mesh,
                placements=tuple(placements))


def _mesh(coord: Coordinator, device: torch.device, shape: tuple[int, ...]) -> Any:
    """A device mesh over the job's ranks: the job's group itself (1-D), or a new mesh."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if len(shape) == 1:
        return DeviceMesh.from_group(coord.group, device.type)
    return init_device_mesh(device.type, shape)


def _usable(t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device | None = None) -> bool:
    return t is not None and not _is_dtensor(t) and t.is_contiguous() and t.dtype == dtype and \
        tuple(t.shape) == shape and (device is None or t.device == device)


def _restore(restorer: Restorer, source: Source, step: int, m: Manifest, target: Any, device: torch.device | None,
             loader: str, rank_map: RankMap | None, coord: Coordinator | None) -> Any:
    where = f"{source.url}: step {step}"
    me = coord.rank if coord is not None else 0
    plan: _Plan | None = None
    error: CkptError | None = None
    try:
        plan = _plan(m, coord, target, device, rank_map, restorer.allow_pickle, where)
    except CkptError as exc:
        error = exc
    _agree(coord, error, f"the target check of step {step}")
    assert plan is not None
    dev = plan.device
    if str(dev) == "cuda":  # no index: the current device
        dev = torch.device("cuda", torch.cuda.current_device())
    loaded: dict[str, torch.Tensor] = {}
    reads = RangedReads(source, step, m)
    own = _own_files(m, plan, me) if plan.aligned else None
    staged: dict[str, torch.Tensor] | None = None  # aligned: this rank's tensors, verified, in fresh memory
    try:  # read and verify everything this rank needs; nothing lands in the target yet
        with read_errors(source, step, where):
            if own is not None:
                staged = _read_own(restorer, source, step, own, plan, dev, loader, where)
            else:
                _want(m, plan, me, reads, where)
                reads.read()
    except CkptError as exc:
        error = exc
    _agree(coord, error, f"reading step {step}")
    outs: dict[str, torch.Tensor] = {}
    try:  # every rank verified its part: land it
        with torch.no_grad(), read_errors(source, step, where):
            if own is not None:
                dests = _own_dests(plan, own)
                if staged is not None:
                    loaded = _move_into(staged, dests, own, where)
                    staged = None  # (the fresh memory goes as soon as nothing of it is left in use)
                else:  # (no room for it on the device: verified above, now read again into place)
                    loaded = restorer.read(source, step, own, dev, loader, None, dests, verified=True)
                outs = {key: loaded[d.own] for key, d in plan.dests.items()}
            else:
                loaded, outs = _assemble(m, plan, me, reads, dev, where)
                log.info("%s: read %d bytes (%d needed) for this rank's part at world size %d (saved at %d)",
                         where, reads.bytes_read, reads.requested, coord.world if coord else 1, m.world_size)
    except CkptError as exc:
        error = exc
    _agree(coord, error, f"loading step {step}")
    with torch.no_grad():
        if coord is not None:
            group = coord.tensor_group(dev)
            for name in plan.replicated:
                src = plan.reader[name]
                buf = loaded.get(name) if src == me else None
                if buf is None:
                    s = stored(m, name, where)
                    t = plan.landing.get(name)
                    buf = t if t is not None and _usable(t, s.shape, s.dtype, dev) else \
                        torch.empty(s.shape, dtype=s.dtype, device=dev)
                dist.broadcast(buf, src=coord.global_rank(src), group=group)
                loaded[name] = buf
    for name in plan.views:
        e = m.tensors[name]
        if name not in loaded and e["view_of"] in loaded:
            loaded[name] = view_of(loaded[e["view_of"]], name, e, where)
    for key, d in plan.dests.items():
        loaded[key] = _wrap(d, outs[key])
    if plan.target is not None:  # copy what did not land in the target, load its Stateful objects
        return plan.target.finish(loaded)
    return unflatten(plan.skeleton, loaded, allow_pickle=restorer.allow_pickle)


def _own_files(m: Manifest, plan: _Plan, me: int) -> Manifest:
    """The part of the manifest that is this rank's own files, whole (the layout is unchanged)."""
    mine = {f: rec for f, rec in m.files.items() if owner_of(f) == me}
    own = {n: e for n, e in m.tensors.items() if e.get("file") in mine}
    own.update({n: e for n, e in m.tensors.items() if e.get("view_of") in own})
    return Manifest(step=m.step, state=plan.skeleton, tensors=own, files=mine, metadata=m.metadata, time=m.time)


def _own_dests(plan: _Plan, own: Manifest) -> dict[str, torch.Tensor]:
    """Stored name -> the target's tensor it lands in (DTensors: their local shards)."""
    dests = {n: t for n, t in plan.landing.items() if n in own.tensors}
    for d in plan.dests.values():
        if d.target is not None:
            dests[d.own] = local_tensor(d.target)
    return dests


def _read_own(restorer: Restorer, source: Source, step: int, own: Manifest, plan: _Plan, dev: torch.device,
              loader: str, where: str) -> dict[str, torch.Tensor] | None:
    """Read this rank's own files ``own`` once, into fresh memory on ``dev``: the restorer's
    read with no destination (preflight, then every checksum chunk verified as it lands, on
    the loader the restore asked for). The target is untouched: :func:`_move_into` copies
    the tensors into it once every rank's files have verified.

    That costs, until the copies are done, memory for this rank's own files on ``dev`` (the
    target's device): its shard once more. Where a GPU has no room for it, every checksum of
    the files is verified here instead, reading them, and None is returned: the files are
    then read a second time, after the ranks agree, straight into the target's tensors.
    """
    size = sum(r.size for r in own.files.values())
    in_memory = getattr(source, "staged", None)  # (a peer restore's shard, fetched onto dev and verified there)
    fetched: dict[str, torch.Tensor] | None = in_memory(step, own, dev, where) if in_memory is not None else None
    if fetched is not None:
        log.info("%s: this rank's own files, %d bytes, fetched onto %s and verified there", where, size, dev)
        return fetched
    try:
        staged = restorer.read(source, step, own, dev, loader, None, None)
        log.info("%s: read this rank's own files once, %d bytes, at the saved layout", where, size)
        return staged
    except torch.OutOfMemoryError:
        if dev.type != "cuda" or not (plan.touches or any(d.target is not None for d in plan.dests.values())):
            raise  # (no target: nowhere else to land; host memory: no cheaper way)
    log.info("%s: no room on %s for this rank's %d bytes beside the target; verifying them first, then reading "
             "them into the target", where, dev, size)
    preflight(source, step, own, where)
    verify_files(source, step, own, source.io_pool, int(getattr(source.io_pool, "_max_workers", 8)), where)
    return None


def _move_into(staged: dict[str, torch.Tensor], dests: dict[str, torch.Tensor], own: Manifest,
               where: str) -> dict[str, torch.Tensor]:
    """Copy the verified tensors ``staged`` (stored name -> fresh memory) into the target's
    tensors ``dests`` that take them as they are (same device, dtype and shape, contiguous):
    device-to-device or host memcpys, every bit kept; those come back as the target's own, the
    views of them rebuilt on them. The rest stay in ``staged`` memory, for the target walk to
    copy (as a restore that lands in place leaves them)."""
    out = dict(staged)
    synced: set[torch.device] = set()  # the GPUs copied on
    for name, dst in dests.items():
        src = staged.get(name)
        if src is None or src is dst or "file" not in own.tensors.get(name, {}) or not _usable(
                dst, tuple(src.shape), src.dtype, src.device) or dst.is_conj() or dst.is_neg():
            continue
        dst.copy_(src)
        out[name] = dst
        if dst.device.type == "cuda":
            synced.add(dst.device)
    for name, e in own.tensors.items():  # views of a moved base: of the target's memory, as landing there gives
        if "view_of" in e and out.get(e["view_of"]) is not staged.get(e["view_of"]):
            out[name] = view_of(out[e["view_of"]], name, e, where)
    for device in synced:  # the target holds the bytes when the restore returns
        torch.cuda.current_stream(device).synchronize()
    return out


def _want(m: Manifest, plan: _Plan, me: int, reads: RangedReads, where: str) -> None:
    for name in plan.per_rank + [n for n in plan.replicated if plan.reader[n] == me]:
        whole(stored(m, name, where)).want(reads)
    for d in plan.dests.values():
        for p in d.pieces:
            p.want(reads)


def _assemble(m: Manifest, plan: _Plan, me: int, reads: RangedReads, dev: torch.device, where: str
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The tensors this rank read, landed in the target's tensors where they fit."""
    loaded: dict[str, torch.Tensor] = {}
    for name in plan.per_rank + [n for n in plan.replicated if plan.reader[n] == me]:
        s = stored(m, name, where)
        t = plan.landing.get(name)
        need_dev = dev if name not in plan.per_rank else None  # broadcast buffers live on the group's device
        out = t if t is not None and _usable(t, s.shape, s.dtype, need_dev) else \
            torch.empty(s.shape, dtype=s.dtype, device=dev if need_dev is not None or t is None else t.device)
        fill(out, [whole(s)], reads, where)
        loaded[name] = out
    outs: dict[str, torch.Tensor] = {}
    for key, d in plan.dests.items():
        assert d.box is not None
        local = local_tensor(d.target) if d.target is not None else None
        out = local if _usable(local, d.local_shape, d.dtype) and local is not None else \
            torch.empty(d.local_shape, dtype=d.dtype, device=d.device)
        fill(out, d.pieces, reads, where)
        outs[key] = out
    return loaded, outs


def _wrap(d: Dest, out: torch.Tensor) -> torch.Tensor:
    """The restored value of a DTensor: the target's own DTensor when the bytes landed in it,
    else a DTensor on the destination's mesh, else (plain destination) the tensor itself."""
    from torch.distributed.tensor import DTensor

    if d.target is not None and _is_dtensor(d.target):
        local = local_tensor(d.target)
        if local.data_ptr() == out.data_ptr() and local.shape == out.shape:
            return d.target
        return DTensor.from_local(out, d.target.device_mesh, d.target.placements, run_check=False,  # type: ignore[attr-defined]
                                  shape=d.target.shape, stride=d.target.stride())
    if d.mesh is not None and d.placements is not None:
        return DTensor.from_local(out, d.mesh, d.placements, run_check=False, shape=torch.Size(d.shape),
                                  stride=contiguous_stride(d.shape))
    return out


class RankRestore:
    """The multi-rank side of the manager's restorer (its
    :class:`~ckptmgr.restore.restorer.MultiRank`): the manager builds one and hands it to the
    restorer, whose fallback loop (``restore_newest``) serves single- and multi-rank restores.

    Args:
        coord: the job's coordinator; None in a single process (which still reads steps
            written by several ranks, whole).
    """

    def __init__(self, coord: Coordinator | None) -> None:
        self.coord = coord
        self.coordinated = coord is not None

    def restore_step(self, restorer: Restorer, step: int, target: Any, device: torch.device | None, loader: str,
                     rank_map: RankMap | None = None) -> Any:
        """Restore ``step`` on every rank of the job (all ranks call it together); every rank
        raises the same error when any fails."""
        coord = self.coord
        assert coord is not None, "a restore by every rank needs the job's coordinator"
        m = _manifest(restorer, coord, step)
        with restorer.guard.reading(step) as ok:
            error = None if ok else StepNotFoundError(f"step {step} is being deleted by the retention policy")
            _agree(coord, error, f"holding step {step} against deletion")
            return _restore(restorer, restorer.target, step, m, target, device, loader, rank_map, coord)

    def restore_solo(self, restorer: Restorer, source: Source, step: int, manifest: Manifest, target: Any,
                     device: torch.device | None, loader: str, rank_map: RankMap | None = None) -> Any:
        """Restore a multi-rank checkpoint in a single process: DTensors come back whole."""
        return _restore(restorer, source, step, manifest, target, device, loader, rank_map, None)
