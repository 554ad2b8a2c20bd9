"""Ways to write a torch checkpoint file without stalling training, measured side by side.

    python benchmarks/bench_torchzip.py --mib 1024 --tensors 64 --dir /var/tmp/ckptmgr-bench-tz

One state of ``--tensors`` fp32 tensors (``--mib`` in all, on the GPU when there is one),
written to ``--dir`` by each route, a few times each (the first run of a route allocates its
buffers; the table shows the median of the others):

* ``torch.save``: blocking; the caller waits for the whole write.
* ``clone + torch.save in a thread``: the caller pays a fresh copy of every tensor (GPU clone
  or CPU clone), a background thread runs torch.save and fsync (Lightning's AsyncCheckpointIO).
* ``reused host copy + torch.save in a thread``: tensors copied into host buffers made once
  (pinned on a GPU machine), then torch.save of those buffers in a background thread.
* ``torchzip image``: ckptmgr's route. The caller pays plan + the copy into a reused slot;
  a background thread seals the image (CRC-32 of the records, CRC32C chunks) and writes it in
  parallel chunks, fsync, rename. ``torchzip, no zip CRC-32`` leaves the records' CRC-32
  fields as torch.save left them (only the CRC32C chunks), to show what the zip CRC-32 costs.

Reports the caller's blocked time, the time until the file is durable and the CPU time of the
whole process (every thread; on a shared machine the steadiest of the three), per route; writes
JSON (default benchmarks/out/torchzip.json, or $OUT/torchzip.json when OUT is set).
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ckptmgr.format import torchzip
from ckptmgr.storage.commit.file import write_file_atomic


def _fsync_save(obj: Any, path: str) -> None:
    with open(path + ".tmp", "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--dir", default="/var/tmp/ckptmgr-bench-tz")
    default_out = os.path.join(os.environ["OUT"], "torchzip.json") if os.environ.get("OUT") else \
        os.path.join(os.path.dirname(__file__), "out", "torchzip.json")
    ap.add_argument("--out", default=default_out)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = args.mib * (1 << 20) // 4 // args.tensors
    state = {"state_dict": {f"layer{i}.weight": torch.randn(n, device=dev) for i in range(args.tensors)},
             "epoch": 3, "hyper_parameters": {"lr": 0.1}}
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "x.ckpt")
    pin = dev.type == "cuda"
    io = ThreadPoolExecutor(args.io_threads)
    host: dict[str, torch.Tensor] = {}
    slot: list[torch.Tensor] = []

    def route_blocking() -> Callable[[], None]:
        _fsync_save(state, path)
        return lambda: None

    def route_clone() -> Callable[[], None]:
        copy = {**state, "state_dict": {k: v.detach().clone() for k, v in state["state_dict"].items()}}
        _sync(dev)
        t = threading.Thread(target=_fsync_save, args=(copy, path))
        t.start()
        return t.join

    def route_reused() -> Callable[[], None]:
        if not host:
            host.update({k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin)
                         for k, v in state["state_dict"].items()})
        for k, v in state["state_dict"].items():
            host[k].copy_(v, non_blocking=pin)
        _sync(dev)
        t = threading.Thread(target=_fsync_save, args=({**state, "state_dict": host}, path))
        t.start()
        return t.join

    def route_torchzip(crc32: bool) -> Callable[[], None]:
        image = torchzip.plan_image(state, chunk_size=64 << 20)
        if not slot or slot[0].numel() < image.size:
            slot[:] = [torch.empty(image.size, dtype=torch.uint8, pin_memory=pin)]
        seg = slot[0][:image.size]
        buf = seg.numpy()
        image.write_static(buf)
        for s in image.spans:
            seg[s.offset:s.offset + s.nbytes].copy_(s.source, non_blocking=pin)
        _sync(dev)

        def finish() -> None:
            if crc32:
                torchzip.seal(image, buf, io)
            else:  # CRC32C chunks only
                for _ in io.map(lambda c: torchzip.crc32c.crc32c(buf[c[0]:c[1]]),
                                torchzip.chunk_ranges(image.covered, image.chunk_size)):
                    pass
            write_file_atomic(path, buf, pool=io, chunk_size=64 << 20)

        t = threading.Thread(target=finish)
        t.start()
        return t.join

    routes: dict[str, Callable[[], Callable[[], None]]] = {
        "torch.save (blocking)": route_blocking,
        "clone + torch.save in a thread": route_clone,
        "reused host copy + torch.save in a thread": route_reused,
        "torchzip image (ckptmgr)": lambda: route_torchzip(True),
        "torchzip, no zip CRC-32": lambda: route_torchzip(False),
    }
    results: dict[str, dict[str, float]] = {}
    for name, route in routes.items():
        blocked, durable, cpu = [], [], []
        for _ in range(args.runs + 1):
            _sync(dev)
            c0, t0 = time.process_time(), time.perf_counter()
            join = route()
            t1 = time.perf_counter()
            join()
            t2 = time.perf_counter()
            blocked.append(t1 - t0)
            durable.append(t2 - t0)
            cpu.append(time.process_time() - c0)
        results[name] = {"blocked_s": statistics.median(blocked[1:]), "durable_s": statistics.median(durable[1:]),
                         "cpu_s": statistics.median(cpu[1:]), "first_blocked_s": blocked[0]}
        loaded = torch.load(path, weights_only=True, map_location="cpu")
        assert torch.equal(loaded["state_dict"]["layer0.weight"], state["state_dict"]["layer0.weight"].cpu())
        print(f"  {name}: blocked {results[name]['blocked_s']:.3f} s, durable {results[name]['durable_s']:.3f} s",
              flush=True)
    image = torchzip.plan_image(state)
    t = time.perf_counter()
    buf = np.zeros(image.size, dtype=np.uint8)
    torchzip.seal(image, buf, io)
    seal_s = time.perf_counter() - t
    shutil.rmtree(args.dir, ignore_errors=True)
    io.shutdown()
    device = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"\n{args.mib} MiB in {args.tensors} tensors on {dev}, {device}, to {args.dir}; median of {args.runs}\n")
    print("| route | caller blocked s | durable s | CPU s (all threads) |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['blocked_s']:.3f} | {r['durable_s']:.3f} | {r['cpu_s']:.3f} |")
    print(f"\nseal (CRC-32 + CRC32C, {args.io_threads} threads) alone: {seal_s:.3f} s")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "device": device, "results": results, "seal_s": seal_s,
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
