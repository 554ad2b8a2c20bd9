"""Cold-disk read patterns against fastsafetensors 0.5's (16 threads, 512 KiB O_DIRECT blocks
from one FIFO in file order) and ckptmgr's ring, on the same files.

    python prof_tmp/cold_probe.py DIR OUT.json [rounds]
"""
import json
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, "benchmarks")
from bench_restore import data_files, drop_cache, fingerprint
from bench_staging import make_state

from ckptmgr import CheckpointManager, StagingOptions

d, out = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
ALIGN = 4096


def window(paths, threads, block):
    """One FIFO of ``block``-sized reads in file order; ``threads`` take the next one."""
    jobs = [(p, off) for p in paths for off in range(0, os.path.getsize(p) // ALIGN * ALIGN, block)]
    bufs = [mmap.mmap(-1, block) for _ in range(threads)]
    local = threading.local()
    counter = iter(range(threads))
    lock = threading.Lock()
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths}

    def one(job):
        if not hasattr(local, "buf"):
            with lock:
                local.buf = bufs[next(counter)]
        p, off = job
        n = min(block, os.path.getsize(p) // ALIGN * ALIGN - off)
        os.preadv(fds[p], [memoryview(local.buf)[:n]], off)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, jobs))
    took = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    return took


def chunked(paths, threads, block, chunk=16 << 20):
    """Each task one ``chunk`` (a checksum chunk), read as sequential ``block`` reads."""
    jobs = [(p, off) for p in paths for off in range(0, os.path.getsize(p) // ALIGN * ALIGN, chunk)]
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]
    local = threading.local()
    counter = iter(range(threads))
    lock = threading.Lock()
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths}

    def one(job):
        if not hasattr(local, "buf"):
            with lock:
                local.buf = bufs[next(counter)]
        p, off = job
        end = min(off + chunk, os.path.getsize(p) // ALIGN * ALIGN)
        mv = memoryview(local.buf)
        for b in range(off, end, block):
            n = min(block, end - b)
            os.preadv(fds[p], [mv[b - off:b - off + n]], b)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, jobs))
    took = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    return took


def per_file(paths, threads, block):
    """Files split in ``threads`` contiguous ranges, each read sequentially in ``block`` reads."""
    total = [(p, os.path.getsize(p) // ALIGN * ALIGN) for p in paths]
    per = -(-sum(n for _, n in total) // threads)
    per = -(-per // ALIGN) * ALIGN
    ranges, cur = [[] for _ in range(threads)], 0
    for p, n in total:
        off = 0
        while off < n:
            i = min(cur // per, threads - 1)
            take = min(n - off, (i + 1) * per - cur) if i < threads - 1 else n - off
            ranges[i].append((p, off, off + take))
            off += take
            cur += take
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths}

    def one(i):
        buf = mmap.mmap(-1, block)
        mv = memoryview(buf)
        for p, b, e in ranges[i]:
            for o in range(b, e, block):
                n = min(block, e - o)
                os.preadv(fds[p], [mv[:n]], o)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))
    took = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    return took


K = 1024
PATTERNS = [("window", 16, 512 * K), ("window", 32, 512 * K), ("window", 8, 512 * K), ("window", 16, 256 * K),
            ("window", 16, 1024 * K), ("window", 16, 4096 * K), ("window", 12, 16384 * K),
            ("window", 16, 16384 * K), ("window", 64, 512 * K),
            ("chunked", 12, 512 * K), ("chunked", 16, 512 * K), ("chunked", 16, 1024 * K),
            ("chunked", 32, 512 * K), ("chunked", 12, 2048 * K), ("per_file", 16, 512 * K), ("per_file", 16, 4096 * K)]
FUNCS = {"window": window, "chunked": chunked, "per_file": per_file}

shutil.rmtree(d, ignore_errors=True)
os.makedirs(d)
state = make_state(4.0, "cpu", n_tensors=150)
with CheckpointManager(os.path.join(d, "root"), staging=StagingOptions(local_tier=False)) as m:
    m.save(1, state).result()
step_dir = os.path.join(d, "root", "step_000000000001")
files = data_files(step_dir)
size = sum(os.path.getsize(p) for p in files)
shapes = os.path.join(d, "shapes.json")
with open(shapes, "w") as f:
    json.dump({"shapes": {k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state.items()},
               "crc": fingerprint(state)}, f)
del state
print(f"{len(files)} files, {size / 1e9:.2f} GB; sizes {[os.path.getsize(p) for p in files]}", flush=True)
res = {"files": len(files), "bytes": size, "patterns": {}, "tools": {}}
TOOLS = ["ckptmgr restore(device)", "fastsafetensors (nogds)"]
for r in range(rounds):
    order = PATTERNS[r % len(PATTERNS):] + PATTERNS[:r % len(PATTERNS)]
    if r % 2:
        order = order[::-1]
    for kind, t, b in order:
        drop_cache(files)
        s = FUNCS[kind](files, t, b)
        key = f"{kind} {t} x {b // K} KiB"
        res["patterns"].setdefault(key, []).append(size / s / 1e9)
        print(f"  {key:28s} {size / s / 1e9:.2f} GB/s", flush=True)
    for tool in (TOOLS if r % 2 == 0 else TOOLS[::-1]):
        drop_cache(files)
        p = subprocess.run([sys.executable, "benchmarks/bench_restore.py", "--child", tool, step_dir, "-", "cuda",
                            shapes], capture_output=True, text=True, timeout=120)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(f"  {tool}: failed {p.stderr[-800:]}", flush=True)
            continue
        x = json.loads(line[0][7:])
        res["tools"].setdefault(tool, []).append(x)
        print(f"  {tool:28s} {x['s']:.3f} s = {size / x['s'] / 1e9:.2f} GB/s identical={x['identical']}", flush=True)
with open(out, "w") as f:
    json.dump(res, f, indent=1)
print("best patterns (median GB/s):")
for k, v in sorted(res["patterns"].items(), key=lambda kv: -sorted(kv[1])[len(kv[1]) // 2]):
    print(f"  {k:28s} {sorted(v)[len(v) // 2]:.2f}  {[f'{x:.2f}' for x in v]}")
shutil.rmtree(d, ignore_errors=True)
