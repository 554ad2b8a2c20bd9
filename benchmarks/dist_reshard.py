"""Resharding part of benchmarks/bench_distributed.py (``--reshard SAVE:R1,R2``): an FSDP2 model
+ AdamW saved by SAVE processes with ckptmgr and with DCP, restored by R1 and then R2 processes
into a fresh model and optimizer from the disk (page cache dropped). See that script's docstring.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from common import evict, global_fingerprint
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ckptmgr import CheckpointManager, StagingOptions


def _init(rank: int, world: int, port: int, device: str) -> torch.device:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        return torch.device("cuda", rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build_fsdp(width: int, layers: int, dev: torch.device, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def reshard_worker(rank: int, world: int, port: int, args: argparse.Namespace, phase: str, out: str) -> None:
    dev = _init(rank, world, port, args.device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    result: dict[str, Any] = {}
    if phase == "save":
        model, opt = build_fsdp(args.width, args.layers, dev, seed=0)
        model(torch.randn(16, args.width, device=dev)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        result["fingerprint"] = global_fingerprint(model, opt)
        for tool in ("ckptmgr", "DCP"):
            d = os.path.join(args.dir, "reshard", tool)
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            sync()
            t0 = time.perf_counter()
            if tool == "ckptmgr":
                with CheckpointManager(d) as mgr:
                    mgr.save(1, {"model": model, "optim": opt, "step": 1}).result()
            else:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)
            sync()
            result[tool] = {"save_s": time.perf_counter() - t0}
    else:
        with open(args.saved_fingerprint) as f:
            saved = json.load(f)
        for tool in ("ckptmgr", "DCP"):
            d = os.path.join(args.dir, "reshard", tool)
            model, opt = build_fsdp(args.width, args.layers, dev, seed=1)  # fresh, as at a restart
            if rank == 0:
                evict(d)
            sync()
            counted = [0]
            io0, t0 = _io(), time.perf_counter()
            if tool == "ckptmgr":  # from the durable files, as DCP (not the local tier the save left in RAM)
                with CheckpointManager(d, staging=StagingOptions(local_tier=False)) as mgr:
                    real = mgr._target.read_into

                    def read_into(step: int, name: str, offset: int, bufs: list[Any], real: Any = real,
                                  counted: list[int] = counted) -> None:
                        counted[0] += sum(b.size for b in bufs)
                        real(step, name, offset, bufs)

                    mgr._target.read_into = read_into  # type: ignore[method-assign]
                    mgr.restore(1, target={"model": model, "optim": opt, "step": 0})
            else:
                msd, osd = get_state_dict(model, opt)
                sd = {"model": msd, "optim": osd}
                dcp.load(sd, checkpoint_id=d)
                set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            sync()
            elapsed, io1 = time.perf_counter() - t0, _io()
            result[tool] = {"restore_s": elapsed, "identical": global_fingerprint(model, opt) == saved,
                            "counted_bytes": counted[0] if tool == "ckptmgr" else None,
                            "rchar": io1["rchar"] - io0["rchar"], "read_bytes": io1["read_bytes"] - io0["read_bytes"]}
            del model, opt
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    sys.stdout.flush()  # leave without the teardown, which torch 2.13 sometimes aborts after DCP calls
    sys.stderr.flush()
    os._exit(0)


def _spawn(world: int, args: argparse.Namespace, phase: str) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = f"{args.out}.{phase}.ranks"
    mp.spawn(reshard_worker, args=(world, port, args, phase, raw), nprocs=world, join=True)
    with open(raw) as f:
        ranks = json.load(f)
    os.remove(raw)
    return ranks


def reshard_main(args: argparse.Namespace) -> None:
    saved_world, _, rest = args.reshard.partition(":")
    save_w, restore_ws = int(saved_world), [int(x) for x in rest.split(",") if x]
    need = max([save_w, *restore_ws])
    if args.device == "cuda" and torch.cuda.device_count() < need:
        raise SystemExit(f"--reshard {args.reshard} needs {need} GPUs; this machine has {torch.cuda.device_count()}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t0 = time.perf_counter()
    save = _spawn(save_w, args, "save")
    args.saved_fingerprint = f"{args.out}.fingerprint"
    with open(args.saved_fingerprint, "w") as f:
        json.dump(save[0]["fingerprint"], f)
    nbytes = sum(p.numel() * 4 for p in torch.nn.Linear(args.width, args.width).parameters()) * args.layers * 3
    results: dict[str, Any] = {"save": {tool: {"save_s": max(r[tool]["save_s"] for r in save)}
                                        for tool in ("ckptmgr", "DCP")}}
    for w in restore_ws:
        ranks = _spawn(w, args, f"restore{w}")
        results[f"restore at {w}"] = {tool: {
            "restore_s": max(r[tool]["restore_s"] for r in ranks),
            "identical": all(r[tool]["identical"] for r in ranks),
            "counted_bytes_per_rank": [r[tool]["counted_bytes"] for r in ranks],
            "rchar_per_rank": [r[tool]["rchar"] for r in ranks],
            "read_bytes_per_rank": [r[tool]["read_bytes"] for r in ranks]} for tool in ("ckptmgr", "DCP")}
    os.remove(args.saved_fingerprint)
    shutil.rmtree(os.path.join(args.dir, "reshard"), ignore_errors=True)  # both tools' checkpoints
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (gloo)"
    lines = [f"FSDP2 MLP {args.layers} x {args.width}^2 fp32 + AdamW ({nbytes / 2**30:.2f} GiB), saved by {save_w} "
             f"x {dev_name}", "",
             "| tool | save s | " + " | ".join(f"restore at {w}: s, MiB read per rank (rchar), identical"
                                            for w in restore_ws) + " |",
             "|---|---|" + "---|" * len(restore_ws)]
    for tool in ("ckptmgr", "DCP"):
        cells = []
        for w in restore_ws:
            r = results[f"restore at {w}"][tool]
            per = ", ".join(f"{x / 2**20:.1f}" for x in r["rchar_per_rank"])
            cells.append(f"{r['restore_s']:.2f}, [{per}], {r['identical']}")
        lines.append(f"| {tool} | {results['save'][tool]['save_s']:.2f} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    with open(args.out, "w") as f:
        json.dump({"mode": "reshard", "save_world": save_w, "restore_worlds": restore_ws, "device": dev_name,
                   "state_bytes": nbytes, "args": {k: v for k, v in vars(args).items() if k != "saved_fingerprint"},
                   "date": time.strftime("%Y-%m-%d"), "commit": args.commit, "wall_s": time.perf_counter() - t0,
                   "results": results}, f, indent=1)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
