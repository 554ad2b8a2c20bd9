"""A timeline of one save inside a training loop: where the time goes, thread by thread.

    python benchmarks/bench_timeline.py --out $OUT/timeline          # GPU: Linear(4096) x 24 + AdamW
    python benchmarks/bench_timeline.py --device cpu --dim 512 --layers 8 --out /tmp/tl

A training loop (the ``linear`` model of bench_training.py: ``--layers`` x Linear(``--dim``),
fused AdamW on the GPU) runs ``--steps`` steps and saves once, at ``--save-at``, with
``save(block=False)`` and ``wait_staged()`` before the next ``optimizer.step()`` (the overlap
pattern), after a first save at start-up that pays the one-time costs. While it runs, a
sampler reads every Python thread's CPU clock every ``--sample-ms`` milliseconds and groups
the threads by name (the training thread, ckptmgr's copy, local-tier, checksum, I/O and
persist threads). Recorded on one clock:

* each training step's start and end (the GPU synchronized at each step's end, so a step's
  time is its real time);
* the save's phases from its ``SaveInfo``: ``save()`` returning (``blocked_s``), the copy
  landed in host memory (``staging_s``, the GPU side stream's work), the local-tier commit
  (``local_s``), the durable commit (``total_s``);
* per thread group, the share of one core it used in each sample interval.

Prints the timeline as text (one row per thread group, one column per ``--bucket-ms``; the
darker the character the busier the group) with the phase marks and the step times around the
save, and writes ``timeline.json`` (and ``timeline.png`` when matplotlib is installed) under
``--out``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import torch

from ckptmgr import CheckpointManager

_GROUPS = [("ckptmgr-copy", "copy threads"), ("ckptmgr-local-crc", "local-tier checksums"),
           ("ckptmgr-local", "local-tier commit"), ("ckptmgr-io", "durable I/O + checksums"),
           ("ckptmgr-s3", "S3 uploads"), ("ckptmgr-persist", "persist thread"), ("MainThread", "training thread")]


def _group(name: str) -> str:
    for prefix, label in _GROUPS:
        if name.startswith(prefix):
            return label
    return "ckptmgr other" if name.startswith("ckptmgr") else "other"


def _cpu_by_thread() -> dict[str, float]:
    """CPU seconds of every Python thread so far (nanosecond clocks), by thread name."""
    out = {}
    for th in threading.enumerate():
        if th.ident is None:
            continue
        try:
            out[th.name] = time.clock_gettime(time.pthread_getcpuclockid(th.ident))
        except (OSError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return out


class Sampler:
    """CPU seconds of every thread group per interval, on the caller's clock."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []  # owned by the sampler thread until stop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        last, last_t = _cpu_by_thread(), time.perf_counter()
        while not self._stop.wait(self.interval):
            now, t = _cpu_by_thread(), time.perf_counter()
            busy: dict[str, float] = {}
            for name, cpu in now.items():
                g = _group(name)
                busy[g] = busy.get(g, 0.0) + (cpu - last.get(name, cpu)) / (t - last_t)
            busy.pop("other", None)
            self.samples.append((t, busy))
            last, last_t = now, t


