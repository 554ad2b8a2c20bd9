"""Multi-rank save: which tensors each rank writes, and the coordinated commit.

Every rank flattens the same state. Tensors under :class:`~ckptmgr.PerRank` and DTensor
shards are the rank's own (names start ``rank00001/``); everything else is *replicated*
(identical on every rank, e.g. a DDP model and optimizer) and is written once: the alias
groups are dealt to the ranks largest first, each to the least loaded, so every rank writes
a disjoint share and write bandwidth grows with the ranks. Each rank writes its files
(``data-r00001-00000.safetensors``) in parallel with the others.

Commit, on each rank's persist thread: every rank reports over the commit group whether its
files are durable, with its skeleton, file records (with 1 MiB sub-chunk checksums, computed
from the staging slot, which still holds the files: they let a rank that restores at another
layout verify the parts it reads) and fingerprints of small CPU tensors;
when all are, rank 0 checks that the replicated parts agree (a value that differs between
ranks and is not wrapped in PerRank would otherwise be restored from one rank onto all),
gathers every rank's files into its step and writes the manifest last. If any rank fails or
vanishes (collective timeout), nothing is committed and each rank removes what it wrote; a
SIGKILLed rank's files are garbage that the next start removes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CkptError, SaveError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import FileRecord, Manifest
from ..format.tree import Leaf
from ..save.persist import PersistJob, StepCommit
from ..storage import StepWriter, Target
from .coordinator import Coordinator, rank_file_prefix
from .ranged import sub_chunk_size

__all__ = ["CoordinatedCommit", "RankPart", "coordinated_commit", "fingerprints", "share_of", "sub_checksums"]

log = logging.getLogger("ckptmgr")
_FINGERPRINT_MAX = 1 << 20  # CPU tensors up to this size are compared across ranks at commit


def share_of(leaves: list[Leaf], rank: int, world: int) -> list[Leaf]:
    """The leaves ``rank`` writes: its own, and its deal of the replicated alias groups."""
    groups: dict[tuple[str, int], list[Leaf]] = {}
    order: list[tuple[str, int]] = []
    for i, leaf in enumerate(leaves):
        if leaf.per_rank:
            continue
        t = leaf.tensor
        key = (str(t.device), t.untyped_storage().data_ptr()) if t.numel() else ("empty", i)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(leaf)
    load = [0] * world
    mine: set[str] = set()
    sizes = {k: max(m.tensor.untyped_storage().nbytes() for m in groups[k]) for k in order}
    for k in sorted(order, key=lambda k: (-sizes[k], order.index(k))):
        r = min(range(world), key=lambda r: (load[r], r))
        load[r] += sizes[k]
        if r == rank:
            mine.update(m.name for m in groups[k])
    return [leaf for leaf in leaves if leaf.per_rank or leaf.name in mine]


def fingerprints(leaves: list[Leaf]) -> dict[str, str]:
    """CRC32C of small replicated CPU tensors (RNG states, counters): cheap to compare."""
    out = {}
    for leaf in leaves:
        t = leaf.tensor
        if not leaf.per_rank and t.device.type == "cpu" and t.numel() * t.element_size() <= _FINGERPRINT_MAX:
            arr = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[leaf.path] = crc32c_hex(np.ascontiguousarray(arr))
    return out


@dataclass
class RankPart:
    """What a rank reports at commit."""

    rank: int
    step: int
    error: str = ""
    state: Any = None
    tensors: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    location: str = ""
    fingerprints: dict[str, str] = field(default_factory=dict)


def _replicated_view(node: Any) -> Any:
    """The skeleton with every rank's own parts blanked: equal on all ranks when the
    replicated state agrees."""
    if isinstance(node, list):
        return [_replicated_view(v) for v in node]
    if not isinstance(node, dict):
        return node
    if "$per_rank" in node:
        return {"$per_rank": None}
    if "$dtensor" in node:  # each rank's own shard: its name and offsets differ
        return {k: v for k, v in node.items() if k not in ("$dtensor", "offsets")}
    return {k: _replicated_view(v) for k, v in node.items()}


def _first_difference(a: Any, b: Any, path: str = "state") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}[{k!r}]"
            if a[k] != b[k]:
                return _first_difference(a[k], b[k], path if k.startswith("$") else f"{path}[{k!r}]")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"{path} ({a!r:.60} on rank 0, {b!r:.60} here)"  # "here": the caller names the rank


def _merge(parts: list[RankPart], template: Manifest) -> Manifest:
    """The job's manifest from every rank's part. Raises SaveError when they disagree."""
    lead = parts[0]
    base = _replicated_view(lead.state)
    for p in parts[1:]:
        if p.step != lead.step:
            raise SaveError(f"rank {p.rank} saved step {p.step} while rank 0 saved step {lead.step}")
        if _replicated_view(p.state) != base:
            raise SaveError(
                f"rank {p.rank}'s state differs from rank 0's at "
                f"{_first_difference(base, _replicated_view(p.state)).replace(' here)', f' on rank {p.rank})')}; "
                "values that differ between ranks must be wrapped in ckptmgr.PerRank(...)")
        for path, crc in p.fingerprints.items():
            if lead.fingerprints.get(path, crc) != crc:
                raise SaveError(f"tensor {path} differs between rank 0 and rank {p.rank}; tensors that differ "
                                "between ranks (RNG states, ...) must be wrapped in ckptmgr.PerRank(...)")
    tensors: dict[str, Any] = {}
    files: dict[str, FileRecord] = {}
    for p in parts:
        tensors.update(p.tensors)
        files.update({k: FileRecord.from_json(v) for k, v in p.files.items()})
    return dataclasses.replace(template, state=lead.state, tensors=tensors, files=files, world_size=len(parts),
                               rank_states=[p.state for p in parts])


class CoordinatedCommit(StepCommit):
    """This rank's share of a multi-rank save, committed by every rank's agreement: its files
    carry the rank's prefix; its commit is :func:`coordinated_commit` (rank 0 writes the
    manifest once every rank's files are durable); a failure is told to the other ranks once,
    and what this rank wrote is removed unless the step was committed meanwhile. Never
    retried alone (the other ranks have moved on)."""

    retryable = False

    def __init__(self, coord: Coordinator, target: Target, fps: dict[str, str], job: PersistJob) -> None:
        self.prefix = rank_file_prefix(coord.rank)
        self._coord = coord
        self._target = target
        self._fps = fps
        self._job = job
        self._told = False  # the other ranks heard how this save went (persist thread only)

    def _images(self) -> dict[str, np.ndarray[Any, Any]]:  # the files as written, still in the staging slot
        job = self._job
        return {name: seg.numpy() for name, seg in zip(job.names, job.slot.segments, strict=True)}

    def commit(self, writer: StepWriter, m: Manifest) -> None:
        self._told = True
        coordinated_commit(self._coord, self._target, writer, m, self._fps, None, self._images)

    def failed(self, writer: StepWriter | None, m: Manifest, error: BaseException) -> None:
        if not self._told:
            self._told = True
            try:
                coordinated_commit(self._coord, self._target, writer, m, self._fps, error)
            except BaseException:
                pass  # (the caller raises ``error``)
        if writer is not None and not _committed(self._target, m.step):
            writer.abort()  # (another rank's commit of this step is never undone)


def _committed(target: Target, step: int) -> bool:
    try:
        return step in target.list_steps()
    except Exception:
        return False


def sub_checksums(target: Target, files: dict[str, FileRecord],
                  images: dict[str, np.ndarray[Any, Any]]) -> dict[str, FileRecord]:
    """``files`` with the finer checksums that let a rank restoring at another layout verify
    the parts of a file it reads (see :mod:`.ranged`), computed on the target's I/O threads."""
    tasks = []
    for name, rec in files.items():
        sub = sub_chunk_size(rec.chunk_size)
        if sub:
            tasks += [(name, b, e) for b, e in chunk_ranges(rec.size, sub)]
    crcs = list(target.io_pool.map(lambda t: crc32c_hex(images[t[0]][t[1]:t[2]]), tasks))
    joined: dict[str, list[str]] = {}
    for (name, _, _), crc in zip(tasks, crcs, strict=True):
        joined.setdefault(name, []).append(crc)
    return {name: dataclasses.replace(rec, sub_chunk_size=sub_chunk_size(rec.chunk_size),
                                      sub_crc32c="".join(joined[name])) if name in joined else rec
            for name, rec in files.items()}


