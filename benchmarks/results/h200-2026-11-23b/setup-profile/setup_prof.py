"""Where the every-25 coalesce+device overhead goes: GPU step times from CUDA events, and
host-side marks of ckptmgr's set-up work on one clock.

    python setup_prof.py VARIANT OUT.json     # from the repository root, on a GPU

VARIANT: ``none`` (no checkpoints), ``current`` (the installed ckptmgr), ``prepared`` (every
slot made before the timed window), ``chunk`` (pages populated 16 MiB per madvise call),
``chunk2`` (the same, two files made at a time), ``parpop`` (each file populated by 8
threads), ``pause10`` (10 ms between pinned pieces). The JSON files beside this script are
its output on H200s, two calls (``first-call/`` and the others), both at 9e31887: one
``madvise`` call per file, which ``chunk`` replaces by one per 16 MiB.
"""
import itertools
import json
import os
import shutil
import sys
import threading
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_training import Linear24

from ckptmgr import (
    CheckpointManager,
    StagingOptions,
    _cuda,
)
from ckptmgr.save import buffers, slots, staging

variant = sys.argv[1]
out = sys.argv[2]
T0 = time.perf_counter()
marks = []
mu = threading.Lock()


def mark(what, t0, t1, **kw):
    with mu:
        marks.append({"what": what, "t0": t0 - T0, "t1": t1 - T0, "thread": threading.current_thread().name, **kw})


def wrap(obj, name, label=None, **kw):
    real = getattr(obj, name)

    def f(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            mark(label or name, t0, time.perf_counter(), **kw)
    setattr(obj, name, f)


wrap(buffers.HostBuffer, "populate")
wrap(buffers.HostBuffer, "pin")
wrap(_cuda, "host_register")
wrap(slots.SlotPool, "acquire")
wrap(slots.SlotPool, "prepare", "pool.prepare")
wrap(staging.Stager, "stage")
wrap(staging.Stager, "reserve")
wrap(staging.StagingJob, "wait_safe")
wrap(slots.SlotPool, "_make")

if variant == "pause10":
    buffers.PIN_PAUSE_S = 0.010
if variant == "parpop":
    from concurrent.futures import ThreadPoolExecutor
    real_pop = buffers._populate
    PAGE = 4096

    def par_populate(ptr, nbytes, tensor):
        part = max(256 << 20, -(-nbytes // 8))
        part -= part % PAGE
        jobs = [(ptr + i, min(part, nbytes - i), tensor[i:i + part]) for i in range(0, nbytes, part)]
        with ThreadPoolExecutor(len(jobs)) as ex:
            list(ex.map(lambda j: real_pop(*j), jobs))
    buffers._populate = par_populate
if variant.startswith("chunk"):
    real_pop2 = buffers._populate
    P = 16 << 20

    def chunk_populate(ptr, nbytes, tensor):
        for i in range(0, nbytes, P):
            real_pop2(ptr + i, min(P, nbytes - i), tensor[i:i + P])
    buffers._populate = chunk_populate
if variant == "chunk2":
    RealPool = slots.DaemonPool

    def capped(n, thread_name_prefix=""):
        return RealPool(min(n, 2), thread_name_prefix=thread_name_prefix)
    slots.DaemonPool = capped
if variant == "pieces16":
    buffers.PIN_PIECE_BYTES = 16 << 20

torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
dim = 4096 if dev == "cuda" else 256
model = Linear24(dim, 24).to(dev)
batch = torch.randn(1024 if dev == "cuda" else 64, dim, device=dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
if dev == "cpu":  # (a smoke test of this script)
    class _E:
        def __init__(self, **k): self.t = 0.0
        def record(self): self.t = time.perf_counter()
        def elapsed_time(self, o): return (o.t - self.t) * 1000
    torch.cuda.Event = _E
    torch.cuda.synchronize = lambda: None
root = "/var/tmp/setup-prof/root"
shutil.rmtree("/var/tmp/setup-prof", ignore_errors=True)
os.makedirs(root)
mgr = None
if variant != "none":
    mgr = CheckpointManager(root, staging=StagingOptions(slots=3, device_buffer_bytes=64 << 30))


def step_fn(step, pending):
    loss = model(batch).square().mean()
    loss.backward()
    if pending is not None:
        t0 = time.perf_counter()
        pending.wait_staged()
        mark("wait_staged", t0, time.perf_counter(), step=step)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if mgr is not None and step % 25 == 0:
        t0 = time.perf_counter()
        h = mgr.save(step, {"model": model, "optim": opt, "step": step}, block=False)
        mark("save", t0, time.perf_counter(), step=step)
        return h
    return None


for _ in range(5):
    step_fn(0 if mgr is None else -1, None)
torch.cuda.synchronize()
events = []
host = []
t_start = time.perf_counter()
ev0 = torch.cuda.Event(enable_timing=True)
ev0.record()
if mgr is not None:
    if variant == "prepared":
        mgr.prepare({"model": model, "optim": opt, "step": 0})
        mgr.wait(timeout=60)  # (the floor: set-up done before the window)
        torch.cuda.synchronize()
        t_start = time.perf_counter()
        ev0 = torch.cuda.Event(enable_timing=True)
        ev0.record()
    else:
        t0 = time.perf_counter()
        mgr.prepare({"model": model, "optim": opt, "step": 0})
        mark("mgr.prepare", t0, time.perf_counter())
pending = None
for step in range(1, 201):
    host.append(time.perf_counter() - T0)
    pending = step_fn(step, pending)
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    events.append(e)
torch.cuda.synchronize()
total = time.perf_counter() - t_start
gpu = [ev0.elapsed_time(e) / 1000 for e in events]
gpu_steps = [gpu[0]] + [b - a for a, b in itertools.pairwise(gpu)]
if mgr is not None:
    stats = mgr.stats()
    mgr.close()
else:
    stats = None
res = {"variant": variant, "total_s": total, "host_step_t": host, "gpu_step_s": gpu_steps, "marks": marks,
       "stats": stats, "t_start": t_start - T0}
with open(out, "w") as f:
    json.dump(res, f)
slow = [(i + 1, round(x * 1000)) for i, x in enumerate(gpu_steps) if x > 0.0535]
print(f"{variant}: total {total:.3f} s, {total / 200 * 1000:.2f} ms/step; slow GPU steps {slow}")
agg = {}
for m in marks:
    a = agg.setdefault(m["what"], [0, 0.0, 1e9, 0])
    a[0] += 1
    a[1] += m["t1"] - m["t0"]
    a[2] = min(a[2], m["t0"])
    a[3] = max(a[3], m["t1"])
for k, (n, s, first, last) in agg.items():
    print(f"  {k:14s} n={n:4d} sum={s:.3f}s  span {first:.2f}..{last:.2f}")
