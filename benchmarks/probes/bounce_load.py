"""Probe: a safetensors file in /dev/shm onto the GPU through reusable pinned bounce buffers.

Each variant runs in a fresh process (the first load in a process is what ``load_file``
users get): ``load_file`` (pins the mapping in pieces), fastsafetensors (nogds) and a bounce
loader with T threads, each preading the file into two pinned buffers of B MiB in turn and
copying each to the GPU on a stream of its own. Prints a table, writes JSON. Not a product
benchmark: it picks the bounce loader's settings. With ``--cold`` and a ``--dir`` on disk, the
file is dropped from the page cache before each run: ``load_file`` (direct reads), ``load_file
buffered`` (the same readers through the page cache) and ``load_file pinwhole`` (the mapping
pinned whole, as files on disk were loaded before).

    python benchmarks/probes/bounce_load.py --gib 4 --rounds 3 --out bounce.json
    python benchmarks/probes/bounce_load.py --dir /var/tmp/bounce --cold \
        --variants "load_file,load_file buffered,load_file pinwhole,fastsafetensors"
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import commit, drop_cache

VARIANTS = ["load_file", "load_file many", "load_file reg", "load_file 4x8", "load_file 8x4",
            "load_file +pin", "load_file +out", "load_file +both", "fastsafetensors",
            "bounce 8x8", "bounce 8x16", "reg 8x8", "reg 8x16", "reg 12x8",
            "hybrid 8x8", "hybrid 8x16", "ctypes 8x8", "ctypes 16x8", "ctypesreg 16x8", "pageable 8x64",
            "preg 1x64", "preg 4x64", "preg 8x64", "preg 16x64", "preg 8x16", "preg 8x256", "pregpop 8x64",
            "regonly 1x64", "regonly 4x64", "regonly 8x64", "regonly 16x64",
            "serial 1x16", "serial 2x16", "serial 4x16", "serial 1x64", "serial 2x8", "parts",
            "load_file buffered", "load_file pinwhole"]


def parts(path: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``load_file``'s steps one by one, each timed (the bounce buffers allocated apart from
    the copies, then served to them from PyTorch's pinned cache)."""
    from ckptmgr.restore.loaders import bounce as product
    from ckptmgr.restore.loaders import mapped
    from ckptmgr.restore.loaders.landing import plan_landing

    phases: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases[name] = now - t
        t = now

    mf = mapped.open_mapped(path)
    lap("open+header")
    mapped.sibling_record(mf)
    lap("manifest lookup")
    dev = torch.device("cuda", torch.cuda.current_device())
    landing = plan_landing(mf.entries, mf.data_start, mf.size - mf.data_start, dev)
    torch.cuda.synchronize()
    lap("device alloc")
    held = product._buffers(product.THREADS, True)  # (the loader's own block, left in the allocator's cache)
    del held
    lap("pinned alloc")
    first = mf.data_start - mf.data_start % mmap.PAGESIZE
    product.copy_through_bounce(mf.fd, first, mf.size, landing, dev, path)
    lap("copies")
    out = landing.tensors()
    mf.close()
    lap("views+close")
    return out, phases


def pin_whole(path: str) -> dict[str, torch.Tensor]:
    """A file's mapping pinned in place whole and copied in one transfer (the disk path of
    ``load_file`` before the bounce readers took it: ``to_device`` of a mapping opened without
    a descriptor to read)."""
    from ckptmgr.restore.loaders import mapped

    mf = mapped.open_mapped(path, reads=False)
    try:
        return mapped.to_device(mf, torch.device("cuda"))
    finally:
        mf.close()


def registered(nbytes: int) -> torch.Tensor:
    """Anonymous memory, populated, pinned in place (cudaHostRegister), as a uint8 tensor."""
    from ckptmgr import _cuda

    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    t = torch.frombuffer(m, dtype=torch.uint8)
    _cuda.host_register(t.data_ptr(), nbytes)
    return t