def coordinated_commit(coord: Coordinator, target: Target, writer: StepWriter | None, m: Manifest,
                       fps: dict[str, str], error: BaseException | None,
                       images: Callable[[], dict[str, np.ndarray[Any, Any]]] | None = None) -> Manifest:
    """Run on every rank's persist thread once its files are durable (or its save failed):
    add the finer checksums, agree, and on rank 0 commit. Returns the committed manifest;
    raises on every rank if any rank failed, the ranks disagree, or the commit failed."""
    files = m.files
    if error is None and images is not None:
        try:
            files = sub_checksums(target, m.files, images())
        except Exception as exc:  # told to every rank below, like a failed write
            error = exc
    part = RankPart(coord.rank, m.step, error=f"{type(error).__name__}: {error}" if error else "",
                    state=m.state, tensors=m.tensors, files={k: v.to_json() for k, v in files.items()},
                    location=writer.location if writer is not None else "", fingerprints=fps)
    parts = coord.all_gather(part, f"the commit of step {m.step}", group=coord.commit)
    failed = [p for p in parts if p.error]
    if failed:
        if error is not None:
            raise error
        raise SaveError(f"step {m.step} not committed: rank {failed[0].rank} failed: {failed[0].error}")
    outcome = ""
    merged = m
    if coord.is_leader:
        try:
            merged = _merge(parts, m)
            assert writer is not None
            writer.adopt([(p.location, sorted(p.files)) for p in parts[1:]])
            writer.commit(merged.to_bytes())
        except (CkptError, OSError) as exc:
            outcome = f"{type(exc).__name__}: {exc}"
    outcome = coord.broadcast(outcome, f"the commit outcome of step {m.step}", group=coord.commit)
    if outcome:
        raise SaveError(f"step {m.step} not committed: {outcome}")
    if writer is not None and not coord.is_leader:
        writer.close()  # rank 0 committed this rank's files: release the claim on them
    return merged
