"""``ls``, ``inspect`` and ``verify`` of torch checkpoint files: a Lightning ModelCheckpoint
directory of ``.ckpt`` files (or one such file) instead of a ckptmgr root.

A ROOT is taken as such when it is a ``.ckpt``/``.pt``/``.pth`` file, or a directory with such
files and no ckptmgr steps. Files are read without running code from them: the pickle is
loaded with ``weights_only=True`` (memory-mapped, so tensor bytes are not read); what that
refuses (hyper-parameters holding Python objects) is reported, not loaded. Only regular files
are opened (a link to one is followed: Lightning's ``save_last="link"``), and without blocking:
a FIFO, socket, device or directory named ``*.ckpt`` is listed with its kind, never opened.
Files are ordered by their step (the checkpoint's ``global_step``, else ``step=N`` in the
name), and ``inspect DIR STEP`` picks a file by its step as well as by its name.
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
import zipfile
from typing import IO, Any

from ..errors import CheckpointCorruptError, StepNotFoundError
from ..format.ziprecords import CHECKSUM_RECORD, read_records, verify_file
from ._context import CorruptFound, Ctx
from ._render import human_bytes, print_json, table, when

__all__ = ["NotRegular", "check_file", "handle", "open_regular", "torch_files"]

_SUFFIXES = (".ckpt", ".pt", ".pth")
_STEP_IN_NAME = re.compile(r"(?:^|[-_])step=(\d+)")  # Lightning's default name: epoch=3-step=500.ckpt
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


class NotRegular(FileNotFoundError):
    """A path that is not a regular file: reported, never opened; no such checkpoint file
    (exit code 3)."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str) -> IO[bytes]:
    """``path`` opened for reading if it is a regular file (a link to one is followed).

    The type is checked before opening (``stat`` opens nothing), the open cannot block
    (``O_NONBLOCK``: a FIFO swapped in meanwhile opens at once), and the opened file is
    checked again (``fstat``: the same regular file).

    Raises:
        NotRegular: ``path`` is a FIFO, socket, device, directory or dangling link.
        OSError: it cannot be opened.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise NotRegular(f"{path} is a dangling symbolic link") from None
        raise
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(f"{path} is {_kind(st.st_mode)}, not a regular file: not opened")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    got = os.fstat(fd)
    if not stat.S_ISREG(got.st_mode) or (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise NotRegular(f"{path} changed while being opened ({_kind(got.st_mode)} now): not read")
    return os.fdopen(fd, "rb")


def torch_files(root: str) -> list[str] | None:
    """The torch checkpoint files ROOT names, or None when ROOT is not such a file or directory."""
    if "://" in root:
        return None
    if root.endswith(_SUFFIXES) and os.path.lexists(root) and not os.path.isdir(root):
        return [root]  # one file (a FIFO or device too: reported, not opened)
    if not os.path.isdir(root):
        return None
    names = os.listdir(root)
    if any(n.startswith("step_") for n in names):
        return None  # a ckptmgr root
    files = [os.path.join(root, n) for n in names if n.endswith(_SUFFIXES) and not n.startswith(".")]
    return sorted(files, key=_natural) or None


def _natural(path: str) -> list[tuple[int, int, str]]:
    """A file name's sort key with numbers compared as numbers (epoch=3 before epoch=11)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", os.path.basename(path))]


def _step(row: dict[str, Any]) -> int | None:
    """A file's step: the checkpoint's ``global_step``, else ``step=N`` in its name."""
    if type(row.get("global_step")) is int:
        return int(row["global_step"])
    found = _STEP_IN_NAME.search(os.path.basename(row["file"]))
    return int(found.group(1)) if found else None