def _mapped(path: str) -> tuple[mmap.mmap, int]:
    """The safetensors file mapped shared and read-only, and where its data region starts
    (its header read and parsed first)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        json.loads(f.read(n))
        return mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ), 8 + n


def hybrid(path: str, threads: int, mib: int) -> tuple[torch.Tensor, float]:
    """The front of the file pinned in place piece by piece and copied by this thread, the back
    read through registered bounce buffers by ``threads`` threads: they meet in the middle."""
    import threading

    from ckptmgr import _cuda

    mm, start = _mapped(path)
    size_all = os.path.getsize(path)
    length = size_all - start
    data = torch.frombuffer(mm, dtype=torch.uint8)
    out = torch.empty(length, dtype=torch.uint8, device="cuda")
    size = mib << 20
    t = time.perf_counter()
    pool = registered(2 * threads * size)
    alloc = time.perf_counter() - t
    piece = 64 << 20  # file pieces (page-aligned in the mapping), the front ones registered in place
    begins = list(range(0, size_all, piece))
    mu = threading.Lock()
    nxt = [0, len(begins)]  # [front, back): pieces not yet taken
    fd = os.open(path, os.O_RDONLY)
    regs: list[int] = []

    def take(front: bool) -> int:
        with mu:
            if nxt[0] >= nxt[1]:
                return -1
            if front:
                nxt[0] += 1
                return nxt[0] - 1
            nxt[1] -= 1
            return nxt[1]

    def land(b: int, e: int, src: torch.Tensor) -> None:  # file bytes [b, e) -> out
        lo, hi = max(b, start), e
        if hi > lo:
            out[lo - start:hi - start].copy_(src[lo - b:hi - b], non_blocking=True)

    def back(w: int) -> None:
        stream = torch.cuda.Stream()
        events: list[Any] = [None, None]
        k = 0
        while (i := take(False)) >= 0:
            b = begins[i]
            e = min(b + piece, size_all)
            for sb in range(b, e, size):
                se = min(sb + size, e)
                slot = k % 2
                k += 1
                if events[slot] is not None:
                    events[slot].synchronize()
                buf = pool[(2 * w + slot) * size:(2 * w + slot) * size + size]
                got = os.preadv(fd, [memoryview(buf.numpy())[: se - sb]], sb)
                assert got == se - sb
                with torch.cuda.stream(stream):
                    land(sb, se, buf)
                    ev = torch.cuda.Event()
                    ev.record()
                    events[slot] = ev
        stream.synchronize()

    streams = [torch.cuda.Stream() for _ in range(4)]
    try:
        with ThreadPoolExecutor(threads) as ex:
            futs = [ex.submit(back, w) for w in range(threads)]
            k = 0
            while (i := take(True)) >= 0:
                b = begins[i]
                e = min(b + piece, size_all)
                _cuda.host_register(data[b:e].data_ptr(), e - b, read_only=True)
                regs.append(data[b:e].data_ptr())
                with torch.cuda.stream(streams[k % 4]):
                    land(b, e, data[b:e])
                k += 1
            for s in streams:
                s.synchronize()
            for fu in futs:
                fu.result()
    finally:
        for p in regs:
            _cuda.host_unregister(p)
        os.close(fd)
    return out, alloc


def _on_threads(work: Any, threads: int, fd: int) -> None:
    """``work(w)`` for every thread ``w``, at once; then the file is closed."""
    try:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(work, range(threads)))
    finally:
        os.close(fd)


def _setup(path: str, threads: int, mib: int, reg: bool) -> tuple[int, int, torch.Tensor, list[torch.Tensor], float]:
    """The data region's start and length, the output on the GPU, two bounce buffers of ``mib``
    MiB per thread (torch's pinned memory, or populated anonymous memory registered in place
    with ``reg``) and the seconds the buffers took."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        json.loads(f.read(n))
    start = 8 + n
    length = os.path.getsize(path) - start
    out = torch.empty(length, dtype=torch.uint8, device="cuda")
    size = mib << 20
    t = time.perf_counter()
    if reg:
        pool = registered(2 * threads * size)
        bufs = [pool[i * size:(i + 1) * size] for i in range(2 * threads)]
    else:
        bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2 * threads)]
    return start, length, out, bufs, time.perf_counter() - t


