"""Step-time overhead of Hugging Face Trainer checkpoints: the stock Trainer against CkptmgrTrainer.

A decoder built from a config (no download) is fine-tuned in bf16 mixed precision with a
checkpoint every ``--save-steps`` steps, once per mode, each mode in a fresh process (modes in
rotated order per round):

* ``none``: no checkpoints (the baseline);
* ``stock``: ``transformers.Trainer``, which writes each checkpoint synchronously;
* ``ckptmgr``: ``CkptmgrTrainer`` (copies into reused pinned memory, background writes).

Per mode: the training loop's time (first step begin to last step end; every checkpoint but
the final wait inside it), the per-step times, the wait for the last checkpoint to become
durable after the loop (``teardown_s``, which every tool pays once), and the peak GPU memory.
Overhead = loop time / baseline loop time - 1. The JSON goes to ``$OUT/bench_hf_trainer.json``.

    python benchmarks/bench_hf_trainer.py --out "$OUT"            # the GPU run (~2-3 minutes)
    python benchmarks/bench_hf_trainer.py --tiny --cpu --steps 12   # a smoke run on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MODES = ("none", "stock", "ckptmgr")


def _one(a: argparse.Namespace) -> dict[str, Any]:
    """Run one mode in this process; the measurements."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    if a.tiny:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=a.seq)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                          num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                          num_key_value_heads=a.hidden // 128, max_position_embeddings=a.seq)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.x = torch.randint(0, cfg.vocab_size, (a.batch * (a.steps + 1), a.seq),
                                   generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.x[i], "labels": self.x[i]}

    class Clock(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []

        def _sync(self) -> float:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_step_begin(self, *args: Any, **kw: Any) -> None:
            self.begin.append(self._sync())

        def on_step_end(self, *args: Any, **kw: Any) -> None:
            self.end.append(self._sync())

    clock = Clock()
    out_dir = os.path.join(a.workdir, a.mode)
    cuda = torch.cuda.is_available() and not a.cpu
    args = TrainingArguments(output_dir=out_dir, max_steps=a.steps,
                             save_strategy="no" if a.mode == "none" else "steps", save_steps=a.save_steps,
                             per_device_train_batch_size=a.batch, learning_rate=1e-4, bf16=cuda,
                             logging_steps=10_000, report_to=[], use_cpu=not cuda, disable_tqdm=True,
                             dataloader_num_workers=0, save_total_limit=2)
    if a.mode == "ckptmgr":
        from ckptmgr.integrations.transformers import AsyncSaveOptions, CkptmgrTrainer

        trainer: Any = CkptmgrTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[clock],
                                      checkpointing=AsyncSaveOptions(slots=1))
    else:
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[clock])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    # a step's time: from its begin to the next step's begin (the checkpoint after a step is in it)
    starts = [*clock.begin, clock.end[-1]]
    steps = [starts[i + 1] - starts[i] for i in range(len(clock.begin))]
    ckpt_bytes = 0
    ckpts = sorted(n for n in os.listdir(out_dir) if n.startswith("checkpoint-")) if os.path.isdir(out_dir) else []
    if ckpts:
        d = os.path.join(out_dir, ckpts[-1])
        ckpt_bytes = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    saves_at = [s for s in range(1, a.steps + 1) if a.mode != "none" and s % a.save_steps == 0]
    return {"mode": a.mode, "params": n_params, "checkpoint_bytes": ckpt_bytes, "saves": len(saves_at),
            "loop_s": clock.end[-1] - clock.begin[0], "train_call_s": total,
            "teardown_s": total - (clock.end[-1] - clock.begin[0]), "step_s": steps,
            "step_median_s": statistics.median(steps), "save_step_s": [steps[s - 1] for s in saves_at],
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def _rng(values: list[float], fmt: str = "{:.2f}") -> str:
    """Median (min to max)."""
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))} to {fmt.format(max(values))})"


