"""``ls``, ``inspect`` and ``verify`` of torch checkpoint files: a Lightning ModelCheckpoint
directory of ``.ckpt`` files (or one such file) instead of a ckptmgr root.

A ROOT is taken as such when it is a ``.ckpt``/``.pt``/``.pth`` file, or a directory with such
files and no ckptmgr steps. Files are read without running code from them: the pickle is
loaded with ``weights_only=True`` (memory-mapped, so tensor bytes are not read); what that
refuses (hyper-parameters holding Python objects) is reported, not loaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import zipfile
from typing import Any

from ..errors import CheckpointCorruptError
from ..format.torchzip import CHECKSUM_RECORD, read_records, verify_file
from ._context import CorruptFound, Ctx
from ._render import human_bytes, print_json, table, when

__all__ = ["handle"]

_SUFFIXES = (".ckpt", ".pt", ".pth")


def _files(root: str) -> list[str] | None:
    """The torch checkpoint files ROOT names, or None when ROOT is not such a file or directory."""
    if "://" in root:
        return None
    if os.path.isfile(root) and root.endswith(_SUFFIXES):
        return [root]
    if not os.path.isdir(root):
        return None
    names = os.listdir(root)
    if any(n.startswith("step_") for n in names):
        return None  # a ckptmgr root
    files = sorted(os.path.join(root, n) for n in names if n.endswith(_SUFFIXES) and not n.startswith("."))
    return files or None


def _summary(path: str) -> dict[str, Any]:
    st = os.stat(path)
    row: dict[str, Any] = {"file": path, "bytes": st.st_size, "time": st.st_mtime, "checksums": False,
                           "global_step": None, "epoch": None, "keys": None, "note": ""}
    try:
        with open(path, "rb") as f:
            records = read_records(lambda o, n: (f.seek(o), f.read(n))[1], st.st_size)
        row["checksums"] = any(r.name == CHECKSUM_RECORD for r in records)
        row["tensors"] = sum(1 for r in records if r.name.startswith("data/"))
        row["tensor_bytes"] = sum(r.size for r in records if r.name.startswith("data/"))
    except (CheckpointCorruptError, OSError) as exc:
        row["note"] = f"not a torch zip checkpoint: {exc}"
        return row
    import torch

    try:
        obj = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as exc:  # weights_only refuses Python objects: report, never run them
        row["note"] = f"not loaded with weights_only=True ({str(exc).splitlines()[0][:120]})"
        return row
    if isinstance(obj, dict):
        row["keys"] = sorted(map(str, obj))
        row["global_step"] = obj.get("global_step")
        row["epoch"] = obj.get("epoch")
        hp = obj.get("hyper_parameters")
        row["hyper_parameters"] = sorted(map(str, hp)) if isinstance(hp, dict) else None
    return row


def _ls(ctx: Ctx, root: str, files: list[str]) -> int:
    rows = [_summary(f) for f in files]
    if ctx.json:
        print_json({"root": root, "files": rows})
        return 0
    print(table([[os.path.basename(r["file"]), "" if r["global_step"] is None else str(r["global_step"]),
                  "" if r["epoch"] is None else str(r["epoch"]), human_bytes(r["bytes"]), when(r["time"]),
                  "crc32c" if r["checksums"] else "-", r["note"][:60]] for r in rows],
                ["FILE", "STEP", "EPOCH", "SIZE", "MODIFIED", "CHECKSUMS", "NOTE"]))
    return 0


def _inspect(ctx: Ctx, root: str, files: list[str], which: str | None) -> int:
    if which is not None:
        chosen = [f for f in files if os.path.basename(f) == which]
        if not chosen:
            raise FileNotFoundError(f"no checkpoint file {which!r} in {root} (files: "
                                    f"{', '.join(os.path.basename(f) for f in files)})")
    else:
        chosen = [max(files, key=os.path.getmtime)]
    r = _summary(chosen[0])
    if ctx.json:
        print_json(r)
        return 0
    print(f"{r['file']}: {human_bytes(r['bytes'])}, modified {when(r['time'])}, "
          f"{'with' if r['checksums'] else 'without'} ckptmgr checksums")
    if r.get("tensors") is not None:
        print(f"{r['tensors']} storages, {human_bytes(r['tensor_bytes'])}")
    for key in ("global_step", "epoch", "keys", "hyper_parameters"):
        if r.get(key) is not None:
            print(f"{key}: {r[key]}")
    if r["note"]:
        print(r["note"])
    return 0


def _verify(ctx: Ctx, root: str, files: list[str]) -> int:
    results: list[dict[str, Any]] = []
    for path in files:
        try:
            with open(path, "rb") as f:
                if verify_file(f, what=path):
                    how = "crc32c chunks"
                else:  # written by torch.save: the zip's own CRC-32 of every record
                    bad = zipfile.ZipFile(path).testzip()
                    if bad is not None:
                        raise CheckpointCorruptError(f"{path}: record {bad!r} fails its CRC-32")
                    how = "zip CRC-32"
            results.append({"file": path, "ok": True, "checked": how, "problem": None})
        except (CheckpointCorruptError, zipfile.BadZipFile, OSError) as exc:
            results.append({"file": path, "ok": False, "checked": None, "problem": str(exc)})
    if ctx.json:
        print_json({"root": root, "ok": all(r["ok"] for r in results), "files": results})
    else:
        for r in results:
            name = os.path.basename(r["file"])
            print(f"{name}: ok ({r['checked']})" if r["ok"] else f"{name}: CORRUPT")
            if not r["ok"]:
                print(f"  {r['problem']}", file=sys.stderr)
    if not all(r["ok"] for r in results):
        raise CorruptFound
    return 0


def handle(ctx: Ctx, args: argparse.Namespace) -> int | None:
    """Run ``ls``/``inspect``/``verify`` on torch checkpoint files when ROOT names some;
    None when ROOT is a ckptmgr root (the caller goes on as usual)."""
    files = _files(args.root)
    if files is None:
        return None
    if args.command == "ls":
        return _ls(ctx, args.root, files)
    if args.command == "inspect":
        return _inspect(ctx, args.root, files, args.step if args.step not in (None, "latest") else None)
    return _verify(ctx, args.root, files)