def bounce(path: str, threads: int, mib: int, reg: bool = False) -> tuple[torch.Tensor, float]:
    start, length, out, bufs, alloc = _setup(path, threads, mib, reg)
    size = mib << 20
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

    _on_threads(work, threads, fd)
    return out, alloc


def _cudart() -> Any:
    """The CUDA runtime PyTorch loaded, through ctypes (each call releases the GIL): the library
    of :class:`ckptmgr._cuda.Runtime`, whose argument types it has set."""
    from ckptmgr import _cuda

    rt = _cuda.runtime()
    if rt is None:
        raise SystemExit("libcudart is not a shared library of this process")
    return rt._lib

def gil_free(path: str, threads: int, mib: int, reg: bool) -> tuple[torch.Tensor, float]:
    """The bounce loop with no PyTorch call per piece: ``pread`` and the runtime's
    cudaMemcpyAsync / cudaEventRecord / cudaEventSynchronize through ctypes (GIL released)."""
    import ctypes

    rt = _cudart()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    libc.pread.restype = ctypes.c_ssize_t
    start, length, out, bufs, alloc = _setup(path, threads, mib, reg)
    size = mib << 20
    ptrs = [b.data_ptr() for b in bufs]
    streams = [torch.cuda.Stream() for _ in range(threads)]
    handles = [s.cuda_stream for s in streams]
    begins = list(range(0, length, size))
    fd = os.open(path, os.O_RDONLY)
    base = out.data_ptr()
    dev = torch.cuda.current_device()

    def work(w: int) -> None:
        assert rt.cudaSetDevice(dev) == 0
        st = ctypes.c_void_p(handles[w])
        evs = [ctypes.c_void_p(), ctypes.c_void_p()]
        for ev in evs:
            assert rt.cudaEventCreateWithFlags(ctypes.byref(ev), 2) == 0  # cudaEventDisableTiming
        used = [False, False]
        try:
            for k, i in enumerate(range(w, len(begins), threads)):
                b = begins[i]
                e = min(b + size, length)
                slot = k % 2
                if used[slot]:
                    assert rt.cudaEventSynchronize(evs[slot]) == 0
                src = ptrs[2 * w + slot]
                got = libc.pread(fd, src, e - b, start + b)
                assert got == e - b, got
                assert rt.cudaMemcpyAsync(base + b, src, e - b, 1, st) == 0  # cudaMemcpyHostToDevice
                assert rt.cudaEventRecord(evs[slot], st) == 0
                used[slot] = True
            assert rt.cudaStreamSynchronize(st) == 0
        finally:
            for ev in evs:
                rt.cudaEventDestroy(ev)

    _on_threads(work, threads, fd)
    return out, alloc


def parallel_register(path: str, threads: int, mib: int, copy: bool, populate: bool) -> tuple[torch.Tensor, float]:
    """The file mapped where it lies and pinned in place in pieces of ``mib`` MiB by ``threads``
    threads at once (cudaHostRegister through ctypes, GIL released), each piece copied to the
    GPU on its thread's stream as soon as it is pinned (with ``copy``); every piece unregistered
    at the end (those seconds returned). ``populate``: MADV_POPULATE_READ before each register."""
    import ctypes

    rt = _cudart()
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    rt.cudaHostRegister.argtypes = [vp, sz, ctypes.c_uint]
    rt.cudaHostUnregister.argtypes = [vp]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [vp, sz, ctypes.c_int]
    mm, start = _mapped(path)
    total = os.path.getsize(path)
    data = torch.frombuffer(mm, dtype=torch.uint8)
    base = data.data_ptr()
    out = torch.empty(total - start, dtype=torch.uint8, device="cuda")
    size = mib << 20
    begins = list(range(0, total, size))
    streams = [torch.cuda.Stream() for _ in range(threads)]
    regs: list[int] = []
    dev = torch.cuda.current_device()

    def work(w: int) -> None:
        assert rt.cudaSetDevice(dev) == 0
        for i in range(w, len(begins), threads):
            b = begins[i]
            e = min(b + size, total)
            if populate:
                libc.madvise(base + b, e - b, 22)  # MADV_POPULATE_READ
            err = rt.cudaHostRegister(base + b, e - b, 1 | 8)  # portable | read-only
            assert err == 0, err
            regs.append(base + b)
            lo = max(b, start)
            if copy and e > lo:
                with torch.cuda.stream(streams[w]):
                    out[lo - start:e - start].copy_(data[lo:e], non_blocking=True)
        streams[w].synchronize()

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(work, range(threads)))
    torch.cuda.synchronize()
    t = time.perf_counter()
    for p in regs:
        assert rt.cudaHostUnregister(p) == 0
    return out, time.perf_counter() - t


