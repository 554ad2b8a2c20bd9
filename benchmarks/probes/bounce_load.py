"""Probe: a safetensors file in /dev/shm onto the GPU through reusable pinned bounce buffers.

Each variant runs in a fresh process (the first load in a process is what ``load_file``
users get): ``load_file`` (pins the mapping in pieces), fastsafetensors (nogds) and a bounce
loader with T threads, each preading the file into two pinned buffers of B MiB in turn and
copying each to the GPU on a stream of its own. Prints a table, writes JSON. Not a product
benchmark: it picks the bounce loader's settings.

    python benchmarks/probes/bounce_load.py --gib 4 --rounds 3 --out bounce.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

VARIANTS = ["load_file", "fastsafetensors", "bounce 4x16", "bounce 8x8", "bounce 8x16", "bounce 16x8", "bounce 8x32"]


def bounce(path: str, threads: int, mib: int) -> tuple[torch.Tensor, float]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        json.loads(f.read(n))
    start = 8 + n
    length = os.path.getsize(path) - start
    out = torch.empty(length, dtype=torch.uint8, device="cuda")
    size = mib << 20
    t = time.perf_counter()
    bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2 * threads)]
    alloc = time.perf_counter() - t
    streams = [torch.cuda.Stream() for _ in range(threads)]
    begins = list(range(0, length, size))
    fd = os.open(path, os.O_RDONLY)

    def work(w: int) -> None:
        events: list[Any] = [None, None]
        for k, i in enumerate(range(w, len(begins), threads)):
            b = begins[i]
            e = min(b + size, length)
            slot = k % 2
            if events[slot] is not None:
                events[slot].synchronize()
            buf = bufs[2 * w + slot]
            got = os.preadv(fd, [memoryview(buf.numpy())[: e - b]], start + b)
            assert got == e - b
            with torch.cuda.stream(streams[w]):
                out[b:e].copy_(buf[: e - b], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                events[slot] = ev
        streams[w].synchronize()

    try:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(work, range(threads)))
    finally:
        os.close(fd)
    return out, alloc


def child(variant: str, path: str) -> dict[str, Any]:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    alloc = 0.0
    t = time.perf_counter()
    if variant == "load_file":
        import ckptmgr

        res: Any = ckptmgr.load_file(path, device="cuda")
    elif variant == "fastsafetensors":
        from fastsafetensors import fastsafe_open

        with fastsafe_open(path, nogds=True, device="cuda:0") as f:
            res = {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118 (a handle, not a dict)
    else:
        threads, mib = (int(x) for x in variant.split()[1].split("x"))
        res, alloc = bounce(path, threads, mib)
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    nbytes = os.path.getsize(path)
    if isinstance(res, dict):
        check = int(sum(v.view(torch.uint8).to(torch.int64).sum().item() for v in res.values()) % (1 << 31))
    else:
        check = int(res.to(torch.int64).sum().item() % (1 << 31))
    return {"variant": variant, "s": s, "gbps": nbytes / s / 1e9, "alloc_s": alloc, "check": check}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm/ckptmgr-bounce")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="")
    p.add_argument("--child", nargs=2)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1])))
        return
    from safetensors.torch import save_file

    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "w.safetensors")
    n = int(a.gib * 2**30) // 2 // 64
    g = torch.Generator().manual_seed(0)
    state = {f"l{i:03d}": torch.randint(-2**15, 2**15, (n,), dtype=torch.int16, generator=g) for i in range(64)}
    save_file(state, path)
    del state
    variants = [v for v in a.variants.split(",") if v]
    runs: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            cp = subprocess.run([sys.executable, __file__, "--child", v, path], capture_output=True, text=True,
                                timeout=300)
            if cp.returncode:
                print(v, "failed:", cp.stderr[-2000:], flush=True)
                continue
            res = json.loads(cp.stdout.strip().splitlines()[-1])
            res["round"] = r
            runs.append(res)
            print(f"round {r} {v:18s} {res['s']:.3f} s {res['gbps']:.1f} GB/s alloc {res['alloc_s']:.3f} "
                  f"check {res['check']}", flush=True)
    print(f"\n{'variant':18s} {'median s':>9s} {'range':>15s} {'GB/s':>6s}")
    summary = {}
    for v in variants:
        ss = [x["s"] for x in runs if x["variant"] == v]
        if ss:
            med = statistics.median(ss)
            summary[v] = {"median_s": med, "min_s": min(ss), "max_s": max(ss)}
            print(f"{v:18s} {med:9.3f} {min(ss):7.3f}-{max(ss):.3f} {os.path.getsize(path) / med / 1e9:6.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "gib": a.gib, "runs": runs, "summary": summary}, f,
                      indent=1)
    os.unlink(path)


if __name__ == "__main__":
    main()
