"""Where each byte of a file's data region lands: fresh memory, or a target's own tensors.

A *landing plan* for one file is a list of spans: byte ranges of the file, each with the
uint8 destination it is copied into. Without a target, one span covers the whole data
region and lands in one fresh allocation of which the tensors are views (one allocation per
file). With ``restore(target=...)``, a tensor whose target tensor lives on the device with
the same dtype and shape and is contiguous lands straight in the target's memory: no
second copy of it is ever allocated. The tensors left over (a fresh optimizer has no state
tensors yet) are packed into one allocation per file, each run of neighbours in one span.

Loaders feed chunks of the file (in file order) to :meth:`Landing.land`, which copies the
parts that overlap each span; on a GPU the copies are asynchronous on the loader's stream.

A restore into a target on a GPU may instead land *through spare device memory*
(``plan_landing(..., through_device=True)``): the file lands in one fresh device allocation,
its chunks checked as they arrive (or, from pinned images, beside the copies) exactly as a
restore into fresh memory is, and only
once every chunk of the step has verified does :meth:`Landing.commit` move the bytes into
the target's tensors with device-to-device copies (a memcpy for each large tensor, the
small ones fused: one kernel launch per ~100 tensors, not one copy per tensor). The target
is never touched by a step that fails, the step is read once, and ten thousand small
tensors cost no more than one large one. It needs room on the device for the step;
without it the restorer verifies first instead.
"""

from __future__ import annotations

import bisect
from operator import itemgetter
from typing import NamedTuple

import torch

__all__ = ["Dests", "Entry", "Landing", "checked_dests", "lands_in_target", "plan_landing", "usable_dest"]

_PACK_ALIGN = 64  # each packed run starts on a boundary any dtype accepts
_MEMCPY_BYTES = 1 << 20  # moves of at least this many bytes are one memcpy each, smaller ones fused
# Moves copy every dtype as a dtype whose fused copy keeps every bit: float32 and float64 as
# themselves (their fused copy computes in the dtype: NaN payloads of float32 measured kept on an
# H200), the rest as signed integers of their width (a fused copy of bf16 or fp16 goes through float
# and would rewrite NaN payloads; uint16/32/64, bool and float8 have no exact fused copy, or none).
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FUSED = frozenset({torch.float32, torch.float64, *_INT_OF_WIDTH.values()})  # moved in fused copies


def _move_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a move of ``dtype`` copies as (itself where no same-width integer exists)."""
    return dtype if dtype in _FUSED else _INT_OF_WIDTH.get(dtype.itemsize, dtype)


class Entry(NamedTuple):
    """One stored tensor of a file: offsets are relative to the data region."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class Dests(dict[str, torch.Tensor]):
    """Target tensors by stored tensor name, each already checked (by
    :func:`ckptmgr.restore.target.match_target`) to take its stored tensor's bytes as they are:
    the stored dtype and shape, contiguous, not a conjugate or negative view, writable, not
    empty, sharing memory with no other target tensor. ``device`` is the one device they are
    all on (None: several), where the loaders land them with no second check (of ten thousand
    tensors, each check costs more than a restore into fresh memory spends on the tensor)."""

    device: torch.device | None = None


def checked_dests(dests: dict[str, torch.Tensor] | None, device: torch.device | None) -> bool:
    """True when every tensor of ``dests`` is known to take its bytes as it is on ``device``."""
    return type(dests) is Dests and dests.device is not None and dests.device == device


_ENTRY_BEGIN = itemgetter(3)  # Entry.begin
_SPAN_BEGIN = itemgetter(0)  # the file offset a span begins at


class _Moves(NamedTuple):
    """What :meth:`Landing.commit` copies: targets (or same-width views of them) and what landed
    for them, viewed alike (see :data:`_FUSED`)."""

    fused: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]]  # dtype -> (targets, sources)
    single: list[tuple[torch.Tensor, torch.Tensor]]  # (target, source): large, or no fused copy


