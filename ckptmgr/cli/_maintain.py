"""``ckptmgr verify`` and ``ckptmgr prune``: check checkpoints byte for byte, free space."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import ConfigError
from ..restore.verify import StepReport, verify_step
from ..retention import AnyOf, KeepBest, KeepEvery, KeepEverySeconds, KeepLatest, RetentionPolicy
from ..retention.deleter import Deleter, StepGuard
from . import _torchfiles as torchfiles
from ._context import CorruptFound, Ctx, manifests
from ._render import human_bytes, print_json, progress

__all__ = ["cmd_prune", "cmd_verify", "policy_from_args"]


def cmd_verify(ctx: Ctx, args: argparse.Namespace) -> int:
    if (done := torchfiles.handle(ctx, args)) is not None:  # a directory of .ckpt files
        return done
    target = ctx.target(args.root)
    steps = [ctx.step(target, args.step)] if args.step is not None else target.list_steps()
    found = manifests(ctx, target, steps)
    reports: list[StepReport] = []
    with progress(sum(m.total_bytes for m in found.values()), "verify", enabled=ctx.show_progress) as bar:
        for step in steps:
            reports.append(verify_step(target, step, threads=args.threads, manifest=found[step], on_bytes=bar.update))
    if ctx.json:
        print_json({"root": target.url, "ok": all(r.ok for r in reports),
                    "steps": [{"step": r.step, "ok": r.ok, "files": r.files, "bytes": r.bytes,
                               "problems": r.problems} for r in reports]})
    else:
        for r in reports:
            state = "ok" if r.ok else f"CORRUPT ({len(r.problems)} problem(s))"
            print(f"step {r.step}: {state}: {r.files} file(s), {human_bytes(r.bytes)} checked")
            for p in r.problems:
                print(f"  {p}", file=sys.stderr)
        if not reports:
            print(f"no committed checkpoints under {target.url}")
    if not all(r.ok for r in reports):
        raise CorruptFound
    return 0


def _best(spec: str) -> KeepBest:
    """``METRIC:N[:min|max]`` -> KeepBest."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1].isdigit():
        raise ConfigError(f"--keep-best takes METRIC:N[:min|max], e.g. val_loss:3:min, got {spec!r}")
    return KeepBest(int(parts[1]), parts[0], parts[2] if len(parts) == 3 else "min")


def policy_from_args(args: argparse.Namespace) -> RetentionPolicy:
    """The retention policy the prune flags describe (the same classes the manager runs)."""
    policies: list[RetentionPolicy] = []
    if args.keep_latest is not None:
        policies.append(KeepLatest(args.keep_latest))
    if args.keep_every is not None:
        policies.append(KeepEvery(args.keep_every))
    if args.keep_every_seconds is not None:
        policies.append(KeepEverySeconds(args.keep_every_seconds))
    policies += [_best(s) for s in args.keep_best or ()]
    if not policies:
        raise ConfigError("prune needs at least one of --keep-latest, --keep-every, --keep-every-seconds, "
                          "--keep-best (the newest and protected steps are always kept)")
    return policies[0] if len(policies) == 1 else AnyOf(*policies)


def cmd_prune(ctx: Ctx, args: argparse.Namespace) -> int:
    policy = policy_from_args(args)  # bad flags fail before the root is touched
    target = ctx.target(args.root, read_only=args.dry_run)
    deleter = Deleter(target, policy, StepGuard())
    try:
        doomed = deleter.plan()
        sizes = {s: m.total_bytes for s, m in manifests(ctx, target, doomed).items()}
        deleted = doomed if args.dry_run else deleter.delete(doomed)
    finally:
        deleter.close()
    kept = [s for s in target.list_steps() if s not in deleted] if not args.dry_run else \
        [s for s in target.list_steps() if s not in doomed]
    freed = sum(sizes[s] for s in deleted)
    out: dict[str, Any] = {"root": target.url, "policy": repr(policy), "dry_run": bool(args.dry_run),
                           "deleted": [] if args.dry_run else deleted, "would_delete": doomed if args.dry_run else [],
                           "kept": kept, "bytes_freed": 0 if args.dry_run else freed}
    if ctx.json:
        print_json(out)
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    if not deleted:
        print(f"nothing to delete under {target.url} ({policy!r}); {len(kept)} step(s) kept")
        return 0
    print(f"{verb} {len(deleted)} step(s), {human_bytes(freed)}: {', '.join(map(str, deleted))}")
    print(f"kept {len(kept)} step(s): {', '.join(map(str, kept))}")
    return 0
