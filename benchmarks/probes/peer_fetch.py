"""Throughput of the peer tier's restore transport (``Transport.exchange``), 1 GiB each way.

    torchrun --nproc-per-node 2 benchmarks/probes/peer_fetch.py --out peer_fetch.json
    torchrun --nproc-per-node 2 benchmarks/probes/peer_fetch.py --device cpu --mib 64 --segments 4,16

Builds the real :class:`~ckptmgr.distributed.peer_transport.Transport` on the job's default
group (``cpu:gloo,cuda:nccl`` with ``--device cuda``, gloo with ``--device cpu``) and moves
``--mib`` MiB from rank 0 to rank 1 and as much from rank 1 to rank 0 in one ``exchange()``,
for host arrays of three kinds: files in a /dev/shm directory mapped shared and reused between
repeats (their pages faulted in), "fresh": the receiving file made anew for every repeat,
allocated with ``posix_fallocate`` and never touched before the exchange, as
:meth:`PeerArea.create <ckptmgr.storage.peer_tier.PeerArea.create>` makes the files a restore
receives into, and plain anonymous arrays. Grid: segment size (``--segments``, MiB) x host copy:
pinned staging with one ``np.copyto`` (today's), the same split across 4 and 8 threads, and
pageable copies straight between the host array and the GPU (CUDA only; on CPU the host
arrays go to gloo as they are, so only the segment size varies). Each setting: one small
warm-up exchange (staging and threads made), then ``--repeats`` timed ones; the time of a
repeat is the slower rank's; GB/s is bytes received per rank / time. Every repeat's received
bytes are compared with what the peer sent (both ranks make both arrays from known seeds;
one byte of each 4 KiB page is spoiled beforehand, so a segment never written is caught).
Ceilings (CUDA): NCCL device-to-device send/recv of the same size both ways, pinned H2D and
D2H. Prints a table; ``--out`` writes JSON. About 60-90 s on 2 GPUs at the defaults
(estimate printed first: 2 kinds x 16 settings x 3 repeats of about 0.1-0.6 s, plus a
0.2 s comparison each). ``--piece-mib 16`` moves the arrays as a restore does today: one
``exchange()`` per piece of ``PeerOptions.chunk_bytes`` (16 MiB by default), each drained
before the next, so a segment larger than the piece gains nothing there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ckptmgr.distributed.coordinator import Coordinator
from ckptmgr.distributed.peer_transport import Transport

HOST_COPIES = [("pinned", 1), ("pinned", 4), ("pinned", 8), ("pageable", 1)]


def slowest(dt: float) -> float:
    """The slower rank's time (every rank calls this together)."""
    t = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=GLOO)
    return float(t.item())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary(n: int, times: list[float]) -> dict[str, Any]:
    rates = [n / t / 1e9 for t in times]
    return {"gbps_median": statistics.median(rates), "gbps_min": min(rates), "gbps_max": max(rates),
            "s": times}


