"""Where a training loop's checkpoint overhead goes: per-step times beside the manager's log.

    python benchmarks/probes/save_timeline.py --slots 0 --every 25 --steps 100

24 x Linear(4096) + fused AdamW (4.83 GB of state on a GPU), ``save(block=False)`` every
``--every`` steps with ``wait_staged()`` before the next optimizer step (as bench_training's
``ckptmgr overlap``), ``prepare()`` at the loop's start. Prints every step over 1.5x the median
and every log line of the ``ckptmgr`` logger, both on one clock (seconds since the loop's start),
then the manager's stats. ``--slots 0``: the default options.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time

import torch

from ckptmgr import CheckpointManager, Schedule, StagingOptions

T0 = time.perf_counter()


class Clock(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.created - T0_WALL:8.3f} [{record.threadName}] {record.levelname} {record.getMessage()}"


T0_WALL = time.time()


def main() -> None:
    global T0, T0_WALL
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=0)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--no-prepare", action="store_true")
    ap.add_argument("--budget", type=float, default=None,
                    help="Schedule(max_overhead=BUDGET): the loop saves when should_save(step) says")
    ap.add_argument("--level", default="DEBUG")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-first", action="store_true", help="cProfile the first save() call")
    args = ap.parse_args()
    h = logging.StreamHandler()
    h.setFormatter(Clock())
    lg = logging.getLogger("ckptmgr")
    lg.addHandler(h)
    lg.setLevel(args.level)
    lg.propagate = False
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers)]
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.ReLU())]).to(args.device)
    x = torch.randn(args.batch, args.dim, device=args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device.startswith("cuda"))
    root = os.path.join(args.dir, "timeline-root")
    shutil.rmtree(root, ignore_errors=True)
    schedule = Schedule(max_overhead=args.budget) if args.budget is not None else None
    mgr = CheckpointManager(root, staging=StagingOptions(slots=args.slots or None), schedule=schedule)

    def step() -> None:
        model(x).square().mean().backward()
        if pending[0] is not None:
            pending[0].wait_staged()
            pending[0] = None
        opt.step()
        opt.zero_grad(set_to_none=True)

    pending: list = [None]
    for _ in range(5):
        step()
    torch.cuda.synchronize() if args.device.startswith("cuda") else None
    T0, T0_WALL = time.perf_counter(), time.time()
    if not args.no_prepare:
        mgr.prepare({"model": model, "optim": opt, "step": 0})
    times = []
    for s in range(1, args.steps + 1):
        t = time.perf_counter()
        step()
        if (mgr.should_save(s) if schedule is not None else s % args.every == 0):
            t1 = time.perf_counter()
            prof = None
            if args.profile_first and prof is None and not getattr(main, "profiled", False):
                main.profiled = True  # type: ignore[attr-defined]
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            pending[0] = mgr.save(s, {"model": model, "optim": opt, "step": s}, block=False)
            if prof is not None:
                import pstats
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
            took = time.perf_counter() - t1
            print(f"{time.perf_counter() - T0:8.3f} save({s}) returned after {took:.3f} s", flush=True)
        times.append((time.perf_counter() - T0, time.perf_counter() - t))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    total = time.perf_counter() - T0
    med = statistics.median(d for _, d in times)
    for i, (at, d) in enumerate(times, 1):
        if d > 1.5 * med:
            print(f"{at:8.3f} step {i}: {d:.3f} s")
    stats = mgr.stats()
    t = time.perf_counter()
    mgr.close()
    print(f"slots={args.slots or 'default'}: loop {total:.3f} s, {len(times)} steps, median {med * 1e3:.1f} ms, "
          f"excess over median {total - med * len(times):.3f} s; close {time.perf_counter() - t:.2f} s")
    print(json.dumps({k: v for k, v in stats.items() if not isinstance(v, (list, dict))}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "times": times, "stats": stats, "total": total}, f, default=str)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
