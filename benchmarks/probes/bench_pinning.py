"""The longest training step while ``prepare()`` pins the staging slot and the first save runs.

    python benchmarks/bench_pinning.py --out $OUT/pinning.json

A 24 x Linear(4096) + fused AdamW loop (4.8 GB of state) trains on the GPU, with a
``torch.cuda.synchronize()`` at the end of every step so each step's wall time is exact.
For each pinning strategy (``ckptmgr.save.buffers.PIN_MODE``), in a fresh process:

1. warm-up, then ``--base`` steps: the normal step time (median);
2. ``mgr.prepare(state)`` at a step boundary, training on until the slot is pinned: the
   longest step in that window;
3. ``mgr.save(step, state, block=False)``, ``handle.wait_staged()`` before ``opt.step()``
   (overlap mode), training on until the checkpoint is durable: the longest step;
4. a second save, for the later-save stall (``SaveInfo.blocked_s`` and staging time).

Variants: ``whole`` (one cudaHostRegister on fresh pages: what ckptmgr did before),
``populate`` (pages populated first, then one call), ``pieces`` (populated, then 64 MiB
pieces with a pause between them: the default), and ``pieces-noprepare`` (the default
without ``prepare()``: the first save makes its slot itself). The goal is a longest step
under 2x the normal one. Writes JSON and prints a table; finishes in about 2 minutes on an
H100/H200 (each variant writes 4.8 GB to ``--dir`` twice).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

VARIANTS = ["whole", "populate", "pieces", "pieces-noprepare"]


def _run_variant(variant: str, work: str, layers: int, base_steps: int, width: int, device: str) -> dict[str, Any]:
    import torch

    import ckptmgr.save.buffers as buffers
    from ckptmgr import CheckpointManager, CkptTimeoutError, StagingOptions

    buffers.PIN_MODE = variant.removesuffix("-noprepare")
    torch.manual_seed(0)
    dev = torch.device(device)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    x = torch.randn(1024 if dev.type == "cuda" else 16, width, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    state = {"model": model, "optim": opt}

    def step(before_opt: Any = None) -> float:
        t = time.perf_counter()
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if before_opt is not None:
            before_opt()
        opt.step()
        sync()
        return time.perf_counter() - t

    for _ in range(15):  # warm-up: kernels, the optimizer state, the allocator
        step()
    base = [step() for _ in range(base_steps)]
    root = os.path.join(work, "root")
    mgr = CheckpointManager(root, staging=StagingOptions(slots=1))  # the local tier in /dev/shm
    out: dict[str, Any] = {"variant": variant, "normal_step_s": statistics.median(base),
                           "normal_step_max_s": max(base)}

    def settled() -> bool:
        try:
            mgr.wait(timeout=0)
            return True
        except CkptTimeoutError:
            return False

    # prepare(): pin in the background while the loop trains
    prep_steps: list[float] = []
    if not variant.endswith("noprepare"):
        t0 = time.perf_counter()
        mgr.prepare(state)
        while not settled():
            prep_steps.append(step())
        out["prepare_s"] = time.perf_counter() - t0
        prep_steps += [step() for _ in range(3)]
    out["prepare_steps"] = len(prep_steps)
    out["prepare_max_step_s"] = max(prep_steps, default=0.0)

    # the first save, overlapped with the next forward/backward
    save_steps: list[float] = []
    handles: list[Any] = []
    t0 = time.perf_counter()

    def first_save() -> None:
        h = mgr.save(1, state, block=False)
        handles.append(h)
        h.wait_staged()

    save_steps.append(step(first_save))
    while not handles[0].done():
        save_steps.append(step())
    info = handles[0].result()
    save_steps += [step() for _ in range(3)]
    out["first_save"] = {"blocked_s": info.blocked_s, "staging_s": info.staging_s, "total_s": info.total_s,
                         "bytes": info.bytes, "wall_s": time.perf_counter() - t0}
    out["first_save_max_step_s"] = max(save_steps)
    out["first_save_steps"] = len(save_steps)

    # a later save: the stall every checkpoint pays
    later: list[Any] = []
    s2 = step(lambda: later.append(mgr.save(2, state, block=True)))
    info2 = later[0].result()
    out["later_save"] = {"step_s": s2, "blocked_s": info2.blocked_s, "staging_s": info2.staging_s,
                         "gbps_staging": info2.bytes / info2.staging_s / 1e9}
    out["stats"] = mgr.stats()
    mgr.close()
    worst = max(out["prepare_max_step_s"], out["first_save_max_step_s"])
    out["worst_over_normal"] = worst / out["normal_step_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/out"), "pinning.json"))
    p.add_argument("--dir", default=None, help="scratch directory on disk (default: a temporary one)")
    p.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--base", type=int, default=30, help="steps timed for the normal step")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--device", default="cuda", help="cuda (the measurement); cpu runs the script through only")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:  # one variant, in its own process
        print(json.dumps(_run_variant(args.child, args.dir, args.layers, args.base, args.width, args.device)),
              flush=True)
        return
    import torch

    results: list[dict[str, Any]] = []
    for variant in args.variants:
        work = tempfile.mkdtemp(prefix="ckptmgr-pin-", dir=args.dir)
        try:
            t = time.perf_counter()
            done = subprocess.run([sys.executable, __file__, "--child", variant, "--dir", work, "--layers",
                                   str(args.layers), "--base", str(args.base), "--width", str(args.width),
                                   "--device", args.device],
                                  capture_output=True, text=True, timeout=170)
            if done.returncode != 0:
                results.append({"variant": variant, "error": done.stderr[-3000:]})
                print(f"{variant}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            r["process_s"] = time.perf_counter() - t
            results.append(r)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    report = {"machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
              "torch": torch.__version__, "layers": args.layers, "results": results,
              "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"{'variant':<18} {'normal':>8} {'prepare max':>12} {'1st save max':>13} {'worst/normal':>13} "
          f"{'prepare s':>10} {'later stall':>12}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<18} failed")
            continue
        print(f"{r['variant']:<18} {r['normal_step_s'] * 1e3:7.1f}ms {r['prepare_max_step_s'] * 1e3:10.1f}ms "
              f"{r['first_save_max_step_s'] * 1e3:11.1f}ms {r['worst_over_normal']:12.2f}x "
              f"{r.get('prepare_s', 0.0):9.2f}s {r['later_save']['blocked_s'] * 1e3:10.1f}ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
