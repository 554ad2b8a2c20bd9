"""Cold restore onto the GPU: fastsafetensors, ckptmgr, and prototypes of two read patterns
with the whole restore's work (O_DIRECT reads into pinned buffers, CRC32C of each 16 MiB
chunk, host-to-device copy), each in a fresh process after dropping the page cache.

    python benchmarks/results/h200-2026-11-23g/cold-read/cold_window.py DIR OUT.json ROUNDS
    python benchmarks/results/h200-2026-11-23e/cold-read/cold_window.py child MODE STEP_DIR   (internal)

proto-chunk T: a task per 16 MiB chunk (one O_DIRECT read of the chunk), T threads = today's ring.
proto-window T B N: one FIFO of B-byte O_DIRECT blocks in file order, T threads take the next;
   N chunk buffers; the thread that reads a chunk's last block checks it and copies it.
aio D B [sep]: the read pattern alone, D reads of B KiB kept in flight by Linux AIO from one
   thread (sep: each read in its own io_submit).
fst: fastsafetensors (nogds). ckptmgr [opts]: a restore; opts T=threads, cached=1 (chunks
   read through the page cache), drop=1, wn=1 (WILLNEED ahead), noaio=1 (chunk-by-chunk
   reads), D (queue depth), B (KiB per read), A (completions reaped before resubmitting),
   REG=1 (ring buffers: malloc'd memory pinned by cudaHostRegister instead of cudaHostAlloc),
   CIF=N (N chunk buffers instead of 6), fin=none|crc|copy (a chunk's finish does nothing,
   only the checksum, or only the copy), SW=s (sys.setswitchinterval), PKG=dir (import from dir).
land D B S [crc=0] [copy=0]: the whole restore's work with a small landing (land_read): D reads
   of B KiB in flight into S block slots of one pinned region, each landed block checksummed and
   copied to the device at once, a chunk's CRC combined from its blocks'.
aio D B sep pin: the read pattern into cudaHostAlloc memory (without pin: an anonymous mmap);
   rot=N: into N rotating 16 MiB chunk buffers, where the product's reads land; ownfd: on files
   opened by ckptmgr's open_direct.
"""
import json
import os
import subprocess
import sys
import threading
import time

K = 1024
ALIGN = 4096
CUDA = os.environ.get("CW_CPU") is None
TRACE = {"reap_s": 0.0, "reaps": 0, "events": 0, "submit_s": 0.0, "submits": 0}  # where the read loop's time goes