def _pct(values: list[float]) -> str:
    return _rng([100 * v for v in values], "{:+.1f}%") if values else "-"


def _save_cost(run: dict[str, Any]) -> float:
    """What the checkpoints cost the loop, from its own step times: the time of each step
    with a save beyond the run's median step (robust to a baseline that ran at other clocks)."""
    med = run["step_median_s"]
    return float(sum(max(0.0, x - med) for x in run["save_step_s"])) / max(1, run["saves"])


def _write(a: argparse.Namespace, runs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Summarise the runs so far and write the JSON. Overhead is per round, against the same
    round's baseline (each round's modes run back to back), median and range."""
    base = {x["round"]: x["loop_s"] for x in runs if x["mode"] == "none"}
    summary = {}
    for mode in MODES:
        mine = [x for x in runs if x["mode"] == mode]
        if not mine:
            continue
        loops = [x["loop_s"] for x in mine]
        summary[mode] = {"loop_s_median": statistics.median(loops), "loop_s": loops,
                         "overhead_per_round": [x["loop_s"] / base[x["round"]] - 1 for x in mine if x["round"] in base],
                         "save_cost_s": [_save_cost(x) for x in mine if x["saves"]],
                         "teardown_s_median": statistics.median(x["teardown_s"] for x in mine),
                         "peak_gpu_bytes": max((x["peak_gpu_bytes"] or 0) for x in mine) or None}
    doc: dict[str, Any] = {"machine": {"python": platform.python_version(), "host": platform.node()},
                           "args": vars(a), "runs": runs, "summary": summary}
    try:
        import torch
        import transformers

        doc["machine"].update(torch=torch.__version__, transformers=transformers.__version__,
                              gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    except Exception as exc:  # the numbers matter more than the labels
        doc["machine"]["error"] = repr(exc)
    path = os.path.join(a.out, "bench_hf_trainer.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path, summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the JSON (default $OUT)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="modes to run, comma-separated (default all; 'none' is the baseline every overhead needs)")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.mode:  # a child: one mode
        res = _one(a)
        with open(a.result, "w") as f:
            json.dump(res, f)
        return
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if "none" not in modes or not set(modes) <= set(MODES):
        p.error(f"--modes: some of {', '.join(MODES)}, with none (the baseline)")
    os.makedirs(a.out, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory(dir=a.workdir) as work:
        for r in range(a.rounds):
            for i in range(len(modes)):
                mode = modes[(i + r) % len(modes)]
                result = os.path.join(work, f"{mode}-{r}.json")
                cmd = [sys.executable, __file__, "--mode", mode, "--result", result, "--workdir", work,
                       "--steps", str(a.steps), "--save-steps", str(a.save_steps), "--batch", str(a.batch),
                       "--seq", str(a.seq), "--hidden", str(a.hidden), "--layers", str(a.layers)]
                cmd += ["--tiny"] * a.tiny + ["--cpu"] * a.cpu
                subprocess.run(cmd, check=True)
                with open(result) as f:
                    runs.append({"round": r, **json.load(f)})
                print(f"round {r} {mode:8s} loop {runs[-1]['loop_s']:.2f} s, teardown {runs[-1]['teardown_s']:.2f} s",
                      flush=True)
                import shutil

                shutil.rmtree(os.path.join(work, mode), ignore_errors=True)
                path, summary = _write(a, runs)  # after every run: a stopped benchmark keeps its rounds
    for mode, s in summary.items():
        print(f"{mode:8s} loop {s['loop_s_median']:.2f} s  overhead {_pct(s['overhead_per_round'])}  "
              f"per save {_rng(s['save_cost_s'], '{:.3f}')} s  teardown {s['teardown_s_median']:.2f} s  "
              f"peak GPU {(s['peak_gpu_bytes'] or 0) / 2**30:.2f} GiB")
    print("wrote", path)


if __name__ == "__main__":
    main()
