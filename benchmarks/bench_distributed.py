"""Multi-rank checkpoints: ckptmgr against torch.distributed.checkpoint (DCP) on the same state.

    python benchmarks/bench_distributed.py --rounds 3 --saves 3 --out $OUT/distributed.json          # every GPU, NCCL
    python benchmarks/bench_distributed.py --device cpu --gpus 2 --width 512 --layers 4 --rounds 3   # CPU, gloo

For DDP (the model and AdamW state replicated on every rank, the RNG state per rank) and FSDP2
(``fully_shard``: every parameter and optimizer state a DTensor shard), each tool runs in its
own fresh processes (a launch of ``--gpus`` ranks per tool and round, the tools' order rotated
from round to round) and saves ``--saves`` times, one training step between saves:

* ``ckptmgr``: ``save(step, state, block=False)`` (the call), ``wait_staged()`` (the state may
  change), ``result()`` (durable: every rank's files written, rank 0 committed);
* ``DCP save``: ``dcp.save`` of ``get_state_dict`` (the call returns once durable);
* ``DCP async_save``: ``dcp.async_save`` with one ``DefaultStager`` (pinned on GPUs, async
  staging) reused for every save (the call; ``staging_completion``; ``upload_completion``). If a
  reused stager fails on this torch, the error is reported and every save uses a fresh stager
  instead, and the tool is labelled ``DCP async_save (fresh stager)``.

The first save of a process (allocations, pinning, plans) and the later ones are reported apart:
per round, the first save and the median of the later saves; over the rounds, the median and
the range of each. Then each round restores the newest step in fresh processes per tool
(``ckptmgr`` with ``target=`` from the durable files, its local tier off: the slots the saving
processes left in /dev/shm would serve it from RAM; ``DCP``: ``dcp.load`` + ``set_state_dict``,
from the ``dcp.save`` checkpoint) into a freshly initialized model and optimizer, after dropping the files' page
cache, and checks bit-identity with an exact, layout-independent fingerprint. Times are the
slowest rank's; each restore also reports the most bytes any rank had the disk read (from
/proc/self/io, the page cache dropped) beside that rank's shard of the state. Prints a table and writes JSON
(``--out``). ``--max-wall-s`` stops starting rounds after that long (the JSON says how many ran).
``--tools ckptmgr`` leaves DCP out (another ckptmgr build measured in the same call, beside a run
that has it; the restores then check against the first save's fingerprint).

Resharding (``--reshard SAVE:R1,R2``, benchmarks/dist_reshard.py): an FSDP2 model + AdamW saved
by SAVE processes with each tool, restored by R1 and then R2 processes:

    NCCL_NVLS_ENABLE=0 python benchmarks/bench_distributed.py --reshard 4:2,4 --out $OUT/reshard.json
    python benchmarks/bench_distributed.py --reshard 2:1,3 --device cpu --width 256 --layers 2   # CPU, gloo
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from common import evict, global_fingerprint, proc_io
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ckptmgr import CheckpointManager, KeepLatest, PerRank, StagingOptions

SAVERS = ("ckptmgr", "DCP save", "DCP async_save")
RESTORERS = ("ckptmgr", "DCP")


def init(rank: int, world: int, port: int, device: str) -> torch.device:
    """Join the job: NCCL for CUDA tensors and gloo for CPU ones (DCP's async_save needs a CPU
    backend), or gloo alone on the CPU."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", rank))
        return torch.device("cuda", rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build(mode: str, width: int, layers: int, dev: torch.device, seed: int) -> tuple[torch.nn.Module,
                                                                                     torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, width: int, dev: torch.device) -> None:
    model(torch.randn(16, width, device=dev)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _rng(dev: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state() if dev.type == "cuda" else torch.get_rng_state()


class _Sync:
    def __init__(self, dev: torch.device) -> None:
        self.dev = dev

    def __call__(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()


def _stager(dev: torch.device) -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager
    from torch.distributed.checkpoint.staging import StagingOptions as DcpStagingOptions

    return DefaultStager(DcpStagingOptions(use_pinned_memory=dev.type == "cuda", use_shared_memory=False,
                                           use_async_staging=True, use_non_blocking_copy=dev.type == "cuda"))


def _dcp_async(state: dict[str, Any], path: str, stager: Any) -> tuple[Any, Any]:
    """(wait until staged, wait until durable) of one dcp.async_save."""
    r = dcp.async_save(state, checkpoint_id=path, async_stager=stager)
    if hasattr(r, "staging_completion"):
        return r.staging_completion.result, r.upload_completion.result
    return (lambda: None), r.result


def _saves(tool: str, mode: str, d: str, args: argparse.Namespace, dev: torch.device, reuse: bool
           ) -> tuple[list[dict[str, float]], dict[str, list[int]]]:
    """Build, train, save ``args.saves`` times with ``tool``; this rank's times per save and the
    fingerprint of the state of the last save."""
    sync = _Sync(dev)
    model, opt = build(mode, args.width, args.layers, dev, seed=0)
    train_step(model, opt, args.width, dev)
    mgr = CheckpointManager(d, retention=KeepLatest(1)) if tool == "ckptmgr" else None
    stager = _stager(dev) if tool == "DCP async_save" and reuse else None
    times: list[dict[str, float]] = []
    try:
        for s in range(1, args.saves + 1):
            if s > 1:
                train_step(model, opt, args.width, dev)
            sync()
            try:
                times.append(_one_save(tool, s, model, opt, mgr, d, dev, stager if reuse else None))
                error = None
            except Exception as exc:  # agreed on below: every rank raises, or none
                error = f"{type(exc).__name__}: {exc}"
            errors: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
            if bad:
                raise RuntimeError(f"save {s}: " + "; ".join(bad))
            sync()
            if mgr is not None:
                mgr.wait()  # its retention's deletion of the step before, outside the timed window
            elif dist.get_rank() == 0 and s > 1:
                shutil.rmtree(os.path.join(d, f"step{s - 1}"), ignore_errors=True)
            sync()
        return times, global_fingerprint(model, opt)
    finally:
        if mgr is not None:
            mgr.close()
        if stager is not None:
            stager.close()
        del model, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _one_save(tool: str, s: int, model: torch.nn.Module, opt: torch.optim.Optimizer, mgr: CheckpointManager | None,
              d: str, dev: torch.device, stager: Any) -> dict[str, float]:
    """One save with ``tool`` (``stager``: the reused one, or None for a fresh one): the call,
    until the state may change, until durable (this rank)."""
    t0 = time.perf_counter()
    if mgr is not None:
        handle = mgr.save(s, {"model": model, "optim": opt, "step": s, "rng": PerRank(_rng(dev))}, block=False)
        call = time.perf_counter() - t0
        handle.wait_staged()
        staged = time.perf_counter() - t0
        handle.result()
        return {"call_s": call, "staged_s": staged, "durable_s": time.perf_counter() - t0}
    msd, osd = get_state_dict(model, opt)
    path = os.path.join(d, f"step{s}")
    if tool == "DCP save":
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        call = time.perf_counter() - t0
        return {"call_s": call, "staged_s": call, "durable_s": call}
    fresh = _stager(dev) if stager is None else None
    try:
        wait_staged, wait_durable = _dcp_async({"model": msd, "optim": osd}, path, stager or fresh)
        call = time.perf_counter() - t0
        wait_staged()
        staged = time.perf_counter() - t0
        wait_durable()
        return {"call_s": call, "staged_s": staged, "durable_s": time.perf_counter() - t0}
    finally:
        if fresh is not None:
            fresh.close()


def _local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's own part of the model and optimizer state (a DTensor's local shard)."""
    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    return sum(local(p) for p in model.parameters()) + sum(
        local(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def _restore(tool: str, mode: str, d: str, args: argparse.Namespace, dev: torch.device,
             saved: dict[str, list[int]]) -> dict[str, Any]:
    sync = _Sync(dev)
    model, opt = build(mode, args.width, args.layers, dev, seed=1)
    train_step(model, opt, args.width, dev)  # optimizer state exists, with other values
    if dist.get_rank() == 0:
        evict(d)
    sync()
    io0 = proc_io()
    t0 = time.perf_counter()
    if tool == "ckptmgr":  # from the durable files, as DCP (not the local tier the save left in RAM)
        with CheckpointManager(d, staging=StagingOptions(local_tier=False)) as mgr:
            mgr.restore(target={"model": model, "optim": opt, "step": 0, "rng": PerRank(_rng(dev))},
                        loader=args.loader)
    else:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(d, f"step{args.saves}"))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    sync()
    out = {"restore_s": time.perf_counter() - t0, "identical": global_fingerprint(model, opt) == saved}
    io1 = proc_io()
    if io0 and io1:  # what this rank had the disk read (the page cache was dropped) against its shard's size
        out["read_mib"] = (io1["read_bytes"] - io0["read_bytes"]) / 2**20
        out["shard_mib"] = _local_bytes(model, opt) / 2**20
    del model, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, phase: str, tool: str, rnd: int,
           out: str) -> None:
    dev = init(rank, world, port, args.device)
    result: dict[str, Any] = {}
    for mode in args.modes.split(","):
        d = os.path.join(args.dir, f"round{rnd}", mode, "DCP save" if phase == "restore" and tool == "DCP" else tool)
        fp_path = os.path.join(args.dir, f"round{rnd}", mode, "fingerprint.json")
        if phase == "save":
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
            r: dict[str, Any] = {}
            try:
                times, fp = _saves(tool, mode, d, args, dev, reuse=True)
            except Exception as exc:
                if tool != "DCP async_save":
                    raise
                r["stager_error"] = f"{type(exc).__name__}: {exc}"
                print(f"rank {rank}: {mode}: DCP async_save with a reused stager failed ({r['stager_error']}); "
                      "a fresh stager per save instead", file=sys.stderr)
                traceback.print_exc()
                if rank == 0:
                    shutil.rmtree(d, ignore_errors=True)
                dist.barrier()
                times, fp = _saves(tool, mode, d, args, dev, reuse=False)
                r["fresh_stager"] = True
            r["per_save"] = times
            if rank == 0 and (tool == "DCP save" or not os.path.exists(fp_path)):  # what every restore of
                # this round must give back (every saver trains alike; DCP's, when it runs, is the reference)
                with open(fp_path, "w") as f:
                    json.dump(fp, f)
            result[mode] = r
        else:
            with open(fp_path) as f:
                saved = json.load(f)
            result[mode] = _restore(tool, mode, d, args, dev, saved)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    # Torch 2.13 sometimes aborts a rank of these jobs at its teardown ("terminate called
    # without an active exception", seen on gloo after DCP's save, async_save and load);
    # everything is measured and written by now, so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(args: argparse.Namespace, phase: str, tool: str, rnd: int) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = f"{args.out}.{phase}.ranks"
    print(f"round {rnd + 1}: {phase} with {tool}", flush=True)
    mp.spawn(worker, args=(args.gpus, port, args, phase, tool, rnd, raw), nprocs=args.gpus, join=True)
    with open(raw) as f:
        ranks = json.load(f)
    os.remove(raw)
    return ranks


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(rounds: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per mode and tool: first save and later saves (per round: the first, the median of the
    rest; slowest rank), then the median and range over the rounds; restores likewise."""
    out: dict[str, Any] = {}
    for mode in modes:
        for tool in SAVERS:
            ranks_by_round = [r["save"][tool] for r in rounds if tool in r["save"]]
            if not ranks_by_round:
                continue
            fresh = any(rk[mode].get("fresh_stager") for ranks in ranks_by_round for rk in ranks)
            name = f"{mode} {tool}" + (" (fresh stager)" if fresh else "")
            entry: dict[str, Any] = {"tool": tool, "mode": mode, "rounds": len(ranks_by_round)}
            errors = sorted({rk[mode]["stager_error"] for ranks in ranks_by_round for rk in ranks
                             if "stager_error" in rk[mode]})
            if errors:
                entry["reused_stager_error"] = errors
            for key in ("call_s", "staged_s", "durable_s"):
                firsts, laters = [], []
                for ranks in ranks_by_round:
                    per_save = [max(rk[mode]["per_save"][i][key] for rk in ranks)
                                for i in range(len(ranks[0][mode]["per_save"]))]
                    firsts.append(per_save[0])
                    if len(per_save) > 1:
                        laters.append(statistics.median(per_save[1:]))
                entry[f"first {key}"] = _spread(firsts)
                if laters:
                    entry[f"later {key}"] = _spread(laters)
            out[name] = entry
        for tool in RESTORERS:
            rs = [r["restore"][tool] for r in rounds if tool in r.get("restore", {})]
            if rs:
                out[f"{mode} {tool} restore"] = {
                    "tool": tool, "mode": mode, "rounds": len(rs),
                    "restore_s": _spread([max(rk[mode]["restore_s"] for rk in ranks) for ranks in rs]),
                    "identical": all(rk[mode]["identical"] for ranks in rs for rk in ranks)}
                if all("read_mib" in rk[mode] for ranks in rs for rk in ranks):  # the most any rank read
                    out[f"{mode} {tool} restore"].update(
                        read_mib=_spread([max(rk[mode]["read_mib"] for rk in ranks) for ranks in rs]),
                        shard_mib=max(rk[mode]["shard_mib"] for ranks in rs for rk in ranks))
    return out


def table(summary: dict[str, Any]) -> list[str]:
    def cell(e: dict[str, Any], key: str, fmt: str = ".3f") -> str:
        s = e.get(key)
        return "-" if s is None else f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    lines = ["| mode / tool | first: call s | first: staged s | first: durable s | later: call s | "
             "later: staged s | later: durable s |", "|---|---|---|---|---|---|---|"]
    for name, e in summary.items():
        if "restore_s" in e:
            continue
        lines.append(f"| {name} | " + " | ".join(cell(e, f"{w} {k}") for w in ("first", "later")
                                                 for k in ("call_s", "staged_s", "durable_s")) + " |")
    for name, e in summary.items():
        for err in e.get("reused_stager_error", []):
            lines.append(f"\n{name}: a reused DefaultStager failed ({err}); every save used a fresh stager")
    lines += ["", "| mode / tool | restore s (fresh processes, cold cache) | identical | MiB read by a rank (most) "
              "| its shard, MiB |", "|---|---|---|---|---|"]
    for name, e in summary.items():
        if "restore_s" in e:
            shard = f"{e['shard_mib']:.0f}" if "shard_mib" in e else "-"
            read = cell(e, "read_mib", ".0f")
            lines.append(f"| {name} | {cell(e, 'restore_s')} | {e['identical']} | {read} | {shard} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count(), help="ranks (processes) per launch")
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--modes", default="ddp,fsdp2")
    ap.add_argument("--tools", default="ckptmgr,DCP",
                    help="ckptmgr, DCP (dcp.save, dcp.async_save and dcp.load), or both: the peer need not run "
                         "again for another ckptmgr build measured in the same call")
    ap.add_argument("--rounds", type=int, default=3, help="launches per tool; medians and ranges over them")
    ap.add_argument("--saves", type=int, default=3, help="saves per launch: the first, and the later ones")
    ap.add_argument("--max-wall-s", type=float, default=0.0, help="start no round after this long (0: no limit)")
    ap.add_argument("--loader", default="auto", help="ckptmgr's restore loader")
    ap.add_argument("--dir", default="/var/tmp/ckptmgr-bench-dist")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "distributed.json"))
    ap.add_argument("--reshard", default="", metavar="SAVE:R1,R2",
                    help="FSDP2 saved by SAVE processes, restored by R1, then R2 (e.g. 4:2,4)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="GPUs (NCCL) or CPU (gloo)")
    args = ap.parse_args()
    if args.reshard:
        from dist_reshard import reshard_main

        reshard_main(args)
        return
    if args.device == "cpu" and args.gpus < 1:
        args.gpus = 2
    if args.device == "cuda" and (args.gpus < 1 or torch.cuda.device_count() < args.gpus):
        raise SystemExit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPUs "
                         "(--device cpu: ranks on gloo)")
    if args.rounds < 1 or args.saves < 1:
        raise SystemExit("--rounds and --saves must be at least 1")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    modes = args.modes.split(",")
    chosen = set(args.tools.split(","))
    if not chosen or chosen - {"ckptmgr", "DCP"}:
        raise SystemExit(f"--tools {args.tools}: name ckptmgr, DCP or both")
    savers = [t for t in SAVERS if t.split()[0] in chosen]
    restorers = [t for t in RESTORERS if t in chosen]
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (gloo)"
    nbytes = (args.width * args.width + args.width) * 4 * args.layers * 3  # params + 2 AdamW moments, fp32
    t0 = time.perf_counter()
    rounds: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        if rounds and args.max_wall_s and time.perf_counter() - t0 > args.max_wall_s:
            print(f"--max-wall-s {args.max_wall_s:.0f}: stopping after {len(rounds)} round(s)")
            break
        k = rnd % len(savers)
        order = savers[k:] + savers[:k]  # rotated: each tool runs first, second and third in turn
        r: dict[str, Any] = {"order": list(order), "save": {}, "restore": {}}
        for tool in order:
            r["save"][tool] = _spawn(args, "save", tool, rnd)
        for tool in restorers if rnd % 2 == 0 else restorers[::-1]:
            r["restore"][tool] = _spawn(args, "restore", tool, rnd)
        shutil.rmtree(os.path.join(args.dir, f"round{rnd}"), ignore_errors=True)
        rounds.append(r)
        _write(args, rounds, modes, t0, dev_name, nbytes)  # after every round: a killed run keeps what it measured
        print(f"round {rnd + 1}/{args.rounds} done at {time.perf_counter() - t0:.0f} s", flush=True)
    summary = _write(args, rounds, modes, t0, dev_name, nbytes)
    lines = [f"{args.gpus} x {dev_name}, MLP {args.layers} x {args.width}^2 fp32 + AdamW ({nbytes / 2**30:.2f} GiB); "
             f"{len(rounds)} round(s) of {args.saves} save(s) per tool, fresh processes; median (range)", ""]
    lines += table(summary)
    print("\n".join(lines))
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")


def _write(args: argparse.Namespace, rounds: list[dict[str, Any]], modes: list[str], t0: float, dev_name: str,
           nbytes: int) -> dict[str, Any]:
    summary = summarize(rounds, modes)
    with open(args.out, "w") as f:
        json.dump({"mode": "save-restore", "gpus": args.gpus, "device": dev_name, "state_bytes": nbytes,
                   "args": vars(args), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                   "commit": args.commit, "wall_s": time.perf_counter() - t0, "rounds_done": len(rounds),
                   "summary": summary, "rounds": rounds}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