def serial(path: str, threads: int, mib: int) -> tuple[torch.Tensor, float]:
    """fastsafetensors' nogds loop through ctypes: one cudaHostAlloc of ``threads`` buffers of
    ``mib`` MiB (timed, returned), the data region split in ``threads`` contiguous ranges, each
    thread ``pread``-ing a buffer full and copying it with a synchronous cudaMemcpy in turn."""
    import ctypes

    rt = _cudart()
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    rt.cudaHostAlloc.argtypes = [ctypes.POINTER(vp), sz, ctypes.c_uint]
    rt.cudaFreeHost.argtypes = [vp]
    rt.cudaMemcpy.argtypes = [vp, vp, sz, ctypes.c_int]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    libc.pread.restype = ctypes.c_ssize_t
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        json.loads(f.read(n))
    start = 8 + n
    length = os.path.getsize(path) - start
    size = mib << 20
    t = time.perf_counter()
    host = ctypes.c_void_p()
    assert rt.cudaHostAlloc(ctypes.byref(host), threads * size, 0) == 0
    alloc = time.perf_counter() - t
    out = torch.empty(length, dtype=torch.uint8, device="cuda")
    base = out.data_ptr()
    per = -(-length // threads)
    fd = os.open(path, os.O_RDONLY)
    dev = torch.cuda.current_device()

    def work(w: int) -> None:
        assert rt.cudaSetDevice(dev) == 0
        buf = host.value + w * size
        b, e = w * per, min((w + 1) * per, length)
        while b < e:
            n = min(size, e - b)
            assert libc.pread(fd, buf, n, start + b) == n
            assert rt.cudaMemcpy(base + b, buf, n, 1) == 0
            b += n

    try:
        _on_threads(work, threads, fd)
    finally:
        rt.cudaFreeHost(host)
    return out, alloc


def pageable(path: str, threads: int, mib: int) -> tuple[torch.Tensor, float]:
    """No pinned memory of ours: each thread copies pieces of the mapped file (pageable) to the
    GPU with ``copy_`` on a stream of its own (the driver stages them)."""
    mm, start = _mapped(path)
    data = torch.frombuffer(mm, dtype=torch.uint8)[start:]
    length = data.numel()
    out = torch.empty(length, dtype=torch.uint8, device="cuda")
    size = mib << 20
    begins = list(range(0, length, size))
    streams = [torch.cuda.Stream() for _ in range(threads)]

    def work(w: int) -> None:
        with torch.cuda.stream(streams[w]):
            for i in range(w, len(begins), threads):
                b = begins[i]
                e = min(b + size, length)
                out[b:e].copy_(data[b:e], non_blocking=True)
        streams[w].synchronize()

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(work, range(threads)))
    return out, 0.0


