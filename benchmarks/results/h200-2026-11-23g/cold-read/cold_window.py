"""The cold-read harness of ``../../h200-2026-11-23f/cold-read/cold_window.py`` (every mode of
it, run by it) with two more, for the next call:

    python benchmarks/results/h200-2026-11-23g/cold-read/cold_window.py DIR OUT.json ROUNDS [MODES]
    python benchmarks/results/h200-2026-11-23g/cold-read/cold_window.py child MODE STEP_DIR   (internal)

ckptmgr CIF=N [opts]: the product with N chunk buffers instead of 6 (and the -23f options).
land D B S [crc=0] [copy=0]: the whole restore's work with a small landing (land_read): D reads
   of B KiB in flight into S block slots of one pinned region, each landed block checksummed and
   copied to the device at once, a chunk's CRC combined from its blocks'.

Before the runs it prints the machine's facts that could make where reads land matter
(sysinfo): bounce buffering, the kind of guest, the disk's queues and segments, huge pages.
"""
import importlib.util
import json
import os
import subprocess
import sys
import time

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "h200-2026-11-23f", "cold-read",
                     "cold_window.py")
_spec = importlib.util.spec_from_file_location("cold_window_23f", _BASE)
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
base.__file__ = os.path.abspath(__file__)  # its runs start this script's children


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
    in flight through ckptmgr's AIO context (each read in its own io_submit), each into one of
    ``slots`` block-sized slots of one pinned region (taken in turn). A reap first resubmits into
    free slots, then each landed block gets its CRC32C (GIL released) and its copy to the device
    tensor on one stream, an event recorded after it; a slot is free again once its event has
    passed. A chunk's CRC is its blocks' CRCs combined in order, checked against the manifest."""
    import collections

    import crc32c
    import torch

    from ckptmgr.storage.aio import open_context

    assert slots >= 2 * depth, "a reap resubmits before it lands: slots must cover two queues"
    trace = base.TRACE
    dev = {p: torch.empty(recs[p]["size"], dtype=torch.uint8, device="cuda" if base.CUDA else "cpu") for p in files}
    region = base.pinned(slots * block)
    address = region.data_ptr()
    arr = region.numpy()
    stream = torch.cuda.Stream() if base.CUDA else None
    jobs = []  # (file, offset, bytes, chunk id, block within the chunk)
    chunk_ids = {}
    for p in files:
        size, cs = recs[p]["size"], recs[p]["chunk_size"]
        for off in range(0, size, block):
            ci = chunk_ids.setdefault((p, off // cs), len(chunk_ids))
            jobs.append((p, off, min(block, size - off), ci, (off % cs) // block))
    left = collections.Counter(j[3] for j in jobs)  # per chunk: blocks not yet landed
    crcs = {ci: [None] * n for ci, n in left.items()}  # per chunk: (CRC, bytes) of each block
    key_of = {ci: key for key, ci in chunk_ids.items()}
    bad = []
    aio = open_context(depth)
    if aio is None:
        raise OSError("no AIO context on this system")
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in files}
    free = collections.deque(range(slots))
    passing = collections.deque()  # (event, slot): landed, copy enqueued
    slot_of, job_of = [0] * depth, [0] * depth  # per aio tag: its landing slot and its job
    nxt = 0

    def submit(tag):
        nonlocal nxt
        while not free:  # the oldest copy must have passed
            ev, sl = passing.popleft()
            ev.synchronize()
            free.append(sl)
        sl = free.popleft()
        p, off, n, _, _ = jobs[nxt]
        slot_of[tag], job_of[tag] = sl, nxt
        nxt += 1
        a = time.perf_counter()
        aio.submit_one(tag, fds[p], off, -(-n // base.ALIGN) * base.ALIGN, address + sl * block)
        trace["submit_s"] += time.perf_counter() - a
        trace["submits"] += 1

    try:
        inflight = 0
        for tag in range(min(depth, len(jobs))):
            submit(tag)
            inflight += 1
        while inflight:
            while passing and passing[0][0].query():
                free.append(passing.popleft()[1])
            a = time.perf_counter()
            done = aio.reap(60.0)
            trace["reap_s"] += time.perf_counter() - a
            trace["reaps"] += 1
            trace["events"] += len(done)
            inflight -= len(done)
            landed = []
            for tag, res in done:
                landed.append((slot_of[tag], job_of[tag], res))
                if nxt < len(jobs):
                    submit(tag)
                    inflight += 1
            for sl, ji, res in landed:
                p, off, n, ci, bi = jobs[ji]
                if res < n:
                    raise OSError(-res if res < 0 else 0, f"read {p}@{off}: {res}")
                if crc:
                    crcs[ci][bi] = crc32c.crc32c(arr[sl * block:sl * block + n], 0, 1), n
                if not copy_:
                    free.append(sl)
                elif stream is None:
                    dev[p][off:off + n].copy_(region[sl * block:sl * block + n])
                    free.append(sl)
                else:
                    with torch.cuda.stream(stream):
                        dev[p][off:off + n].copy_(region[sl * block:sl * block + n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    passing.append((ev, sl))
                left[ci] -= 1
                if crc and not left[ci]:
                    value, _ = crcs[ci][0]
                    for c, length in crcs[ci][1:]:
                        value = crc_combine(value, c, length)
                    fp, idx = key_of[ci]
                    if f"{value:08x}" != recs[fp]["crc32c"][idx]:
                        bad.append((fp, idx))
    finally:
        aio.close()  # waits for what is still in flight
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


def child(mode, step_dir):
    if not mode.startswith("land"):
        opts = dict(kv.split("=") for kv in mode.split()[1:] if "=" in kv)
        if mode.startswith("ckptmgr") and "CIF" in opts:  # chunk buffers a step's reads rotate through
            import ckptmgr.restore.loaders.ring as rg
            rg.CHUNKS_IN_FLIGHT = int(opts["CIF"])
        return base.child(mode, step_dir)
    import torch
    if base.CUDA:
        torch.cuda.init()
        torch.empty(1, device="cuda")
    files = sorted(os.path.join(step_dir, n) for n in os.listdir(step_dir) if n.endswith(".safetensors"))
    with open(os.path.join(step_dir, "manifest.json")) as f:
        recs = {os.path.join(step_dir, k): v for k, v in json.load(f)["files"].items()}
    _, depth, kib, slots, *rest = mode.split()
    knobs = dict(kv.split("=") for kv in rest)
    t = time.perf_counter()
    out = land_read(files, recs, int(depth), int(kib) * base.K, int(slots), crc=knobs.get("crc", "1") == "1",
                    copy_=knobs.get("copy", "1") == "1")
    if base.CUDA:
        torch.cuda.synchronize()
    took = time.perf_counter() - t
    n = sum(v.numel() * v.element_size() for v in out.values())
    return {"s": took, "bytes": n, "first_read": None, "trace": base.TRACE}


def main():
    if sys.argv[1] == "child":
        print("RESULT " + json.dumps(child(sys.argv[2], sys.argv[3])))
        return
    print(sysinfo(), flush=True)
    base.main()


if __name__ == "__main__":
    main()