def pinned(n):
    import torch
    if CUDA:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)
    raw = torch.empty(n + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    return raw[skip:skip + n]


def copy(s, dst, src):
    import torch
    if s is None:
        dst.copy_(src)
        return
    with torch.cuda.stream(s):
        dst.copy_(src, non_blocking=True)
    s.synchronize()


def child(mode, step_dir):
    import torch
    if CUDA:
        torch.cuda.init()
        torch.empty(1, device="cuda")
    files = sorted(os.path.join(step_dir, n) for n in os.listdir(step_dir) if n.endswith(".safetensors"))
    if mode == "fst":
        import fastsafetensors  # noqa: F401  (imports before the clock starts, as bench_restore.py does)
    elif mode.startswith("ckptmgr"):
        o = dict(kv.split("=") for kv in mode.split()[1:])
        for k, e in (("D", "CK_DEPTH"), ("C", "CK_CHUNKS"), ("V", "CK_VERIFIERS"), ("B", "CK_BLOCK")):
            if k in o:
                os.environ[e] = o[k]
        if "SW" in o:
            sys.setswitchinterval(float(o["SW"]))
        if os.environ.get("CW_TRACE_DIR"):
            os.environ["CK_TRACE"] = os.path.join(os.environ["CW_TRACE_DIR"],
                                                  mode.replace(" ", "_").replace("=", "") + f"-{time.time():.3f}.json")
        import ckptmgr  # noqa: F401
    t = time.perf_counter()
    first = [None]
    if mode == "fst":
        from fastsafetensors import fastsafe_open
        f = fastsafe_open(files, device="cuda:0", nogds=True)
        f.__enter__()
        out = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (not a dict)
    elif mode.startswith("ckptmgr"):
        opts = dict(kv.split("=") for kv in mode.split()[1:])
        import ckptmgr.manager as mm
        if "T" in opts:
            orig_ring = mm.PinnedRing
            mm.PinnedRing = lambda threads, slot: orig_ring(int(opts["T"]), slot)
        import ckptmgr.storage.posix as px
        if opts.get("probe") == "0":
            px._page_cached = lambda fd, view, off: False
        import ckptmgr.storage.local as lc
        orig_pc = lc.pread_chunk

        if opts.get("cached") == "1":
            px._mostly_cached = lambda *a, **k: True
        dropafter = opts.get("drop") == "1"
        if opts.get("noaio") == "1":
            import ckptmgr.restore.loaders.ring as rg0
            rg0.open_context = lambda depth: None

        def pc(*a, **k):
            if first[0] is None:
                first[0] = time.perf_counter()
            r = orig_pc(*a, **k)
            if dropafter:
                fd = os.open(a[0], os.O_RDONLY, dir_fd=k.get("dir_fd"))
                os.posix_fadvise(fd, a[1], a[3], os.POSIX_FADV_DONTNEED)
                os.close(fd)
            return r
        lc.pread_chunk = pc
        import ckptmgr.restore.loaders.ring as rg
        import ckptmgr.restore.loaders.window as wn
        from ckptmgr import CheckpointManager, StagingOptions
        if "B" in opts:
            wn.BLOCK = int(opts["B"]) * K
        if "D" in opts:
            rg.DEPTH = int(opts["D"])
        if "CIF" in opts:  # chunk buffers a step's reads rotate through
            rg.CHUNKS_IN_FLIGHT = int(opts["CIF"])
        if "A" in opts:
            wn.REAP_AT_LEAST = int(opts["A"])
        if "fin" in opts:  # what a chunk's finish does: none, crc (no copy), copy (no crc)
            orig_lander = rg._lander

            def lander(chunks, device, ring, where):
                streams = ring.streams(device) if CUDA else None
                fin = opts["fin"]

                def land(i, slot, src):
                    c = chunks[i]
                    if fin == "crc":
                        rg.crc32c_hex(src.numpy())
                    elif fin == "copy":
                        with torch.cuda.stream(streams[slot]):
                            c.landing.land(c.begin, src)
                        streams[slot].synchronize()
                return land if fin != "all" else orig_lander(chunks, device, ring, where)
            rg._lander = lander
        if opts.get("REG") == "1":
            import ckptmgr._cuda as cu

            def registered(n):
                raw = torch.empty(n + 4096, dtype=torch.uint8)
                skip = -raw.data_ptr() % 4096
                buf = raw[skip:skip + n]
                cu.host_register(buf.data_ptr(), n)
                return buf
            cu.pinned_empty = registered
        marks = []
        orig_buf = rg.PinnedRing.buffer

        def buffer(self, i):
            a = time.perf_counter()
            r = orig_buf(self, i)
            marks.append(("buffer", a - t, time.perf_counter() - t))
            return r
        rg.PinnedRing.buffer = buffer
        orig_plan = rg._plan_all

        def plan_all(*a, **k):
            x = time.perf_counter()
            r = orig_plan(*a, **k)
            marks.append(("plan_all", x - t, time.perf_counter() - t))
            return r
        rg._plan_all = plan_all
        import ckptmgr.storage.aio as sa
        orig_reap, orig_sub, orig_rw = sa.AioContext.reap, sa.AioContext.submit_one, rg.read_window

        def reap(self, timeout, *args, **kw):
            a = time.perf_counter()
            r = orig_reap(self, timeout, *args, **kw)
            TRACE["reap_s"] += time.perf_counter() - a
            TRACE["reaps"] += 1
            TRACE["events"] += len(r)
            return r

        def submit_one(self, *a):
            x = time.perf_counter()
            orig_sub(self, *a)
            TRACE["submit_s"] += time.perf_counter() - x
            TRACE["submits"] += 1

        def read_window(*a, **k):
            TRACE["loop_begin"] = time.perf_counter() - t
            try:
                return orig_rw(*a, **k)
            finally:
                TRACE["loop_end"] = time.perf_counter() - t
        sa.AioContext.reap, sa.AioContext.submit_one, rg.read_window = reap, submit_one, read_window
        prof = None
        if opts.get("prof"):
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        if opts.get("wn"):
            blk = int(opts.get("wb", "16")) << 20

            def willneed():
                a = time.perf_counter()
                for p in files:
                    fd = os.open(p, os.O_RDONLY)
                    size = os.fstat(fd).st_size
                    for off in range(0, size, blk):
                        os.posix_fadvise(fd, off, min(blk, size - off), os.POSIX_FADV_WILLNEED)
                    os.close(fd)
                marks.append(("willneed-done", a - t, time.perf_counter() - t))
            threading.Thread(target=willneed, daemon=True).start()
        with CheckpointManager(os.path.dirname(step_dir), staging=StagingOptions(local_tier=False)) as m:
            marks.append(("opened", time.perf_counter() - t))
            out = m.restore(int(step_dir.rsplit("_", 1)[1]), device="cuda" if CUDA else "cpu",
                            **({"loader": opts["loader"]} if "loader" in opts else {}))
            marks.append(("restored", time.perf_counter() - t))
            TRACE["restored"] = marks[-1][1]
        marks.append(("closed", time.perf_counter() - t))
        TRACE["closed"] = marks[-1][1]
        if prof is not None:
            prof.disable()
            import io
            import pstats
            sio = io.StringIO()
            pstats.Stats(prof, stream=sio).sort_stats("cumulative").print_stats(45)
            sys.stderr.write(sio.getvalue())
        sys.stderr.write("MARKS " + json.dumps(marks[:6] + marks[-4:]) + "\n")
    elif mode.startswith("aio"):
        with open(os.path.join(step_dir, "manifest.json")) as f:
            man = json.load(f)
        recs = {os.path.join(step_dir, k): v for k, v in man["files"].items()}
        _, depth, kib, *rest = mode.split()
        rot = [int(x[4:]) for x in rest if x.startswith("rot=")]
        total = aio_read(files, recs, int(depth), int(kib) * K, sep="sep" in rest, pin="pin" in rest,
                         rot=rot[0] if rot else 0, own_fds="ownfd" in rest)
        out = {"all": torch.empty(total, dtype=torch.uint8)}
    elif mode.startswith("land"):
        with open(os.path.join(step_dir, "manifest.json")) as f:
            man = json.load(f)
        recs = {os.path.join(step_dir, k): v for k, v in man["files"].items()}
        _, depth, kib, slots, *rest = mode.split()
        knobs = dict(kv.split("=") for kv in rest)
        out = land_read(files, recs, int(depth), int(kib) * K, int(slots), crc=knobs.get("crc", "1") == "1",
                        copy_=knobs.get("copy", "1") == "1")
    else:
        out = proto(mode, step_dir, files, first)
    if CUDA:
        torch.cuda.synchronize()
    took = time.perf_counter() - t
    n = sum(v.numel() * v.element_size() for v in out.values())
    return {"s": took, "bytes": n, "first_read": first[0] - t if first[0] else None, "trace": TRACE}


def proto(mode, step_dir, files, first):
    import crc32c
    import torch
    with open(os.path.join(step_dir, "manifest.json")) as f:
        man = json.load(f)
    recs = {os.path.join(step_dir, k): v for k, v in man["files"].items()}
    knobs = dict(kv.split("=") for kv in mode.split() if "=" in kv)
    parts = [x for x in mode.split() if "=" not in x]
    kind, T = parts[0], int(parts[1])
    do_crc, do_copy = knobs.get("crc", "1") == "1", knobs.get("copy", "1") == "1"
    chunk = 16 << 20
    dev = {p: torch.empty(recs[p]["size"], dtype=torch.uint8, device="cuda" if CUDA else "cpu") for p in files}
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in files}
    chunks = [(p, b, min(b + chunk, recs[p]["size"]), i) for p in files
              for i, b in enumerate(range(0, recs[p]["size"], chunk))]
    bad = []
    from concurrent.futures import ThreadPoolExecutor

    if kind == "proto-chunk":
        bufs = [None] * T
        streams = [torch.cuda.Stream() if CUDA else None for _ in range(T)]
        local = threading.local()
        ids = iter(range(T))
        mu = threading.Lock()

        def task(c):
            if not hasattr(local, "i"):
                with mu:
                    local.i = next(ids)
                bufs[local.i] = pinned(chunk)
            if first[0] is None:
                first[0] = time.perf_counter()
            p, b, e, n = c
            buf = bufs[local.i]
            mv = memoryview(buf.numpy())
            ln = -(-(e - b) // ALIGN) * ALIGN
            got = 0
            while got < e - b:
                r = os.preadv(fds[p], [mv[got:ln]], b + got)
                if r <= 0:
                    raise RuntimeError("short")
                got += r
            crc = crc32c.crc32c(buf.numpy()[:e - b], 0, 1)
            if f"{crc:08x}" != recs[p]["crc32c"][n]:
                bad.append(c)
            s = streams[local.i]
            copy(s, dev[p][b:e], buf[:e - b])

        with ThreadPoolExecutor(T, thread_name_prefix="r") as pool:
            list(pool.map(task, chunks))
    else:
        B, N = int(parts[2]) * K, int(parts[3])
        blocks = [(ci, o) for ci, (p, b, e, n) in enumerate(chunks) for o in range(b, e, B)]
        left = [0] * len(chunks)
        for ci, _ in blocks:
            left[ci] += 1
        mu = threading.Lock()
        cond = threading.Condition(mu)
        free = list(range(N))
        bufs = [None] * N
        streams = [torch.cuda.Stream() if CUDA else None for _ in range(N)]
        slot_of = {}
        pos = [0]

        def worker():
            while True:
                with mu:
                    if pos[0] >= len(blocks):
                        return
                    ci, o = blocks[pos[0]]
                    pos[0] += 1
                    if ci not in slot_of:
                        while not free:
                            cond.wait(60)
                        slot_of[ci] = free.pop()
                    si = slot_of[ci]
                    if bufs[si] is None:
                        bufs[si] = pinned(chunk)
                    buf = bufs[si]
                if first[0] is None:
                    first[0] = time.perf_counter()
                p, b, e, n = chunks[ci]
                end = min(o + B, e)
                ln = -(-(end - o) // ALIGN) * ALIGN
                mv = memoryview(buf.numpy())
                os.preadv(fds[p], [mv[o - b:o - b + ln]], o)
                with mu:
                    left[ci] -= 1
                    last = left[ci] == 0
                if not last:
                    continue
                crc = crc32c.crc32c(buf.numpy()[:e - b], 0, 1) if do_crc else int(recs[p]["crc32c"][n], 16)
                if f"{crc:08x}" != recs[p]["crc32c"][n]:
                    bad.append(chunks[ci])
                s = streams[si]
                if do_copy:
                    copy(s, dev[p][b:e], buf[:e - b])
                with mu:
                    del slot_of[ci]
                    free.append(si)
                    cond.notify()

        ths = [threading.Thread(target=worker) for _ in range(T)]
        for x in ths:
            x.start()
        for x in ths:
            x.join()
    for fd in fds.values():
        os.close(fd)
    if bad:
        raise SystemExit(f"bad chunks {bad[:3]}")
    return dev


def aio_read(files, recs, depth, block, sep=False, pin=False, rot=0, own_fds=False):
    """Linux AIO: one thread keeps ``depth`` O_DIRECT reads of ``block`` bytes in flight, in file order.
    rot=N: each read lands where the product's would, in N rotating 16 MiB chunk buffers (else
    in the slot's own ``block`` bytes)."""
    import ctypes
    import mmap
    import platform
    nr = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}[platform.machine()]
    SETUP, DESTROY, GETEVENTS, SUBMIT = nr
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long

    class Iocb(ctypes.Structure):
        _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                    ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                    ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                    ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]

    class Event(ctypes.Structure):
        _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                    ("res2", ctypes.c_int64)]

    ctx = ctypes.c_ulong(0)
    if syscall(SETUP, depth, ctypes.byref(ctx)) != 0:
        raise OSError(ctypes.get_errno(), "io_setup")
    span = rot * (16 << 20) if rot else depth * block
    if pin:
        import torch
        pool = torch.empty(span, dtype=torch.uint8, pin_memory=True)
        base = pool.data_ptr()
    else:
        pool = mmap.mmap(-1, span)
        base = ctypes.addressof(ctypes.c_char.from_buffer(pool))
    if own_fds:  # opened as the product opens them (its checks, the page-cache sample)
        from ckptmgr.storage.posix import open_direct
        opened = {p: open_direct(p) for p in files}
        if any(f is None for f in opened.values()):
            raise RuntimeError("open_direct refused a file (in the page cache?)")
        fds = {p: f.direct_fd for p, f in opened.items()}
    else:
        fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in files}
    jobs = [(fds[p], off, min(block, -(-recs[p]["size"] // ALIGN) * ALIGN - off)) for p in files
            for off in range(0, recs[p]["size"], block)]
    chunk_of, c = [], -1  # per job: the running number of its 16 MiB chunk
    for _, off, _ in jobs:
        c += off % (16 << 20) == 0
        chunk_of.append(c)
    iocbs = (Iocb * depth)()
    ptrs = (ctypes.POINTER(Iocb) * depth)()
    events = (Event * depth)()
    nxt = 0
    inflight = 0
    total = 0

    def fill(slot):
        nonlocal nxt
        fd, off, n = jobs[nxt]
        cb = iocbs[slot]
        cb.data = slot
        cb.opcode = 0
        cb.fildes = fd
        cb.buf = (base + (chunk_of[nxt] % rot) * (16 << 20) + off % (16 << 20)) if rot else base + slot * block
        nxt += 1
        cb.nbytes = n
        cb.offset = off

    first = min(depth, len(jobs))
    for i in range(first):
        fill(i)
        ptrs[i] = ctypes.pointer(iocbs[i])
    if sep:
        for j in range(first):
            if syscall(SUBMIT, ctx, 1, ctypes.byref(ptrs, j * ctypes.sizeof(ctypes.c_void_p))) != 1:
                raise OSError(ctypes.get_errno(), "io_submit")
    elif syscall(SUBMIT, ctx, first, ptrs) != first:
        raise OSError(ctypes.get_errno(), "io_submit")
    inflight = first
    while inflight:
        a = time.perf_counter()
        got = syscall(GETEVENTS, ctx, 1, depth, events, None)
        TRACE["reap_s"] += time.perf_counter() - a
        TRACE["reaps"] += 1
        TRACE["events"] += max(got, 0)
        if got < 0:
            raise OSError(ctypes.get_errno(), "io_getevents")
        inflight -= got
        k = 0
        for j in range(got):
            ev = events[j]
            if ev.res < 0:
                raise OSError(-ev.res, "aio read")
            total += ev.res
            if nxt < len(jobs):
                slot = ev.data
                fill(slot)
                ptrs[k] = ctypes.pointer(iocbs[slot])
                k += 1
        if k and sep:
            for j in range(k):
                if syscall(SUBMIT, ctx, 1, ctypes.byref(ptrs, j * ctypes.sizeof(ctypes.c_void_p))) != 1:
                    raise OSError(ctypes.get_errno(), "io_submit")
            inflight += k
        elif k:
            if syscall(SUBMIT, ctx, k, ptrs) != k:
                raise OSError(ctypes.get_errno(), "io_submit")
            inflight += k
    syscall(DESTROY, ctx)
    if own_fds:
        for f in opened.values():
            f.close()
    else:
        for fd in fds.values():
            os.close(fd)
    return total


_POLY = 0x82F63B78  # CRC-32C, reflected


def _gf2_times(mat, vec):
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_powers(n=48):
    m = [_POLY] + [1 << (i - 1) for i in range(1, 32)]  # the operator of one zero bit
    for _ in range(3):
        m = [_gf2_times(m, m[j]) for j in range(32)]  # squared three times: one zero byte
    out = [m]
    for _ in range(n - 1):
        out.append([_gf2_times(out[-1], out[-1][j]) for j in range(32)])
    return out  # out[k]: the operator of 2**k zero bytes


_GF2_POW = []
_COMBINE_TABLES = {}


def crc_combine(crc_a, crc_b, len_b):
    """CRC-32C of A+B from those of A and of B (len_b bytes): zlib's crc32_combine for CRC-32C,
    with byte tables for the lengths asked for most."""
    if not _GF2_POW:
        _GF2_POW.extend(_gf2_powers())

    def shift(crc, n):
        k = 0
        while n:
            if n & 1:
                crc = _gf2_times(_GF2_POW[k], crc)
            n >>= 1
            k += 1
        return crc
    t = _COMBINE_TABLES.get(len_b)
    if t is None:
        if len_b % (64 << 10):
            return shift(crc_a, len_b) ^ crc_b
        cols = [shift(1 << j, len_b) for j in range(32)]
        t = _COMBINE_TABLES[len_b] = [[_gf2_times(cols[8 * k:8 * k + 8], b) for b in range(256)] for k in range(4)]
    return t[0][crc_a & 255] ^ t[1][(crc_a >> 8) & 255] ^ t[2][(crc_a >> 16) & 255] ^ t[3][crc_a >> 24] ^ crc_b


def land_read(files, recs, depth, block, slots, crc=True, copy_=True):
    """The whole restore's work with a small landing: ``depth`` O_DIRECT reads of ``block`` bytes
    in flight through Linux AIO, each into one of ``slots`` block-sized slots of one pinned region
    (taken in turn), each read in its own io_submit. A reap first resubmits into free slots, then
    each landed block gets its CRC32C (GIL released) and its copy to the device tensor on one
    stream, an event recorded after it; a slot is free again once its event has passed. A
    chunk's CRC is its blocks' CRCs combined in order, checked against the manifest."""
    import collections
    import ctypes
    import platform

    import crc32c
    import torch
    SETUP, DESTROY, GETEVENTS, SUBMIT = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}[platform.machine()]
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long

    class Iocb(ctypes.Structure):
        _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                    ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                    ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                    ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]

    class Event(ctypes.Structure):
        _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                    ("res2", ctypes.c_int64)]

    assert slots >= 2 * depth, "a reap resubmits before it lands: slots must cover two queues"
    device = "cuda" if CUDA else "cpu"
    dev = {p: torch.empty(recs[p]["size"], dtype=torch.uint8, device=device) for p in files}
    region = pinned(slots * block)
    base = region.data_ptr()
    arr = region.numpy()
    stream = torch.cuda.Stream() if CUDA else None
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in files}
    jobs = []  # (file, offset, bytes, chunk id, block within the chunk)
    chunk_ids = {}
    for p in files:
        size, cs = recs[p]["size"], recs[p]["chunk_size"]
        for off in range(0, size, block):
            ci = chunk_ids.setdefault((p, off // cs), len(chunk_ids))
            jobs.append((p, off, min(block, size - off), ci, (off % cs) // block))
    per_chunk = collections.Counter(j[3] for j in jobs)
    crcs = {ci: [None] * n for ci, n in per_chunk.items()}
    left = dict(per_chunk)
    key_of = {ci: key for key, ci in chunk_ids.items()}
    bad = []
    ctx = ctypes.c_ulong(0)
    if syscall(SETUP, depth, ctypes.byref(ctx)) != 0:
        raise OSError(ctypes.get_errno(), "io_setup")
    iocbs = (Iocb * depth)()
    ptrs = (ctypes.POINTER(Iocb) * depth)()
    for i in range(depth):
        ptrs[i] = ctypes.pointer(iocbs[i])
    events = (Event * depth)()
    free = collections.deque(range(slots))
    passing = collections.deque()  # (event, slot): landed, copy enqueued
    slot_of = [0] * depth  # aio tag -> landing slot
    job_of = [0] * depth
    nxt = 0

    def submit(tag):
        nonlocal nxt
        while not free:  # the oldest copy must have passed
            ev, sl = passing.popleft()
            ev.synchronize()
            free.append(sl)
        sl = free.popleft()
        p, off, n, _, _ = jobs[nxt]
        cb = iocbs[tag]
        cb.data, cb.opcode, cb.fildes = tag, 0, fds[p]
        cb.buf, cb.nbytes, cb.offset = base + sl * block, -(-n // ALIGN) * ALIGN, off
        slot_of[tag], job_of[tag] = sl, nxt
        nxt += 1
        a = time.perf_counter()
        if syscall(SUBMIT, ctx, 1, ctypes.byref(ptrs, tag * ctypes.sizeof(ctypes.c_void_p))) != 1:
            raise OSError(ctypes.get_errno(), "io_submit")
        TRACE["submit_s"] += time.perf_counter() - a
        TRACE["submits"] += 1

    inflight = 0
    for tag in range(min(depth, len(jobs))):
        submit(tag)
        inflight += 1
    while inflight:
        while passing and passing[0][0].query():
            free.append(passing.popleft()[1])
        a = time.perf_counter()
        got = syscall(GETEVENTS, ctx, 1, depth, events, None)
        TRACE["reap_s"] += time.perf_counter() - a
        TRACE["reaps"] += 1
        if got < 0:
            raise OSError(ctypes.get_errno(), "io_getevents")
        TRACE["events"] += got
        inflight -= got
        landed = []
        for j in range(got):
            tag, res = events[j].data, events[j].res
            landed.append((slot_of[tag], job_of[tag], res))
            if nxt < len(jobs):
                submit(tag)
                inflight += 1
        for sl, ji, res in landed:
            p, off, n, ci, bi = jobs[ji]
            if res < n:
                raise OSError(-res if res < 0 else 0, f"read {p}@{off}: {res}")
            src = arr[sl * block:sl * block + n]
            if crc:
                crcs[ci][bi] = crc32c.crc32c(src, 0, 1), n
            if copy_:
                if stream is None:
                    dev[p][off:off + n].copy_(region[sl * block:sl * block + n])
                    free.append(sl)
                else:
                    with torch.cuda.stream(stream):
                        dev[p][off:off + n].copy_(region[sl * block:sl * block + n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    passing.append((ev, sl))
            else:
                free.append(sl)
            left[ci] -= 1
            if crc and not left[ci]:
                value, _ = crcs[ci][0]
                for c, length in crcs[ci][1:]:
                    value = crc_combine(value, c, length)
                fp, idx = key_of[ci]
                if f"{value:08x}" != recs[fp]["crc32c"][idx]:
                    bad.append((fp, idx))
    syscall(DESTROY, ctx)
    for fd in fds.values():
        os.close(fd)
    if stream is not None:
        stream.synchronize()
    if bad:
        raise SystemExit(f"bad chunks {bad[:3]}")
    return dev


def sysinfo():
    """What of the machine might decide how a disk's DMA lands: bounce buffers, guest kind."""
    lines = []
    for cmd in (["sh", "-c", "dmesg 2>/dev/null | grep -i -m5 -e swiotlb -e 'memory encryption' -e tdx -e sev"],
                ["sh", "-c", "grep -o -m1 -w -e tdx_guest -e sev -e sev_es -e sev_snp -e hypervisor /proc/cpuinfo"],
                ["sh", "-c", "cat /sys/kernel/debug/swiotlb/io_tlb_nslabs /sys/kernel/debug/swiotlb/io_tlb_used "
                             "2>/dev/null"],
                ["sh", "-c", "for f in max_segments max_segment_size max_sectors_kb nr_requests; do "
                             "echo $f $(cat /sys/block/vda/queue/$f 2>/dev/null); done; "
                             "echo queues $(ls /sys/block/vda/mq 2>/dev/null | wc -l)"],
                ["sh", "-c", "cat /sys/kernel/mm/transparent_hugepage/enabled; "
                             "grep -i -e virtio -e nvme /proc/interrupts | grep -v -e config -e balloon -e input "
                             "| cut -c1-200 | head -8; ls /sys/devices/system/node | grep -c node"]):
        try:
            lines.append(subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip())
        except (OSError, subprocess.SubprocessError) as exc:
            lines.append(f"{cmd}: {exc}")
    return "\n".join(lines)


def drop(files):
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


MODES = ["fst", "ckptmgr", "proto-chunk 12", "proto-chunk 16", "proto-window 16 512 4", "proto-window 16 512 8",
         "proto-window 16 1024 6", "proto-window 32 512 6", "proto-window 12 2048 6"]


def main():
    if sys.argv[1] == "child":
        print("RESULT " + json.dumps(child(sys.argv[2], sys.argv[3])))
        return
    d, out, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    modes = sys.argv[4].split(",") if len(sys.argv) > 4 else MODES
    import shutil
    sys.path.insert(0, "benchmarks")
    from bench_staging import make_state

    from ckptmgr import CheckpointManager, StagingOptions
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    state = make_state(float(os.environ.get("CW_GIB", "4")), "cpu", n_tensors=150)
    with CheckpointManager(os.path.join(d, "root"), staging=StagingOptions(local_tier=False)) as m:
        m.save(1, state).result()
    del state
    step_dir = os.path.join(d, "root", "step_000000000001")
    files = sorted(os.path.join(step_dir, n) for n in os.listdir(step_dir) if n.endswith(".safetensors"))
    size = sum(os.path.getsize(p) for p in files)
    print(f"{len(files)} files {size / 1e9:.2f} GB", flush=True)
    print(sysinfo(), flush=True)
    res = {}
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        if r % 2:
            order = order[::-1]
        for mode in order:
            drop(files)
            env = dict(os.environ)
            pkg = [kv[4:] for kv in mode.split() if kv.startswith("PKG=")]
            if pkg:
                env["PYTHONPATH"] = os.path.abspath(pkg[0]) + ":" + env.get("PYTHONPATH", "")
            p = subprocess.run([sys.executable, __file__, "child", mode, step_dir], capture_output=True, text=True,
                               timeout=120, env=env)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if os.environ.get("CW_ERR"):
                print(p.stderr[-int(os.environ["CW_ERR"]):], flush=True)
            if not line:
                print(f"  {mode}: failed {p.stderr[-600:]}", flush=True)
                continue
            x = json.loads(line[0][7:])
            res.setdefault(mode, []).append(x)
            fr = f" first read {x['first_read']*1e3:.0f} ms" if x.get("first_read") else ""
            tr = x.get("trace") or {}
            tr_s = (f" | reap {tr['reap_s']:.3f} s x{tr['reaps']} ({tr['events'] / max(tr['reaps'], 1):.1f}/reap)"
                    f" submit {tr['submit_s']:.3f} s x{tr['submits']}"
                    + (f" loop {tr['loop_begin']:.3f}-{tr['loop_end']:.3f} restored {tr['restored']:.3f}"
                       f" closed {tr['closed']:.3f}" if "loop_end" in tr else "")) if tr.get("reaps") else ""
            print(f"  r{r} {mode:26s} {x['s']:.3f} s = {size / x['s'] / 1e9:.2f} GB/s{fr}{tr_s}", flush=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    print("median s (GB/s) [runs]:")
    for k, v in sorted(res.items(), key=lambda kv: sorted(x["s"] for x in kv[1])[len(kv[1]) // 2]):
        s = sorted(x["s"] for x in v)
        med = s[len(s) // 2]
        print(f"  {k:26s} {med:.3f} ({size / med / 1e9:.2f})  {[round(x['s'], 3) for x in v]}")
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
