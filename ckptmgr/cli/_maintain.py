"""``ckptmgr verify``, ``ckptmgr prune`` and ``ckptmgr flush``: check checkpoints byte for byte,
free space, write out (or drop) the steps this node's local tier holds only."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..errors import CkptError, ConfigError, StepNotFoundError, StorageError
from ..format.manifest import Manifest
from ..format.tree import decode_plain
from ..restore.verify import StepReport, verify_step
from ..retention import AnyOf, KeepBest, KeepEvery, KeepEverySeconds, KeepLatest, RetentionPolicy, StepInfo
from ..retention.deleter import Deleter, StepGuard
from ..storage import Target
from . import _dirckpts as dirckpts
from . import _torchfiles as torchfiles
from ._context import EXIT, CorruptFound, Ctx, damaged, exit_code, manifests, no_checkpoint, tier_steps
from ._render import human_bytes, print_json, progress

__all__ = ["cmd_flush", "cmd_prune", "cmd_verify", "policy_from_args"]


def cmd_verify(ctx: Ctx, args: argparse.Namespace) -> int:
    if (done := dirckpts.handle(ctx, args)) is not None:  # checkpoint-N/ directories with ckptmgr.json
        return done
    if (done := torchfiles.handle(ctx, args)) is not None:  # a directory of .ckpt files
        return done
    target = ctx.target(args.root)
    steps = [ctx.step(target, args.step)] if args.step is not None else target.list_steps()
    found = manifests(ctx, target, steps)
    # steps committed in this node's local tier but not (yet) in the root: listed, not read
    # (the tier may belong to a running job, whose slots are reused under a reader)
    local_only = sorted(set(tier_steps(args.local_dir, target.url, written_out=False)) - set(steps)) \
        if args.step is None and args.local_dir else []
    reports: list[StepReport] = []
    unreadable: dict[int, CkptError] = {}  # steps that failed for another reason than damage
    total = sum(m.total_bytes for m in found.values() if isinstance(m, Manifest))
    with progress(total, "verify", enabled=ctx.show_progress) as bar:
        for step in steps:
            m = found[step]
            if isinstance(m, StepNotFoundError) and args.step is None:
                continue  # deleted (by retention) since the listing: nothing to verify
            if isinstance(m, CkptError):  # a damaged manifest: this step fails, the others are checked
                reports.append(StepReport(step, problems=[str(m)]))
                if exit_code(m) != EXIT["corrupt"]:
                    unreadable[step] = m
                continue
            try:
                reports.append(verify_step(target, step, threads=args.threads, manifest=m, on_bytes=bar.update))
            except StepNotFoundError:
                if args.step is not None:
                    raise
            except CkptError as exc:  # the storage failed on this step: say so, go on
                reports.append(StepReport(step, problems=[str(exc)]))
                if exit_code(exc) != EXIT["corrupt"]:
                    unreadable[step] = exc
            except Exception as exc:  # untrusted contents broke the check: this step is damaged
                reports.append(StepReport(step, problems=[str(damaged(target, step, exc))]))
    if not reports and not local_only:  # an empty root, unrelated files, a typo: nothing was checked
        raise no_checkpoint(target, args.root)
    if ctx.json:
        rows = [{"step": r.step, "tier": "durable", "ok": r.ok, "verified": True, "files": r.files, "bytes": r.bytes,
                 "problems": r.problems} for r in reports]
        rows += [{"step": s, "tier": "local", "ok": True, "verified": False, "files": 0, "bytes": 0, "problems": []}
                 for s in local_only]
        print_json({"root": target.url, "ok": all(r.ok for r in reports),
                    "steps": sorted(rows, key=lambda r: r["step"])})
    else:
        lines = [(r.step, f"step {r.step}: {'ok' if r.ok else f'CORRUPT ({len(r.problems)} problem(s))'}: "
                          f"{r.files} file(s), {human_bytes(r.bytes)} checked", r.problems) for r in reports]
        lines += [(s, f"step {s}: in the local tier only (not yet written to the root): not verified", [])
                  for s in local_only]
        for _, line, problems in sorted(lines, key=lambda x: x[0]):
            print(line)
            for p in problems:
                print(f"  {p}", file=sys.stderr)
        if not lines:
            print(f"no committed checkpoints under {target.url}")
    if not all(r.ok for r in reports):
        # exit 1 when a step is damaged; when the only failures are of another kind (the
        # storage failing, a newer format), their exit code
        bad = [r for r in reports if not r.ok and r.step not in unreadable]
        raise CorruptFound(EXIT["corrupt"] if bad else max(exit_code(e) for e in unreadable.values()))
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


def _check_metrics(ctx: Ctx, target: Target, args: argparse.Namespace) -> None:
    """Refuse a ``--keep-best`` whose metric no step has as a number (a typo would keep
    nothing, and prune delete every step but the newest and protected ones), unless forced.

    Raises:
        ConfigError: naming the metric and the metrics the steps do have.
    """
    bests = [_best(s) for s in args.keep_best or ()]
    if not bests or args.force:
        return
    infos: list[StepInfo] = []
    have: set[str] = set()
    for step, m in manifests(ctx, target, target.list_steps()).items():
        if isinstance(m, Manifest):  # what the deleter reads: the decoded metadata
            meta = decode_plain(m.metadata) if m.metadata is not None else {}
            meta = meta if isinstance(meta, dict) else {}
            infos.append(StepInfo(step, m.time, meta))
            have.update(str(k) for k in meta)
    if not infos:
        return
    for best in bests:
        if best.n > 0 and not any(best.keep(infos)):
            raise ConfigError(f"--keep-best {best.metric}:{best.n}: no step under {target.url} has a numeric "
                              f"metadata value {best.metric!r} (the steps have: {', '.join(sorted(have)) or 'none'}); "
                              "this policy would keep nothing and prune would delete every step but the newest "
                              "and protected ones. Check the name, or pass --force to prune anyway")


def cmd_prune(ctx: Ctx, args: argparse.Namespace) -> int:
    policy = policy_from_args(args)  # bad flags fail before the root is touched
    dirckpts.refuse(args.root, "prune")
    target = ctx.target(args.root, read_only=args.dry_run)
    _check_metrics(ctx, target, args)
    deleter = Deleter(target, policy, StepGuard())
    try:
        doomed = deleter.plan()
        sizes = {s: m.total_bytes if isinstance(m, Manifest) else 0 for s, m in manifests(ctx, target, doomed).items()}
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


def cmd_flush(ctx: Ctx, args: argparse.Namespace) -> int:
    """Write the newest step that this node's local tier of ROOT holds only (kept there by a
    Schedule, or left by a job that stopped before writing it) to ROOT; the older such steps
    are superseded. ``--drop``: delete the tier's copies instead, writing nothing."""
    from ..manager import CheckpointManager
    from ..options import StagingOptions
    from ..storage.tier import LocalTier, read_tier, tier_dir

    target = ctx.target(args.root, read_only=False)
    url = target.url
    only = sorted(set(read_tier(args.local_dir, url, written_out=False)) - set(target.list_steps()))
    tier = LocalTier(args.local_dir, url)  # TierBusyError (exit 5) while a running job owns it
    written: list[int] = []
    try:
        slots = [int(n[5:]) for n in os.listdir(tier.path) if n.startswith("slot-") and n[5:].isdigit()]
        if args.drop:
            for index in slots:
                tier.remove_slot(index)
    finally:
        tier.close(remove=True)  # (the directory goes only when no slot is left)
    if only and not args.drop:  # the manager's start-up adopts the tier and writes its newest step out
        staging = StagingOptions(local_dir=args.local_dir, local_tier=True, slots=max(slots, default=0) + 1)
        with CheckpointManager(args.root, storage_options=ctx.storage_options(), staging=staging) as mgr:
            mgr.wait()
        written = [s for s in only if s in target.list_steps()]
        if only[-1] not in written:
            raise StorageError(f"step {only[-1]} of the local tier {tier_dir(args.local_dir, url)} was not written "
                               f"to {url}")
    out = {"root": url, "local_tier": tier_dir(args.local_dir, url), "tier_only": only, "written": written,
           "dropped": only if args.drop else [s for s in only if s not in written]}
    if ctx.json:
        print_json(out)
    elif not only:
        print(f"nothing to {'drop' if args.drop else 'flush'}: the local tier holds no step that is not in {url}")
    elif args.drop:
        print(f"dropped step(s) {', '.join(map(str, only))} from the local tier {out['local_tier']}; "
              f"{url} is unchanged")
    else:
        superseded = [s for s in only if s not in written]
        print(f"wrote step {only[-1]} to {url}" + (f"; older tier-only step(s) {', '.join(map(str, superseded))} "
                                                    "superseded (dropped)" if superseded else ""))
    return 0

