"""Lightning on a GPU: what checkpointing costs the training loop, per CheckpointIO plugin.

    python benchmarks/bench_lightning.py --width 8192 --layers 4 --steps 60 --every 20 --repeat 3
    python benchmarks/bench_lightning.py --quick            # a small CPU run, to check the script

One model (an MLP of ``--layers`` square layers, AdamW: the checkpoint is about 3x the
parameters), one Trainer per plugin in the same run: no checkpointing, Lightning's default
TorchCheckpointIO, Lightning's AsyncCheckpointIO, and ckptmgr's CkptmgrCheckpointIO.
ModelCheckpoint saves every ``--every`` steps keeping the newest one, to local disk. Each
(plugin, round) runs in a fresh process after an untimed warm-up fit, the order rotated each
round, for ``--repeat`` rounds; overheads are against the run without checkpoints of the
same round.

Per plugin it reports:

* ``train_s``: the training steps, from the first step to the end of the last (every save's
  cost to the loop is in here, the first one's too: creating and pinning staging memory);
* ``teardown_s``: from the end of training to the end of ``fit``: the wait for the last
  writes to become durable (time-to-durable, which every asynchronous tool pays once);
* ``save_call_s``: the time inside each ``save_checkpoint`` call (the stall the step sees
  directly; an asynchronous plugin's later waits, such as ckptmgr's fence before the next
  optimizer step, show up in ``train_s``);
* step-time overhead: ``train_s`` against the run without checkpoints; overhead per save;
* peak GPU memory (``torch.cuda.max_memory_allocated``).

Prints a table and writes JSON: ``--out``, default ``$OUT/lightning.json`` when OUT is set, else
benchmarks/out/lightning.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from ckptmgr.integrations.lightning import CkptmgrCheckpointIO


class MLP(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-6)


class Clock(pl.Callback):
    """Marks the start of the first step and the end of training (before teardown)."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.start = self.end = 0.0

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.start = self._now()

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.end = self._now()


def timed(plugin: Any, calls: list[float]) -> Any:
    """Record the time of each save_checkpoint call of ``plugin``."""
    inner = plugin.save_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        try:
            inner(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - t)

    plugin.save_checkpoint = save_checkpoint
    return plugin


