"""Restore to the GPU from /dev/shm: ckptmgr against its peers, on the same files.

    python benchmarks/bench_restore.py --gib 4

ckptmgr saves a state (fp32/bf16, ``--tensors`` tensors) with the local tier on, so its
files lie in /dev/shm. Then, in one process, each tool loads the same bytes onto the GPU:
ckptmgr's ``restore(device="cuda")`` (the pinned ring, checksums verified beside the copy),
``restore(..., loader="inplace")`` (pinned where they lie, verified), ``ckptmgr.load_file``
on the tier's files, ``safetensors.torch.load_file(device="cuda")`` on the same files, and
``torch.load(map_location="cuda")`` of a ``torch.save`` copy in /dev/shm. Reports time to GPU
(synchronized) and the peak growth of private host memory (RssAnon, sampled every 2 ms); the
mapping of tmpfs pages that already exist is not extra memory.
Prints a table and writes JSON (default benchmarks/out/restore.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import ckptmgr
from ckptmgr import CheckpointManager


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    base = rss_anon()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.002)

    th = threading.Thread(target=sample)
    th.start()
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    took = time.perf_counter() - t
    stop.set()
    th.join()
    return took, (peak[0] - base) / 2**20, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--tensors", type=int, default=150)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm/ckptmgr-bench-restore")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "restore.json"))
    args = ap.parse_args()
    from bench_staging import make_state, nbytes

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    state = make_state(args.gib, "cuda", n_tensors=args.tensors)
    size = nbytes(state)
    mgr = CheckpointManager(os.path.join(args.dir, "root"))
    mgr.save(1, state).result()
    tier = mgr._tier
    files = sorted(os.path.join(os.path.dirname(tier.path_of(1, "data-00000.safetensors")), n)
                   for n in os.listdir(os.path.dirname(tier.path_of(1, "data-00000.safetensors")))
                   if n.endswith(".safetensors"))
    cpu_state = {k: v.cpu() for k, v in state.items()}
    torch_path = os.path.join(args.dir, "state.pt")
    torch.save(cpu_state, torch_path)
    del state
    torch.cuda.empty_cache()

    from safetensors.torch import load_file as st_load

    tools: dict[str, Callable[[], Any]] = {
        "ckptmgr restore(device='cuda') [pinned ring, verified]": lambda: mgr.restore(1, device="cuda"),
        "ckptmgr restore(device='cuda', loader='inplace') [verified]": lambda: mgr.restore(1, device="cuda",
                                                                                             loader="inplace"),
        "ckptmgr.load_file(cuda) [in place]": lambda: [ckptmgr.load_file(f, device="cuda") for f in files],
        "safetensors.load_file(cuda)": lambda: [st_load(f, device="cuda") for f in files],
        "torch.load(map_location=cuda)": lambda: torch.load(torch_path, map_location="cuda", weights_only=True),
    }
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in tools}
    for r in range(args.repeat):
        for name in list(tools)[r % len(tools):] + list(tools)[:r % len(tools)]:
            took, extra, out = measure(tools[name])
            results[name].append((took, extra))
            del out
            torch.cuda.empty_cache()
            print(f"  {name}: {took:.3f} s, +{extra:.0f} MiB host", flush=True)
    check = mgr.restore(1, device="cuda")
    ok = all(torch.equal(check[k].cpu(), v) for k, v in cpu_state.items())
    mgr.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    lines = [f"{size / 2**30:.2f} GiB in {len(cpu_state)} tensors, {len(files)} files in /dev/shm, median of "
             f"{args.repeat}; bit-identical: {ok}", "",
             "| tool | s | GB/s | peak extra host MiB |", "|---|---|---|---|"]
    for name, rs in results.items():
        t = statistics.median(x[0] for x in rs)
        m = max(x[1] for x in rs)
        lines.append(f"| {name} | {t:.3f} | {size / t / 1e9:.1f} | {m:.0f} |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bytes": size, "results": results, "identical": ok, "device": torch.cuda.get_device_name(),
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
