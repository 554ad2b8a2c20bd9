"""What the staging and write options cost and buy, on this machine (CPU sizes by default).

    python benchmarks/bench_options.py [--mib 256] [--root DIR] [--out results.json]

Three measurements, each on a fresh manager and a fresh root on local disk:

* ``slots`` and ``on_busy``: saves every ``--gap`` seconds of simulated training; how long each
  ``save()`` blocks the loop (it waits for a free slot when the previous write is not done),
  how many saves are skipped, and what host memory the slots take;
* ``io_threads``: the durable write of one state (after a first save that made the slot);
* the local tier: bytes held in /dev/shm per slot.

Prints a table per measurement and writes JSON. Never a pass/fail: timings depend on the
machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from ckptmgr import CheckpointManager, StagingOptions, WriteOptions


def make_state(mib: int) -> dict[str, torch.Tensor]:
    n = (mib << 20) // 4 // 16
    return {f"layer{i}.weight": torch.randn(n) for i in range(16)}


def tier_bytes(mgr: CheckpointManager) -> int:
    tier = getattr(mgr, "_tier", None)
    if tier is None:
        return 0
    total = 0
    for d, _, files in os.walk(tier.path):
        total += sum(os.stat(os.path.join(d, f)).st_blocks * 512 for f in files)
    return total


def bench_slots(base: str, state: dict[str, torch.Tensor], saves: int, gap: float,
                local_dir: str) -> list[dict[str, Any]]:
    rows = []
    for slots, on_busy in ((1, "wait"), (2, "wait"), (1, "skip")):
        root = os.path.join(base, f"slots{slots}-{on_busy}")
        opts = StagingOptions(slots=slots, on_busy=on_busy, local_dir=local_dir)
        with CheckpointManager(root, staging=opts) as mgr:
            mgr.prepare(state)  # makes every slot ahead of time (else the first use of each is slower)
            deadline = time.monotonic() + 120
            while mgr.save(0, state).skipped and time.monotonic() < deadline:  # "skip" skips while preparing
                time.sleep(0.05)
            mgr.wait()
            blocked, skipped = [], 0
            t_start = time.perf_counter()
            for step in range(1, saves + 1):
                time.sleep(gap)  # the training step
                t0 = time.perf_counter()
                skipped += mgr.save(step, state).skipped
                blocked.append(time.perf_counter() - t0)
            mgr.wait()
            elapsed = time.perf_counter() - t_start
            shm = tier_bytes(mgr)
            stats = mgr.stats()
        rows.append({"slots": slots, "on_busy": on_busy, "saves": saves, "gap_s": gap,
                     "blocked_median_s": statistics.median(blocked), "blocked_max_s": max(blocked),
                     "skipped": skipped, "waits": int(stats["busy_waits"]),
                     "loop_s": elapsed, "tier_bytes": shm, "local_tier": mgr._tier is not None})
        shutil.rmtree(root, ignore_errors=True)
    return rows


def bench_io_threads(base: str, state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    rows = []
    size = sum(t.numel() * t.element_size() for t in state.values())
    for threads in (1, 2, 4, 8):
        root = os.path.join(base, f"io{threads}")
        with CheckpointManager(root, write_options=WriteOptions(io_threads=threads),
                               staging=StagingOptions(local_tier=False)) as mgr:
            mgr.save(0, state).result()
            times = [mgr.save(step, state).result().persist_s for step in (1, 2, 3)]
        rows.append({"io_threads": threads, "bytes": size, "files": len(os.listdir(os.path.join(
            root, "step_000000000003"))) - 1, "persist_median_s": statistics.median(times),
            "gb_per_s": size / statistics.median(times) / 1e9})
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--gap", type=float, default=0.1, help="seconds of 'training' between saves")
    ap.add_argument("--root", default=None, help="a directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.manual_seed(0)
    state = make_state(args.mib)
    base = tempfile.mkdtemp(prefix="ckptmgr-bench-options-", dir=args.root)
    # the local tier in a directory of its own: test runs on a shared machine clean up
    # /dev/shm/ckptmgr-* entries that appear while they run
    shm = tempfile.mkdtemp(prefix="bench-options-", dir="/dev/shm") if os.path.isdir("/dev/shm") else base
    try:
        slots = bench_slots(base, state, args.saves, args.gap, shm)
        io = bench_io_threads(base, state)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(f"state {args.mib} MiB, saves every {args.gap} s of training, root {args.root or tempfile.gettempdir()}")
    print("slots on_busy  blocked median / max s  skipped  loop s  /dev/shm MiB")
    for r in slots:
        shm = f"{r['tier_bytes'] / 2**20:>12.0f}" if r["local_tier"] else "   (no tier)"
        print(f"{r['slots']:>5} {r['on_busy']:<7}  {r['blocked_median_s']:>8.3f} / {r['blocked_max_s']:.3f}"
              f"  {r['skipped']:>7}  {r['loop_s']:>6.2f}  {shm}")
    print("io_threads  files  persist s  GB/s")
    for r in io:
        print(f"{r['io_threads']:>10}  {r['files']:>5}  {r['persist_median_s']:>9.3f}  {r['gb_per_s']:.2f}")
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
              "date": time.strftime("%Y-%m-%d"), "mib": args.mib, "slots": slots, "io_threads": io}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
