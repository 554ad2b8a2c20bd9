"""Where the decoder every-10 overlap overhead goes: GPU step times from CUDA events, host
marks of ckptmgr's work on one clock, and (variant trace) a torch.profiler trace of a save.

    python prof_tmp/dec_prof.py VARIANT OUT.json
VARIANT: none | overlap | overlap2 | trace | nolocal
"""
import json
import os
import shutil
import sys
import threading
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_training import Decoder

from ckptmgr import CheckpointManager, StagingOptions
from ckptmgr import manager as manager_mod
from ckptmgr.save import saver, slots, staging

variant, out = sys.argv[1], sys.argv[2]
T0 = time.perf_counter()
marks = []
mu = threading.Lock()


def mark(what, t0, t1, **kw):
    with mu:
        marks.append({"what": what, "t0": t0 - T0, "t1": t1 - T0, "thread": threading.current_thread().name, **kw})


def wrap(obj, name, label=None):
    real = getattr(obj, name)

    def f(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            mark(label or name, t0, time.perf_counter())
    setattr(obj, name, f)


wrap(manager_mod.CheckpointManager, "_plan", "plan")
wrap(saver.Saver, "save", "saver.save")
wrap(slots.SlotPool, "acquire")
wrap(slots.SlotPool, "fit")
wrap(staging.Stager, "stage")
wrap(staging.StagingJob, "wait_safe")
wrap(saver, "persist")
wrap(saver, "commit_local")
wrap(slots.SlotPool, "_make")
wrap(slots.SlotPool, "_pin")

torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
vocab, dim, layers, heads, bsz, seq = (32000, 1024, 24, 16, 32, 1024) if dev == "cuda" else (1000, 64, 2, 4, 2, 16)
if dev == "cpu":  # (a smoke test of this script)
    class _E:
        def __init__(self, **k): self.t = 0.0
        def record(self): self.t = time.perf_counter()
        def elapsed_time(self, o): return (o.t - self.t) * 1000
    torch.cuda.Event = _E
    torch.cuda.synchronize = lambda: None
model = Decoder(vocab, dim, layers, heads).to(dev)
batch = torch.randint(0, vocab, (bsz, seq + 1), device=dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
amp = torch.autocast(device_type=dev, dtype=torch.bfloat16)
root = "/var/tmp/dec-prof/root"
shutil.rmtree("/var/tmp/dec-prof", ignore_errors=True)
os.makedirs(root)
mgr = None
if variant in ("overlap", "trace"):
    mgr = CheckpointManager(root, staging=StagingOptions(slots=1, local_dir="/dev/shm"))
elif variant == "overlap2":
    mgr = CheckpointManager(root, staging=StagingOptions(slots=2, local_dir="/dev/shm"))
elif variant == "nolocal":
    mgr = CheckpointManager(root, staging=StagingOptions(slots=1, local_tier=False))


def step_fn(step, pending):
    with amp:
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), batch[:, 1:].reshape(-1))
    loss.backward()
    if pending is not None:
        t0 = time.perf_counter()
        pending.wait_staged()
        mark("wait_staged", t0, time.perf_counter(), step=step)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if mgr is not None and step % 10 == 0:
        t0 = time.perf_counter()
        h = mgr.save(step, {"model": model, "optim": opt, "step": step}, block=False)
        mark("save", t0, time.perf_counter(), step=step)
        return h
    return None


for _ in range(6):
    step_fn(-1, None)
torch.cuda.synchronize()
events, host = [], []
ev0 = torch.cuda.Event(enable_timing=True)
ev0.record()
t_start = time.perf_counter()
if mgr is not None:
    t0 = time.perf_counter()
    mgr.prepare({"model": model, "optim": opt, "step": 0})
    mark("mgr.prepare", t0, time.perf_counter())
prof = None
pending = None
for step in range(1, 41):
    if variant == "trace" and step == 18:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    host.append(time.perf_counter() - T0)
    pending = step_fn(step, pending)
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    events.append(e)
    if prof is not None and step == 22:
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(out.replace(".json", ".trace.json"))
        prof = None
torch.cuda.synchronize()
total = time.perf_counter() - t_start
gpu_steps = []
prev = ev0
for e in events:
    gpu_steps.append(prev.elapsed_time(e) / 1000)
    prev = e
stats = None
if mgr is not None:
    stats = mgr.stats()
    mgr.close()
res = {"variant": variant, "total_s": total, "host_step_t": host, "gpu_step_s": gpu_steps, "marks": marks,
       "stats": stats, "t_start": t_start - T0}
with open(out, "w") as f:
    json.dump(res, f)
base = sorted(gpu_steps)[len(gpu_steps) // 2]
slow = [(i + 1, round(x * 1000)) for i, x in enumerate(gpu_steps) if x > base * 1.02]
print(f"{variant}: total {total:.3f} s, {total / 40 * 1000:.2f} ms/step (median GPU step {base * 1000:.1f} ms);"
      f" slow GPU steps {slow}; stats {stats}")
agg = {}
for m in marks:
    a = agg.setdefault(m["what"], [0, 0.0, 1e9, 0])
    a[0] += 1
    a[1] += m["t1"] - m["t0"]
    a[2] = min(a[2], m["t0"])
    a[3] = max(a[3], m["t1"])
for k, (n, s, first, last) in agg.items():
    print(f"  {k:14s} n={n:4d} sum={s:.3f}s  span {first - res['t_start']:.2f}..{last - res['t_start']:.2f}")