def _by_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows by step (files without one last), then by name with numbers compared as numbers."""
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["step"] is None, r["step"] or 0, _natural(r["file"]))

    return sorted(rows, key=key)


def _summary(path: str) -> dict[str, Any]:
    row: dict[str, Any] = {"file": path, "bytes": None, "time": None, "checksums": False, "global_step": None,
                           "epoch": None, "keys": None, "note": "", "regular": True}
    try:
        f = open_regular(path)
    except NotRegular as exc:
        row.update(regular=False, note=str(exc).removeprefix(f"{path} "), step=None)
        return row
    except OSError as exc:
        row.update(note=f"cannot be opened: {exc}", step=None)
        return row
    with f:
        st = os.fstat(f.fileno())
        row.update(bytes=st.st_size, time=st.st_mtime)
        try:
            records = read_records(lambda o, n: os.pread(f.fileno(), n, o), st.st_size)
            row["checksums"] = any(r.name == CHECKSUM_RECORD for r in records)
            row["tensors"] = sum(1 for r in records if r.name.startswith("data/"))
            row["tensor_bytes"] = sum(r.size for r in records if r.name.startswith("data/"))
        except (CheckpointCorruptError, OSError) as exc:
            row.update(note=f"not a torch zip checkpoint: {exc}", step=_step(row))
            return row
        import torch

        # the opened file itself (torch's mmap wants a path), so that what is loaded is what was checked
        by_fd = f"/proc/self/fd/{f.fileno()}"
        try:
            obj = torch.load(by_fd if os.path.exists(by_fd) else path, weights_only=True, mmap=True,
                             map_location="cpu")
        except Exception as exc:  # weights_only refuses Python objects: report, never run them
            row.update(note=f"not loaded with weights_only=True ({str(exc).splitlines()[0][:120]})", step=_step(row))
            return row
    if isinstance(obj, dict):
        row["keys"] = sorted(map(str, obj))
        row["global_step"] = obj.get("global_step")
        row["epoch"] = obj.get("epoch")
        hp = obj.get("hyper_parameters")
        row["hyper_parameters"] = sorted(map(str, hp)) if isinstance(hp, dict) else None
    row["step"] = _step(row)
    return row


def _ls(ctx: Ctx, root: str, files: list[str]) -> int:
    rows = _by_step([_summary(f) for f in files])
    if ctx.json:
        print_json({"root": root, "files": rows})
        return 0
    print(table([[os.path.basename(r["file"]), "" if r["global_step"] is None else str(r["global_step"]),
                  "" if r["epoch"] is None else str(r["epoch"]),
                  "-" if r["bytes"] is None else human_bytes(r["bytes"]), "-" if r["time"] is None else when(r["time"]),
                  "crc32c" if r["checksums"] else "-", r["note"][:60]] for r in rows],
                ["FILE", "STEP", "EPOCH", "SIZE", "MODIFIED", "CHECKSUMS", "NOTE"]))
    return 0


def _inspect(ctx: Ctx, root: str, files: list[str], which: str | None) -> int:
    """The file ``which`` names (a file name, or a step number), else the one of the highest step."""
    names = {os.path.basename(f): f for f in files}
    if which is not None and which in names:
        chosen = [names[which]]
    else:
        rows = _by_step([_summary(f) for f in files])
        stepped = [r for r in rows if r["step"] is not None]
        if which is None and not stepped:
            chosen = [max(files, key=os.path.getmtime)]
        elif which is None or which.isdigit():
            step = stepped[-1]["step"] if which is None else int(which)
            # a step several files hold (last.ckpt beside epoch=3-step=500.ckpt): the one naming it
            chosen = sorted((r["file"] for r in stepped if r["step"] == step),
                            key=lambda f: _STEP_IN_NAME.search(os.path.basename(f)) is None)[:1]
            if not chosen:
                steps = ", ".join(str(s) for s in sorted({r["step"] for r in stepped})) or "none"
                raise FileNotFoundError(f"no checkpoint file of step {which} in {root} (steps: {steps})")
        else:
            raise FileNotFoundError(f"no checkpoint file {which!r} in {root} (files: {', '.join(names)})")
    r = _summary(chosen[0])
    if ctx.json:
        print_json(r)
        return 0
    if not r["regular"]:
        raise NotRegular(f"{r['file']} {r['note']}")
    print(f"{r['file']}: {human_bytes(r['bytes'])}, modified {when(r['time'])}, "
          f"{'with' if r['checksums'] else 'without'} ckptmgr checksums")
    if r.get("tensors") is not None:
        print(f"{r['tensors']} storages, {human_bytes(r['tensor_bytes'])}")
    for key in ("step", "global_step", "epoch", "keys", "hyper_parameters"):
        if r.get(key) is not None:
            print(f"{key}: {r[key]}")
    if r["note"]:
        print(r["note"])
    return 0


def check_file(path: str) -> str:
    """Check one torch checkpoint file byte for byte; return how (its CRC32C chunks, or the
    zip's CRC-32 of every record).

    Raises:
        NotRegular: not a regular file (not opened).
        CheckpointCorruptError, zipfile.BadZipFile, OSError: it is damaged or unreadable.
    """
    with open_regular(path) as f:
        if verify_file(f, what=path):
            return "crc32c chunks"
        f.seek(0)  # written by torch.save: the zip's own CRC-32 of every record
        bad = zipfile.ZipFile(f).testzip()
        if bad is not None:
            raise CheckpointCorruptError(f"{path}: record {bad!r} fails its CRC-32")
        return "zip CRC-32"


def _verify(ctx: Ctx, root: str, files: list[str]) -> int:
    results: list[dict[str, Any]] = []
    for path in files:
        try:
            how = check_file(path)
            results.append({"file": path, "ok": True, "verified": True, "checked": how, "problem": None})
        except NotRegular as exc:  # listed, not opened: not a checkpoint file
            results.append({"file": path, "ok": True, "verified": False, "checked": None, "problem": str(exc)})
        except (CheckpointCorruptError, zipfile.BadZipFile, OSError) as exc:
            results.append({"file": path, "ok": False, "verified": True, "checked": None, "problem": str(exc)})
    if not any(r["verified"] for r in results):
        raise StepNotFoundError(f"no checkpoint file to verify in {root}: "
                                + "; ".join(str(r["problem"]) for r in results))
    if ctx.json:
        print_json({"root": root, "ok": all(r["ok"] for r in results), "files": results})
    else:
        for r in results:
            name = os.path.basename(r["file"])
            if not r["verified"]:
                print(f"{name}: not verified ({r['problem'].removeprefix(r['file'] + ' ')})")
                continue
            print(f"{name}: ok ({r['checked']})" if r["ok"] else f"{name}: CORRUPT")
            if not r["ok"]:
                print(f"  {r['problem']}", file=sys.stderr)
    if not all(r["ok"] for r in results):
        raise CorruptFound
    return 0


def handle(ctx: Ctx, args: argparse.Namespace) -> int | None:
    """Run ``ls``/``inspect``/``verify`` on torch checkpoint files when ROOT names some;
    None when ROOT is a ckptmgr root (the caller goes on as usual)."""
    files = torch_files(args.root)
    if files is None:
        return None
    if args.command == "ls":
        return _ls(ctx, args.root, files)
    if args.command == "inspect":
        return _inspect(ctx, args.root, files, args.step if args.step not in (None, "latest") else None)
    return _verify(ctx, args.root, files)

