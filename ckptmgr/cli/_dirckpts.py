"""``ls`` and ``verify`` of checkpoint directories in a library's own naming, as the
integrations write them: Hugging Face's ``checkpoint-<step>/`` (``CkptmgrTrainer``),
accelerate's ``checkpoint_<step>/`` (``AsyncStateSaver``), and any directory holding the commit
record ``ckptmgr.json`` (accelerate's ``save_state(DIR)``). ROOT is one such directory, or the
directory that holds them (the Trainer's ``output_dir``, accelerate's ``project_dir/checkpoints``).

A directory with a record is verified against it by the integrations' own check
(:func:`ckptmgr.restore.dircheck.verify_dir`: every file it lists present, of its size,
each chunk's CRC32C), so a damaged ``model.safetensors`` fails. One without a record was
written by the library's own code: it is listed, not verified (nothing says what its bytes
should be), and a ROOT where nothing could be verified fails with exit code 3.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from ..errors import CheckpointCorruptError, ConfigError, StepNotFoundError
from ..format.dirrecord import RECORD_NAME, read_record
from ..restore.dircheck import verify_dir
from . import _torchfiles as torchfiles
from ._context import CorruptFound, Ctx
from ._render import human_bytes, print_json, table, when

__all__ = ["checkpoint_dirs", "handle", "refuse"]


DIR_RE = re.compile(r"checkpoint[-_](\d+)")  # transformers' checkpoint-N, accelerate's checkpoint_N


def checkpoint_dirs(root: str) -> list[tuple[int | None, str]] | None:
    """``[(step, path)]`` of the checkpoint directories ROOT names (itself when it holds a
    record, else its ``checkpoint-N``/``checkpoint_N`` subdirectories), by step; None when
    ROOT is neither (a ckptmgr root, a directory of ``.ckpt`` files, a URL)."""
    if "://" in root or not os.path.isdir(root):
        return None
    if os.path.lexists(os.path.join(root, RECORD_NAME)):
        m = DIR_RE.fullmatch(os.path.basename(os.path.normpath(root)))
        return [(int(m.group(1)) if m else None, root)]
    names = os.listdir(root)
    if any(n.startswith("step_") for n in names):
        return None  # a ckptmgr root
    found = []
    for name in names:
        m = DIR_RE.fullmatch(name)
        path = os.path.join(root, name)
        if m is not None and os.path.isdir(path) and not os.path.islink(path):
            found.append((int(m.group(1)), path))
    return sorted(found) or None


def _row(step: int | None, path: str) -> dict[str, Any]:
    """One directory as ``ls`` shows it (its record read, its files not)."""
    row: dict[str, Any] = {"step": step, "path": path, "record": False, "ok": True, "files": None, "bytes": None,
                           "time": os.lstat(path).st_mtime, "metadata": {}, "problem": None}
    try:
        doc = read_record(path)
    except CheckpointCorruptError as exc:
        row.update(record=True, ok=False, problem=str(exc))
        return row
    if doc is not None:
        row.update(record=True, files=len(doc["files"]), bytes=sum(r["size"] for r in doc["files"].values()),
                   metadata=doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {})
        if type(doc.get("time")) in (int, float):
            row["time"] = float(doc["time"])
        if row["step"] is None:
            row["step"] = doc["step"]
    return row


def _ls(ctx: Ctx, root: str, dirs: list[tuple[int | None, str]]) -> int:
    rows = [_row(s, p) for s, p in dirs]
    if ctx.json:
        print_json({"root": root, "ok": all(r["ok"] for r in rows), "checkpoints": rows})
    else:
        print(table([["" if r["step"] is None else str(r["step"]), os.path.basename(os.path.normpath(r["path"])),
                      "-" if r["bytes"] is None else human_bytes(r["bytes"]), when(r["time"]),
                      ("yes" if r["ok"] else "DAMAGED") if r["record"] else "no",
                      json.dumps(r["metadata"], ensure_ascii=False)[:80]] for r in rows],
                    ["STEP", "DIRECTORY", "SIZE", "COMMITTED", RECORD_NAME.upper(), "METADATA"]))
        for r in rows:
            if not r["ok"]:
                print(f"{r['path']}: {r['problem']}", file=sys.stderr)
    if not all(r["ok"] for r in rows):
        raise CorruptFound
    return 0


def _verify(ctx: Ctx, root: str, dirs: list[tuple[int | None, str]]) -> int:
    rows = []
    for step, path in dirs:
        row = _row(step, path)
        row["verified"] = False
        if row["ok"] and row["record"]:
            try:
                row["verified"] = verify_dir(path)
            except CheckpointCorruptError as exc:
                row.update(ok=False, verified=True, problem=str(exc))
        elif row["ok"]:
            row["problem"] = f"no {RECORD_NAME}: not written through ckptmgr, nothing to verify it against"
        rows.append(row)
    if not any(r["verified"] or not r["ok"] for r in rows):
        raise StepNotFoundError(f"no checkpoint directory under {root} has a {RECORD_NAME} record to verify "
                                "against (written without ckptmgr)")
    if ctx.json:
        print_json({"root": root, "ok": all(r["ok"] for r in rows), "checkpoints": rows})
    else:
        for r in rows:
            name = os.path.basename(os.path.normpath(r["path"]))
            if not r["ok"]:
                print(f"{name}: CORRUPT")
                print(f"  {r['problem']}", file=sys.stderr)
            elif r["verified"]:
                print(f"{name}: ok: {r['files']} file(s), {human_bytes(r['bytes'])} checked against {RECORD_NAME}")
            else:
                print(f"{name}: not verified ({r['problem']})")
    if not all(r["ok"] for r in rows):
        raise CorruptFound
    return 0


def handle(ctx: Ctx, args: argparse.Namespace) -> int | None:
    """Run ``ls``/``verify`` on checkpoint directories when ROOT names some; None otherwise."""
    dirs = checkpoint_dirs(args.root)
    if dirs is None:
        return None
    return _ls(ctx, args.root, dirs) if args.command == "ls" else _verify(ctx, args.root, dirs)


def refuse(root: str, command: str) -> None:
    """Refuse ``command`` (prune, export) on what ``ls`` lists but is not a ckptmgr root: a
    directory of torch checkpoint files, or of a library's checkpoint directories.

    Raises:
        ConfigError: saying what ROOT is and what to do instead.
    """
    files = torchfiles.torch_files(root)
    if files is not None:
        raise ConfigError(
            f"{root} is a directory of torch checkpoint files ({len(files)} *.ckpt/*.pt/*.pth, e.g. "
            f"{os.path.basename(files[0])}), not a ckptmgr root: {command} works on ckptmgr roots only. "
            "Lightning's ModelCheckpoint(save_top_k=...) prunes its own files; `ckptmgr import FILE ROOT` stores "
            "one file as a ckptmgr checkpoint, which `ckptmgr export` can then write out")
    dirs = checkpoint_dirs(root)
    if dirs is not None:
        raise ConfigError(
            f"{root} holds a library's checkpoint directories ({os.path.basename(os.path.normpath(dirs[0][1]))}"
            f"{', ...' if len(dirs) > 1 else ''}), not a ckptmgr root: {command} works on ckptmgr roots only. "
            "The integration's retention (save_total_limit, total_limit, AsyncSaveOptions(retention=...)) prunes "
            "them; their files are already plain safetensors and torch files")
