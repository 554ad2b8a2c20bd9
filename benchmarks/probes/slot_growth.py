"""When the default options make their staging slots, end to end: a real manager saving while a
"training loop" sleeps between saves, to a durable target slowed to a chosen write time.

    python benchmarks/probes/slot_growth.py --out slot_growth.json
    python benchmarks/probes/slot_growth.py --cases 1.0:1.25,0.6:1.0 --mib 96 --saves 12

Each case ``INTERVAL:WRITE`` runs in a fresh process: ``CheckpointManager(root)`` with the
default options (the local tier in a private /dev/shm directory, or ``--no-tier``), a float32
state of ``--mib`` MiB saved with ``save(step, state, block=False)`` every INTERVAL seconds of
sleep, ``--saves`` times; every write of a data chunk to the durable target is followed by a
sleep that brings the save's durable write to about WRITE seconds (``storage.posix.pwrite_all``
is wrapped: a slow disk, without the disk). Reported per case: the slots made and at which save
each was announced (from the manager's log), the saves' waits for a slot (``busy_wait_s``) and
how long each ``save()`` call took. With ``--compare PATH`` the same cases also run against the
ckptmgr package in another source tree (PATH on ``PYTHONPATH``), alternating which runs first.

With two slots, a save first waits at save k when (k - 2) x WRITE > (k - 1) x INTERVAL (the
durable writes fall behind by WRITE - INTERVAL a save): the third slot is wanted shortly before
that save, not at the first save that overlaps a write. On the CPU a slot is made in
milliseconds, so the forecast's lead (1.5 times the last slot's making time) is short here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any


def child(interval: float, write_s: float, mib: int, saves: int, tier: bool) -> dict[str, Any]:
    import torch

    from ckptmgr import CheckpointManager, StagingOptions
    from ckptmgr.storage import local as local_mod

    state = {"w": torch.randn(mib, 1 << 18)}  # mib MiB of float32
    nbytes = mib << 20
    real = local_mod.pwrite_all

    def slow(fd: int, data: Any, off: int) -> None:
        real(fd, data, off)
        time.sleep(write_s * data.size / nbytes)

    local_mod.pwrite_all = slow  # type: ignore[assignment]
    announced: list[tuple[float, str]] = []
    t0 = time.monotonic()

    class Told(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            m = record.getMessage()
            if "staging slot" in m and ("being made" in m or "added staging slot" in m):
                announced.append((time.monotonic() - t0, m))

    log = logging.getLogger("ckptmgr")
    log.addHandler(Told())
    log.setLevel(logging.INFO)
    work = tempfile.mkdtemp(prefix="slot-growth-")
    shm = tempfile.mkdtemp(prefix="slot-growth-", dir="/dev/shm") if tier else None
    calls: list[float] = []
    starts: list[float] = []
    try:
        opts = StagingOptions(local_dir=shm) if tier else StagingOptions(local_tier=False)
        with CheckpointManager(os.path.join(work, "root"), staging=opts) as mgr:
            for k in range(saves):
                t = time.monotonic()
                starts.append(t - t0)
                mgr.save(k, state, block=False)
                calls.append(time.monotonic() - t)
                time.sleep(interval)
            stats = mgr.stats()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)

    def save_at(t: float) -> int:  # the save whose call was running, or the last one before
        return max(i for i, s in enumerate(starts) if s <= t + 1e-6) + 1

    return {"interval_s": interval, "write_s": write_s, "mib": mib, "saves": saves, "tier": tier,
            "slots": stats["slots"], "busy_waits": stats["busy_waits"], "busy_wait_s": stats["busy_wait_s"],
            "announced": [{"t_s": round(t, 3), "save": save_at(t), "message": m} for t, m in announced],
            "call_s": [round(c, 4) for c in calls]}


def run(tree: str | None, case: str, args: argparse.Namespace) -> dict[str, Any]:
    interval, write_s = (float(x) for x in case.split(":"))
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, __file__, "--child", case, "--mib", str(args.mib), "--saves", str(args.saves)]
    if args.no_tier:
        cmd.append("--no-tier")
    limit = 60 + args.saves * (interval + write_s) * 3
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
    if out.returncode != 0:
        raise SystemExit(f"case {case} ({tree or 'this tree'}) failed:\n{out.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    res["tree"] = tree or "this tree"
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="1.0:1.25,0.6:1.0,1.0:0.8", help="INTERVAL:WRITE seconds, comma-separated")
    p.add_argument("--mib", type=int, default=96)
    p.add_argument("--saves", type=int, default=12)
    p.add_argument("--no-tier", action="store_true", help="no local tier (the durable target only)")
    p.add_argument("--compare", default=None, help="another source tree whose ckptmgr runs the same cases")
    p.add_argument("--out", default=None, help="JSON file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        interval, write_s = (float(x) for x in args.child.split(":"))
        print(json.dumps(child(interval, write_s, args.mib, args.saves, not args.no_tier)))
        return
    trees: list[str | None] = [None] + ([args.compare] if args.compare else [])
    results = []
    for i, case in enumerate(args.cases.split(",")):
        order = trees if i % 2 == 0 else trees[::-1]
        results += [run(t, case, args) for t in order]
    print(f"{'tree':<28} {'interval s':>10} {'write s':>8} {'slots':>5}  {'announced at save':<18} "
          f"{'waits s':>7}  longest save() s")
    for r in results:
        at = ",".join(str(a["save"]) for a in r["announced"]) or "-"
        print(f"{r['tree'][-28:]:<28} {r['interval_s']:>10.2f} {r['write_s']:>8.2f} {r['slots']:>5}  {at:<18} "
              f"{r['busy_wait_s']:>7.3f}  {max(r['call_s']):.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "results": results}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
