"""Where the time of a restore onto the GPU goes, part by part, on this machine.

    python benchmarks/bench_restore_parts.py --gib 4

On files of ``--gib`` GiB in ``--dir`` (default /dev/shm), each part alone: allocating the
device memory, allocating the pinned ring, parallel ``pread`` into pinned buffers with and
without CRC32C at several thread counts, host-to-device copies of ring-sized chunks from
pinned memory, and registering a mapping in place with cudaHostRegister (whole, and in
pieces from several threads). These are the ceilings the loaders are built from.
Prints a table and writes JSON (default benchmarks/out/restore_parts.json).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ckptmgr import _cuda
from ckptmgr.format.checksum import crc32c_hex

MiB = 1 << 20


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def make_files(d: str, total: int, n: int) -> list[str]:
    os.makedirs(d, exist_ok=True)
    paths = []
    block = np.random.default_rng(0).integers(0, 255, 64 * MiB, dtype=np.uint8)
    for i in range(n):
        p = os.path.join(d, f"part-{i}.bin")
        with open(p, "wb") as f:
            left = total // n
            while left:
                k = min(left, block.size)
                f.write(block[:k].tobytes())
                left -= k
        paths.append(p)
    return paths


def read_parallel(paths: list[str], bufs: list[torch.Tensor], threads: int, crc: bool) -> None:
    chunk = bufs[0].numel()
    jobs = [(p, off) for p in paths for off in range(0, os.path.getsize(p), chunk)]
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}

    def one(i: int) -> None:
        p, off = jobs[i]
        arr = bufs[i % len(bufs)].numpy()
        n = os.preadv(fds[p], [memoryview(arr)], off)  # type: ignore[arg-type]
        if crc:
            crc32c_hex(arr[:n])

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(len(jobs))))
    finally:
        for fd in fds.values():
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--dir", default="/dev/shm/ckptmgr-bench-parts")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "restore_parts.json"))
    args = ap.parse_args()
    total = int(args.gib * (1 << 30))
    shutil.rmtree(args.dir, ignore_errors=True)
    paths = make_files(args.dir, total, 4)
    torch.cuda.init()
    torch.empty(1, device="cuda")
    rows: dict[str, float] = {}

    def region() -> None:
        torch.empty(total, dtype=torch.uint8, device="cuda")

    torch.cuda.empty_cache()
    rows["device allocation, fresh (cudaMalloc)"] = timed(region)
    rows["device allocation, cached"] = timed(region)
    torch.cuda.empty_cache()

    def register_block(nbytes: int) -> None:
        block = torch.empty(nbytes, dtype=torch.uint8)
        _cuda.host_register(block.data_ptr(), nbytes)
        _cuda.host_unregister(block.data_ptr())

    # each measured first in this process: torch caches pinned blocks once allocated
    rows["ring as one block: malloc + cudaHostRegister, 18 x 16 MiB"] = timed(lambda: register_block(18 * 16 * MiB))
    rows["ring by cudaHostAlloc (pin_memory=True), 18 x 16 MiB"] = timed(
        lambda: [_cuda.pinned_empty(16 * MiB) for _ in range(18)])
    for threads in (4, 8, 12, 16):
        bufs = [_cuda.pinned_empty(16 * MiB) for _ in range(threads + 2)]
        for crc in (False, True):
            rows[f"pread into pinned, {threads} threads{' + CRC32C' if crc else ''}"] = timed(
                lambda bufs=bufs, threads=threads, crc=crc: read_parallel(paths, bufs, threads, crc))
    src = _cuda.pinned_empty(256 * MiB)
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")

    def h2d(chunk: int, dst: torch.Tensor = dst) -> None:
        for off in range(0, total, chunk):
            k = min(chunk, total - off)
            dst[off:off + k].copy_(src[:k], non_blocking=True)

    for chunk in (16 * MiB, 64 * MiB):
        rows[f"host-to-device copies of {chunk // MiB} MiB from pinned memory"] = timed(lambda c=chunk: h2d(c))
    del dst
    maps = []
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        maps.append(mmap.mmap(fd, os.path.getsize(p), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
        os.close(fd)
    ptrs = [(np.frombuffer(m, dtype=np.uint8).ctypes.data, len(m)) for m in maps]

    def register(pieces: int, threads: int) -> None:
        ranges = [(p + i * (n // pieces), n // pieces) for p, n in ptrs for i in range(pieces)]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda r: _cuda.host_register(r[0], r[1], read_only=True), ranges))
        for r in ranges:
            _cuda.host_unregister(r[0])

    rows["cudaHostRegister in place, one range per file, 1 thread"] = timed(lambda: register(1, 1))
    rows["cudaHostRegister in place, one range per file, 4 threads"] = timed(lambda: register(1, 4))
    rows["cudaHostRegister in place, 8 ranges per file, 16 threads"] = timed(lambda: register(8, 16))
    shutil.rmtree(args.dir, ignore_errors=True)
    lines = [f"{total / 2**30:.2f} GiB in {len(paths)} files in {args.dir}; {torch.cuda.get_device_name()}", "",
             "| part | s | GB/s |", "|---|---|---|"]
    for name, t in rows.items():
        lines.append(f"| {name} | {t:.4f} | {total / t / 1e9:.1f} |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bytes": total, "seconds": rows, "device": torch.cuda.get_device_name(),
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
