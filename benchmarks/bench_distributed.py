"""Multi-GPU checkpoints: ckptmgr against torch.distributed.checkpoint (DCP) on the same state.

    python benchmarks/bench_distributed.py --gpus 2 --width 8192 --layers 8 --dir /var/tmp/x

One process per GPU (NCCL). For DDP (the model and AdamW state replicated on every rank, the
CUDA RNG state per rank) and FSDP2 (``fully_shard``: every parameter and optimizer state a
DTensor shard), each tool saves the same state twice (the second save is timed) and restores
it into a freshly initialized model and optimizer:

* ckptmgr: ``save(...).result()`` (each rank writes its share, rank 0 commits), restore with
  ``target=`` (each rank reads its own files; replicated tensors are broadcast over NCCL);
* DCP: ``dcp.save``/``dcp.load`` of ``get_state_dict``/``set_state_dict`` (its planner also
  writes a replicated tensor once).

Before each restore the page cache of the checkpoint's files is dropped, so both tools read
from the disk.

Reports, per tool and mode: the time the save call held the ranks, the time to durable (the
slowest rank), the aggregate write throughput, the restore time, and whether the restored
state is bit-identical to the saved one. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ckptmgr import CheckpointManager, PerRank


def build(mode: str, width: int, layers: int, rank: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).cuda()
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, width: int) -> None:
    model(torch.randn(64, width, device="cuda")).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """A sum over every local tensor of the model and optimizer state (shards under FSDP2)."""
    total = torch.zeros((), dtype=torch.float64, device="cuda")
    for t in list(model.state_dict().values()) + [v for s in opt.state.values() for v in s.values()]:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.double().sum()
    return float(total)


def evict(d: str) -> None:
    """Drop the page cache of every file under ``d``: restores read from the disk, whichever
    way the files were written (ckptmgr writes with O_DIRECT, DCP through the cache)."""
    for base, _, names in os.walk(d):
        for n in names:
            fd = os.open(os.path.join(base, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def sync() -> None:
    torch.cuda.synchronize()
    dist.barrier()


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    results: dict[str, Any] = {}
    for mode in args.modes.split(","):
        model, opt = build(mode, args.width, args.layers, rank, seed=0)
        step(model, opt, args.width)
        saved = fingerprint(model, opt)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # params + 2 Adam moments
        for tool in ("ckptmgr", "DCP"):
            d = os.path.join(args.dir, mode, tool)
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            sync()
            mgr = CheckpointManager(d) if tool == "ckptmgr" else None
            times = {}
            for s in (1, 2):
                sync()
                t0 = time.perf_counter()
                if mgr is not None:
                    state = {"model": model, "optim": opt, "step": s, "rng": PerRank(torch.cuda.get_rng_state())}
                    handle = mgr.save(s, state)
                    blocked = time.perf_counter() - t0
                    handle.result()
                else:
                    msd, osd = get_state_dict(model, opt)
                    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(d, f"step{s}"))
                    blocked = time.perf_counter() - t0
                durable = time.perf_counter() - t0
                times = {"blocked_s": blocked, "durable_s": durable}
            sync()
            fresh_model, fresh_opt = build(mode, args.width, args.layers, rank, seed=1)
            step(fresh_model, fresh_opt, args.width)  # optimizer state exists, with other values
            if rank == 0:
                evict(d)
            sync()
            t0 = time.perf_counter()
            if mgr is not None:
                target = {"model": fresh_model, "optim": fresh_opt, "step": 0,
                          "rng": PerRank(torch.cuda.get_rng_state())}
                mgr.restore(2, target=target, loader=args.loader)
            else:
                msd, osd = get_state_dict(fresh_model, fresh_opt)
                sd = {"model": msd, "optim": osd}
                dcp.load(sd, checkpoint_id=os.path.join(d, "step2"))
                set_state_dict(fresh_model, fresh_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            sync()
            times["restore_s"] = time.perf_counter() - t0
            times["identical"] = fingerprint(fresh_model, fresh_opt) == saved
            if mgr is not None:
                mgr.close()
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, times)
            results[f"{mode} {tool}"] = {"per_rank": gathered, "state_bytes_per_rank": nbytes,
                                         "durable_s": max(g["durable_s"] for g in gathered),
                                         "blocked_s": max(g["blocked_s"] for g in gathered),
                                         "restore_s": max(g["restore_s"] for g in gathered),
                                         "identical": all(g["identical"] for g in gathered)}
            del fresh_model, fresh_opt
            torch.cuda.empty_cache()
        del model, opt
        torch.cuda.empty_cache()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--modes", default="ddp,fsdp2")
    ap.add_argument("--loader", default="auto", help="ckptmgr's restore loader")
    ap.add_argument("--dir", default="/var/tmp/ckptmgr-bench-dist")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "distributed.json"))
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    raw = args.out + ".ranks"
    mp.spawn(worker, args=(args.gpus, port, args, raw), nprocs=args.gpus, join=True)
    with open(raw) as f:
        results = json.load(f)
    os.remove(raw)
    lines = [f"{args.gpus} x {torch.cuda.get_device_name()}, MLP {args.layers} x {args.width}^2 fp32 + AdamW",
             "", "| mode / tool | state GiB | save call s | durable s | write GB/s | restore s | identical |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        total = r["state_bytes_per_rank"]  # the whole state (global sizes), written once either way
        lines.append(f"| {name} | {total / 2**30:.1f} | {r['blocked_s']:.2f} | {r['durable_s']:.2f} | "
                     f"{total / r['durable_s'] / 1e9:.2f} | {r['restore_s']:.2f} | {r['identical']} |")
    print("\n".join(lines))
    with open(args.out, "w") as f:
        json.dump({"gpus": args.gpus, "device": torch.cuda.get_device_name(), "args": vars(args),
                   "date": time.strftime("%Y-%m-%d"), "commit": args.commit, "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