def fit(make: Any, args: argparse.Namespace, d: str, gpu: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLP(args.width, args.layers)
    x = torch.randn(args.batch, args.width)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=args.batch)
    calls: list[float] = []
    plugin = timed(make(), calls) if callable(make) else None
    clock = Clock(gpu)
    callbacks: list[pl.Callback] = [clock]
    if make is not False:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=d, every_n_train_steps=args.every, save_top_k=1,
                                                      save_last=False))
    trainer = pl.Trainer(max_steps=args.steps, accelerator="gpu" if gpu else "cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         enable_checkpointing=make is not False, plugins=[plugin] if plugin is not None else None)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    trainer.fit(model, data)
    if gpu:
        torch.cuda.synchronize()
    end = time.perf_counter()
    return {"fit_s": end - t, "train_s": clock.end - clock.start, "teardown_s": end - clock.end,
            "saves": len(calls), "save_call_s": calls,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0}


PLUGINS: dict[str, Any] = {
    "no checkpointing": False,
    "TorchCheckpointIO (Lightning default)": TorchCheckpointIO,
    "AsyncCheckpointIO(TorchCheckpointIO)": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
    "CkptmgrCheckpointIO": CkptmgrCheckpointIO,
}


def child(name: str, args: argparse.Namespace, gpu: bool) -> None:
    """One plugin's fit in this (fresh) process, after an untimed warm-up fit without
    checkpoints (CUDA context, kernels, allocator); prints one JSON line."""
    d = os.path.join(args.dir, "run")
    fit(False, args, d, gpu)
    shutil.rmtree(d, ignore_errors=True)
    r = fit(PLUGINS[name], args, d, gpu)
    shutil.rmtree(d, ignore_errors=True)
    print("RESULT " + json.dumps(r), flush=True)


def _report(args: argparse.Namespace, rounds: list[dict[str, dict[str, Any]]], gpu: bool,
            names: list[str]) -> None:
    """Print the table of the rounds so far and write the JSON."""
    params = args.layers * (args.width * args.width + args.width)
    saves = args.steps // args.every
    ckpt_gib = params * 4 * 3 / 2**30
    where = torch.cuda.get_device_name() if gpu else f"CPU ({os.cpu_count()} cores)"

    def med(name: str, key: str) -> float:
        return statistics.median(rd[name][key] for rd in rounds)

    def spread(name: str, key: str, fmt: str) -> str:
        vals = [rd[name][key] for rd in rounds]
        return format(statistics.median(vals), fmt) + (f" ({format(min(vals), fmt)}..{format(max(vals), fmt)})"
                                                       if len(vals) > 1 else "")

    lines = [f"{params / 1e6:.0f} M parameters, fp32 + AdamW (checkpoint {ckpt_gib:.2f} GiB), {args.steps} steps, "
             f"a save every {args.every} ({saves} saves) to {args.dir}; {where}; median (range) of {args.repeat} "
             "round(s), each plugin in a fresh process, order rotated", "",
             "| CheckpointIO | train s | step-time overhead | per save s | save call s (first / later) | "
             "teardown s (time-to-durable) | peak GPU GiB |",
             "|---|---|---|---|---|---|---|"]
    summary: dict[str, dict[str, float]] = {}
    for name in names:
        firsts = [rd[name]["save_call_s"][0] for rd in rounds if rd[name]["save_call_s"]]
        laters = [c for rd in rounds for c in rd[name]["save_call_s"][1:]]
        first = statistics.median(firsts) if firsts else 0.0
        later = statistics.median(laters) if laters else 0.0
        summary[name] = {"train_s": med(name, "train_s"), "step_overhead": med(name, "step_overhead"),
                         "per_save_s": med(name, "per_save_s"), "first_save_call_s": first,
                         "later_save_call_s": later, "teardown_s": med(name, "teardown_s"),
                         "peak_gpu_gib": med(name, "peak_gpu_gib")}
        lines.append(f"| {name} | {spread(name, 'train_s', '.2f')} | {spread(name, 'step_overhead', '+.1%')} | "
                     f"{spread(name, 'per_save_s', '.3f')} | {first:.3f} / {later:.3f} | "
                     f"{spread(name, 'teardown_s', '.2f')} | {med(name, 'peak_gpu_gib'):.2f} |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "checkpoint_gib": ckpt_gib, "summary": summary, "rounds": rounds,
                   "device": where, "torch": torch.__version__, "lightning": pl.__version__,
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each plugin runs once per round")
    ap.add_argument("--quick", action="store_true", help="a small model on the CPU (checks the script, not the GPU)")
    ap.add_argument("--dir", default="/var/tmp/ckptmgr-bench-lightning")
    default_out = os.path.join(os.environ["OUT"], "lightning.json") if os.environ.get("OUT") else \
        os.path.join(os.path.dirname(__file__), "out", "lightning.json")
    ap.add_argument("--out", default=default_out)
    ap.add_argument("--plugins", default=None,
                    help="comma-separated subset of the plugins to measure (default: all); "
                         "'no checkpointing', the baseline, always runs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.width, args.layers, args.batch, args.steps, args.every = 1024, 4, 256, 12, 4
        args.repeat = min(args.repeat, 1)
    gpu = torch.cuda.is_available() and not args.quick
    if args.child:
        child(args.child, args, gpu)
        return
    names = list(PLUGINS)
    if args.plugins:
        chosen = {n.strip() for n in args.plugins.split(",") if n.strip()}
        unknown = chosen - set(PLUGINS)
        if unknown:
            raise SystemExit(f"unknown plugins {sorted(unknown)}; choose from {list(PLUGINS)}")
        names = [n for n in PLUGINS if n == "no checkpointing" or n in chosen]
    rounds: list[dict[str, dict[str, Any]]] = []
    passthrough = [a for a in sys.argv[1:] if a != "--quick"]
    if args.quick:
        passthrough += ["--width", "1024", "--layers", "4", "--batch", "256", "--steps", "12", "--every", "4"]
    for k in range(args.repeat):
        order = names[k % len(names):] + names[:k % len(names)]  # rotated each round
        got: dict[str, dict[str, Any]] = {}
        for name in order:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), *passthrough, "--child", name],
                               capture_output=True, text=True, env={**os.environ, "CUDA_MODULE_LOADING": "LAZY"})
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if p.returncode != 0 or line is None:
                raise SystemExit(f"{name} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
            got[name] = r = json.loads(line[len("RESULT "):])
            print(f"  round {k + 1} {name}: train {r['train_s']:.2f} s, teardown {r['teardown_s']:.2f} s, save calls "
                  f"{[round(c, 3) for c in r['save_call_s']]}, peak GPU {r['peak_gpu_gib']:.2f} GiB", flush=True)
        for name in names:
            r = got[name]
            base = got["no checkpointing"]["train_s"]
            r["step_overhead"] = (r["train_s"] - base) / base
            r["per_save_s"] = (r["train_s"] - base) / r["saves"] if r["saves"] else 0.0
        rounds.append(got)
        _report(args, rounds, gpu, names)  # after every round: a stopped run keeps its rounds


if __name__ == "__main__":
    main()