def child(variant: str, path: str) -> dict[str, Any]:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    from fastsafetensors import fastsafe_open

    import ckptmgr  # (every import before the clock starts)
    from ckptmgr.restore.loaders import bounce as product

    alloc = 0.0
    warm = variant.split()[1] if variant.startswith("load_file +") else ""
    if warm in ("+pin", "+both"):  # the bounce buffers allocated and freed before the clock (kept by torch's cache)
        t = time.perf_counter()
        warmed = product._buffers(product.THREADS, True)
        alloc = time.perf_counter() - t
        del warmed
    if warm in ("+out", "+both"):  # the output tensors' device memory, allocated and freed before the clock
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        held = [torch.empty(v["data_offsets"][1] - v["data_offsets"][0], dtype=torch.uint8, device="cuda")
                for k, v in header.items() if k != "__metadata__"]
        torch.cuda.synchronize()
        del held
    phases: dict[str, float] = {}
    t = time.perf_counter()
    if variant == "parts":
        res, phases = parts(path)
    elif variant.startswith("load_file"):
        if variant == "load_file torch":  # the readers' copies through Tensor.copy_, not the runtime library
            product.runtime_for = lambda landing, device: None
        elif variant == "load_file many":  # each bounce buffer its own pinned allocation
            product._buffers = lambda threads, gpu: [
                [torch.empty(product.PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
                for _ in range(threads)]
        elif variant == "load_file reg":  # one block of populated anonymous memory pinned in place
            def reg_buffers(threads: int, gpu: bool) -> list[list[torch.Tensor]]:
                size = product.PIECE_BYTES
                block = registered(2 * threads * size)
                return [[block[(2 * w + k) * size:(2 * w + k + 1) * size] for k in range(2)] for w in range(threads)]

            product._buffers = reg_buffers
        elif " " in variant and not warm and "x" in variant:  # "load_file TxM": the product's bounce settings
            product.THREADS, mib = (int(x) for x in variant.split()[1].split("x"))
            product.PIECE_BYTES = mib << 20
        elif variant == "load_file buffered":  # a cold file on disk read through the page cache
            from ckptmgr.restore.loaders import mapped

            mapped.direct_of = lambda fd, where: None
        elif variant == "load_file pinwhole":  # a file on disk as it was loaded before: pinned whole, one copy
            res = pin_whole(path)
        if variant != "load_file pinwhole":
            res = ckptmgr.load_file(path, device="cuda")
    elif variant == "fastsafetensors":
        with fastsafe_open(path, nogds=True, device="cuda:0") as f:
            res = {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118 (a handle, not a dict)
    else:
        threads, mib = (int(x) for x in variant.split()[1].split("x"))
        kind = variant.split()[0]
        if kind == "hybrid":
            res, alloc = hybrid(path, threads, mib)
        elif kind in ("ctypes", "ctypesreg"):
            res, alloc = gil_free(path, threads, mib, reg=kind == "ctypesreg")
        elif kind == "serial":
            res, alloc = serial(path, threads, mib)
        elif kind in ("preg", "pregpop", "regonly"):
            res, alloc = parallel_register(path, threads, mib, copy=kind != "regonly", populate=kind == "pregpop")
        elif kind == "pageable":
            res, alloc = pageable(path, threads, mib)
        else:
            res, alloc = bounce(path, threads, mib, reg=kind == "reg")
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    nbytes = os.path.getsize(path)
    if isinstance(res, dict):
        check = int(sum(v.view(torch.uint8).to(torch.int64).sum().item() for v in res.values()) % (1 << 31))
    else:
        check = int(res.to(torch.int64).sum().item() % (1 << 31))
    return {"variant": variant, "s": s, "gbps": nbytes / s / 1e9, "alloc_s": alloc, "check": check, "phases": phases}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm/ckptmgr-bounce")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="")
    p.add_argument("--child", nargs=2)
    p.add_argument("--cold", action="store_true", help="drop the file from the page cache before each run "
                   "(a --dir on disk)")
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
    # (one discarded process first: the first of a call runs slower, whatever it runs)
    subprocess.run([sys.executable, __file__, "--child", variants[0], path], capture_output=True, timeout=300)
    for r in range(a.rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            if a.cold:
                drop_cache([path])
            cp = subprocess.run([sys.executable, __file__, "--child", v, path], capture_output=True, text=True,
                                timeout=300)
            if cp.returncode:
                print(v, "failed:", cp.stderr[-2000:], flush=True)
                continue
            res = json.loads(cp.stdout.strip().splitlines()[-1])
            res["round"] = r
            runs.append(res)
            print(f"round {r} {v:18s} {res['s']:.3f} s {res['gbps']:.1f} GB/s alloc {res['alloc_s']:.3f} "
                  f"check {res['check']}" + "".join(f" {k} {x:.3f}" for k, x in res.get("phases", {}).items()),
                  flush=True)
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
            json.dump({"gpu": torch.cuda.get_device_name(), "gib": a.gib, "dir": a.dir, "cold": a.cold,
                       "commit": commit(), "runs": runs, "summary": summary}, f, indent=1)
    os.unlink(path)


if __name__ == "__main__":
    main()