class Landing:
    """Spans of one file (absolute file offsets, sorted) and the tensors they produce."""

    def __init__(self, spans: list[tuple[int, int, torch.Tensor]],
                 outputs: list[tuple[Entry, torch.Tensor, bool]], moves: _Moves | None = None) -> None:
        self.spans = spans
        self._outputs = outputs  # (entry, raw bytes or the target tensor, is the target)
        self._ends = [e for _, e, _ in spans]
        self._moves = moves  # what commit() copies, ready to copy; owned by the restoring thread
        self._plain = all(d.dim() == 1 and d.dtype == torch.uint8 and d.stride(0) == 1 for _, _, d in spans)

    @property
    def into_target(self) -> bool:
        """True when some tensors come back as a target's own (straight there, or through
        spare device memory at :meth:`commit`)."""
        return any(direct for _, _, direct in self._outputs)

    def commit(self) -> None:
        """Move what landed in spare device memory into the target's tensors (asynchronous on
        the current stream; a no-op for a plan that lands in place, and the second time).
        Call once every chunk of the step has verified."""
        moves, self._moves = self._moves, None
        if moves is None:
            return
        with torch.no_grad():  # (the targets may be parameters that require grad)
            for d, s in moves.single:  # large: one device memcpy each (as fused byte-wise copies,
                d.copy_(s, non_blocking=True)  # 4.8 GB took 41 ms on an H200)
            for dsts, srcs in moves.fused.values():  # small: one kernel launch per ~100 tensors of a dtype
                torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The file's tensors, in file order; call once every byte has landed."""
        return {e.name: t if direct else _view(t, e) for e, t, direct in self._outputs}

    def land(self, begin: int, src: torch.Tensor) -> None:
        """Copy ``src`` (the file's bytes from ``begin``) into every span it overlaps."""
        end = begin + src.numel()
        i = bisect.bisect_right(self._ends, begin)
        while i < len(self.spans) and self.spans[i][0] < end:
            sb, se, dst = self.spans[i]
            lo, hi = max(begin, sb), min(end, se)
            if hi > lo:
                dst[lo - sb:hi - sb].copy_(src[lo - begin:hi - begin], non_blocking=True)
            i += 1

    @property
    def plain(self) -> bool:
        """True when every destination is one run of plain bytes (uint8, contiguous): :meth:`raw`
        can give its copies as addresses."""
        return self._plain

    def raw(self, begin: int, nbytes: int) -> list[tuple[int, int, int]] | None:
        """The copies :meth:`land` would make of the file's bytes ``[begin, begin + nbytes)``,
        as ``(destination address, offset in the source, bytes)``, for a loader that queues
        them itself; None when some destination is not one run of plain bytes (then it calls
        :meth:`land`)."""
        if not self._plain:
            return None
        end = begin + nbytes
        out = []
        i = bisect.bisect_right(self._ends, begin)
        while i < len(self.spans) and self.spans[i][0] < end:
            sb, se, dst = self.spans[i]
            lo, hi = max(begin, sb), min(end, se)
            if hi > lo:  # (the address read now, as land() would write to the tensor's storage now)
                out.append((dst.data_ptr() + lo - sb, lo - begin, hi - lo))
            i += 1
        return out

    def gather(self, begin: int, dst: torch.Tensor) -> None:
        """Copy the landed bytes ``[begin, begin + dst.numel())`` of the file's data region
        back into ``dst`` (the reverse of :meth:`land`; synchronous), to verify what landed."""
        end = begin + dst.numel()
        i = bisect.bisect_right(self._ends, begin)
        while i < len(self.spans) and self.spans[i][0] < end:
            sb, se, src = self.spans[i]
            lo, hi = max(begin, sb), min(end, se)
            if hi > lo:
                dst[lo - begin:hi - begin].copy_(src[lo - sb:hi - sb])
            i += 1


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def usable_dest(t: torch.Tensor | None, entry: Entry, device: torch.device | None) -> bool:
    """True when ``t`` can take ``entry``'s bytes directly (a conjugate or negative view
    cannot: its memory holds other values than it shows)."""
    return (t is not None and t.dtype == entry.dtype and t.shape == entry.shape and t.is_contiguous()
            and t.numel() > 0 and (device is None or t.device == device) and not t.is_conj() and not t.is_neg())


def lands_in_target(entries: list[Entry], dests: dict[str, torch.Tensor] | None, device: torch.device) -> bool:
    """True when a landing plan for ``entries`` would write into any of ``dests``' tensors."""
    if not dests:
        return False
    if checked_dests(dests, device):
        return any(e.name in dests for e in entries)
    return any(usable_dest(dests.get(e.name), e, device) for e in entries)


def plan_landing(entries: list[Entry], data_start: int, data_len: int, device: torch.device,
                 dests: dict[str, torch.Tensor] | None = None, *, through_device: bool = False) -> Landing:
    """The landing plan of one file whose data region is ``[data_start, data_start + data_len)``.

    ``dests`` maps tensor names to target tensors; those that fit (:func:`usable_dest`) take
    their bytes directly and come back as themselves. The rest land in fresh memory on
    ``device``: the whole data region in one allocation when nothing lands in a target.
    With ``through_device``, the targets' bytes land in runs of spare device memory first
    and :meth:`Landing.commit` moves them (see the module's docstring); that memory is
    released with the plan.

    Raises:
        torch.OutOfMemoryError: ``through_device`` and no room on the device for the step.
    """
    entries = sorted(entries, key=_ENTRY_BEGIN)
    direct: dict[str, torch.Tensor] = {}  # name -> the target tensor it lands in
    hits: list[Entry] = []  # their entries
    rest: list[Entry] = []  # the entries that land in fresh memory
    if dests:
        checked = checked_dests(dests, device)
        for e in entries:
            t = dests.get(e.name)
            if t is not None and (checked or usable_dest(t, e, device)):
                direct[e.name] = t
                hits.append(e)
            else:
                rest.append(e)
    if not direct:
        region = torch.empty(data_len, dtype=torch.uint8, device=device)
        return Landing([(data_start, data_start + data_len, region)] if data_len else [],
                       [(e, region[e.begin:e.end], False) for e in entries])
    fresh = _pack(rest, device)
    spans = [(data_start + b, data_start + e, dst) for b, e, dst in fresh.spans]
    moves = None
    if through_device:  # the targets' entries, in runs of their own spare memory
        staged = _pack(hits, device, raw=False)
        spans += [(data_start + b, data_start + e, dst) for b, e, dst in staged.spans]
        moves = _moves(staged, direct)
    else:
        spans += [(data_start + e.begin, data_start + e.end, _as_bytes(direct[e.name])) for e in hits]
    spans.sort(key=_SPAN_BEGIN)
    raw = fresh.raw
    return Landing(spans, [(e, raw[e.name], False) if e.name in raw else (e, direct[e.name], True)
                           for e in entries], moves)


