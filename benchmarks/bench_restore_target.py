"""What all-or-nothing restores into a target cost: restore(target=...) against a restore into
fresh memory, per loader, from a warm page cache (or /dev/shm), in one process.

A restore into a target verifies every checksum of the step before the first byte lands in
the target's tensors (so a damaged step leaves the target as it was); a restore into fresh
memory checks each chunk as it lands. The difference between the two columns is the price of
the guarantee. Run the same script on an older checkout (PYTHONPATH) to compare.

    python benchmarks/bench_restore_target.py --device cpu --gib 0.5
    python benchmarks/bench_restore_target.py --device cuda --gib 4 --root /dev/shm/bench --out $OUT
    python benchmarks/bench_restore_target.py --device cpu --gib 1 --tensors 10000   # many small tensors
    python benchmarks/bench_restore_target.py --device cpu --state model             # nested, Stateful

``--state model`` restores a model of ~2000 parameters and its AdamW optimizer (Stateful
objects, nested state dicts: what restoring a training job costs beyond its bytes) into a
model and an optimizer that already exist; ``--tensors`` splits the flat state into that many
tensors (each restore then walks that many leaves).

Prints a table; with ``--out DIR`` writes ``restore_target.json`` there. Never asserts a time.
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
from typing import Any

import torch

from ckptmgr import CheckpointManager, StagingOptions


def _state(gib: float, device: str, tensors: int) -> dict[str, torch.Tensor]:
    n = int(gib * (1 << 30)) // 4 // tensors
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.randn(n, generator=g).to(device) for i in range(tensors)}


def _model(device: str, seed: int) -> dict[str, Any]:
    """125 blocks of 4 linear layers and 4 layer norms (2000 parameters) and its AdamW, stepped once."""
    torch.manual_seed(seed)
    blocks = [torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))])
              for _ in range(125)]
    model = torch.nn.Sequential(*blocks).to(device)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64, device=device)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "step": seed}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gib", type=float, default=0.5)
    p.add_argument("--tensors", type=int, default=16, help="tensors of the flat state")
    p.add_argument("--state", choices=("flat", "model"), default="flat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--loaders", default=None, help="comma-separated (default: host,ring on CPU; ring,inplace on GPU)")
    p.add_argument("--root", default=None, help="where to save (default: a temporary directory)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    loaders = (args.loaders or ("ring,inplace" if gpu else "host,ring")).split(",")
    root = args.root or tempfile.mkdtemp(prefix="ckptmgr-bench-target-")
    state: Any = _state(args.gib, args.device, args.tensors) if args.state == "flat" else _model(args.device, 1)
    sizes = list(state.values()) if args.state == "flat" else list(state["model"].state_dict().values())
    nbytes = sum(t.numel() * t.element_size() for t in sizes)
    rows = []
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, state).result()
        for loader in loaders:
            for mode in ("fresh", "target"):
                times = []
                target = ({k: torch.empty_like(v) for k, v in state.items()} if args.state == "flat"
                          else _model(args.device, 2))
                for _ in range(args.repeats + 1):  # the first run warms the page cache and the ring
                    _sync(args.device)
                    t = time.perf_counter()
                    if mode == "fresh":
                        mgr.restore(1, device=args.device, loader=loader)
                    else:
                        mgr.restore(1, target=target, loader=loader)
                    _sync(args.device)
                    times.append(time.perf_counter() - t)
                best, median = min(times[1:]), statistics.median(times[1:])
                rows.append({"loader": loader, "mode": mode, "best_s": best, "median_s": median,
                             "GBps_best": nbytes / best / 1e9})
                print(f"{loader:8s} {mode:7s} best {best:7.3f} s  median {median:7.3f} s  "
                      f"{nbytes / best / 1e9:6.2f} GB/s", flush=True)
    for loader in loaders:
        fresh, tgt = (next(r for r in rows if r["loader"] == loader and r["mode"] == m) for m in ("fresh", "target"))
        print(f"{loader:8s} target / fresh (median): {tgt['median_s'] / fresh['median_s']:.2f}x")
    if args.root is None:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        info = {"device": args.device, "gib": nbytes / (1 << 30), "state": args.state,
                "tensors": args.tensors if args.state == "flat" else len(sizes), "host": platform.node(),
                "gpu": torch.cuda.get_device_name() if gpu else None, "torch": torch.__version__, "rows": rows}
        with open(os.path.join(args.out, "restore_target.json"), "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
