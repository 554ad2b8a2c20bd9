"""Restore after a crash from the local tier: a job saves into /dev/shm and dies (SIGKILL); its
restart, a fresh process, restores the newest step from the tier into the tensors it already
has on the device.

    python benchmarks/bench_tier_restore.py --gib 4.5 --rounds 3 --out $OUT/tier_restore.json
    python benchmarks/bench_tier_restore.py --gib 4.5 --rounds 3 --after-adoption --out $OUT/tier_settled.json
    python benchmarks/bench_tier_restore.py --device cpu --gib 0.25 --rounds 2   # no GPU here

Each round: a child process builds the state (``--tensors`` fp32 tensors on the device), saves
step 1 with the local tier in ``--local-dir`` and a durable root on disk, waits until the step
is durable, reports ready and is SIGKILLed. Then a fresh process (CUDA initialized, the target
tensors allocated before the clock starts) times, separately, opening the
``CheckpointManager`` on the same root and tier (which adopts the dead job's slot) with
``latest_step()``, and
``restore(target=...)`` (and both together: the time to resume), and checks every tensor bit
for bit. The manager verifies the adopted slot while it pins it, so the time of the checks
shows in the open and in the sum, and the restore waits for whatever of them is left: it copies
each piece of the slot as soon as the adoption has pinned it. With ``--after-adoption`` the
restore starts only once the adoption has ended (the wait is reported apart, as ``settle_s``,
and is in neither the restore nor the sum). The host-to-device ceiling is
measured in the same process: one pinned buffer of the step's size copied to the device.
Prints the table (median and range over the rounds) and writes JSON. Never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch
from common import commit


def _state(gib: float, tensors: int, device: str) -> dict[str, torch.Tensor]:
    n = int(gib * (1 << 30)) // 4 // tensors
    g = torch.Generator(device=device).manual_seed(0)
    return {f"t{i:04d}": torch.randn(n, generator=g, device=device) for i in range(tensors)}


def saver(args: argparse.Namespace) -> None:
    from ckptmgr import CheckpointManager, StagingOptions

    state = _state(args.gib, args.tensors, args.device)
    mgr = CheckpointManager(args.root, staging=StagingOptions(local_dir=args.local_dir, local_tier=True))
    mgr.save(1, state).result()
    mgr.wait()
    print("ready", flush=True)
    time.sleep(3600)  # killed here


def restorer(args: argparse.Namespace) -> None:
    from ckptmgr import CheckpointManager, StagingOptions

    cuda = args.device.startswith("cuda")
    ref = _state(args.gib, args.tensors, args.device)
    target = {k: torch.empty_like(v) for k, v in ref.items()}
    nbytes = sum(v.numel() * v.element_size() for v in ref.values())
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    mgr = CheckpointManager(args.root, staging=StagingOptions(local_dir=args.local_dir, local_tier=True))
    step = mgr.latest_step()  # (what a restart asks first: in the open's time)
    t1 = time.perf_counter()
    tier_steps = mgr._tier.steps() if getattr(mgr, "_tier", None) is not None else {}
    # When the adoption's checks end and when its pinning ends, counted from the open's end (a
    # thread waits on their futures meanwhile): which of the two a restore at once waits for.
    with mgr._restorer._mu:
        checks = [f for _, fs in mgr._restorer._adopted.values() for f in fs]
    with mgr._saver.pool._cond:
        pinning = list(mgr._saver.pool._adopting.values())
    ends: dict[str, float] = {}

    def watch() -> None:
        for name, futs in (("checks_end_s", checks), ("adoption_end_s", pinning)):
            for f in futs:
                f.exception(timeout=600)
            ends[name] = time.perf_counter() - t1

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    settle = 0.0
    if args.after_adoption:  # (the adoptions in progress: the pool's own futures)
        pool = mgr._saver.pool
        with pool._cond:
            adoptions = list(pool._adopting.values())
        for adoption in adoptions:
            adoption.result(timeout=600)
        settle = time.perf_counter() - t1
        t1 = time.perf_counter()
        t0 += settle
    if step != 1:
        raise SystemExit(f"latest_step() is {step}, not the step saved")
    mgr.restore(step, target=target)
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    identical = all(torch.equal(target[k], v) for k, v in ref.items())
    watcher.join(600)
    mgr.close()
    ceiling = None
    if cuda:  # one pinned buffer of the step's size, copied to the device
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        ceiling = nbytes / best / 1e9
    print(json.dumps({"open_s": t1 - t0, "restore_s": t2 - t1, "resume_s": t2 - t0, "settle_s": settle,
                      "bytes": nbytes, **ends,
                      "identical": identical,
                      "from_tier": 1 in tier_steps, "h2d_ceiling_gbps": ceiling}), flush=True)


def _child(role: str, args: argparse.Namespace, root: str, local: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--root", root, "--local-dir", local,
           "--gib", str(args.gib), "--tensors", str(args.tensors), "--device", args.device]
    if args.after_adoption:
        cmd.append("--after-adoption")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.5)
    ap.add_argument("--tensors", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--disk-dir", default=None, help="the durable root's parent (default: a temporary directory)")
    ap.add_argument("--local-dir", default="/dev/shm")
    ap.add_argument("--root", default=None)
    ap.add_argument("--role", choices=["saver", "restorer"], default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--after-adoption", action="store_true",
                    help="restore only once the adoption of the slot has ended (not timed with the restore)")
    args = ap.parse_args()
    if args.role is not None:
        (saver if args.role == "saver" else restorer)(args)
        return
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        base = tempfile.mkdtemp(prefix="ckptmgr-bench-tier-", dir=args.disk_dir)
        local = tempfile.mkdtemp(prefix="ckptmgr-bench-tier-", dir=args.local_dir)
        try:
            root = os.path.join(base, "ckpt")
            p = _child("saver", args, root, local)
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], 600)  # the save of the state, bounded
            line = p.stdout.readline() if ready else ""
            if line.strip() != "ready":
                p.kill()
                raise SystemExit(f"the saving process did not get ready (said {line!r})")
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
            q = _child("restorer", args, root, local)
            out, _ = q.communicate(timeout=600)
            if q.returncode:
                raise SystemExit(f"the restoring process failed ({q.returncode})")
            run = json.loads(out.strip().splitlines()[-1])
            run["round"] = r
            runs.append(run)
            print(f"round {r}: open {run['open_s']:.3f} s, restore {run['restore_s']:.3f} s "
                  f"({run['bytes'] / run['restore_s'] / 1e9:.1f} GB/s), from tier {run['from_tier']}, "
                  f"identical {run['identical']}" + "".join(f", {k} {run[k]:.3f}" for k in
                                                            ("checks_end_s", "adoption_end_s") if k in run),
                  flush=True)
        finally:
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(local, ignore_errors=True)

    def summary(key: str) -> dict[str, float]:
        xs = [r[key] for r in runs]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    nbytes = runs[0]["bytes"]
    rest, opened, resumed = summary("restore_s"), summary("open_s"), summary("resume_s")
    ceil = [r["h2d_ceiling_gbps"] for r in runs if r["h2d_ceiling_gbps"]]
    print(f"\n{'what':32} {'median s':>9} {'range s':>15} {'GB/s (median)':>14}")
    print(f"{'open + latest_step() (adopt)':32} {opened['median']:9.3f} {opened['min']:7.3f}-{opened['max']:<7.3f}")
    print(f"{'restore(target) from the tier':32} {rest['median']:9.3f} {rest['min']:7.3f}-{rest['max']:<7.3f} "
          f"{nbytes / rest['median'] / 1e9:14.1f}")
    print(f"{'both (open + restore)':32} {resumed['median']:9.3f} {resumed['min']:7.3f}-{resumed['max']:<7.3f} "
          f"{nbytes / resumed['median'] / 1e9:14.1f}")
    if ceil:
        print(f"{'pinned H2D ceiling':32} {'':9} {'':15} {statistics.median(ceil):14.1f}")
    ends = {k: summary(k) for k in ("checks_end_s", "adoption_end_s") if all(k in r for r in runs)}
    for k, label in (("checks_end_s", "checks end, after the open"),
                     ("adoption_end_s", "pinning ends, after the open")):
        if k in ends:
            print(f"{label:32} {ends[k]['median']:9.3f} {ends[k]['min']:7.3f}-{ends[k]['max']:<7.3f}")
    result = {**ends, "bench": "tier_restore", "commit": commit(), "device": args.device,
              "after_adoption": args.after_adoption,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "gib": args.gib, "tensors": args.tensors, "bytes": nbytes, "runs": runs, "restore_s": rest,
              "open_s": opened, "resume_s": resumed, "restore_gbps_median": nbytes / rest["median"] / 1e9,
              "h2d_ceiling_gbps_median": statistics.median(ceil) if ceil else None,
              "all_identical": all(r["identical"] for r in runs), "all_from_tier": all(r["from_tier"] for r in runs)}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
