"""Probe: what a fresh process pays for the pinned bounce buffers of ``load_file``.

Each variant runs in a fresh process with the CUDA context already made (as in ``load_file``'s
benchmark, where the context comes before the clock) and times only the allocation of the
buffers: PyTorch's pinned allocator in many blocks or one, ``cudaHostAlloc`` called directly,
and anonymous memory pinned in place (``cudaHostRegister``), populated first or not. Then each
buffer is written once (a first touch the load would pay otherwise). Prints a table, writes JSON.
Not a product benchmark: it picks how the bounce buffers are allocated.

    python benchmarks/probes/pinned_alloc.py --rounds 3 --out alloc.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import time

MIB = 1 << 20
VARIANTS = ["torch 12x8", "torch 1x128", "torch 1x64", "torch 6x16", "hostalloc 12x8", "hostalloc 1x96",
            "hostalloc 1x256", "register 1x96", "register+populate 1x96", "register 12x8"]


def _one(variant: str) -> dict[str, float]:
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    kind, shape = variant.split(" ")
    count, mib = (int(x) for x in shape.split("x"))
    lib = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    keep: list[object] = []
    t0 = time.perf_counter()
    ptrs: list[int] = []
    for _ in range(count):
        n = mib * MIB
        if kind == "torch":
            t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            keep.append(t)
            ptrs.append(t.data_ptr())
        elif kind == "hostalloc":
            p = ctypes.c_void_p()
            rc = lib.cudaHostAlloc(ctypes.byref(p), ctypes.c_size_t(n), 0)
            assert rc == 0, rc
            ptrs.append(int(p.value or 0))
        else:
            flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS
            if "populate" in kind:
                flags |= getattr(mmap, "MAP_POPULATE", 0)
            m = mmap.mmap(-1, n, flags=flags)
            t = torch.frombuffer(m, dtype=torch.uint8)
            keep.extend((m, t))
            rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 1)
            assert int(rc) == 0, rc
            ptrs.append(t.data_ptr())
    t1 = time.perf_counter()
    for p in ptrs:  # first touch of every page, as the reads into the buffers would
        ctypes.memset(p, 1, mib * MIB)
    t2 = time.perf_counter()
    return {"alloc_s": t1 - t0, "touch_s": t2 - t1, "total_s": t2 - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(args.one)))
        return
    variants = args.variants.split(",")
    runs: list[dict[str, object]] = []
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            out = subprocess.run([sys.executable, __file__, "--one", v], capture_output=True, text=True, timeout=120)
            if out.returncode != 0:
                print(f"{v}: failed\n{out.stderr[-2000:]}")
                continue
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append({"variant": v, "round": r, **res})
            print(f"round {r} {v:24s} alloc {res['alloc_s']:.4f} s touch {res['touch_s']:.4f} s", flush=True)
    print(f"\n{'variant':24s} {'alloc s median':>15s} {'range':>16s} {'alloc+touch s':>14s}")
    table = {}
    for v in variants:
        a = [float(x["alloc_s"]) for x in runs if x["variant"] == v]  # type: ignore[arg-type]
        t = [float(x["total_s"]) for x in runs if x["variant"] == v]  # type: ignore[arg-type]
        if not a:
            continue
        table[v] = {"alloc_s": statistics.median(a), "alloc_min": min(a), "alloc_max": max(a),
                    "total_s": statistics.median(t)}
        print(f"{v:24s} {statistics.median(a):15.4f} {min(a):7.4f}-{max(a):.4f} {statistics.median(t):14.4f}")
    if args.out:
        import torch

        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "runs": runs, "summary": table}, f, indent=1)


if __name__ == "__main__":
    main()
