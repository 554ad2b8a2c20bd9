"""Summarize a benchmark run: one table per metric and a PNG chart of ckptmgr against its peers.

    python benchmarks/report.py DIR            # DIR holds the JSON files benchmarks/run.py wrote

Reads whichever of ``staging.json`` (bench_staging.py), ``restore.json`` (bench_restore.py, GPU)
or ``save_restore.json`` (bench_save_restore.py, CPU), ``training.json`` (bench_training.py)
and ``s3.json`` (bench_s3.py) are in DIR, and writes ``DIR/summary.json`` and, when matplotlib
is installed (``pip install 'ckptmgr[bench]'``), ``DIR/chart.png`` with six panels:

* stall per save: seconds until the training loop may change its state again (warm saves);
* time to durable: seconds from the save call until the checkpoint is on disk (fsync'd);
* restore: seconds to load the checkpoint (onto the GPU when there is one);
* extra GPU memory a save takes;
* training-step overhead against no checkpointing;
* S3 upload time (moto with injected latency).

Lower is better on every panel; ckptmgr's bars are drawn in a colour of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

Metrics = dict[str, dict[str, float]]

PANELS = [
    ("stall_s", "stall per save (s)"),
    ("durable_s", "time to durable (s)"),
    ("restore_s", "restore (s)"),
    ("extra_gpu_gib", "extra GPU memory per save (GiB)"),
    ("training_overhead_pct", "training step overhead (%)"),
    ("s3_upload_s", "S3 upload (s)"),
]


def _load(path: str) -> Any:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _staging(d: Any, out: Metrics, notes: list[str]) -> None:
    size = sorted(d["sizes"], key=float)[0]
    entry = d["sizes"][size]
    target = "disk" if "disk" in entry["targets"] else next(iter(entry["targets"]))
    notes.append(f"saves: {float(size):g} GiB state ({entry['tensors']} tensors) to {target}, each tool in fresh "
                 "processes; first save and later saves apart")
    for tool, r in entry["targets"][target].items():
        procs = r["processes"] if "processes" in r else [r["runs"]]
        first = [p[0] for p in procs if p and p[0]]
        later = [x for p in procs for x in p[1:] if x]
        for label, runs in (("first", first), ("later", later)):
            if not runs:
                continue
            out["stall_s"][f"{tool} ({label})"] = statistics.median(x["safe_s"] for x in runs)
            out["durable_s"][f"{tool} ({label})"] = statistics.median(x["durable_s"] for x in runs)
        if d.get("device", "cpu") != "cpu" and first + later:
            out["extra_gpu_gib"][tool] = max(x["extra_gpu_mib"] for x in first + later) / 1024


def _restore(d: Any, out: Metrics, notes: list[str]) -> None:
    if "summary" not in d:  # the single-process format of earlier runs
        notes.append(f"restore: {d['bytes'] / 2**30:.1f} GiB from {d.get('dir', '?')} onto {d.get('device', '?')}")
        for tool, runs in d["results"].items():  # each run: [seconds, extra host MiB, extra GPU MiB]
            seconds = [r[0] if isinstance(r, list) else r for r in runs]
            if seconds:
                out["restore_s"][tool] = statistics.median(seconds)
        return
    notes.append(f"restore: {d['bytes'] / 2**30:.1f} GiB onto {d.get('device', '?')}, each run a fresh process "
                 f"(median of {d.get('repeat', '?')}): [shm] from /dev/shm, [disk] from a cold disk")
    for src, tools in d["summary"].items():
        for tool, r in tools.items():
            out["restore_s"][f"{tool} [{src}]"] = r["median_s"]


def _save_restore(d: Any, out: Metrics, notes: list[str]) -> None:
    notes.append(f"restore: {d['meta']['bytes'] / 2**30:.2f} GiB on the CPU")
    for tool, r in d["summary"].items():
        out["restore_s"][tool] = r["restore_s"]


def _training(d: Any, out: Metrics, notes: list[str]) -> None:
    a = d["args"]
    notes.append(f"training: {a.get('model', 'decoder')} d={a['dim']} x {a['layers']} layers, checkpoint every "
                 f"{a['every']} steps" + (", first save included" if "summary" in d else ""))
    if "summary" in d:  # rounds of fresh processes
        for mode, r in d["summary"].items():
            if mode != "none" and r.get("overhead_pct_median") is not None:
                out["training_overhead_pct"][mode] = r["overhead_pct_median"]
        return
    base = d["baseline_s"]
    for r in d["results"]:
        if r["mode"] != "none":
            out["training_overhead_pct"][r["mode"]] = (r["mean_step_s"] / base - 1) * 100


def _s3(d: Any, out: Metrics, notes: list[str]) -> None:
    a = d["args"]
    notes.append(f"S3: {a['mib']} MiB to moto on {d.get('machine', 'this machine')}, {a['latency_ms']:g} ms + "
                 f"{a['jitter_ms']:g} ms jitter per request")
    for tool, ts in d["times_s"].items():
        out["s3_upload_s"][tool] = statistics.median(ts)


def summarize(directory: str) -> dict[str, Any]:
    """The metrics of every benchmark JSON found in ``directory``."""
    metrics: Metrics = {k: {} for k, _ in PANELS}
    notes: list[str] = []
    machine: dict[str, Any] = {}
    for name, fn in (("staging.json", _staging), ("restore.json", _restore), ("save_restore.json", _save_restore),
                     ("training.json", _training), ("s3.json", _s3)):
        d = _load(os.path.join(directory, name))
        if d is None:
            continue
        fn(d, metrics, notes)
        for key in ("device", "date", "commit", "torch"):
            value = d.get(key) if isinstance(d, dict) else None
            value = value if value is not None else (d.get("meta", {}) or {}).get(key)
            if value and key not in machine:
                machine[key] = value
    run = _load(os.path.join(directory, "run.json")) or {}
    machine.update({k: v for k, v in run.items() if k in ("device", "date", "commit", "host")})
    return {"machine": machine, "notes": notes, "metrics": metrics}


def tables(summary: dict[str, Any]) -> str:
    lines = []
    for key, title in PANELS:
        values = summary["metrics"][key]
        if not values:
            continue
        lines += ["", f"| {title} | value |", "|---|---|"]
        lines += [f"| {tool} | {v:.3f} |" for tool, v in sorted(values.items(), key=lambda kv: kv[1])]
    return "\n".join(lines)


def chart(summary: dict[str, Any], path: str) -> bool:
    """Draw the six panels to ``path``; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 3, figsize=(18, 9))
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        values = sorted(summary["metrics"][key].items(), key=lambda kv: -kv[1])
        ax.set_title(title, fontsize=11)
        if not values:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        names = [n if len(n) <= 42 else n[:40] + "..." for n, _ in values]
        colors = ["#d9480f" if n.startswith("ckptmgr") else "#868e96" for n, _ in values]
        bars = ax.barh(names, [v for _, v in values], color=colors)
        ax.bar_label(bars, fmt="%.3g", fontsize=8, padding=2)
        ax.tick_params(axis="y", labelsize=8)
        ax.margins(x=0.2)
    m = summary["machine"]
    fig.suptitle(f"ckptmgr vs peers, lower is better: {m.get('device', '?')}, {m.get('date', '?')}, "
                 f"commit {m.get('commit', '?')}", fontsize=13)
    fig.text(0.01, 0.005, "; ".join(summary["notes"]), fontsize=8)
    fig.tight_layout(rect=(0, 0.02, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="directory of benchmark JSON files")
    args = ap.parse_args(argv)
    summary = summarize(args.dir)
    if not any(summary["metrics"].values()):
        print(f"no benchmark results in {args.dir}", file=sys.stderr)
        return 1
    print(tables(summary))
    with open(os.path.join(args.dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    png = os.path.join(args.dir, "chart.png")
    if chart(summary, png):
        print(f"\nwrote {os.path.join(args.dir, 'summary.json')} and {png}")
    else:
        print("\nmatplotlib is not installed (pip install 'ckptmgr[bench]'): no chart drawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
