"""Device-to-host copy speed into the kinds of host memory a staging slot can be.

    python benchmarks/probes/d2h_targets.py --gib 4.5

Copies ``--gib`` of GPU tensors (64 MiB each, as 24 x Linear(4096)'s weights) into: torch's
pinned memory (cudaHostAlloc), anonymous memory registered in 64 MiB pieces, a /dev/shm file
mapped and registered in pieces (what a local-tier slot is), the same registered whole; each
copy split at piece boundaries as the stager splits it. Then the same save through
``CheckpointManager`` with its slots made up front and the GPU idle: ``save(block=False)`` to
``wait_staged()``. Prints GB/s per kind (median of 5).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from ckptmgr.save import buffers as B


def timed(fn, n=5):
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.5)
    ap.add_argument("--shm", default="/dev/shm")
    args = ap.parse_args()
    n = int(args.gib * 2**30) // (64 << 20)
    srcs = [torch.randn(4096, 4096, device="cuda") for _ in range(n)]
    total = n * (64 << 20)
    stream = torch.cuda.Stream()
    offset = 4096 + 160  # a header: every tensor straddles a piece boundary, as in a real image

    def copy_into(buf: torch.Tensor, piece: int, d2h: bool = True) -> None:
        with torch.cuda.stream(stream):
            for i, s in enumerate(srcs):
                begin = offset + i * (64 << 20)
                sb = s.view(-1).view(torch.uint8)
                pos = begin
                while pos < begin + sb.numel():
                    end = min(begin + sb.numel(), (pos // piece + 1) * piece) if piece else begin + sb.numel()
                    if d2h:
                        buf[pos:end].copy_(sb[pos - begin:end - begin], non_blocking=True)
                    else:
                        sb[pos - begin:end - begin].copy_(buf[pos:end], non_blocking=True)
                    pos = end
        stream.synchronize()

    size = total + offset
    rows = []
    t = time.perf_counter()
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    made = time.perf_counter() - t
    rows.append(("torch pinned (cudaHostAlloc)", made, timed(lambda b=pinned: copy_into(b, 0)),
                 timed(lambda b=pinned: copy_into(b, 0, False))))
    del pinned
    for kind, piece_mode in [("anonymous, pieces", "pieces"), ("/dev/shm file, pieces", "pieces"),
                             ("/dev/shm file, whole", "populate")]:
        B.PIN_MODE = piece_mode
        B.PIN_PAUSE_S = 0.0
        path = None
        t = time.perf_counter()
        if kind.startswith("anonymous"):
            hb = B.anonymous_buffer(size)
        else:
            path = os.path.join(args.shm, f"d2h-probe-{os.getpid()}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, size)
            hb = B.file_buffer(fd, size, path)
            os.close(fd)
        hb.pin(1 << 20)
        made = time.perf_counter() - t
        piece = hb.boundaries()
        rows.append((f"{kind} ({len(hb.registered)} registrations)", made,
                     timed(lambda b=hb.tensor, p=piece: copy_into(b, p)),
                     timed(lambda b=hb.tensor, p=piece: copy_into(b, p, False))))
        hb.unpin()
        if path:
            os.unlink(path)
        del hb
    print(f"{total / 2**30:.2f} GiB in {n} tensors of 64 MiB")
    print(f"{'host memory':48} {'make s':>8} {'D2H GB/s':>9} {'H2D GB/s':>9}")
    for name, made, d2h, h2d in rows:
        print(f"{name:48} {made:8.3f} {total / d2h / 1e9:9.1f} {total / h2d / 1e9:9.1f}")
    # the product: slots made up front, GPU idle, save(block=False) -> wait_staged()
    B.PIN_MODE, B.PIN_PAUSE_S = "pieces", 0.002
    from ckptmgr import CheckpointManager, StagingOptions
    root = tempfile.mkdtemp(dir="/var/tmp")
    state = {f"w{i}": s for i, s in enumerate(srcs)}
    for slots in (3, None):
        mgr = CheckpointManager(os.path.join(root, str(slots)), staging=StagingOptions(slots=slots))
        mgr.prepare({"model": state})
        time.sleep(8)  # (a probe: the slots are made in the background meanwhile)
        for step in (1, 2, 3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            h = mgr.save(step, {"model": state}, block=False)
            ret = time.perf_counter() - t
            h.wait_staged()
            took = time.perf_counter() - t
            print(f"manager slots={slots}: save {step}: returned {ret:.3f} s, staged {took:.3f} s "
                  f"({total / took / 1e9:.1f} GB/s)", flush=True)
            h.result(timeout=600)
        mgr.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
