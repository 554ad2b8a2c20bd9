"""Save and restore of one training-like state: ckptmgr against torch.save/torch.load and
safetensors save_file/load_file, in one process, on the same data, in the same directory.

    python benchmarks/bench_save_restore.py --gib 1 --dir /path/on/target/disk --repeat 3

Prints a table and writes JSON (default benchmarks/out/save_restore.json). Numbers are
medians over --repeat runs. Restore times include reading every page of the result, so a
lazily memory-mapped load (safetensors.load_file) pays for its reads like the others.
"durable" includes fsync of the written files for every tool (torch.save and safetensors
do not fsync by themselves; ckptmgr does before committing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from common import commit, fsync_tree, make_state

from ckptmgr import CheckpointManager


def touch(tensors: dict[str, torch.Tensor]) -> None:
    """Read one byte of every 4 KiB page, so lazily mapped results pay for their reads too."""
    for t in tensors.values():
        t.reshape(-1).view(torch.uint8)[::4096].sum()


def timed(fn: Callable[[], Any], *, load: bool = False) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    if load:
        touch(out)
    return time.perf_counter() - t, out


def bench_torch(state: dict[str, torch.Tensor], work: str) -> dict[str, float]:
    p = os.path.join(work, "state.pt")
    blocked, _ = timed(lambda: torch.save(state, p))
    sync, _ = timed(lambda: fsync_tree(p))
    load, out = timed(lambda: torch.load(p, weights_only=True, mmap=False), load=True)
    assert torch.equal(out["layers.1.weight"], state["layers.1.weight"])
    return {"blocked_s": blocked, "durable_s": blocked + sync, "restore_s": load}


def bench_safetensors(state: dict[str, torch.Tensor], work: str) -> dict[str, float]:
    from safetensors.torch import load_file, save_file

    p = os.path.join(work, "state.safetensors")
    blocked, _ = timed(lambda: save_file(state, p))
    sync, _ = timed(lambda: fsync_tree(p))
    load, out = timed(lambda: load_file(p), load=True)
    assert torch.equal(out["layers.1.weight"], state["layers.1.weight"])
    return {"blocked_s": blocked, "durable_s": blocked + sync, "restore_s": load}


def bench_ckptmgr(state: dict[str, torch.Tensor], work: str) -> dict[str, float]:
    with CheckpointManager(os.path.join(work, "ckpt")) as mgr:
        t0 = time.perf_counter()
        h = mgr.save(1, state)
        blocked = time.perf_counter() - t0
        info = h.result()
        durable = time.perf_counter() - t0
        load, out = timed(lambda: mgr.restore(1), load=True)
    assert torch.equal(out["layers.1.weight"], state["layers.1.weight"])
    return {"blocked_s": blocked, "durable_s": durable, "restore_s": load, "persist_gbps": info.throughput_gbps}


PEERS: dict[str, Callable[[dict[str, torch.Tensor], str], dict[str, float]]] = {
    "torch.save / torch.load": bench_torch,
    "safetensors save_file / load_file": bench_safetensors,
    "ckptmgr save / restore": bench_ckptmgr,
}


def run_once(state: dict[str, torch.Tensor], base: str, i: int) -> dict[str, dict[str, float]]:
    """Every tool once, in an order rotated per repeat, each in a fresh directory after a sync."""
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    names = list(PEERS)
    names = names[i % len(names):] + names[:i % len(names)]
    res = {}
    for name in names:
        work = tempfile.mkdtemp(prefix="bench-", dir=base)
        try:
            os.sync()  # no writeback of earlier files competes with this tool
            r = PEERS[name](state, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        r["durable_gbps"] = nbytes / r["durable_s"] / 1e9
        r["restore_gbps"] = nbytes / r["restore_s"] / 1e9
        res[name] = r
    return {name: res[name] for name in PEERS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="where files are written (default: a temp dir beside the repo)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "out", "save_restore.json"))
    args = ap.parse_args()

    state = make_state(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    base = args.dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(base, exist_ok=True)
    runs = [run_once(state, base, i) for i in range(args.repeat)]
    summary = {tool: {k: statistics.median(r[tool][k] for r in runs) for k in runs[0][tool]} for tool in runs[0]}
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {os.cpu_count()} cores",
            "torch": torch.__version__, "commit": commit(), "bytes": nbytes, "tensors": len(state),
            "dir": base, "repeat": args.repeat}
    print(f"\n{nbytes / 2**30:.2f} GiB in {len(state)} tensors, median of {args.repeat}, {meta['machine']}, "
          f"commit {meta['commit']}, files in {base}")
    print(f"| {'tool':36} | blocked s | durable s | durable GB/s | restore s | restore GB/s |")
    print(f"|{'-' * 38}|-----------|-----------|--------------|-----------|--------------|")
    for tool, r in summary.items():
        print(f"| {tool:36} | {r['blocked_s']:9.3f} | {r['durable_s']:9.3f} | {r['durable_gbps']:12.2f} "
              f"| {r['restore_s']:9.3f} | {r['restore_gbps']:12.2f} |")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "summary": summary, "runs": runs}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
