"""Restore as a restarted job does it: every tool, every run, in a fresh process.

    python benchmarks/bench_restore.py --gib 4                          # /dev/shm and a cold disk
    python benchmarks/bench_restore.py --gib 4 --sources shm --repeat 5
    python benchmarks/bench_restore.py --device cpu --gib 0.25          # no GPU: loads to host memory
    python benchmarks/bench_restore.py --writer safetensors --dtype bf16 --sources shm   # a published file

ckptmgr saves one state (fp32/bf16, ``--tensors`` tensors) into ``/dev/shm`` (``shm``, warm: the
files are in RAM) and into ``--disk-dir`` (``disk``, cold: the page cache of every file is
dropped before each run), plus a ``torch.save`` copy for torch.load. Then, for ``--repeat``
rounds with the tool order varied each round (:func:`round_order`: each tool runs first in turn,
and after a different tool each round), each tool restores the same bytes in a process of
its own (a restarted job: nothing is cached, no pinned memory exists yet, CUDA is initialized
before the clock starts):

* ckptmgr ``restore(device=...)`` (a fresh ``CheckpointManager``, the automatic loader);
* ckptmgr ``restore(target=...)`` into tensors that already exist on the device;
* ckptmgr ``restore(loader="inplace")`` (``shm`` only: it maps the files where they lie);
* ``ckptmgr.load_file``, ``safetensors.torch.load_file``, ``torch.load`` and fastsafetensors
  (when installed; ``nogds``) on the same files.

With ``--writer safetensors`` the state is one file written by ``safetensors.torch.save_file``
(as a model is published) and only the file loaders run: ``ckptmgr.load_file``,
``safetensors.load_file`` and fastsafetensors (skipped, with a note, where it cannot be imported).

Each run reports the seconds of the load call (synchronized; on the CPU, every page of the
result is read inside the timing, since a mapped file is not loaded until touched), the peak growth of private host
memory (RssAnon), of resident memory (VmRSS: also the file pages a loader maps), both sampled every 2 ms, and of
device memory, and whether every tensor came back
bit for bit. The table gives the median and the range over the rounds. With ``disk`` the disk's
read ceiling is measured in the same run (several request patterns, cold cache, the best
taken). Prints the table and writes JSON (default benchmarks/out/restore.json).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from common import PeakRss, commit, drop_cache, fingerprint, make_state, nbytes, round_order

HERE = os.path.dirname(os.path.abspath(__file__))
FILE_TOOLS = ["ckptmgr.load_file", "safetensors.load_file", "fastsafetensors (nogds)"]
TOOLS = ["ckptmgr restore(device)", "ckptmgr restore(target)", "ckptmgr restore(loader='inplace')",
         "ckptmgr.load_file", "safetensors.load_file", "fastsafetensors (nogds)", "torch.load"]


# ---------------------------------------------------------------------------- helpers

def data_files(step_dir: str) -> list[str]:
    return sorted(os.path.join(step_dir, n) for n in os.listdir(step_dir) if n.endswith(".safetensors"))


def read_ceiling(paths: list[str], direct: bool, threads: int, block: int) -> float:
    """Seconds to read ``paths`` with ``threads`` parallel reads of ``block`` bytes."""
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


# ---------------------------------------------------------------------------- one run (child)

_after: list[Callable[[], Any]] = []  # run once the result has been checked

def _loader(tool: str, step_dir: str, torch_path: str, device: str,
            target: dict[str, torch.Tensor] | None) -> Callable[[], dict[str, torch.Tensor]]:
    root = os.path.dirname(step_dir)
    files = data_files(step_dir)
    if tool.startswith("ckptmgr restore"):
        from ckptmgr import CheckpointManager, StagingOptions

        def run() -> dict[str, torch.Tensor]:
            with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as m:
                if tool == "ckptmgr restore(target)":
                    return m.restore(1, target=target)  # type: ignore[no-any-return]
                kw = {"loader": "inplace"} if "inplace" in tool else {}
                return m.restore(1, device=device, **kw)  # type: ignore[no-any-return]
        return run
    if tool == "ckptmgr.load_file":  # (imported before the clock, as the other tools are: its first
        from ckptmgr import load_file as ck_load  # use imports the restore modules, 0.075 s)
        return lambda: {k: v for f in files for k, v in ck_load(f, device=device).items()}
    if tool == "safetensors.load_file":
        from safetensors.torch import load_file
        return lambda: {k: v for f in files for k, v in load_file(f, device=device).items()}
    if tool == "torch.load":
        return lambda: torch.load(torch_path, map_location=device, weights_only=True)  # type: ignore[no-any-return]
    if tool == "fastsafetensors (nogds)":
        from fastsafetensors import fastsafe_open

        def fst() -> dict[str, torch.Tensor]:
            f = fastsafe_open(files, device="cuda:0" if device == "cuda" else device, nogds=True)
            f.__enter__()
            _after.append(lambda: f.__exit__(None, None, None))  # its tensors live until the loader closes
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (not a dict)
        return fst
    raise SystemExit(f"unknown tool {tool!r}")


def child(tool: str, step_dir: str, torch_path: str, device: str, shapes_path: str) -> dict[str, Any]:
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context exists before the clock starts
    with open(shapes_path) as f:
        meta = json.load(f)
    target = None
    if tool == "ckptmgr restore(target)":
        target = {k: torch.empty(s, dtype=getattr(torch, d), device=device) for k, (d, s) in meta["shapes"].items()}
    load = _loader(tool, step_dir, torch_path, device, target)
    gpu0 = torch.cuda.memory_allocated() if cuda else 0
    with PeakRss() as rss:
        t = time.perf_counter()
        out = load()
        if cuda:
            torch.cuda.synchronize()
        else:  # a lazily mapped result has not been read yet: touch every page, as using it would
            for v in out.values():
                b = v.detach().reshape(-1).view(torch.uint8)
                if b.numel():
                    b[::4096].sum()
        took = time.perf_counter() - t
    gpu = (torch.cuda.max_memory_allocated() - gpu0) / 2**20 if cuda else 0.0
    got = fingerprint(out)
    del out
    for fn in _after:
        fn()
    return {"tool": tool, "s": took, "host_mib": rss.anon / 2**20, "rss_mib": rss.total / 2**20, "gpu_mib": gpu,
            "identical": got == meta["crc"]}


# ---------------------------------------------------------------------------- the run (parent)

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--tensors", type=int, default=150)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sources", default="shm,disk", help="shm (warm, /dev/shm), disk (cold)")
    ap.add_argument("--shm-dir", default="/dev/shm/ckptmgr-bench-restore")
    ap.add_argument("--disk-dir", default=os.path.join(HERE, "out", "restore-disk"))
    ap.add_argument("--tools", default=None,
                    help=f"comma-separated (default: all of {', '.join(TOOLS)}; with --writer safetensors, the "
                         f"file loaders {', '.join(FILE_TOOLS)})")
    ap.add_argument("--writer", choices=("ckptmgr", "safetensors"), default="ckptmgr",
                    help="who writes the files: a ckptmgr save, or safetensors.torch.save_file (one file, as a "
                         "model is published; only the file loaders read it)")
    ap.add_argument("--dtype", choices=("mixed", "bf16", "fp32"), default="mixed",
                    help="the state's tensors: every third bf16 and the rest fp32 (mixed), or all of one dtype")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "restore.json"))
    ap.add_argument("--child", nargs=5, metavar=("TOOL", "STEP_DIR", "TORCH_PATH", "DEVICE", "SHAPES"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)), flush=True)
        return
    from ckptmgr import CheckpointManager, StagingOptions

    cuda = args.device.startswith("cuda")
    by_file = args.writer == "safetensors"
    tools = [t for t in (args.tools or ",".join(FILE_TOOLS if by_file else TOOLS)).split(",") if t]
    skipped: dict[str, str] = {}
    for t in [t for t in tools if by_file and t not in FILE_TOOLS]:
        skipped[t] = "reads ckptmgr checkpoints, not a file written by safetensors"
    if not cuda:
        skipped.update({t: "needs CUDA" for t in tools if "fastsafetensors" in t})
    if "fastsafetensors (nogds)" in tools:
        try:
            import fastsafetensors  # noqa: F401
        except ImportError as exc:
            skipped["fastsafetensors (nogds)"] = f"not importable ({exc})"
    for t, why in skipped.items():
        print(f"  skipped {t}: {why}", flush=True)
    tools = [t for t in tools if t not in skipped]
    sources = {"shm": args.shm_dir, "disk": args.disk_dir}
    sources = {k: sources[k] for k in args.sources.split(",")}
    dtype = {"mixed": None, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    state = make_state(args.gib, args.device, n_tensors=args.tensors, dtype=dtype)
    size = nbytes(state)
    cpu_state = {k: v.cpu() for k, v in state.items()}
    layout: dict[str, dict[str, str]] = {}
    meta = {"shapes": {k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in cpu_state.items()},
            "crc": fingerprint(cpu_state)}
    for name, d in sources.items():
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        if by_file:  # one file, as safetensors writes it
            from safetensors.torch import save_file

            step_dir = os.path.join(d, "file")
            os.makedirs(step_dir)
            save_file(cpu_state, os.path.join(step_dir, "model.safetensors"))
        else:
            with CheckpointManager(os.path.join(d, "root"), staging=StagingOptions(local_tier=False)) as m:
                m.save(1, state).result()
            step_dir = os.path.join(d, "root", "step_000000000001")
        torch_path = os.path.join(d, "state.pt")
        if "torch.load" in tools:
            torch.save(cpu_state, torch_path)
        with open(os.path.join(d, "shapes.json"), "w") as f:
            json.dump(meta, f)
        layout[name] = {"step_dir": step_dir, "torch": torch_path, "shapes": os.path.join(d, "shapes.json")}
    del state, cpu_state
    if cuda:
        torch.cuda.empty_cache()
    ceilings: dict[str, float] = {}
    if "disk" in layout:
        files = data_files(layout["disk"]["step_dir"])
        for label, direct, threads, block in (("buffered 8 x 64 MiB", False, 8, 64 << 20),
                                              ("buffered 16 x 16 MiB", False, 16, 16 << 20),
                                              ("O_DIRECT 16 x 16 MiB", True, 16, 16 << 20),
                                              ("O_DIRECT 32 x 4 MiB", True, 32, 4 << 20)):
            drop_cache(files)
            try:
                ceilings[label] = sum(os.path.getsize(p) for p in files) / read_ceiling(files, direct, threads, block)
            except OSError as exc:  # a filesystem without O_DIRECT
                print(f"  ceiling {label}: {exc}", flush=True)
        print("  disk read ceiling (GB/s): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in ceilings.items()),
              flush=True)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {t: [] for t in tools} for s in layout}
    # One discarded run before the rounds: the first process to read the files after they were
    # written took up to 1.5x as long, whichever tool it ran (H200, benchmarks/probes/bounce_load.py).
    first_src, first = next(iter(layout.items()))
    warm = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", tools[0], first["step_dir"],
                           first["torch"], args.device, first["shapes"]], capture_output=True, text=True, timeout=600)
    print(f"  warm-up run ({first_src}, {tools[0]}, discarded): rc {warm.returncode}", flush=True)
    for r in range(args.repeat):
        for src, where in layout.items():
            use = [t for t in tools if not ("inplace" in t and src == "disk")]
            for tool in round_order(use, r):
                if src == "disk":
                    drop_cache([*data_files(where["step_dir"]), *[p for p in [where["torch"]] if os.path.exists(p)]])
                p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", tool, where["step_dir"],
                                    where["torch"], args.device, where["shapes"]],
                                   capture_output=True, text=True, timeout=600)
                line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    res: dict[str, Any] = {"tool": tool, "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
                else:
                    res = json.loads(line[7:])
                runs[src][tool].append(res)
                shown = f"{res['s']:.3f} s, +{res['host_mib']:.0f} MiB private host (+{res['rss_mib']:.0f} MiB " \
                        f"resident), +{res['gpu_mib']:.0f} MiB device" \
                        f"{'' if res['identical'] else ', NOT IDENTICAL'}" if "s" in res else res["error"]
                print(f"  [{src}] {tool}: {shown}", flush=True)
    for d in sources.values():
        shutil.rmtree(d, ignore_errors=True)
    ceiling = max(ceilings.values()) if ceilings else None
    lines = [f"{size / 2**30:.2f} GiB in {args.tensors} {args.dtype} tensors written by {args.writer}, onto "
             f"{args.device}; each run a fresh process; "
             f"median (min-max) of {args.repeat} rounds, tool order varied (round_order)", ""]
    if ceiling:
        lines += ["disk read ceiling (cold cache, best pattern): "
                  + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in ceilings.items()), ""]
    lines += ["| source | tool | s | GB/s | of disk ceiling | peak extra private host MiB | peak extra resident MiB "
              "| peak extra device MiB | identical |",
              "|---|---|---|---|---|---|---|---|---|"]
    summary: dict[str, dict[str, Any]] = {}
    for src, by_tool in runs.items():
        for tool, rs in by_tool.items():
            ok = [x for x in rs if "s" in x]
            if not ok:
                if rs:
                    lines.append(f"| {src} | {tool} | failed: {rs[0].get('error', '')[:80]} | | | | | | |")
                continue
            secs = [x["s"] for x in ok]
            med = statistics.median(secs)
            share = f"{size / med / ceiling:.0%}" if ceiling and src == "disk" else "-"
            ident = all(x["identical"] for x in ok)
            summary.setdefault(src, {})[tool] = {"median_s": med, "min_s": min(secs), "max_s": max(secs),
                                                 "gbps": size / med / 1e9, "identical": ident,
                                                 "host_mib_max": max(x["host_mib"] for x in ok),
                                                 "rss_mib_max": max(x["rss_mib"] for x in ok)}
            lines.append(f"| {src} | {tool} | {med:.3f} ({min(secs):.3f}-{max(secs):.3f}) | {size / med / 1e9:.1f} | "
                         f"{share} | {max(x['host_mib'] for x in ok):.0f} | {max(x['rss_mib'] for x in ok):.0f} | "
                         f"{max(x['gpu_mib'] for x in ok):.0f} | "
                         f"{'yes' if ident else 'NO'} |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "bytes": size, "tensors": args.tensors,
                   "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                   "commit": commit(), "writer": args.writer, "dtype": args.dtype, "skipped": skipped,
                   "repeat": args.repeat, "disk_ceilings_bps": ceilings, "summary": summary, "runs": runs}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