class Linear(torch.nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-at", type=int, default=20)
    ap.add_argument("--dir", default=None, help="the durable root's parent (default: a temporary directory)")
    ap.add_argument("--sample-ms", type=float, default=5.0)
    ap.add_argument("--bucket-ms", type=float, default=50.0)
    ap.add_argument("--out", default="benchmarks/out/timeline")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    model = Linear(args.dim, args.layers).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x = torch.randn(args.batch, args.dim, device=args.device)
    base = tempfile.mkdtemp(prefix="ckptmgr-bench-timeline-", dir=args.dir)
    state = {"model": model, "optim": opt}
    steps: list[tuple[float, float]] = []
    marks: dict[str, float] = {}
    sampler = Sampler(args.sample_ms / 1000)
    try:
        with CheckpointManager(os.path.join(base, "ckpt")) as mgr:
            model(x).square().mean().backward()
            opt.step()  # the optimizer's state exists
            mgr.save(0, state).result()  # start-up: the one-time costs are paid here
            sync()
            sampler.start()
            pending = None
            for step in range(1, args.steps + 1):
                t = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                if pending is not None:
                    pending.wait_staged()
                opt.step()
                if step == args.save_at:
                    marks["save() called"] = time.perf_counter()
                    pending = handle = mgr.save(step, state, block=False)
                    marks["save() returned"] = time.perf_counter()
                sync()
                steps.append((t, time.perf_counter()))
            info = handle.result()
            mgr.wait()
            sampler.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    t0 = marks["save() called"]
    marks["copy landed in host memory"] = t0 + info.staging_s
    if info.local_s is not None:
        marks["local-tier commit"] = t0 + info.local_s
    marks["durable commit"] = t0 + info.total_s
    origin = steps[0][0]
    groups = sorted({g for _, b in sampler.samples for g in b}, key=lambda g: [lab for _, lab in _GROUPS].index(g)
                    if g in [lab for _, lab in _GROUPS] else 99)
    result: dict[str, Any] = {
        "bench": "timeline", "device": args.device, "gpu": torch.cuda.get_device_name() if cuda else None,
        "model": f"{args.layers} x Linear({args.dim}) + AdamW", "bytes": info.bytes, "save_at": args.save_at,
        "steps": [[a - origin, b - origin] for a, b in steps],
        "marks": {k: v - origin for k, v in marks.items()},
        "save_info": {k: getattr(info, k) for k in ("staging_s", "persist_s", "total_s", "blocked_s", "busy_wait_s",
                                                     "local_s")},
        "threads": {g: [[t - origin, b.get(g, 0.0)] for t, b in sampler.samples] for g in groups},
    }
    _print(result, args.bucket_ms / 1000)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "timeline.json"), "w") as f:
        json.dump(result, f, indent=1)
    _plot(result, os.path.join(args.out, "timeline.png"))


def _print(r: dict[str, Any], bucket: float) -> None:
    end = r["marks"]["durable commit"] + 0.2
    start = max(0.0, r["marks"]["save() called"] - 0.3)
    n = int((end - start) / bucket) + 1
    shades = " .:-=+*#%@"
    print(f"{r['model']}, {r['bytes'] / 1e9:.2f} GB, save at step {r['save_at']}; one column = {bucket * 1000:.0f} ms, "
          f"from t = {start:.2f} s")
    for g, series in r["threads"].items():
        cols = [0.0] * n
        counts = [0] * n
        for t, busy in series:
            i = int((t - start) / bucket)
            if 0 <= i < n:
                cols[i] += busy
                counts[i] += 1
        row = "".join(shades[min(9, int(c / max(k, 1) * 9 / 4 + 0.999)) if c else 0] for c, k in zip(cols, counts,
                                                                                                    strict=True))
        print(f"{g:>26} |{row}|")
    print(f"{'(busy: 4 cores = @)':>26}")
    for name, t in sorted(r["marks"].items(), key=lambda kv: kv[1]):
        print(f"{name:>26} at +{(t - r['marks']['save() called']) * 1000:8.1f} ms")
    durations = [b - a for a, b in r["steps"]]
    k = r["save_at"] - 1
    around = durations[max(0, k - 3):k + 6]
    print("step times around the save (ms):", " ".join(f"{d * 1000:.1f}" for d in around),
          f"| median of all {sorted(durations)[len(durations) // 2] * 1000:.1f}")


def _plot(r: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(11, 4))
    for i, (g, series) in enumerate(r["threads"].items()):
        ts = [t for t, _ in series]
        ax.fill_between(ts, [i] * len(ts), [i + min(b, 4) / 4 * 0.9 for _, b in series], step="post", label=g)
    for i, (a, b) in enumerate(r["steps"]):
        ax.plot([a, b], [-0.5, -0.5], lw=6, color="C7" if i % 2 else "C8", solid_capstyle="butt")
    for name, t in r["marks"].items():
        ax.axvline(t, color="k", lw=0.6, ls=":")
        ax.text(t, len(r["threads"]) + 0.1, name, rotation=30, fontsize=7)
    ax.set_yticks([-0.5, *range(len(r["threads"]))], ["training steps", *r["threads"]])
    ax.set_xlabel("seconds")
    ax.set_title(f"one save: {r['model']}, {r['bytes'] / 1e9:.2f} GB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
