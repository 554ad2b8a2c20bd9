"""Upload throughput to S3 with request latency: ckptmgr's S3 writer against s3fs's
single-stream writer (``fs.open(..., "wb")``) and ``fs.pipe_file``, at the same part size and
concurrency, on the same bytes, in one process.

    python benchmarks/bench_s3.py --mib 256 --part-mib 8 --concurrency 16 --latency-ms 50 --jitter-ms 300

There is no real S3 here: moto's server on 127.0.0.1 stands in, behind a proxy that delays
each request by ``latency`` plus a uniform ``jitter`` (moto itself is CPU-bound at roughly
100 MB/s on 2 cores, so latency is what separates the writers). Prints a table and writes
JSON (default benchmarks/out/s3.json). Numbers are medians over --repeat runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from s3_proxy import FaultyProxy, start_moto

from ckptmgr import S3Options
from ckptmgr.storage import open_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--part-mib", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--latency-ms", type=float, default=50)
    ap.add_argument("--jitter-ms", type=float, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "s3.json"))
    args = ap.parse_args()
    server, endpoint = start_moto()
    proxy = FaultyProxy(endpoint, latency_s=args.latency_ms / 1e3, jitter_s=args.jitter_ms / 1e3)
    so = {"endpoint_url": proxy.endpoint, "key": "testing", "secret": "testing"}
    part = args.part_mib << 20
    opts = S3Options(part_size=part, concurrency=args.concurrency)
    target: Any = open_target("s3://bench/root", dict(so), io_threads=8, s3_options=opts)
    fs = target.raw_fs
    data = np.random.default_rng(0).integers(0, 255, size=args.mib << 20, dtype=np.uint8)

    def ckptmgr_writer(i: int) -> float:
        w = target.begin(i)  # listing and leftover checks: not part of the upload
        t = time.perf_counter()
        w.write_files([("data-00000.safetensors", data)], 16 << 20)
        took = time.perf_counter() - t
        w.abort()
        return took

    def single_stream(i: int) -> float | None:
        with fs.open(f"bench/single/{i}", "wb", block_size=part) as f:
            for b in range(0, data.size, part):
                f.write(data[b:b + part].tobytes())
        return None

    def pipe_file(i: int) -> float | None:
        fs.pipe_file(f"bench/pipe/{i}", data.tobytes(), chunksize=part, max_concurrency=args.concurrency)
        return None

    tools = {"ckptmgr S3 writer": ckptmgr_writer, "s3fs open('wb')": single_stream, "s3fs pipe_file": pipe_file}
    times: dict[str, list[float]] = {k: [] for k in tools}
    for r in range(args.repeat):
        order = list(tools)[r % len(tools):] + list(tools)[:r % len(tools)]
        for name in order:
            t = time.perf_counter()
            took = tools[name](r)
            times[name].append(took if took is not None else time.perf_counter() - t)
            print(f"  {name}: {times[name][-1]:.2f} s", flush=True)
    proxy.close()
    server.stop()
    size = data.size
    base = statistics.median(times["s3fs open('wb')"])
    lines = [f"{args.mib} MiB, parts of {args.part_mib} MiB, concurrency {args.concurrency}, "
             f"latency {args.latency_ms:g} ms + up to {args.jitter_ms:g} ms jitter per request, "
             f"median of {args.repeat}",
             "", "| writer | s | MB/s | vs single stream |", "|---|---|---|---|"]
    for name, ts in times.items():
        m = statistics.median(ts)
        lines.append(f"| {name} | {m:.2f} | {size / m / 1e6:.0f} | {base / m:.2f}x |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "bytes": size, "times_s": times, "date": time.strftime("%Y-%m-%d"),
                   "machine": f"{platform.node()}, {os.cpu_count()} cores"}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
