"""Restore to the GPU: ckptmgr against its peers, on the same files, from /dev/shm or a cold disk.

    python benchmarks/bench_restore.py --gib 4                       # /dev/shm
    python benchmarks/bench_restore.py --gib 4 --dir /var/tmp/x --cold  # disk, page cache dropped

ckptmgr saves a state (fp32/bf16, ``--tensors`` tensors) under ``--dir``. Then, in one
process, each tool loads the same bytes onto the GPU:

* ckptmgr one-shot: a fresh ``CheckpointManager`` (as in a restarted job) restoring with the
  pinned ring (its pinned buffers allocated inside the timing), in place, into an existing
  GPU target (no new GPU memory), and through kvikio (``loader="gds"``) when installed;
* ckptmgr in the saving process: the step is still in its pinned staging slot (/dev/shm only);
* ``ckptmgr.load_file``, ``safetensors.torch.load_file(device="cuda")``, ``torch.load(map_location=
  "cuda")`` of a ``torch.save`` copy, and fastsafetensors (when installed), on the same files.

Reports time to GPU (synchronized), the peak growth of private host memory (RssAnon, sampled
every 2 ms; mapping tmpfs pages that already exist is not extra memory) and of GPU memory.
With ``--cold`` the page cache of every file is dropped before each run (posix_fadvise), and
the disk's read ceiling is measured in the same run (parallel O_DIRECT and buffered reads).
Prints a table and writes JSON (default benchmarks/out/restore.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import ckptmgr
import ckptmgr.storage.cufile
from ckptmgr import CheckpointManager, StagingOptions


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(fn: Callable[[], Any]) -> tuple[float, float, float, Any]:
    """Seconds, peak extra host MiB, peak extra GPU MiB, result."""
    base = rss_anon()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.002)

    gc.collect()  # results of earlier runs must not be freed inside this one
    torch.cuda.empty_cache()
    th = threading.Thread(target=sample)
    th.start()
    torch.cuda.synchronize()
    gpu0 = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    took = time.perf_counter() - t
    stop.set()
    th.join()
    return took, (peak[0] - base) / 2**20, (torch.cuda.max_memory_allocated() - gpu0) / 2**20, out


def all_files(d: str) -> list[str]:
    return [os.path.join(r, n) for r, _, ns in os.walk(d) for n in ns]


def drop_cache(d: str) -> None:
    """Evict the files under ``d`` from the page cache (they are written back first)."""
    for p in all_files(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_ceiling(paths: list[str], direct: bool, threads: int = 16, block: int = 16 << 20) -> float:
    """Seconds to read ``paths`` with ``threads`` parallel reads of ``block`` bytes into reused
    buffers, O_DIRECT (no page cache) or buffered (cold cache, kernel readahead)."""
    jobs = [(p, off) for p in paths for off in range(0, os.path.getsize(p) // 4096 * 4096, block)]
    bufs = [mmap.mmap(-1, block) for _ in range(threads)]
    local = threading.local()
    counter = iter(range(threads))
    fds = {p: os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for p in paths}

    def one(job: tuple[str, int]) -> None:
        if not hasattr(local, "buf"):
            local.buf = bufs[next(counter)]
        p, off = job
        n = min(block, os.path.getsize(p) // 4096 * 4096 - off)
        os.preadv(fds[p], [memoryview(local.buf)[:n]], off)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, jobs))
    took = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--tensors", type=int, default=150)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm/ckptmgr-bench-restore")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "restore.json"))
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run (disk dirs)")
    args = ap.parse_args()
    from bench_staging import make_state, nbytes

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    state = make_state(args.gib, "cuda", n_tensors=args.tensors)
    size = nbytes(state)
    root = os.path.join(args.dir, "root")
    in_shm = os.path.realpath(args.dir).startswith("/dev/shm")
    mgr = CheckpointManager(root, staging=StagingOptions(local_tier=in_shm and not args.cold))
    mgr.save(1, state).result()
    step_dir = os.path.join(root, "step_000000000001")
    files = sorted(os.path.join(step_dir, n) for n in os.listdir(step_dir) if n.endswith(".safetensors"))
    cpu_state = {k: v.cpu() for k, v in state.items()}
    torch_path = os.path.join(args.dir, "state.pt")
    torch.save(cpu_state, torch_path)
    del state
    torch.cuda.empty_cache()

    from safetensors.torch import load_file as st_load

    def one_shot(**kw: Any) -> Callable[[], Any]:
        def run() -> Any:
            with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as m:
                return m.restore(1, **kw)
        return run

    target = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda") for k, v in cpu_state.items()}
    tools: dict[str, Callable[[], Any]] = {
        "ckptmgr one-shot restore(cuda) [pinned ring, verified]": one_shot(device="cuda"),
        "ckptmgr one-shot restore(cuda, loader='inplace') [verified]": one_shot(device="cuda", loader="inplace"),
        "ckptmgr one-shot restore(target=GPU tensors) [ring, verified]": one_shot(target=target),
    }
    if ckptmgr.storage.cufile.installed():
        tools["ckptmgr one-shot restore(cuda, loader='gds') [kvikio]"] = one_shot(device="cuda", loader="gds")
    if mgr._tier is not None:
        tools["ckptmgr in the saving process [pinned slot, verified]"] = lambda: mgr.restore(1, device="cuda")
    tools.update({
        "ckptmgr.load_file(cuda) [in place]": lambda: [ckptmgr.load_file(f, device="cuda") for f in files],
        "safetensors.load_file(cuda)": lambda: [st_load(f, device="cuda") for f in files],
        "torch.load(map_location=cuda)": lambda: torch.load(torch_path, map_location="cuda", weights_only=True),
    })
    try:
        from fastsafetensors import fastsafe_open

        def fst() -> Any:
            with fastsafe_open(files, device="cuda:0", nogds=True) as f:
                return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (not a dict)
        tools["fastsafetensors (nogds)"] = fst
    except ImportError:
        pass
    ceiling = None
    ceilings = {}
    if args.cold:
        for direct in (True, False, True, False):
            drop_cache(args.dir)
            name = "O_DIRECT" if direct else "buffered"
            ceilings[name] = min(ceilings.get(name, 1e9), read_ceiling(files, direct))
        ceiling = min(ceilings.values())
        print(f"  disk read ceiling (16 parallel 16 MiB reads): {ceilings}", flush=True)
    results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in tools}
    for r in range(args.repeat):
        for name in list(tools)[r % len(tools):] + list(tools)[:r % len(tools)]:
            if args.cold:
                drop_cache(args.dir)
            took, extra, gpu, out = measure(tools[name])
            results[name].append((took, extra, gpu))
            del out
            torch.cuda.empty_cache()
            print(f"  {name}: {took:.3f} s, +{extra:.0f} MiB host, +{gpu:.0f} MiB GPU", flush=True)
    check = one_shot(device="cuda")()
    ok = all(torch.equal(check[k].cpu(), v) and torch.equal(target[k].cpu(), v) for k, v in cpu_state.items())
    mgr.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    where = f"{args.dir}, page cache dropped before each run" if args.cold else args.dir
    lines = [f"{size / 2**30:.2f} GiB in {len(cpu_state)} tensors, {len(files)} files in {where}; median of "
             f"{args.repeat}; bit-identical: {ok}", ""]
    if ceiling is not None:
        lines += ["disk read ceiling, the faster of 16 parallel 16 MiB reads O_DIRECT or buffered from a cold cache: "
                  + ", ".join(f"{k} {v:.3f} s ({size / v / 1e9:.2f} GB/s)" for k, v in ceilings.items()), ""]
    lines += ["| tool | s | GB/s | of ceiling | peak extra host MiB | peak extra GPU MiB |",
              "|---|---|---|---|---|---|"]
    for name, rs in results.items():
        t = statistics.median(x[0] for x in rs)
        share = f"{ceiling / t:.0%}" if ceiling else "-"
        lines.append(f"| {name} | {t:.3f} | {size / t / 1e9:.1f} | {share} | {max(x[1] for x in rs):.0f} | "
                     f"{max(x[2] for x in rs):.0f} |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bytes": size, "results": results, "identical": ok, "device": torch.cuda.get_device_name(),
                   "dir": args.dir, "cold": args.cold, "ceilings_s": ceilings,
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
