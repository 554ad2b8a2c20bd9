"""A safetensors file in /dev/shm to the GPU: ckptmgr.load_file, a pinned-weights handle, and others.

    python benchmarks/bench_inplace.py --gib 4 --rounds 3              # on the GPU machine
    python benchmarks/bench_inplace.py --gib 0.02 --rounds 1 --device cpu   # smoke test, no GPU

The parent writes one file of ``--gib`` GiB (bf16, ``--tensors`` tensors of random bits) into
``--dir`` with the safetensors library, and records each tensor's CRC32C. Then, for ``--rounds``
rounds, the tool order rotated each round (the rest reversed every other round), each tool runs in a
process of its own (the CUDA context is made before the clock starts):

* ``ckptmgr.load_file(path, device=...)``;
* ``safetensors.torch.load_file`` and fastsafetensors (``nogds``, when installed);
* ``ckptmgr.pin_file``: the handle on a fresh copy of the file, which is unlinked right after
  pinning; then ``--loads`` loads (the first into fresh tensors, the others into the first's
  tensors with ``out=``, one more into fresh tensors), the last checked bit for bit; then
  ``close()``, and how much of MemAvailable came back (the unlinked file's pages included).

Each run reports the seconds of the load (synchronized), GB/s, the peak growth of private host
memory during it (RssAnon, sampled every 2 ms) and whether every tensor came back bit for bit.
Prints a table (median and range over the rounds) and writes JSON (``--out``). It never passes
or fails on a time.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = ["ckptmgr.load_file", "ckptmgr.pin_file", "safetensors.load_file", "fastsafetensors (nogds)"]


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fingerprint(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """name -> CRC32C of the tensor's bytes (moved to the host first)."""
    import crc32c

    return {k: crc32c.crc32c(v.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
            for k, v in tensors.items()}


class Peak:
    """The peak growth of RssAnon while it is entered (a thread samples it every 2 ms)."""

    def __enter__(self) -> Peak:
        self.base = rss_anon()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            self._stop.wait(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.peak = max(self.peak, rss_anon())

    @property
    def mib(self) -> float:
        return (self.peak - self.base) / 2**20


def _timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


# ---------------------------------------------------------------------------- one run (child)

def child(tool: str, path: str, meta_path: str, device: str, loads: int) -> dict[str, Any]:
    if device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context exists before the clock starts
    with open(meta_path) as f:
        meta = json.load(f)
    want = {k: int(v) for k, v in meta["crc"].items()}
    nbytes = meta["bytes"]
    if tool == "ckptmgr.pin_file":
        return _child_pinned(path, device, loads, want, nbytes)
    after: list[Callable[[], Any]] = []
    if tool == "ckptmgr.load_file":
        from ckptmgr import load_file as ckptmgr_load_file  # (imported before the clock starts)

        def load() -> dict[str, torch.Tensor]:
            return ckptmgr_load_file(path, device=device)
    elif tool == "safetensors.load_file":
        from safetensors.torch import load_file

        def load() -> dict[str, torch.Tensor]:
            return load_file(path, device=device)
    elif tool == "fastsafetensors (nogds)":
        from fastsafetensors import fastsafe_open

        def load() -> dict[str, torch.Tensor]:
            f = fastsafe_open([path], device="cuda:0" if device == "cuda" else device, nogds=True)
            f.__enter__()
            after.append(lambda: f.__exit__(None, None, None))  # its tensors live until it closes
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (not a dict)
    else:
        raise SystemExit(f"unknown tool {tool!r}")
    with Peak() as peak:
        took, out = _timed(load, device)
    identical = fingerprint(out) == want
    del out
    for fn in after:
        fn()
    return {"tool": tool, "s": took, "gbps": nbytes / took / 1e9, "host_mib": peak.mib, "identical": identical}


def _child_pinned(path: str, device: str, loads: int, want: dict[str, int], nbytes: int) -> dict[str, Any]:
    from ckptmgr import pin_file  # (imported before the clock starts)

    mem0 = mem_available()
    with Peak() as peak:
        pin_s, weights = _timed(lambda: pin_file(path), device)
    os.unlink(path)  # pinned: the handle keeps its pages
    file_size = weights.nbytes
    first_s, first = _timed(functools.partial(weights.load, device), device)
    later: list[float] = []
    for _ in range(max(1, loads - 1)):
        s, got = _timed(functools.partial(weights.load, device, out=first), device)
        later.append(s)
    fresh_s, fresh = _timed(functools.partial(weights.load, device), device)
    identical = fingerprint(fresh) == want and fingerprint(got) == want and all(
        got[k] is first[k] for k in first)
    del first, got, fresh
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    weights.close()
    mem1 = mem_available()
    return {"tool": "ckptmgr.pin_file", "s": statistics.median(later), "gbps": nbytes / statistics.median(later) / 1e9,
            "host_mib": peak.mib, "identical": identical, "pin_s": pin_s, "first_s": first_s, "later_s": later,
            "fresh_later_s": fresh_s, "best_gbps": nbytes / min(later) / 1e9,
            # the unlinked file's pages come back at close: MemAvailable should rise by the file's size
            "mem_not_returned_mib": (mem0 + file_size - mem1) / 2**20}


# ---------------------------------------------------------------------------- the run (parent)

def make_file(path: str, gib: float, tensors: int) -> dict[str, Any]:
    from safetensors.torch import save_file

    n = max(1, int(gib * 2**30) // 2 // tensors)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i:04d}.weight": torch.randint(-2**15, 2**15, (n,), dtype=torch.int16, generator=g)
             .view(torch.bfloat16) for i in range(tensors)}  # random bits: NaN payloads included
    save_file(state, path)
    return {"crc": fingerprint(state), "bytes": sum(v.numel() * 2 for v in state.values()),
            "file_bytes": os.path.getsize(path), "tensors": tensors}


def order(tools: list[str], r: int) -> list[str]:
    """Round ``r``'s order: rotated by ``r`` (each tool runs first in turn), the ones after the
    first reversed every other round (each also runs after another one)."""
    row = tools[r % len(tools):] + tools[:r % len(tools)]
    return [row[0], *row[:0:-1]] if r % 2 else row


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loads", type=int, default=10, help="loads per pinned handle")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default="/dev/shm/ckptmgr-bench-inplace")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--out", default=os.path.join(HERE, "out", "inplace.json"))
    ap.add_argument("--child", nargs=4, metavar=("TOOL", "PATH", "META", "LOADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        tool, path, meta, loads = args.child
        print(json.dumps(child(tool, path, meta, args.device, int(loads))))
        return
    tools = [t for t in args.tools.split(",") if t]
    if "fastsafetensors (nogds)" in tools and importlib.util.find_spec("fastsafetensors") is None:
        print("fastsafetensors is not installed: left out")
        tools.remove("fastsafetensors (nogds)")
    os.makedirs(args.dir, exist_ok=True)
    base = os.path.join(args.dir, "weights.safetensors")
    meta_path = os.path.join(args.dir, "meta.json")
    try:
        meta = make_file(base, args.gib, args.tensors)
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        runs: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for tool in order(tools, r):
                path = base
                if tool == "ckptmgr.pin_file":  # a copy of its own, which the run unlinks
                    path = os.path.join(args.dir, f"pinned-{r}.safetensors")
                    shutil.copyfile(base, path)
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--device", args.device,
                                       "--child", tool, path, meta_path, str(args.loads)],
                                      capture_output=True, text=True, timeout=600)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{tool} failed in round {r}")
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                res["round"] = r
                runs.append(res)
                print(f"round {r} {tool:26s} {res['s']:.3f} s {res['gbps']:6.1f} GB/s host +{res['host_mib']:.0f} MiB "
                      f"identical={res['identical']}", flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    summary = summarize(runs, tools)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"device": device, "commit": commit(), "gib": args.gib, "bytes": meta["bytes"],
              "tensors": args.tensors, "rounds": args.rounds, "loads": args.loads, "summary": summary, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{meta['bytes'] / 2**30:.2f} GiB, {args.tensors} bf16 tensors, {device}, commit {report['commit']}")
    print(f"{'tool':26s} {'median s':>9s} {'range s':>15s} {'GB/s':>6s} {'host MiB':>9s} identical")
    for tool, s in summary.items():
        print(f"{tool:26s} {s['median_s']:9.3f} {s['min_s']:7.3f}-{s['max_s']:<7.3f} {s['gbps']:6.1f} "
              f"{s['host_mib_max']:9.0f} {s['identical']}")
        if "pin_s" in s:
            print(f"{'':26s} pin {s['pin_s']:.3f} s, first load {s['first_s']:.3f} s, later loads best "
                  f"{s['best_gbps']:.1f} GB/s, memory not returned at close {s['mem_not_returned_mib_max']:.0f} MiB")
    print(f"JSON: {args.out}")


def summarize(runs: list[dict[str, Any]], tools: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        rs = [r for r in runs if r["tool"] == tool]
        if not rs:
            continue
        times = [r["s"] for r in rs]
        s: dict[str, Any] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                             "gbps": rs[0]["gbps"] * rs[0]["s"] / statistics.median(times),
                             "host_mib_max": max(r["host_mib"] for r in rs),
                             "identical": all(r["identical"] for r in rs)}
        if tool == "ckptmgr.pin_file":
            s.update(pin_s=statistics.median(r["pin_s"] for r in rs),
                     first_s=statistics.median(r["first_s"] for r in rs),
                     best_gbps=max(r["best_gbps"] for r in rs),
                     mem_not_returned_mib_max=max(r["mem_not_returned_mib"] for r in rs))
        out[tool] = s
    return out


if __name__ == "__main__":
    main()
