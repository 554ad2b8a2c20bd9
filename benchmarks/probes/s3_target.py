"""S3 with request latency, at the storage layer (the target's writer and ranged reads, not a
whole save or restore; benchmarks/bench_s3.py measures those through the public API):
ckptmgr's upload and restore paths against s3fs's, and ckptmgr's adaptive request window
against a fixed one under throttling (its lowest window and decreases). Same bytes, one process.

    python benchmarks/probes/s3_target.py upload --mib 256 --part-mib 8 --concurrency 16 --latency-ms 50 --jitter-ms 300
    python benchmarks/probes/s3_target.py restore  --mib 256 --latency-ms 50 --jitter-ms 300
    python benchmarks/probes/s3_target.py throttle --mib 256 --part-mib 8 --concurrency 16 --capacity 10

There is no real S3 here: moto's server on 127.0.0.1 (in its own process) stands in, behind
tests/s3_proxy.py, which delays each request by ``latency`` plus a uniform ``jitter``
(moto itself is CPU-bound at roughly 100 MB/s on 2 cores, so latency is what separates the
tools), optionally moves each request's bytes at ``--conn-mbps`` (a store serves each
connection at tens of MB/s) and, for ``throttle``, answers 503 SlowDown to requests arriving
while ``capacity`` requests are being served (a store throttling past its capacity: the share
of SlowDown answers depends on how hard the client pushes, as with S3's per-prefix rates).

* ``upload``: ckptmgr's S3 writer (its figure includes ``begin()``'s claim of the step and the
  commit's listing and manifest, as the peers' include their own set-up), s3fs's single
  stream (``fs.open(..., "wb")``) and ``fs.pipe_file``, at the same part size and concurrency;
* ``restore``: ckptmgr's restore reads (parallel ranged GETs of ``chunk`` bytes on the
  target's I/O threads, listing and manifest included) against s3fs ``cat_file`` and
  ``get_file`` of the same object;
* ``throttle``: the same save with ``adaptive_concurrency`` on and off: time, requests sent,
  SlowDown answers.

Prints a table and writes JSON (default benchmarks/out/s3[_restore|_throttle].json). Numbers
are medians over --repeat runs; the order of the tools rotates between runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_s3 import _net, _proxy, _table, start_moto_process  # the server, the proxy and the table, as measured there

from ckptmgr import S3Options
from ckptmgr.storage import open_target

NAME = "data-00000.safetensors"


def _manifest(step: int, size: int, crcs: Any, chunk: int) -> bytes:
    """A manifest that lists the one file (its first 4096 bytes taken as the header) as a byte
    tensor: the commit checks what a manifest names, not the bytes."""
    from ckptmgr.format.manifest import FileRecord, Manifest

    n = size - 4096
    tensors = {"data": {"file": NAME, "dtype": "U8", "shape": [n], "offsets": [0, n]}}
    state = {"$dict": {"data": {"$tensor": "data"}}}  # (the typed skeleton of {"data": tensor})
    return Manifest(step=step, state=state, tensors=tensors, files={NAME: FileRecord(size, chunk, crcs, 4096)}
                    ).to_bytes()


def _save(target: Any, step: int, data: np.ndarray[Any, Any]) -> None:
    """One step the way a save writes it: claim, upload, check and commit."""
    w = target.begin(step)
    try:
        crcs = w.write_files([(NAME, data)], 16 << 20, checksum=True)[0]
        w.commit(_manifest(step, data.size, crcs, 16 << 20))
    except BaseException:
        w.abort()
        raise


def _rotate(tools: dict[str, Callable[[int], float | None]], repeat: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in tools}
    for r in range(repeat):
        for name in list(tools)[r % len(tools):] + list(tools)[:r % len(tools)]:
            t = time.perf_counter()
            took = tools[name](r)
            times[name].append(took if took is not None else time.perf_counter() - t)
            print(f"  {name}: {times[name][-1]:.2f} s", flush=True)
    return times


def upload(args: argparse.Namespace, endpoint: str, data: np.ndarray[Any, Any]) -> dict[str, Any]:
    proxy = _proxy(args, endpoint)
    so = {"endpoint_url": proxy.endpoint, "key": "testing", "secret": "testing"}
    part = args.part_mib << 20
    target: Any = open_target("s3://bench/up", dict(so), io_threads=8,
                              s3_options=S3Options(part_size=part, concurrency=args.concurrency))
    fs = target.raw_fs

    def ckptmgr_writer(i: int) -> None:
        _save(target, i, data)

    def single_stream(i: int) -> None:
        with fs.open(f"bench/single/{i}", "wb", block_size=part) as f:
            for b in range(0, data.size, part):
                f.write(data[b:b + part].tobytes())

    def pipe_file(i: int) -> None:
        fs.pipe_file(f"bench/pipe/{i}", data.tobytes(), chunksize=part, max_concurrency=args.concurrency)

    tools = {"ckptmgr S3 writer": ckptmgr_writer, "s3fs open('wb')": single_stream, "s3fs pipe_file": pipe_file}
    times = _rotate(tools, args.repeat)  # type: ignore[arg-type]
    target.close()
    proxy.close()
    print("\n".join(_table(f"upload {args.mib} MiB, parts of {args.part_mib} MiB, concurrency {args.concurrency}, "
                           f"{_net(args)}, median of {args.repeat}", times, data.size, "s3fs open('wb')")))
    return {"times_s": times}


def restore(args: argparse.Namespace, endpoint: str, data: np.ndarray[Any, Any]) -> dict[str, Any]:
    direct = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    setup: Any = open_target("s3://bench/rs", dict(direct), s3_options=S3Options(part_size=8 << 20))
    _save(setup, 1, data)  # written straight to moto, without the proxy
    # the file's object: data objects carry the writer's claim token in their names
    key = next(k for k in setup.raw_fs.ls("bench/rs/step_000000000001/") if NAME.split(".")[0] in k)
    setup.close()
    proxy = _proxy(args, endpoint)
    so = {"endpoint_url": proxy.endpoint, "key": "testing", "secret": "testing"}
    chunk = args.chunk_mib << 20
    opts = S3Options(concurrency=args.concurrency)
    tmp = tempfile.mkdtemp(prefix="bench-s3-")

    def ckptmgr_reads(i: int) -> None:
        target: Any = open_target("s3://bench/rs", dict(so), io_threads=args.io_threads, s3_options=opts,
                                  read_only=True)
        try:
            step = target.list_steps()[-1]  # discovery and the manifest, as a restore does
            name = next(iter(json.loads(target.read_manifest(step))["files"]))  # (the committed object's name)
            size = target.file_size(step, name)
            out = np.empty(size, dtype=np.uint8)
            ranges = [(b, min(size, b + chunk)) for b in range(0, size, chunk)]
            futures = [target.io_pool.submit(target.read_into, step, name, b, [out[b:e]]) for b, e in ranges]
            for f in concurrent.futures.as_completed(futures):
                f.result()
            assert out[-1] == data[-1]
        finally:
            target.close()

    def fresh_fs() -> Any:
        import s3fs

        return s3fs.S3FileSystem(**so, skip_instance_cache=True)

    def cat_file(i: int) -> None:
        got = fresh_fs().cat_file(key)
        assert len(got) == data.size

    def get_file(i: int) -> None:
        dest = os.path.join(tmp, f"get-{i}")
        fresh_fs().get_file(key, dest)
        assert os.path.getsize(dest) == data.size
        os.unlink(dest)

    tools = {"ckptmgr ranged GETs": ckptmgr_reads, "s3fs cat_file": cat_file, "s3fs get_file": get_file}
    times = _rotate(tools, args.repeat)  # type: ignore[arg-type]
    proxy.close()
    print("\n".join(_table(f"restore {args.mib} MiB, ckptmgr: {args.io_threads} threads x {args.chunk_mib} MiB "
                           f"ranges, {_net(args)}, median of {args.repeat}", times, data.size, "s3fs cat_file")))
    return {"times_s": times}


def throttle(args: argparse.Namespace, endpoint: str, data: np.ndarray[Any, Any]) -> dict[str, Any]:
    proxy = _proxy(args, endpoint, max_inflight=args.capacity)
    so = {"endpoint_url": proxy.endpoint, "key": "testing", "secret": "testing"}
    stats: dict[str, list[dict[str, float]]] = {"adaptive window": [], "fixed window": []}

    def run(adaptive: bool) -> Callable[[int], float]:
        def go(i: int) -> float:
            opts = S3Options(part_size=args.part_mib << 20, concurrency=args.concurrency,
                             adaptive_concurrency=adaptive)
            target: Any = open_target(f"s3://bench/th-{int(adaptive)}", dict(so), s3_options=opts)
            proxy.reset_counts()
            t = time.perf_counter()
            _save(target, i, data)
            took = time.perf_counter() - t
            w = target.window
            stats["adaptive window" if adaptive else "fixed window"].append(
                {"s": took, "requests": proxy.requests, "slowdown": proxy.throttled, "retries": target.retries,
                 "lowest_window": w.lowest, "decreases": w.decreases})
            target.close()
            return took
        return go

    times = _rotate({"adaptive window": run(True), "fixed window": run(False)}, args.repeat)
    proxy.close()
    lines = [f"throttle: {args.mib} MiB save, parts of {args.part_mib} MiB, concurrency {args.concurrency}, store "
             f"capacity {args.capacity} requests in flight (503 SlowDown beyond), {_net(args)}, "
             f"median of {args.repeat}", "",
             "| window | s | requests | SlowDown answers | share SlowDown | smallest window |",
             "|---|---|---|---|---|---|"]
    for name, runs in stats.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        lines.append(f"| {name} | {med['s']:.2f} | {med['requests']:.0f} | {med['slowdown']:.0f} | "
                     f"{med['slowdown'] / med['requests']:.0%} | {med['lowest_window']:.0f} |")
    print("\n".join(lines))
    return {"times_s": times, "runs": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", default="upload", choices=["upload", "restore", "throttle"])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--part-mib", type=int, default=8)
    ap.add_argument("--chunk-mib", type=int, default=16, help="restore: bytes per ranged GET")
    ap.add_argument("--io-threads", type=int, default=8, help="restore: ckptmgr's reader threads")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=10, help="throttle: requests the store serves at once")
    ap.add_argument("--latency-ms", type=float, default=50)
    ap.add_argument("--jitter-ms", type=float, default=300)
    ap.add_argument("--conn-mbps", type=float, default=0.0, help="bytes moved per connection (0: no cap)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    suffix = "" if args.mode == "upload" else f"_{args.mode}"
    out = args.out or os.path.join(os.path.dirname(__file__), "out", f"s3{suffix}.json")
    server, endpoint = start_moto_process()
    data = np.random.default_rng(0).integers(0, 255, size=args.mib << 20, dtype=np.uint8)
    try:
        result = {"upload": upload, "restore": restore, "throttle": throttle}[args.mode](args, endpoint, data)
    finally:
        server.kill()
        server.wait(30)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"mode": args.mode, "args": vars(args), "bytes": data.size, **result,
                   "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()}, {os.cpu_count()} cores"},
                  f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
