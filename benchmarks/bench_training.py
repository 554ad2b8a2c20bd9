"""Step-time overhead of checkpointing a training loop, ckptmgr against its peers.

    python benchmarks/bench_training.py --dir /path/on/disk
    python benchmarks/bench_training.py --model linear --every 25 --modes none,ckptmgr overlap
    python benchmarks/bench_training.py --merge round1.json round2.json --out all.json  # rounds run apart

Two models: ``decoder`` (the default), a ~350M-parameter decoder-only transformer (24 layers,
d=1024, bf16 autocast, ~4 GiB of model and AdamW state), and ``linear``, 24 x Linear(4096)
with fused AdamW (~4.8 GB of state, ~50 ms steps at batch 1024 on an H100/H200). Every
``--every`` steps the model and optimizer state is checkpointed to ``--dir``. Modes:

* ``none``: no checkpoints (the baseline);
* ``ckptmgr block``: ``mgr.save(step, state)`` after ``optimizer.step()``;
* ``ckptmgr overlap``: ``mgr.save(..., block=False)``; ``handle.wait_staged()`` right before
  the next ``optimizer.step()``, so the copy overlaps the next forward and backward; the
  default ``StagingOptions`` (slots sized by the manager, unless ``--slots``);
* ``ckptmgr budget``: like ``overlap``, but the loop saves when ``mgr.should_save(step)``
  says (called every timed step) under ``Schedule(max_overhead=--max-overhead)`` (default
  0.01: at most 1% of the step time), not every ``--every`` steps; the saves made and the
  intervals the manager picked are reported;
* ``ckptmgr continuous``: like ``budget`` under ``Schedule(continuous=True)``: the next save
  goes to the durable target as soon as the last durable write ended;
* ``ckptmgr lost``: like ``budget`` under ``Schedule(max_lost_s=--max-lost-s)``: a crash loses
  at most that many seconds of training (the local interval achieved is reported);
* ``ckptmgr coalesce``: like ``overlap`` with ``--slots`` staging slots (default 3) in the
  local tier and ``ckptmgr.Schedule(durable_every=--durable-every)`` (0: every save is meant
  for the durable target): when saves come faster than the disk absorbs them, each one still
  lands in the local tier at copy speed and the durable write goes to the newest step;
* ``ckptmgr overlap+device`` and ``ckptmgr coalesce+device``: the same with
  ``StagingOptions(device_buffer_bytes=...)`` (``--device-buffer-gib``): the state is first
  copied into a buffer on the GPU (device to device), so ``wait_staged()`` returns after that
  copy and the copy to the host runs from the buffer behind the next steps. Costs that much
  GPU memory (the peak GPU column shows it);
* ``Lightning AsyncCheckpointIO``: its ``save_checkpoint`` (clones on the GPU, writes in a
  thread);
* ``DCP async_save``: with a pinned DefaultStager, ``staging_completion`` awaited before the
  next ``optimizer.step()`` (one stager reused where the installed torch allows it).

Each (mode, round) runs in a fresh process, the mode order rotated each round, for
``--repeat`` rounds. Warm-up steps take no checkpoint, so every tool's first save, with its
one-time costs (allocating and pinning buffers), falls inside the timed steps, as it does in a
real job; ckptmgr's modes call ``mgr.prepare(state)`` when the timed loop starts, as a job would
at start-up, without waiting for it. The timed window ends when the last step's GPU work is
done; the wait for the last write to become durable (time-to-durable, which every tool pays) is
reported apart. Choose ``--batch`` so that ``--every`` steps take longer than one durable write
unless the point is to checkpoint faster than the disk absorbs.

Durable freshness (ckptmgr modes): at every checkpoint, the age of the newest step committed
on the durable target (seconds since that step's ``save()``; steps behind the step being
saved), and the steps superseded for the durable tier. Host memory: the peak resident set of
the process (``VmHWM``: the staging slots it touched, /dev/shm ones included).

Saves faster than the disk (a GPU machine, ~1.8 s per durable write of the 4.8 GB state)::

    python benchmarks/bench_training.py --model linear --every 25 --steps 200 --warmup 5 \
        --modes "none,ckptmgr overlap,ckptmgr coalesce" --repeat 3 --dir /var/tmp/x

Reports, per mode, the mean step time and its overhead against ``none`` of the same round
(median and range over the rounds), the longest step (with ``--sync-each``), the peak GPU
memory and the teardown wait. Prints a table and writes JSON (default
benchmarks/out/training.json).
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

import torch
from common import commit, median_range, proc_status

from ckptmgr import CheckpointManager, Schedule, StagingOptions

SCHEDULED = ("ckptmgr budget", "ckptmgr continuous", "ckptmgr lost")  # the manager's should_save() decides


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


class Linear24(torch.nn.Module):
    """24 x Linear(4096): large state, short steps (checkpoint pressure without attention)."""

    def __init__(self, dim: int = 4096, layers: int = 24) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)  # type: ignore[no-any-return]


class Saver:
    """One checkpointing mode: ``save`` after the optimizer step, ``before_step`` right
    before the next one, ``finish`` after the timed loop."""

    def __init__(self, mode: str, directory: str, args: argparse.Namespace) -> None:
        device = mode.endswith("+device")
        mode = mode.removesuffix("+device")
        self.mode, self.dir = mode, directory
        buffer = int(args.device_buffer_gib * 2**30) if device else 0
        self.pending: Any = None
        self.errors: list[str] = []
        self.stager: Any = None
        self.uploads: list[Any] = []
        self.handles: list[tuple[int, float, Any]] = []  # ckptmgr: (step, time of save(), handle)
        self.newest_durable: tuple[int, float] | None = None
        self.freshness: list[dict[str, Any]] = []
        if mode == "ckptmgr coalesce":
            schedule = Schedule(durable_every=args.durable_every) if args.durable_every else None
            self.mgr = CheckpointManager(os.path.join(directory, "root"), schedule=schedule,
                                         staging=StagingOptions(slots=args.slots or 3, local_dir=args.local_dir,
                                                                device_buffer_bytes=buffer))
        elif mode.startswith("ckptmgr"):
            staging = StagingOptions(slots=args.slots or None, local_dir=args.local_dir, device_buffer_bytes=buffer)
            schedule = {"ckptmgr budget": Schedule(max_overhead=args.max_overhead),
                        "ckptmgr continuous": Schedule(continuous=True),
                        "ckptmgr lost": Schedule(max_lost_s=args.max_lost_s)}.get(mode)
            self.mgr = CheckpointManager(os.path.join(directory, "root"), staging=staging, schedule=schedule)
        elif mode == "Lightning AsyncCheckpointIO":
            try:
                from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
            except ImportError:
                from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO  # type: ignore[no-redef]
            self.io = AsyncCheckpointIO(TorchCheckpointIO())

    @staticmethod
    def _new_stager() -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        gpu = torch.cuda.is_available()
        return DefaultStager(StagingOptions(use_pinned_memory=gpu, use_shared_memory=False,
                                            use_async_staging=True, use_non_blocking_copy=gpu))

    def start(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        """When the timed loop starts: what a job does at start-up (not waited for)."""
        if self.mode.startswith("ckptmgr"):
            self.mgr.prepare({"model": model, "optim": opt, "step": 0})

    def note_durable(self, step: int) -> None:
        """At a checkpoint of ``step``: how far behind the durable target is."""
        now = time.perf_counter()
        for s, t, h in self.handles:
            if h.done() and (self.newest_durable is None or s > self.newest_durable[0]):
                try:
                    if h.result(timeout=0).durable:
                        self.newest_durable = (s, t)
                except Exception as exc:
                    self.errors.append(f"save {s}: {type(exc).__name__}: {exc}")
        self.handles = [x for x in self.handles if not x[2].done()]
        nd = self.newest_durable
        self.freshness.append({"step": step, "newest_durable": nd[0] if nd else None,
                               "age_s": now - nd[1] if nd else None, "behind_steps": step - nd[0] if nd else None})

    def due(self, step: int, every: int) -> bool:
        """Whether to checkpoint ``step``: the manager's budget schedule decides in the budget
        mode (asked every step), else every ``every`` steps."""
        if self.mode in SCHEDULED:
            return bool(self.mgr.should_save(step))
        return step % every == 0

    def save(self, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if self.mode.startswith("ckptmgr"):
            self.note_durable(step)
        if self.mode == "ckptmgr block":
            h = self.mgr.save(step, {"model": model, "optim": opt, "step": step})
            self.handles.append((step, time.perf_counter(), h))
        elif self.mode in ("ckptmgr overlap", "ckptmgr coalesce", *SCHEDULED):
            self.pending = self.mgr.save(step, {"model": model, "optim": opt, "step": step}, block=False)
            self.handles.append((step, time.perf_counter(), self.pending))
        elif self.mode == "Lightning AsyncCheckpointIO":
            self.io.save_checkpoint({"model": model.state_dict(), "optim": opt.state_dict(), "step": step},
                                    os.path.join(self.dir, f"step{step}.ckpt"))
        elif self.mode == "DCP async_save":
            import torch.distributed.checkpoint as dcp

            sd = {"model": model.state_dict(), "optim": opt.state_dict()}
            for attempt in range(2):  # one stager, reused; a fresh one where reuse fails
                if self.stager is None:
                    self.stager = self._new_stager()
                try:
                    self.pending = dcp.async_save(sd, checkpoint_id=os.path.join(self.dir, f"step{step}"),
                                                  async_stager=self.stager)
                    self.uploads.append(self.pending)
                    return
                except Exception as exc:
                    self.errors.append(f"save {step} attempt {attempt}: {type(exc).__name__}: {exc}")
                    self.stager = None

    def before_step(self) -> None:
        if self.pending is None:
            return
        if self.mode in ("ckptmgr overlap", "ckptmgr coalesce", *SCHEDULED):
            self.pending.wait_staged()
        elif self.mode == "DCP async_save":
            try:
                self.pending.staging_completion.result()
            except Exception as exc:
                self.errors.append(f"staging: {type(exc).__name__}: {exc}")
                self.stager = None
        self.pending = None

    def finish(self) -> None:
        self.before_step()
        if self.mode.startswith("ckptmgr"):
            self.stats = self.mgr.stats()
            self.mgr.close()
        elif self.mode == "Lightning AsyncCheckpointIO":
            self.io.teardown()
        elif self.mode == "DCP async_save":
            for resp in self.uploads:
                try:
                    resp.upload_completion.result()
                except Exception as exc:
                    self.errors.append(f"upload: {type(exc).__name__}: {exc}")
            if self.stager is not None:
                self.stager.close()


def run(mode: str, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    torch.manual_seed(0)
    device = args.device
    cuda = device.startswith("cuda")
    if args.model == "linear":
        model: torch.nn.Module = Linear24(args.dim, args.layers).to(device)
        batch = torch.randn(args.batch, args.dim, device=device)
    else:
        model = Decoder(args.vocab, args.dim, args.layers, args.heads).to(device)
        batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    saver = Saver(mode, directory, args) if mode != "none" else None
    amp = torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16)

    def step_fn(step: int, checkpoint: bool) -> None:
        if args.model == "linear":
            loss = model(batch).square().mean()
        else:
            with amp:
                logits = model(batch[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab).float(),
                                                         batch[:, 1:].reshape(-1))
        loss.backward()
        if saver is not None:
            saver.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if checkpoint and saver is not None and saver.due(step, args.every):
            saver.save(step, model, opt)

    for s in range(args.warmup):  # no checkpoints: every tool's first save falls in the timed steps
        step_fn(s, checkpoint=False)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    t_all = time.perf_counter()
    if saver is not None:
        saver.start(model, opt)
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        step_fn(step, checkpoint=True)
        if args.sync_each and cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - t_all
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    t_fin = time.perf_counter()
    if saver is not None:
        saver.finish()
    teardown = time.perf_counter() - t_fin
    nparams = sum(p.numel() for p in model.parameters())
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in model.parameters())  # weights + 2 AdamW moments
    shutil.rmtree(directory, ignore_errors=True)
    fresh = saver.freshness if saver else []
    ages = [f["age_s"] for f in fresh if f["age_s"] is not None]
    return {"mode": mode, "mean_step_s": total / args.steps, "step_times": times, "peak_gpu_gib": peak,
            "peak_host_gib": proc_status("VmHWM") / 2**30,
            "teardown_s": teardown, "params": nparams, "state_bytes": state_bytes,
            "errors": saver.errors if saver else [], "freshness": fresh,
            "durable_age_s_median": statistics.median(ages) if ages else None,
            "durable_age_s_max": max(ages) if ages else None,
            "stats": getattr(saver, "stats", None)}


def _saves(stats: dict[str, Any] | None) -> str:
    """For a round's line: the saves made, the slots used and, in the budget mode, the intervals."""
    if not stats:
        return ""
    out = f", {stats.get('saves', 0):.0f} saves, {stats.get('slots', 0):.0f} slots"
    budget = {k.removeprefix("budget_"): v for k, v in stats.items() if k.startswith("budget_")}
    if budget:
        out += ", budget " + " ".join(f"{k}={v:.4g}" for k, v in sorted(budget.items()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(__file__), "out", "train-ckpt"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=("decoder", "linear"), default="decoder")
    ap.add_argument("--dim", type=int, default=None, help="default 1024 (decoder) or 4096 (linear)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=None, help="default 32 (decoder) or 1024 (linear)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each (mode, round) is a fresh process")
    ap.add_argument("--sync-each", action="store_true", help="synchronize after every step (per-step times)")
    ap.add_argument("--slots", type=int, default=0,
                    help="ckptmgr staging slots (0: the default options for block/overlap/budget, 3 for coalesce)")
    ap.add_argument("--max-overhead", type=float, default=0.01,
                    help="ckptmgr budget: Schedule(max_overhead=...), the share of step time saves may take")
    ap.add_argument("--durable-every", type=int, default=0,
                    help="ckptmgr coalesce: Schedule(durable_every=N) (0: every save meant for the durable target)")
    ap.add_argument("--max-lost-s", type=float, default=10.0,
                    help="ckptmgr lost: Schedule(max_lost_s=...), the seconds of training a crash may lose")
    ap.add_argument("--local-dir", default="/dev/shm", help="ckptmgr's local tier (a tmpfs)")
    ap.add_argument("--device-buffer-gib", type=float, default=64.0,
                    help="the +device modes' StagingOptions.device_buffer_bytes, in GiB "
                         "(grown only to the state's size)")
    ap.add_argument("--modes", default="none,ckptmgr block,ckptmgr overlap,Lightning AsyncCheckpointIO,"
                                       "DCP async_save")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "training.json"))
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="run nothing: report the rounds of these earlier runs (same model, steps and modes; "
                         "rounds run as separate calls, e.g. interleaved with another build's) as one run")
    ap.add_argument("--child", metavar="MODE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dim is None:
        args.dim = 4096 if args.model == "linear" else 1024
    if args.batch is None:
        args.batch = 1024 if args.model == "linear" else 32
    if args.child:
        print("RESULT " + json.dumps(run(args.child, args, args.dir)), flush=True)
        return
    rounds: list[dict[str, Any]] = []
    made_by = None
    if args.merge:
        runs = []
        for path in args.merge:
            with open(path) as f:
                runs.append(json.load(f))
        keys = ("model", "dim", "layers", "batch", "steps", "every", "modes", "max_lost_s", "max_overhead")
        for path, run_ in zip(args.merge, runs, strict=True):
            differs = [k for k in keys if run_["args"].get(k) != runs[0]["args"].get(k)]
            if differs or (run_["commit"], run_["device"]) != (runs[0]["commit"], runs[0]["device"]):
                raise SystemExit(f"{path}: not the same benchmark as {args.merge[0]} ({differs or 'commit/device'})")
            rounds += run_["rounds"]
        for k in keys:
            setattr(args, k, runs[0]["args"][k])
        args.repeat, made_by = len(rounds), runs[0]["commit"]
    modes = args.modes.split(",")
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k not in ("out", "child", "sync_each", "repeat")] + (["--sync-each"] if args.sync_each else [])
    for r in range(0 if args.merge else args.repeat):
        got: dict[str, Any] = {}
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), *passthrough, "--child", mode],
                               capture_output=True, text=True, timeout=1800)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                got[mode] = {"mode": mode, "error": (p.stderr.strip().splitlines() or ["no output"])[-1]}
                print(f"round {r + 1} {mode}: FAILED {got[mode]['error']}", flush=True)
                continue
            got[mode] = json.loads(line[7:])
            x = got[mode]
            print(f"round {r + 1} {mode}: {x['mean_step_s'] * 1e3:.1f} ms/step, longest "
                  f"{max(x['step_times']) * 1e3:.0f} ms, peak GPU {x['peak_gpu_gib']:.1f} GiB, "
                  f"peak host {x.get('peak_host_gib', 0):.1f} GiB, "
                  f"teardown {x['teardown_s']:.2f} s"
                  f"{_saves(x.get('stats'))}"
                  f"{'; errors: ' + str(x['errors'][:2]) if x['errors'] else ''}", flush=True)
        rounds.append(got)
    first = next((x for g in rounds for x in g.values() if "params" in x), None)
    lines = [f"{args.model}: {first['params'] / 1e6:.0f}M parameters ({first['state_bytes'] / 1e9:.2f} GB of state), "
             f"AdamW, batch {args.batch}, checkpoint every {args.every} steps, {args.steps} timed steps incl. the "
             f"first save; median (range) of {args.repeat} fresh-process rounds" if first else "no run succeeded", "",
             "| mode | ms/step | overhead vs none | longest step ms | peak GPU GiB | peak host GiB | teardown s "
             "| durable age s (median / max) | superseded | saves |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    summary: dict[str, Any] = {}
    notes: list[str] = []
    for mode in modes:
        ok = [(g[mode], g.get("none")) for g in rounds if "mean_step_s" in g.get(mode, {})]
        if not ok:
            continue
        steps = [x["mean_step_s"] for x, _ in ok]
        over = [(x["mean_step_s"] / b["mean_step_s"] - 1) * 100 for x, b in ok if b and "mean_step_s" in b]
        longest = [max(x["step_times"]) for x, _ in ok]
        summary[mode] = {"mean_step_s": statistics.median(steps), "overhead_pct": over,
                         "overhead_pct_median": statistics.median(over) if over else None,
                         "longest_step_s": longest, "teardown_s": [x["teardown_s"] for x, _ in ok],
                         "peak_gpu_gib": max(x["peak_gpu_gib"] for x, _ in ok),
                         "peak_host_gib": max(x.get("peak_host_gib", 0.0) for x, _ in ok),
                         "saves": [x["stats"].get("saves", 0) for x, _ in ok if x.get("stats")],
                         "intervals": [{k.removeprefix("budget_"): v for k, v in x["stats"].items()
                                        if k.startswith("budget_")} for x, _ in ok if x.get("stats")]}
        ages = [x["durable_age_s_median"] for x, _ in ok if x.get("durable_age_s_median") is not None]
        worst = [x["durable_age_s_max"] for x, _ in ok if x.get("durable_age_s_max") is not None]
        superseded = [x["stats"]["durable_superseded"] for x, _ in ok if x.get("stats")]
        summary[mode].update(durable_age_s_median=ages, durable_age_s_max=worst, durable_superseded=superseded)
        lines.append(f"| {mode} | {median_range(steps, 1e3)} | {median_range(over, fmt='{:+.2f}%') if over else '-'} | "
                     f"{median_range(longest, 1e3, '{:.0f}')} | {summary[mode]['peak_gpu_gib']:.1f} | "
                     f"{summary[mode]['peak_host_gib']:.1f} | "
                     f"{median_range(summary[mode]['teardown_s'], fmt='{:.2f}')} | "
                     f"{median_range(ages, fmt='{:.2f}') if ages else '-'} / "
                     f"{median_range(worst, fmt='{:.2f}') if worst else '-'} | "
                     f"{median_range([float(s) for s in superseded], fmt='{:.0f}') if superseded else '-'} | "
                     f"{median_range([float(n) for n in summary[mode]['saves']], fmt='{:.0f}') if superseded else '-'} "
                     "|")
        for i, iv in enumerate(summary[mode]["intervals"]):
            if iv:  # the budget modes: the intervals the manager planned and achieved
                notes.append(f"{mode}, round {i + 1}: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(iv.items())))
    print("\n".join(lines + (["", *notes] if notes else [])))
    report = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "commit": made_by or commit(),
              "args": vars(args), "summary": summary, "rounds": rounds}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