def pattern(seed: int, n: int) -> np.ndarray:
    """``n`` bytes (a multiple of 8) that differ between seeds and between every two 64 MiB
    blocks: one random block, XORed with each block's own 64-bit word."""
    block = 64 << 20
    base = np.random.default_rng(seed).integers(0, 1 << 63, block // 8, dtype=np.uint64)
    out = np.empty(n // 8, dtype=np.uint64)
    for k, at in enumerate(range(0, out.size, base.size)):
        piece = out[at:at + base.size]
        np.bitwise_xor(base[:piece.size], np.uint64(0x9E3779B97F4A7C15 * (k + 1) % (1 << 64)), out=piece)
    return out.view(np.uint8)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Every byte equal (compared 2 MiB at a time: no temporary of the arrays' size)."""
    x, y, step = a.view(np.uint64), b.view(np.uint64), 1 << 18
    return all(np.array_equal(x[i:i + step], y[i:i + step]) for i in range(0, x.size, step))


def host_arrays(kind: str, n: int, shm: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(what this rank sends, where it receives) of ``kind``."""
    if kind == "anon":
        return np.empty(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)
    assert shm is not None
    r = dist.get_rank()
    return (np.memmap(os.path.join(shm, f"send-{r}"), dtype=np.uint8, mode="w+", shape=(n,)),
            np.memmap(os.path.join(shm, f"recv-{r}"), dtype=np.uint8, mode="w+", shape=(n,)))


def fresh_recv(shm: str, n: int) -> np.ndarray:
    """A receiving file made as the peer area makes one: created, allocated, mapped, untouched."""
    path = os.path.join(shm, f"fresh-{dist.get_rank()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, n)
        return np.frombuffer(mmap.mmap(fd, n), dtype=np.uint8)
    finally:
        os.close(fd)


def run_grid(coord: Coordinator, device: torch.device, kind: str, n: int, mine: np.ndarray,
             theirs: np.ndarray, segs: list[int], copies: list[tuple[str, int]], repeats: int,
             shm: str | None, piece: int) -> list[dict[str, Any]]:
    peer = 1 - dist.get_rank()
    send, recv = host_arrays("shm" if kind == "fresh" else kind, n, shm)
    send[:] = mine
    rows = []
    small = np.zeros(4096, dtype=np.uint8)
    for seg in segs:
        for method, threads in copies:
            t = Transport(coord, dist.group.WORLD, device if device.type == "cuda" else None, segment_bytes=seg,
                          timeout_s=120, copy_threads=threads, copy_method=method)
            t.exchange([(peer, small)], [(peer, small.copy())])  # (staging, threads, communicator made)
            times, exact = [], True
            for _ in range(repeats):
                if kind == "fresh":  # (zeros: a segment never written is caught)
                    recv = fresh_recv(shm or "", n)
                else:
                    recv[::4096] = ~theirs[::4096]  # (spoiled: a segment never written is caught)
                sync(device)
                dist.barrier(group=GLOO)
                t0 = time.perf_counter()
                for at in range(0, n, piece or n):  # (as ShardMover moves a shard: one exchange per piece)
                    t.exchange([(peer, send[at:at + (piece or n)])], [(peer, recv[at:at + (piece or n)])])
                times.append(slowest(time.perf_counter() - t0))
                exact = exact and same(recv, theirs)
            staged = t.staging_bytes()
            t.close()
            flags = [False, False]
            dist.all_gather_object(flags, exact, group=GLOO)
            row = {"kind": kind, "piece_mib": piece / (1 << 20), "segment_mib": seg / (1 << 20),
                   "method": method if device.type == "cuda" else "gloo",
                   "threads": threads, "exact": all(flags), "staging_bytes": staged, **summary(n, times)}
            rows.append(row)
            if dist.get_rank() == 0:
                print(f"{kind:5} {row['segment_mib']:7.0f} {row['method']:9} {threads:3} "
                      f"{row['gbps_median']:8.2f} {row['gbps_min']:7.2f}-{row['gbps_max']:<7.2f} "
                      f"{'exact' if row['exact'] else 'WRONG BYTES'}", flush=True)
    del send, recv
    return rows


def ceilings(device: torch.device, n: int, repeats: int) -> dict[str, Any]:
    """NCCL device-to-device both ways at once, pinned H2D and D2H, of ``n`` bytes."""
    peer = 1 - dist.get_rank()
    a = torch.full((n,), dist.get_rank() + 1, dtype=torch.uint8, device=device)
    b = torch.empty(n, dtype=torch.uint8, device=device)
    pin = torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def nccl() -> None:
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer), dist.P2POp(dist.irecv, b, peer)]):
            w.wait()

    out = {}
    for name, fn in (("nccl_d2d", nccl), ("pinned_h2d", lambda: b.copy_(pin, non_blocking=True)),
                     ("pinned_d2h", lambda: pin.copy_(a, non_blocking=True))):
        fn()
        sync(device)
        times = []
        for _ in range(repeats):
            dist.barrier(group=GLOO)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(slowest(time.perf_counter() - t0))
        out[name] = summary(n, times)
    out["nccl_d2d_exact"] = bool((b == peer + 1).all().item())
    return out


def main() -> None:
    global GLOO
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--mib", type=int, default=1024, help="MiB each way")
    ap.add_argument("--segments", default="4,16,64,128", help="segment sizes, MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shm", default="/dev/shm", help="where the mapped arrays' files go")
    ap.add_argument("--piece-mib", type=int, default=0,
                    help="move the arrays in exchanges of this many MiB, as a restore's ShardMover does with "
                         "PeerOptions.chunk_bytes (16 MiB by default); 0: one exchange")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    assert dist.get_world_size() == 2, "run with 2 processes (torchrun --nproc-per-node 2)"
    GLOO = dist.new_group(backend="gloo")
    rank, n = dist.get_rank(), args.mib << 20
    segs = [int(s) << 20 for s in args.segments.split(",")]
    copies = HOST_COPIES if device.type == "cuda" else [("pinned", 1)]
    coord = Coordinator(dist.group.WORLD, 120)
    dist.all_reduce(torch.zeros(1, device=device))  # (a first collective on the job's group, as a restore runs)
    mine, theirs = pattern(rank, n), pattern(1 - rank, n)
    kinds = ["shm", "fresh", "anon"]
    shm = None
    if shutil.disk_usage(args.shm).free < 7 * n:  # (both ranks' three arrays, and room)
        kinds = ["anon"]
        if rank == 0:
            print(f"{args.shm} has under {7 * n >> 20} MiB free: the mapped arrays are left out", flush=True)
    else:
        shm = tempfile.mkdtemp(prefix="peer-fetch-", dir=args.shm) if rank == 0 else None
        got: list[Any] = [shm]
        dist.broadcast_object_list(got, src=0, group=GLOO)
        shm = got[0]
    if rank == 0:
        how = f"exchanges of {args.piece_mib} MiB" if args.piece_mib else "one exchange"
        print(f"{args.mib} MiB each way ({how}), "
              f"{device}, {len(kinds)} kinds x {len(segs) * len(copies)} settings x "
              f"{args.repeats} repeats (about {len(kinds) * len(segs) * len(copies) * args.repeats * 0.6:.0f} s "
              f"at most at 2 GB/s)", flush=True)
        print(f"{'kind':5} {'seg MiB':>7} {'method':9} {'thr':>3} {'GB/s med':>8} {'min-max':>15}", flush=True)
    t_start = time.perf_counter()
    rows = []
    try:
        for kind in kinds:
            rows += run_grid(coord, device, kind, n, mine, theirs, segs, copies, args.repeats, shm,
                             args.piece_mib << 20)
    finally:
        dist.barrier(group=GLOO)
        if rank == 0 and shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    report: dict[str, Any] = {"device": str(device), "mib_each_way": args.mib, "repeats": args.repeats,
                              "piece_mib": args.piece_mib,
                              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                              "torch": torch.__version__, "rows": rows}
    if device.type == "cuda":
        report["ceilings"] = ceilings(device, n, args.repeats)
        if rank == 0:
            for name, c in report["ceilings"].items():
                if isinstance(c, dict):
                    print(f"ceiling {name:10} {c['gbps_median']:8.2f} {c['gbps_min']:7.2f}-{c['gbps_max']:<7.2f}")
            print(f"ceiling nccl_d2d bytes exact: {report['ceilings']['nccl_d2d_exact']}")
    report["probe_s"] = time.perf_counter() - t_start
    if rank == 0:
        print(f"probe {report['probe_s']:.1f} s; every setting exact: {all(r['exact'] for r in rows)}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    dist.destroy_process_group()


GLOO: Any = None

if __name__ == "__main__":
    main()
