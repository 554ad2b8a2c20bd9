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
from typing import NamedTuple

import torch

__all__ = ["Entry", "Landing", "lands_in_target", "plan_landing", "usable_dest"]

_PACK_ALIGN = 64  # each packed run starts on a boundary any dtype accepts
_MEMCPY_BYTES = 1 << 20  # moves of at least this many bytes are one memcpy each, smaller ones fused
# Moves copy integers of the same width as the dtype: byte-exact whatever the dtype (a fused
# copy of bf16 or fp16 goes through float and would rewrite NaN payloads; some dtypes have no
# fused copy at all).
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element's width (itself for a width without one)."""
    as_int = _INT_OF_WIDTH.get(t.element_size())
    return t if as_int is None or t.dtype == as_int else t.view(as_int)


class Entry(NamedTuple):
    """One stored tensor of a file: offsets are relative to the data region."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class Landing:
    """Spans of one file (absolute file offsets, sorted) and the tensors they produce."""

    def __init__(self, spans: list[tuple[int, int, torch.Tensor]],
                 outputs: list[tuple[Entry, torch.Tensor, bool]],
                 moves: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None) -> None:
        self.spans = spans
        self._outputs = outputs  # (entry, raw bytes or the target tensor, is the target)
        self._ends = [e for _, e, _ in spans]
        # (target, what landed for it, bytes) that commit() copies; owned by the restoring thread
        self._moves = moves or []

    @property
    def into_target(self) -> bool:
        """True when some tensors come back as a target's own (straight there, or through
        spare device memory at :meth:`commit`)."""
        return any(direct for _, _, direct in self._outputs)

    def commit(self) -> None:
        """Move what landed in spare device memory into the target's tensors (asynchronous on
        the current stream; a no-op for a plan that lands in place). Call once every chunk
        of the step has verified."""
        moves, self._moves = self._moves, []
        small: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # width -> (targets, sources)
        with torch.no_grad():  # (the targets may be parameters that require grad)
            for d, s, nbytes in moves:
                width = d.element_size()
                if nbytes >= _MEMCPY_BYTES or width not in _INT_OF_WIDTH:  # large: one device memcpy each
                    _bits(d).copy_(_bits(s), non_blocking=True)  # (as fused byte-wise copies, 4.8 GB took
                else:  # 41 ms on an H200)
                    dst, src = small.setdefault(width, ([], []))
                    dst.append(_bits(d))
                    src.append(_bits(s))
            for dst, src in small.values():  # small: fused, one kernel launch per ~100 tensors of a width
                torch._foreach_copy_(dst, src, non_blocking=True)

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
    return dests is not None and any(usable_dest(dests.get(e.name), e, device) for e in entries)


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
    entries = sorted(entries, key=lambda e: e.begin)
    direct = {e.name: dests[e.name] for e in entries
              if dests is not None and usable_dest(dests.get(e.name), e, device)}
    if not direct:
        region = torch.empty(data_len, dtype=torch.uint8, device=device)
        return Landing([(data_start, data_start + data_len, region)] if data_len else [],
                       [(e, region[e.begin:e.end], False) for e in entries])
    fresh = _pack([e for e in entries if e.name not in direct], device)
    spans = [(data_start + b, data_start + e, dst) for b, e, dst in fresh.spans]
    moves: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    if through_device:  # the targets' entries, in runs of their own spare memory
        staged = _pack([e for e in entries if e.name in direct], device, raw=False)
        spans += [(data_start + b, data_start + e, dst) for b, e, dst in staged.spans]
        moves = _moves(staged, direct)
    else:
        spans += [(data_start + e.begin, data_start + e.end, _as_bytes(direct[e.name]))
                  for e in entries if e.name in direct]
    spans.sort(key=lambda s: s[0])
    return Landing(spans, [(e, direct[e.name], True) if e.name in direct else (e, fresh.raw[e.name], False)
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


def _moves(staged: _Packed, direct: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(target, the bytes landed for it as a tensor of the target's dtype and shape, bytes)
    for every entry of ``staged``: each run of neighbours of one dtype is viewed as that dtype
    and split in one call (ten thousand small tensors cost one call, not three views each)."""
    out: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    for run, mem in staged.runs:
        i, rb = 0, run[0].begin
        while i < len(run):
            dtype, j = run[i].dtype, i + 1
            while j < len(run) and run[j].dtype == dtype:
                j += 1
            group, size = run[i:j], dtype.itemsize
            b, e = group[0].begin - rb, group[-1].end - rb
            if (mem.storage_offset() + b) % size:  # a foreign file's unaligned tensor: moved as bytes
                out += [(_as_bytes(direct[x.name]), mem[x.begin - rb:x.end - rb], x.end - x.begin) for x in group]
            else:
                views = mem[b:e].view(dtype).split_with_sizes([(x.end - x.begin) // size for x in group])
                for x, v in zip(group, views, strict=True):
                    out.append((direct[x.name], v if len(x.shape) == 1 else v.view(x.shape), x.end - x.begin))
            i = j
    return out


def _view(raw: torch.Tensor, e: Entry) -> torch.Tensor:
    if raw.data_ptr() % e.dtype.itemsize:  # a foreign file with an unaligned tensor: own copy
        raw = raw.clone()
    return raw.view(e.dtype).view(e.shape)