class _Packed(NamedTuple):
    spans: list[tuple[int, int, torch.Tensor]]  # data-region offsets and the memory they land in
    raw: dict[str, torch.Tensor]  # each entry's bytes in that memory (with raw=True)
    runs: list[tuple[list[Entry], torch.Tensor]]  # each run of file neighbours and the memory it lands in


def _pack(entries: list[Entry], device: torch.device, *, raw: bool = True) -> _Packed:
    """One allocation on ``device`` for ``entries`` (sorted by offset), each run of file
    neighbours in one span, as aligned in the allocation as in the file."""
    runs: list[list[Entry]] = []
    for e in entries:
        if runs and runs[-1][-1].end == e.begin:
            runs[-1].append(e)
        else:
            runs.append([e])
    offsets, total = [], 0
    for run in runs:
        total = -(-total // _PACK_ALIGN) * _PACK_ALIGN + run[0].begin % _PACK_ALIGN
        offsets.append(total)
        total += run[-1].end - run[0].begin
    pack = torch.empty(total, dtype=torch.uint8, device=device)
    spans: list[tuple[int, int, torch.Tensor]] = []
    raws: dict[str, torch.Tensor] = {}
    memory: list[tuple[list[Entry], torch.Tensor]] = []
    for run, off in zip(runs, offsets, strict=True):
        rb, re = run[0].begin, run[-1].end
        mem = pack[off:off + re - rb]
        memory.append((run, mem))
        if re > rb:
            spans.append((rb, re, mem))
        if raw:
            for e in run:
                raws[e.name] = pack[off + e.begin - rb:off + e.end - rb]
    return _Packed(spans, raws, memory)


def _moves(staged: _Packed, direct: dict[str, torch.Tensor]) -> _Moves:
    """The copies from ``staged`` into the targets ``direct``, in one pass: each run of file
    neighbours of one dtype is viewed as its move dtype (:func:`_move_dtype`) and split in one
    call, and each target is moved as itself where that is its own dtype (ten thousand small
    float32 tensors cost no view at all; bf16 ones one view each)."""
    fused: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    single: list[tuple[torch.Tensor, torch.Tensor]] = []
    for run, mem in staged.runs:
        i, n, rb, base = 0, len(run), run[0].begin, mem.storage_offset()
        while i < n:
            dtype, j = run[i].dtype, i + 1
            while j < n and run[j].dtype == dtype:
                j += 1
            group, size = run[i:j], dtype.itemsize
            b, e = group[0].begin - rb, group[-1].end - rb
            i = j
            if (base + b) % size:  # a foreign file's unaligned tensor: moved as bytes
                single += [(_as_bytes(direct[x.name]), mem[x.begin - rb:x.end - rb]) for x in group]
                continue
            move = _move_dtype(dtype)
            counts = [(x.end - x.begin) // size for x in group]
            srcs = list(mem[b:e].view(move).split_with_sizes(counts))
            dsts = [direct[x.name] for x in group]
            if move is not dtype:
                dsts = [d.view(move) for d in dsts]  # (same width: same shape)
            if any(len(x.shape) != 1 for x in group):
                srcs = [v if len(x.shape) == 1 else v.view(x.shape) for x, v in zip(group, srcs, strict=True)]
            if move not in _FUSED:
                single += zip(dsts, srcs, strict=True)
            elif max(counts) * size < _MEMCPY_BYTES:  # (the common case: all of them small)
                lists = fused.setdefault(move, ([], []))
                lists[0].extend(dsts)
                lists[1].extend(srcs)
            else:
                lists = fused.setdefault(move, ([], []))
                for d, v, c in zip(dsts, srcs, counts, strict=True):
                    if c * size >= _MEMCPY_BYTES:
                        single.append((d, v))
                    else:
                        lists[0].append(d)
                        lists[1].append(v)
    return _Moves({k: v for k, v in fused.items() if v[0]}, single)


def _view(raw: torch.Tensor, e: Entry) -> torch.Tensor:
    if not raw.numel():  # (an empty tensor may lie at any offset of a foreign file: nothing to view)
        return torch.empty(e.shape, dtype=e.dtype, device=raw.device)
    if raw.data_ptr() % e.dtype.itemsize:  # a foreign file with an unaligned tensor: own copy
        raw = raw.clone()
    return raw.view(e.dtype).view(e.shape)
