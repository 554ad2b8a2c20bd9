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

Resharding (``--reshard SAVE:R1,R2``): an FSDP2 model + AdamW (one step taken, so the moments
exist) is saved by SAVE processes with each tool, then restored by R1 processes, then by R2
(one launch each), into a fresh model and a fresh AdamW, from the disk (page cache dropped):

    NCCL_NVLS_ENABLE=0 python benchmarks/bench_distributed.py --reshard 4:2,4 --out $OUT/reshard.json
    python benchmarks/bench_distributed.py --reshard 2:1,3 --device cpu --width 256 --layers 2   # CPU, gloo

Reports per tool and world size: the save time, the restore time (slowest rank), the bytes each
rank read (ckptmgr: counted at its storage; both tools: ``rchar`` and ``read_bytes`` of
/proc/self/io), and whether every parameter and moment is bit-identical to the saved one (an
exact, layout-independent fingerprint: wrap-around int64 sums of the raw bits, plain and weighted
by each element's global position).
"""

from __future__ import annotations

import argparse
import json
import math
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


# ------------------------------------------------------------------ resharding


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


def global_fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[int]]:
    """Per parameter and moment: (sum of the raw 32-bit words, sum weighted by global position),
    int64 with wrap-around, reduced over the ranks: exact and independent of the layout."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        for key, t in [(name, p), *((f"{name}.{k}", v) for k, v in opt.state[p].items())]:
            if isinstance(t, DTensor):
                local = t.to_local().detach()
                _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                start = int(offset[0]) * math.prod(t.shape[1:]) if t.dim() else 0  # FSDP2: Shard(0)
            else:
                local, start = t.detach(), 0
            words = local.contiguous().reshape(-1).view(torch.int32).to(torch.int64)
            pos = torch.arange(start, start + words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
            s = torch.stack([words.sum(), (words * pos).sum()])
            if isinstance(t, DTensor):
                dist.all_reduce(s)
            out[key] = s
    return {k: [int(x) for x in v.cpu()] for k, v in out.items()}


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
            if tool == "ckptmgr":
                with CheckpointManager(d) as mgr:
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
    dist.destroy_process_group()


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
    ap.add_argument("--reshard", default="", metavar="SAVE:R1,R2",
                    help="FSDP2 saved by SAVE processes, restored by R1, then R2 (e.g. 4:2,4)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="--reshard on GPUs (NCCL) or CPU (gloo)")
    args = ap.parse_args()
    if args.reshard:
        reshard_main(args)
        return
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
