"""``ckptmgr export`` and ``ckptmgr import``: checkpoints to and from files anyone can read.

Export writes plain safetensors files (loadable with ``safetensors.torch.load_file``) under
the names Hugging Face's ``from_pretrained`` looks for: ``model.safetensors`` when there is
one file, else ``model-00001-of-0000N.safetensors``..., always with
``model.safetensors.index.json`` (``weight_map``: tensor -> file) and ``state.json`` (the
whole state tree as plain JSON, each tensor naming its file). Before anything is written,
every file is checked against the manifest (a regular file of the recorded size, with the
header it records: the checks a restore runs before it allocates anything), so a manifest
claiming a huge shape or file is refused, and the bytes to write are compared with the free
space; every byte read is then checked against the manifest's checksums. Views (tied
weights, tensors sharing storage) are written as tensors of their own. The export is
assembled in a hidden sibling directory and renamed into place, so a half-written export
never looks done.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import shutil
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointCorruptError, ConfigError, StepExistsError, StorageError, UnsupportedValueError
from ..format.layout import ST_TO_DTYPE, StoredTensor, header_bytes
from ..format.manifest import Manifest
from ..restore.loaders.host import view_of
from ..restore.preflight import preflight
from ..restore.read import Mismatch, plan_check, run
from ..restore.transports.pread import PreadTransport
from ..restore.verify import file_url
from ..storage import Target
from . import _dirckpts as dirckpts
from ._context import Ctx
from ._render import Progress, human_bytes, plain_tree, print_json, progress

__all__ = ["SAFE_WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_NAME", "cmd_export", "cmd_import"]

_EMPTY = torch.empty(0, dtype=torch.uint8)
SAFE_WEIGHTS_NAME = "model.safetensors"  # the names transformers' from_pretrained looks for
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


class _Out:
    """One exported safetensors file: its tensors, packed in source order."""

    def __init__(self, name: str, picks: list[tuple[str, str, dict[str, Any]]], step: int) -> None:
        self.name = name
        self.tensors, off = [], 0
        self.where: dict[str, int] = {}  # source name -> offset in the new data region
        for src, dst, e in picks:
            n = int(e["offsets"][1]) - int(e["offsets"][0])
            self.tensors.append(StoredTensor(dst, e["dtype"], tuple(e["shape"]), off, off + n, _EMPTY))
            self.where[src] = off
            off += n
        self.header = header_bytes(self.tensors, {"format": "pt", "step": str(step)})


def _select(m: Manifest, prefix: str) -> dict[str, str]:
    """Manifest tensor name -> exported name, for tensors under ``prefix`` (internal storage
    spans are never exported; the views over them are)."""
    return {n: n[len(prefix):] for n in m.tensors if n.startswith(prefix) and not n.endswith("~storage")}


class _Export:
    """Where the verified chunks of one source file go: the selected tensors' bytes to the
    export file ``fd``, the bytes of view bases into ``bases``."""

    def __init__(self, spans: list[tuple[int, int, str]], base_spans: list[tuple[int, int, str]],
                 out: _Out | None, fd: int | None, bases: dict[str, np.ndarray[Any, Any]], bar: Progress) -> None:
        self.spans, self.base_spans, self.out, self.fd, self.bases, self.bar = spans, base_spans, out, fd, bases, bar

    def land(self, begin: int, data: torch.Tensor) -> None:
        buf = data.numpy()
        b, e = begin, begin + buf.size
        for lo, hi, n in self.spans:
            s, t = max(lo, b), min(hi, e)
            if s < t and self.out is not None and self.fd is not None:
                os.pwrite(self.fd, buf[s - b:t - b].data, len(self.out.header) + self.out.where[n] + s - lo)
        for lo, hi, n in self.base_spans:
            s, t = max(lo, b), min(hi, e)
            if s < t:
                self.bases[n][s - lo:t - lo] = buf[s - b:t - b]
        self.bar.update(e - b)


def _stream(target: Target, step: int, m: Manifest, fname: str, out: _Out | None, fd: int | None,
            bases: dict[str, np.ndarray[Any, Any]], bar: Progress) -> None:
    """Read ``fname`` chunk by chunk, verify each chunk, write the selected tensors' bytes
    to ``fd`` and keep the bytes of view bases in ``bases`` (a plan of the file's chunks,
    run by the read driver)."""
    hs = m.files[fname].header_size
    spans = [(hs + int(m.tensors[n]["offsets"][0]), hs + int(m.tensors[n]["offsets"][1]), n)
             for n in (out.where if out else {})]
    base_spans = [(hs + int(m.tensors[n]["offsets"][0]), hs + int(m.tensors[n]["offsets"][1]), n)
                  for n in bases if m.tensors[n].get("file") == fname]

    def message(x: Mismatch) -> str:
        return f"{file_url(target, step, x.file)}: bytes [{x.begin}, {x.end}) fail their checksum"

    plan = plan_check(m, file_url(target, step, fname), files=[fname], message=message,
                      dests={fname: _Export(spans, base_spans, out, fd, bases, bar)})
    run(plan, PreadTransport(target, step, workers=8))


def _view(m: Manifest, name: str, bases: dict[str, np.ndarray[Any, Any]]) -> torch.Tensor:
    """The view ``name`` as a tensor of its own, from its base's verified bytes."""
    e = m.tensors[name]
    return view_of(torch.from_numpy(bases[e["view_of"]]), name, e, f"step {m.step}").contiguous()


