"""``ckptmgr ls`` and ``ckptmgr inspect``: what is under a root, and what a step holds."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import CkptError, StepNotFoundError
from ..format.manifest import Manifest
from . import _dirckpts as dirckpts
from . import _torchfiles as torchfiles
from ._context import EXIT, CorruptFound, Ctx, exit_code, manifests, peer_steps, tier_steps
from ._render import SEQUENCE_LIMIT, human_bytes, plain_tree, print_json, table, tensor_bytes, text_tree, when

__all__ = ["cmd_inspect", "cmd_ls", "local_tier_steps"]


def local_tier_steps(local_dir: str, root_url: str) -> dict[int, Manifest]:
    """Steps committed in this user's local tier of ``root_url`` (read only: the tier may
    belong to a running job; a tier that is not this user's private directory is ignored)."""
    return tier_steps(local_dir, root_url)


def _metadata(m: Manifest) -> dict[str, Any]:
    meta = plain_tree(m.metadata, lambda kind, name: name) if m.metadata is not None else {}
    return meta if isinstance(meta, dict) else {}


def cmd_ls(ctx: Ctx, args: argparse.Namespace) -> int:
    if (done := dirckpts.handle(ctx, args)) is not None:  # checkpoint-N/ directories
        return done
    if (done := torchfiles.handle(ctx, args)) is not None:  # a directory of .ckpt files
        return done
    target = ctx.target(args.root)
    found = manifests(ctx, target, target.list_steps())
    # a step deleted (by retention) between the listing and the read is simply not there
    found = {s: m for s, m in found.items() if not isinstance(m, StepNotFoundError)}
    local = local_tier_steps(args.local_dir, target.url) if args.local_dir else {}
    peer = peer_steps(args.local_dir, target.url) if args.local_dir else {}  # shards in this node's peer tier
    rows: list[dict[str, Any]] = []
    for step in sorted(set(found) | set(local) | set(peer)):
        durable = found.get(step)
        m = durable if isinstance(durable, Manifest) else local.get(step)
        tier = "+".join(t for t, held in (("durable", found), ("local", local), ("peer", peer)) if step in held)
        row: dict[str, Any] = {"step": step, "tier": tier, "ok": not isinstance(durable, CkptError)}
        if step in peer:
            row["peer"] = {"ranks": sorted(peer[step]), "world_size": max(peer[step].values())}
        if isinstance(durable, CkptError):
            row["error"] = str(durable)
        if m is not None:
            row.update({"bytes": m.total_bytes, "files": len(m.files), "tensors": len(m.tensors), "time": m.time,
                        "metadata": _metadata(m)})
        row["protected"] = step in found and target.is_protected(step)
        rows.append(row)
    bad = [r for r in rows if not r["ok"]]
    if ctx.json:
        print_json({"root": target.url, "ok": not bad, "steps": rows})
    elif not rows:
        print(f"no committed checkpoints under {target.url}")
    else:
        print(table([[str(r["step"]), r["tier"] if r["ok"] else f"{r['tier']} DAMAGED",
                      human_bytes(r["bytes"]) if "bytes" in r else "-", when(r["time"]) if "time" in r else "-",
                      "yes" if r["protected"] else "",
                      json.dumps(r["metadata"], ensure_ascii=False)[:80] if "metadata" in r else "-"]
                     for r in rows], ["STEP", "TIER", "SIZE", "COMMITTED", "PROTECTED", "METADATA"]))
        for r in bad:
            print(f"step {r['step']}: {r['error']}", file=sys.stderr)
    if bad:
        codes = [exit_code(e) for e in found.values() if isinstance(e, CkptError)]
        raise CorruptFound(EXIT["corrupt"] if EXIT["corrupt"] in codes else max(codes))
    return 0


def cmd_inspect(ctx: Ctx, args: argparse.Namespace) -> int:
    if (done := torchfiles.handle(ctx, args)) is not None:  # STEP names the .ckpt file
        return done
    target = ctx.target(args.root)
    step = ctx.step(target, args.step)
    m = ctx.manifest(target, step)
    rows = []
    for name, e in m.tensors.items():
        rows.append({"name": name, "dtype": e["dtype"], "shape": e["shape"], "bytes": tensor_bytes(e),
                     "file": e.get("file"), "view_of": e.get("view_of")})
    if ctx.json:
        def leaf(kind: str, name: str) -> dict[str, Any]:
            e = m.tensors.get(name, {})
            return {"kind": kind, "name": name, "dtype": e.get("dtype"), "shape": e.get("shape")}

        print_json({"root": target.url, "step": step, "time": m.time, "library_version": m.library_version,
                    "format_version": m.format_version, "bytes": m.total_bytes, "files": sorted(m.files),
                    "metadata": _metadata(m), "state": plain_tree(m.state, leaf), "tensors": rows})
        return 0
    print(f"step {step} under {target.url}")
    print(f"committed {when(m.time)} by ckptmgr {m.library_version or '?'} (format {m.format_version}); "
          f"{len(m.tensors)} tensors, {human_bytes(m.total_bytes)} in {len(m.files)} file(s)")
    meta = _metadata(m)
    if meta:
        print(f"metadata: {json.dumps(meta, ensure_ascii=False)}")
    print()
    for line in text_tree(m.state, m.tensors, limit=None if args.all else SEQUENCE_LIMIT):
        print(line)
    if args.tensors:
        print()
        print(table([[r["name"], r["dtype"], str(r["shape"]), human_bytes(r["bytes"]) if r["file"] else "-",
                      r["file"] or f"view of {r['view_of']}"] for r in rows],
                    ["TENSOR", "DTYPE", "SHAPE", "BYTES", "FILE"]))
    return 0
