"""Step-time overhead of checkpointing a training loop, ckptmgr against its peers.

    python benchmarks/bench_training.py --dir /path/on/disk

A ~350M-parameter decoder-only transformer (24 layers, d=1024, bf16 autocast) trains with
AdamW; every ``--every`` steps the model and optimizer state (~4 GiB) is checkpointed to
``--dir``. Each mode runs the same steps in the same process:

* ``none``: no checkpoints (the baseline);
* ``ckptmgr block``: ``mgr.save(step, state)`` after ``optimizer.step()``;
* ``ckptmgr overlap``: ``mgr.save(..., block=False)``; ``handle.wait_staged()`` right before
  the next ``optimizer.step()``, so the copy overlaps the next forward and backward;
* ``Lightning AsyncCheckpointIO``: its ``save_checkpoint`` (clones on the GPU, writes in a
  thread);
* ``DCP async_save``: with a pinned DefaultStager, ``staging_completion`` awaited before the
  next ``optimizer.step()``. A DefaultStager cannot be reused on torch 2.11 (its second
  save fails with KeyError, see bench_staging.py), so each save gets a fresh one.

The warm-up includes one checkpoint for every mode, so first-save costs (allocating and
pinning buffers) are left out of the timed steps for every tool alike; bench_staging.py
reports them. Choose ``--batch`` so that ``--every`` steps take longer than one durable write:
when checkpoints come faster than the disk can absorb them, every tool must wait, queue
without bound, or skip.

Reports mean step time over the timed steps, the overhead against ``none``, and the peak GPU
memory. Prints a table and writes JSON (default benchmarks/out/training.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from typing import Any

import torch

from ckptmgr import CheckpointManager


class Decoder(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                                 norm_first=True, activation="gelu")
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.blocks(self.embed(tokens), mask=mask, is_causal=True)))


class Saver:
    """One checkpointing mode: ``save`` after the optimizer step, ``before_step`` right
    before the next one, ``finish`` after the timed loop (not timed)."""

    def __init__(self, mode: str, directory: str) -> None:
        self.mode, self.dir = mode, directory
        self.pending: Any = None
        self.errors: list[str] = []
        if mode.startswith("ckptmgr"):
            self.mgr = CheckpointManager(os.path.join(directory, "root"))
        elif mode == "Lightning AsyncCheckpointIO":
            try:
                from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
            except ImportError:
                from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO  # type: ignore[no-redef]
            self.io = AsyncCheckpointIO(TorchCheckpointIO())
        elif mode == "DCP async_save":
            self.stagers: list[Any] = []

    @staticmethod
    def _new_stager() -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        gpu = torch.cuda.is_available()
        return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                            use_async_staging=True, use_non_blocking_copy=gpu))

    def save(self, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if self.mode == "ckptmgr block":
            self.mgr.save(step, {"model": model, "optim": opt, "step": step})
        elif self.mode == "ckptmgr overlap":
            self.pending = self.mgr.save(step, {"model": model, "optim": opt, "step": step}, block=False)
        elif self.mode == "Lightning AsyncCheckpointIO":
            self.io.save_checkpoint({"model": model.state_dict(), "optim": opt.state_dict(), "step": step},
                                    os.path.join(self.dir, f"step{step}.ckpt"))
        elif self.mode == "DCP async_save":
            import torch.distributed.checkpoint as dcp

            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            while len(self.stagers) > 1 and self.stagers[0][1].upload_completion.done():
                self.stagers.pop(0)[0].close()  # free the pinned memory of finished saves
            stager = self._new_stager()
            self.pending = dcp.async_save(sd, checkpoint_id=os.path.join(self.dir, f"step{step}"),
                                          async_stager=stager)
            self.stagers.append((stager, self.pending))

    def before_step(self) -> None:
        if self.pending is None:
            return
        if self.mode == "ckptmgr overlap":
            self.pending.wait_staged()
        elif self.mode == "DCP async_save":
            try:
                self.pending.staging_completion.result()
            except Exception as exc:
                self.errors.append(f"staging: {type(exc).__name__}: {exc}")
        self.pending = None

    def finish(self) -> None:
        self.before_step()
        if self.mode.startswith("ckptmgr"):
            self.mgr.close()
        elif self.mode == "Lightning AsyncCheckpointIO":
            self.io.teardown()
        elif self.mode == "DCP async_save":
            for stager, resp in self.stagers:
                try:
                    resp.upload_completion.result()
                except Exception as exc:
                    self.errors.append(f"upload: {type(exc).__name__}: {exc}")
                stager.close()


def run(mode: str, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    torch.manual_seed(0)
    device = args.device
    model = Decoder(args.vocab, args.dim, args.layers, args.heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.startswith("cuda"))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    saver = Saver(mode, directory) if mode != "none" else None
    amp = torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16)

    def step_fn(step: int) -> None:
        with amp:
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        if saver is not None:
            saver.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if saver is not None and step % args.every == 0:
            saver.save(step, model, opt)

    for s in range(args.warmup):  # the last warm-up step checkpoints (first-save costs stay out)
        step_fn(10**6 * args.every if s == args.warmup - 1 else 10**6 * args.every + 1 + s)
    if saver is not None:
        saver.before_step()
        if saver.mode.startswith("ckptmgr"):
            saver.mgr.wait()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    t_all = time.perf_counter()
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        step_fn(step)
        if args.sync_each and device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    total = time.perf_counter() - t_all
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else 0.0
    if saver is not None:
        saver.finish()
    nparams = sum(p.numel() for p in model.parameters())
    shutil.rmtree(directory, ignore_errors=True)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"mode": mode, "mean_step_s": total / args.steps, "step_times": times, "peak_gpu_gib": peak,
            "params": nparams, "errors": saver.errors if saver else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(__file__), "out", "train-ckpt"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--sync-each", action="store_true", help="synchronize after every step (per-step times)")
    ap.add_argument("--modes", default="none,ckptmgr block,ckptmgr overlap,Lightning AsyncCheckpointIO,"
                                       "DCP async_save,none")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "training.json"))
    args = ap.parse_args()
    results = []
    for mode in args.modes.split(","):
        r = run(mode, args, args.dir)
        results.append(r)
        print(f"{mode}: {r['mean_step_s'] * 1e3:.1f} ms/step, peak GPU {r['peak_gpu_gib']:.1f} GiB "
              f"{'; errors: ' + str(r['errors'][:2]) if r['errors'] else ''}", flush=True)
    base = [r["mean_step_s"] for r in results if r["mode"] == "none"]
    baseline = min(base) if base else float("nan")
    lines = [f"{results[0]['params'] / 1e6:.0f}M parameters, AdamW, batch {args.batch}x{args.seq}, checkpoint every "
             f"{args.every} steps, {args.steps} timed steps", "",
             "| mode | ms/step | overhead vs none | peak GPU GiB |", "|---|---|---|---|"]
    for r in results:
        over = (r["mean_step_s"] / baseline - 1) * 100
        lines.append(f"| {r['mode']} | {r['mean_step_s'] * 1e3:.1f} | {over:+.2f}% | {r['peak_gpu_gib']:.1f} |")
    print("\n".join(lines))
    report = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=os.path.dirname(__file__) or ".").stdout.strip(),
              "args": vars(args), "baseline_s": baseline, "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