def _nbytes(e: dict[str, Any]) -> int:
    """Bytes of a tensor of the (validated) entry's dtype and shape."""
    return int(math.prod(e["shape"])) * ST_TO_DTYPE[e["dtype"]].itemsize


def _check_before_writing(target: Target, step: int, m: Manifest, views: list[str]) -> int:
    """Check, before anything is written, every file of the step against the manifest (a
    regular file of the recorded size, with the header it records); return the bytes the
    export of ``views`` will add (views are written out as tensors of their own).

    The manifest itself was validated on read: each stored tensor's bytes match its dtype
    and shape and lie inside its file.

    Raises:
        CheckpointCorruptError: a file is missing, of another size, or not what it claims.
    """
    where = file_url(target, step, "").rstrip("/")
    try:
        preflight(target, step, m, where)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{where}: a data file is missing ({exc})") from exc
    return sum(_nbytes(m.tensors[v]) for v in views)


def _write_file(path: str, header: bytes, pieces: list[bytes]) -> None:
    with open(path, "wb") as f:
        f.write(header)
        for p in pieces:
            f.write(p)
        f.flush()
        os.fsync(f.fileno())


def _write_views(path: str, m: Manifest, views: list[str], chosen: dict[str, str],
                 bases: dict[str, np.ndarray[Any, Any]]) -> list[str]:
    """The views as tensors of their own in one file (each materialized in turn); their names."""
    order = sorted(views, key=lambda v: -ST_TO_DTYPE[m.tensors[v]["dtype"]].itemsize)
    stored, off = [], 0
    for v in order:
        e = m.tensors[v]
        size = _nbytes(e)
        stored.append(StoredTensor(chosen[v], e["dtype"], tuple(e["shape"]), off, off + size, _EMPTY))
        off += size
    header = header_bytes(stored, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(header)
        for v in order:
            f.write(_view(m, v, bases).reshape(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    return [s.name for s in stored]


def _file_names(n: int) -> list[str]:
    """Hugging Face's names: ``model.safetensors``, or ``model-00001-of-00002.safetensors``..."""
    return [SAFE_WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def cmd_export(ctx: Ctx, args: argparse.Namespace) -> int:
    dirckpts.refuse(args.root, "export")
    dest = os.path.abspath(args.to)
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise StepExistsError(f"export destination {dest!r} exists and is not an empty directory")
    target = ctx.target(args.root)
    step = ctx.step(target, args.step)
    m = ctx.manifest(target, step)
    if m.world_size > 1:  # written by several ranks: DTensors are exported whole
        return _export_whole(ctx, args, target, step, m, dest)
    chosen = _select(m, args.only or "")
    if not chosen:
        raise ConfigError(f"no tensor of step {step} starts with --only {args.only!r}")
    views = [n for n in chosen if "view_of" in m.tensors[n]]
    by_file: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for n, dst in chosen.items():
        e = m.tensors[n]
        if "file" in e:
            by_file.setdefault(e["file"], []).append((n, dst, e))
    bases = sorted({m.tensors[v]["view_of"] for v in views})
    needed = sorted(set(by_file) | {m.tensors[b]["file"] for b in bases})
    planned = _check_before_writing(target, step, m, views) + sum(
        int(e["offsets"][1]) - int(e["offsets"][0]) for picks in by_file.values() for _, _, e in picks)
    parent = os.path.dirname(dest)
    free = shutil.disk_usage(parent if os.path.isdir(parent) else ".").free
    if planned > free:
        raise StorageError(f"exporting step {step} writes {human_bytes(planned)}; {parent} has "
                           f"{human_bytes(free)} free")
    base_bufs = {b: np.empty(int(m.tensors[b]["offsets"][1]) - int(m.tensors[b]["offsets"][0]), dtype=np.uint8)
                 for b in bases}
    work = os.path.join(parent, f".{os.path.basename(dest)}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    weight_map: dict[str, str] = {}
    outs = [f for f in needed if f in by_file]
    out_names = _file_names(len(outs) + bool(views))
    names = dict(zip(outs, out_names, strict=False))
    try:
        with progress(sum(m.files[f].size for f in needed), "export", enabled=ctx.show_progress) as bar:
            for fname in needed:
                out = _Out(names[fname], sorted(by_file[fname], key=lambda p: int(p[2]["offsets"][0])), step) \
                    if fname in by_file else None
                fd = os.open(os.path.join(work, out.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644) if out else None
                try:
                    if out is not None and fd is not None:
                        os.pwrite(fd, out.header, 0)
                        os.ftruncate(fd, len(out.header) + (out.tensors[-1].end if out.tensors else 0))
                    _stream(target, step, m, fname, out, fd, base_bufs, bar)
                    if fd is not None:
                        os.fsync(fd)
                finally:
                    if fd is not None:
                        os.close(fd)
                if out is not None:
                    weight_map.update({t.name: out.name for t in out.tensors})
        if views:
            vname = out_names[-1]
            written = _write_views(os.path.join(work, vname), m, views, chosen, base_bufs)
            weight_map.update(dict.fromkeys(written, vname))

        def leaf(kind: str, name: str) -> dict[str, Any]:
            e = m.tensors.get(name, {})
            dst = chosen.get(name)
            return {"tensor": dst, "file": weight_map.get(dst) if dst is not None else None,
                    "dtype": e.get("dtype"), "shape": e.get("shape"), "kind": kind}

        total = sum(os.path.getsize(os.path.join(work, f)) for f in set(weight_map.values()))
        _write_json(os.path.join(work, SAFE_WEIGHTS_INDEX_NAME),
                    {"metadata": {"total_size": total, "step": step, "source": target.url, "format": "pt"},
                     "weight_map": dict(sorted(weight_map.items()))})
        _write_json(os.path.join(work, "state.json"),
                    {"step": step, "time": m.time, "source": target.url,
                     "metadata": plain_tree(m.metadata, lambda k, n: n) if m.metadata is not None else {},
                     "state": plain_tree(m.state, leaf)})
        os.replace(work, dest)  # onto a missing or empty directory
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    result = {"step": step, "to": dest, "tensors": len(weight_map), "files": sorted(set(weight_map.values())),
              "index": SAFE_WEIGHTS_INDEX_NAME}
    if ctx.json:
        print_json(result)
    else:
        print(f"exported step {step}: {len(weight_map)} tensors in {', '.join(result['files'])}, "
              f"{SAFE_WEIGHTS_INDEX_NAME} and state.json to {dest}")
    return 0


def _export_whole(ctx: Ctx, args: argparse.Namespace, target: Target, step: int, m: Manifest, dest: str) -> int:
    """Export a multi-rank checkpoint: each DTensor assembled whole, replicated tensors once,
    every rank's PerRank tensors under their ``rankNNNNN/`` names."""
    from ..distributed.consolidate import write_whole

    work = os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    try:
        with progress(m.total_bytes, "export", enabled=ctx.show_progress) as bar:
            out = write_whole(target, step, m, work, only=args.only or "", on_bytes=bar.update)
        if not out.weight_map:
            raise ConfigError(f"no tensor of step {step} starts with --only {args.only!r}")

        def leaf(kind: str, name: str) -> dict[str, Any]:
            e = out.index.get(name, {})
            dst = out.names.get(name)
            return {"tensor": dst, "file": out.weight_map.get(dst) if dst is not None else None,
                    "dtype": e.get("dtype"), "shape": e.get("shape"), "kind": kind}

        total = sum(os.path.getsize(os.path.join(work, f)) for f in set(out.weight_map.values()))
        _write_json(os.path.join(work, "index.json"),
                    {"metadata": {"total_size": total, "step": step, "source": target.url, "format": "pt"},
                     "weight_map": dict(sorted(out.weight_map.items()))})
        _write_json(os.path.join(work, "state.json"),
                    {"step": step, "time": m.time, "source": target.url, "world_size": m.world_size,
                     "metadata": plain_tree(m.metadata, lambda k, n: n) if m.metadata is not None else {},
                     "state": plain_tree(out.skeleton, leaf)})
        os.replace(work, dest)  # onto a missing or empty directory
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    files = sorted(set(out.weight_map.values()))
    if ctx.json:
        print_json({"step": step, "to": dest, "tensors": len(out.weight_map), "files": files})
    else:
        print(f"exported step {step} (saved by {m.world_size} ranks, DTensors whole): {len(out.weight_map)} tensors "
              f"in {len(files)} safetensors file(s), index.json and state.json to {dest}")
    return 0


def _write_json(path: str, obj: Any) -> None:
    _write_file(path, json.dumps(obj, indent=1, ensure_ascii=False, allow_nan=False).encode("utf-8"), [])


def _load(path: str, safe_globals: list[str]) -> tuple[Any, str]:
    """The object in ``path`` and its kind: safetensors, or torch.load with weights_only."""
    if path.endswith(".safetensors"):
        from ..restore.loaders import load_file

        return load_file(path), "safetensors"
    allowed = []
    for spec in safe_globals:
        module, _, name = spec.rpartition(".")
        try:
            allowed.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"--safe-global {spec!r} cannot be imported: {exc}") from exc
    try:
        with torch.serialization.safe_globals(allowed):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if found is None:  # not a class it refuses: the bytes are not a torch.save file at all
            raise ConfigError(f"{path} is not a file torch.load can read ({_torch_reason(exc)}); ckptmgr "
                              "imports torch.save, Lightning .ckpt and .safetensors files") from exc
        raise ConfigError(
            f"{path}: torch.load(weights_only=True) refuses it: it holds {found.group(1)}, which is not an allowed "
            "type. If you trust the file, allow the named class with --safe-global MODULE.NAME "
            "(and --allow-pickle to store values ckptmgr cannot store natively)") from exc
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as exc:  # torch.load fails on foreign bytes with whatever the unpickler hit
        raise ConfigError(f"{path} is not a file torch.load can read ({type(exc).__name__}: "
                          f"{_torch_reason(exc)}); ckptmgr imports torch.save, Lightning .ckpt and .safetensors "
                          "files") from exc
    kind = "lightning" if isinstance(obj, dict) and "state_dict" in obj and "global_step" in obj else "torch.save"
    return obj, kind


def _torch_reason(exc: BaseException) -> str:
    """The line of a torch.load error that says what it found (its messages are long)."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("Unsupported operand", "invalid load key", "Unsupported", "PytorchStreamReader")):
            return ln
    return lines[-1][:200] if lines else type(exc).__name__


def cmd_import(ctx: Ctx, args: argparse.Namespace) -> int:
    from ..manager import CheckpointManager

    if not os.path.isfile(args.file):
        raise FileNotFoundError(f"no file {args.file!r} to import")
    state, kind = _load(args.file, args.safe_global or [])
    step = args.step
    if step is None:
        if kind != "lightning":
            raise ConfigError(f"{args.file} is a {kind} file: give the step with --step N")
        step = int(state["global_step"])
    meta = {"imported_from": os.path.abspath(args.file), "source_format": kind}
    with CheckpointManager(args.root, storage_options=ctx.storage_options(), allow_pickle=args.allow_pickle) as mgr:
        try:
            info = mgr.save(step, state, metadata=meta).result()
        except UnsupportedValueError as exc:  # the library's advice names its argument; here it is a flag
            msg = str(exc).replace("pass allow_pickle=True to CheckpointManager", "pass --allow-pickle")
            raise ConfigError(f"{args.file}: {msg}") from exc
    out = {"root": mgr.root, "step": step, "source_format": kind, "bytes": info.bytes}
    if ctx.json:
        print_json(out)
    else:
        print(f"imported {args.file} ({kind}) as step {step} under {mgr.root}: {human_bytes(info.bytes)}")
    return 0
