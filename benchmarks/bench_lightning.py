"""Lightning on a GPU: what checkpointing costs the training loop, per CheckpointIO plugin.

    python benchmarks/bench_lightning.py --width 8192 --layers 4 --steps 60 --every 20

One process, one model (an MLP of ``--layers`` square layers, AdamW: the checkpoint is about
3x the parameters), one Trainer per plugin, ModelCheckpoint every ``--every`` steps keeping
the newest one, on local disk: no checkpointing at all, Lightning's default TorchCheckpointIO,
Lightning's AsyncCheckpointIO, and ckptmgr's CkptmgrCheckpointIO. Reports the time of the
fit (teardown included: every checkpoint is on disk when it ends), the overhead per save
against the run without checkpoints, and the peak GPU memory.
Prints a table and writes JSON (default benchmarks/out/lightning.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def fit(plugin: Any, args: argparse.Namespace, d: str) -> tuple[float, float]:
    torch.manual_seed(0)
    model = MLP(args.width, args.layers)
    x = torch.randn(args.batch, args.width)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=args.batch)
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=d, every_n_train_steps=args.every, save_top_k=1,
                                              save_last=False)] if plugin is not False else []
    trainer = pl.Trainer(max_steps=args.steps, accelerator="gpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         enable_checkpointing=plugin is not False,
                         plugins=[plugin] if plugin not in (None, False) else None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    trainer.fit(model, data)
    torch.cuda.synchronize()
    took = time.perf_counter() - t
    return took, torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--dir", default="/var/tmp/ckptmgr-bench-lightning")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "lightning.json"))
    args = ap.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    plugins: dict[str, Any] = {
        "no checkpointing": False,
        "TorchCheckpointIO (Lightning default)": None,
        "AsyncCheckpointIO(TorchCheckpointIO)": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
        "CkptmgrCheckpointIO": lambda: CkptmgrCheckpointIO(),
    }
    fit(False, args, args.dir)  # warm-up: CUDA context, kernels, allocator
    results: dict[str, dict[str, float]] = {}
    for name, make in plugins.items():
        shutil.rmtree(args.dir, ignore_errors=True)
        took, peak = fit(make() if callable(make) else make, args, args.dir)
        results[name] = {"fit_s": took, "peak_gpu_gib": peak}
        print(f"  {name}: fit {took:.2f} s, peak GPU {peak:.2f} GiB", flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    base = results["no checkpointing"]["fit_s"]
    saves = args.steps // args.every
    ckpt_gib = params * 4 * 3 / 2**30
    lines = [f"{params / 1e6:.0f} M parameters, fp32 + AdamW (checkpoint {ckpt_gib:.2f} GiB), {args.steps} steps, "
             f"a save every {args.every} ({saves} saves) to {args.dir}; {torch.cuda.get_device_name()}", "",
             "| CheckpointIO | fit s | overhead per save s | step-time overhead | peak GPU GiB |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        extra = r["fit_s"] - base
        lines.append(f"| {name} | {r['fit_s']:.2f} | {extra / saves if saves else 0:.3f} | "
                     f"{extra / base:+.1%} | {r['peak_gpu_gib']:.2f} |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "checkpoint_gib": ckpt_gib, "results": results,
                   "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
