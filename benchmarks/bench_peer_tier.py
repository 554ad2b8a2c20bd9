"""The peer tier: what replication costs a training loop, how soon a step is replicated, and how
fast a replaced node's ranks get their shards back from peers against the durable target.

    torchrun --nproc-per-node 2 benchmarks/bench_peer_tier.py --ranks-per-node 1 --quick   # 2 GPUs, 1-3 minutes
    torchrun --nproc-per-node 4 benchmarks/bench_peer_tier.py --ranks-per-node 2 --out $OUT/peer.json   # GPUs
    python benchmarks/bench_peer_tier.py --device cpu --nproc 4 --ranks-per-node 2 --width 256 --layers 2 \\
        --batch 16 --steps 50                                                                   # CPU smoke

Ranks are grouped into simulated nodes of ``--ranks-per-node`` (node identity and RAM directory
per group). A DDP model (``--layers`` x Linear(``--width``)) + AdamW trains ``--steps`` steps
with a save every ``--every`` steps, twice: without the peer tier and with it
(``PeerOptions(replicas=1)``, gloo), the order of the two rotated per ``--rounds``, after
``--warmup`` (20) untimed steps with no manager. At the
defaults (width 8192 x 8 layers + AdamW: 6.4 GB of state per rank) one round moves about
17 x 6.4 GB per rank (4 durable writes and 4 RAM copies per run, 4 replications, 9 restores)
and takes minutes; ``--quick`` (2048 x 4, 0.2 GB per rank, one round, 3 restores per source)
is sized for 1-3 minutes on 2 GPUs, most of it process start-up and model builds.

Rank 0 prints a line as each phase starts and ends (flushed); a phase that runs longer than
``--phase-timeout`` seconds on any rank is reported by name on that rank and the process exits
with status 3, instead of hanging. Reported, slowest rank:

* the mean step time of each run (saves included) and the overhead of replication;
* the time from ``save()`` until its step is replicated (every rank's shard confirmed on a peer);
* the bandwidths measured: the durable target's writes (a save's bytes over its persist time)
  and reads (the durable restore), and the peer transport's (bytes sent over the time moving
  them, all rounds of a rank together);
* recovery: the last node is lost (its RAM directory deleted); its ranks come back on a fresh
  node (new identity, empty RAM) and every rank restores the newest step, ``--restores`` times
  from each of three sources, the order reversed every other time: from peers over the restore
  transport (the job's own group: NCCL through GPU memory on GPUs, gloo on ``--device cpu``),
  from peers over the peer tier's gloo group (``PeerOptions(transport="gloo")``: host bytes
  over TCP), and the same step from the durable target with its files' pages dropped from the
  page cache first (fsync, then ``POSIX_FADV_DONTNEED``; the share still cached afterwards is
  measured with ``mincore`` and reported). For the peer sources the other ranks read their
  own node's RAM, and the replacement node starts empty each time (so it fetches again).
  Each restore is timed from the call to the last rank's return; reported as median
  [min-max] (count), with the fetch's transfer rate (bytes received over the time moving
  them, slowest fetching rank) and the GPU memory its staging took. Restored state is
  checked bit-exact every time.

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import evict

from ckptmgr import CheckpointManager, PeerOptions

LIMIT = {"s": 600.0}  # --phase-timeout
# the phases of a peer restore the manager counts (stats()), each reported for its slowest rank
PHASES = ("peer_restore_check_s", "peer_restore_fetch_s", "peer_fetch_check_s", "peer_fetch_write_wait_s",
          "peer_restore_load_s")


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Say the phase starts and ends (rank 0); if it runs past ``--phase-timeout`` seconds on
    this rank, say which phase stalled and exit with status 3 (never a silent hang)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    t0 = time.perf_counter()

    def stalled() -> None:
        print(f"bench_peer_tier: rank {rank}: phase '{name}' stalled: still running after {LIMIT['s']:g} s",
              file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(LIMIT["s"], stalled)
    timer.daemon = True
    timer.start()
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
    try:
        yield
    finally:
        timer.cancel()
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {time.perf_counter() - t0:.1f} s", flush=True)


def init(rank: int, world: int, port: int | None, device: str) -> torch.device:
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
        return torch.device("cuda", local)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build(width: int, layers: int, dev: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values())]:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def node_of(rank: int, per_node: int) -> str:
    return f"node{rank // per_node}"


def run(args: argparse.Namespace, dev: torch.device, root: str, shm: str, peers: bool) -> dict[str, Any]:
    """One training run; returns the slowest rank's numbers."""
    rank = dist.get_rank()
    node = node_of(rank, args.ranks_per_node)
    popts = PeerOptions(replicas=1, node=node, local_dir=os.path.join(shm, node)) if peers else None
    what = "peer tier" if peers else "no peer tier"
    with phase(f"{what}: start"):
        os.makedirs(os.path.join(shm, node), mode=0o700, exist_ok=True)
        model, opt = build(args.width, args.layers, dev)
        mgr = CheckpointManager(root, peers=popts)
        state = {"model": model, "optim": opt}
        g = torch.Generator(device=dev).manual_seed(rank)
        sync(dev)
        dist.barrier()
    handles = []
    with phase(f"{what}: {args.steps} steps, a save every {args.every}"):
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            model(torch.randn(args.batch, args.width, device=dev, generator=g)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step % args.every == 0:
                handles.append(mgr.save(step, state, block=False))
                handles[-1].wait_staged()
        sync(dev)
        loop_s = time.perf_counter() - t0
    with phase(f"{what}: the last durable writes" + (" and replication rounds" if peers else "")):
        mgr.wait(LIMIT["s"])
        infos = [h.result(LIMIT["s"]) for h in handles]
        stats = mgr.stats()
        mgr.close(flush=False)
    writes = [i.bytes / i.persist_s for i in infos if i.durable and i.persist_s > 0]
    sent, moving = stats.get("peer_bytes_sent", 0), stats.get("peer_transfer_s", 0.0)
    out = {"step_ms": 1e3 * loop_s / args.steps, "replicate_s": stats.get("peer_replicate_s", float("nan")),
           "durable_write_gbs": statistics.median(writes) / 1e9 if writes else float("nan"),
           "peer_gbs": sent / moving / 1e9 if moving else float("nan"), "fingerprint": fingerprint(model, opt)}
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, out)
    return {"step_ms": max(g["step_ms"] for g in got), "replicate_s": max(g["replicate_s"] for g in got),
            "durable_write_gbs": min(g["durable_write_gbs"] for g in got),
            "peer_gbs": min(g["peer_gbs"] for g in got), "fingerprints": [g["fingerprint"] for g in got]}


SOURCES = ("peers", "peers-gloo", "durable")  # the restore transport (NCCL on GPUs), the tier's gloo group, disk


def cached_fraction(directory: str) -> float:
    """The share of the pages of the files under ``directory`` in the page cache (mincore); nan
    where it cannot be told."""
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return float("nan")
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = total = 0
    for base, _, names in os.walk(directory):
        for n in names:
            size = os.path.getsize(os.path.join(base, n))
            if not size:
                continue
            with open(os.path.join(base, n), "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
                pages = -(-size // mmap.PAGESIZE)
                vec = (ctypes.c_ubyte * pages)()
                view = np.frombuffer(m, dtype=np.uint8)
                address = view.ctypes.data
                del view  # (the mapping closes only once nothing exports it)
                if mincore(address, size, vec) != 0:
                    return float("nan")
                resident += sum(v & 1 for v in vec)
                total += pages
    return resident / total if total else float("nan")


def restore_once(args: argparse.Namespace, dev: torch.device, root: str, shm: str, node: str, source: str,
                 expect: list[str], i: int) -> dict[str, Any]:
    """One restore of the newest step by every rank from ``source``; the lost node's ranks
    (``node`` None) come back on a fresh node with empty RAM, so they fetch their shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with phase(f"restore {i + 1}/{args.restores} from {source}: start"):
        here = node or f"replacement-{i}-{source}"
        if node is None:
            os.makedirs(os.path.join(shm, here), mode=0o700, exist_ok=True)
        model, opt = build(args.width, args.layers, dev)
        popts = None if source == "durable" else PeerOptions(replicas=1, node=here, local_dir=os.path.join(shm, here),
                                                             transport="gloo" if source == "peers-gloo" else "auto")
        mgr = CheckpointManager(root, peers=popts)
        cached = float("nan")
        if source == "durable" and rank == 0:  # (one host: rank 0 drops every rank's files)
            evict(root)
            cached = cached_fraction(root)
        sync(dev)
        dist.barrier()
    with phase(f"restore {i + 1}/{args.restores} from {source}"):
        t0 = time.perf_counter()
        mgr.restore(target={"model": model, "optim": opt})
        sync(dev)
        took = time.perf_counter() - t0
    stats = mgr.stats()
    mgr.close(flush=False)
    nbytes = sum(t.numel() * t.element_size() for t in
                 [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values()
                                                  if isinstance(v, torch.Tensor))])
    mine = (took, fingerprint(model, opt), stats.get("peer_restore_peer", 0), nbytes,
            stats.get("peer_fetch_bytes_received", 0), stats.get("peer_fetch_s", 0.0),
            stats.get("peer_fetch_staging_bytes", 0), cached, {k: stats.get(k, 0.0) for k in PHASES})
    got: list[Any] = [None] * world
    dist.all_gather_object(got, mine)
    dist.barrier()
    if node is None and rank == world - 1:
        shutil.rmtree(os.path.join(shm, here), ignore_errors=True)  # the next restore's replacement starts empty
    fetched = [(g[4], g[5]) for g in got if g[4]]
    return {"restore_s": max(g[0] for g in got), "bit_exact": [g[1] for g in got] == expect,
            "ranks_from_peers": sum(g[2] for g in got),
            "read_gbs": sum(g[3] for g in got) / max(g[0] for g in got) / 1e9,
            "fetch_bytes": sum(b for b, _ in fetched), "fetch_s": max((t for _, t in fetched), default=0.0),
            "fetch_gbs": min(b / t for b, t in fetched) / 1e9 if fetched else float("nan"),
            "staging_bytes": max(g[6] for g in got), "cached_after_drop": got[0][7],
            "phases_s": {k: max(g[8][k] for g in got) for k in PHASES}}  # (each phase: its slowest rank)


def recover(args: argparse.Namespace, dev: torch.device, root: str, shm: str, expect: list[str]) -> dict[str, Any]:
    """The last node is lost and replaced; restore the newest step ``--restores`` times from
    each source (the order reversed every other time)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lost = node_of(world - 1, args.ranks_per_node)
    node: str | None = node_of(rank, args.ranks_per_node)
    dist.barrier()
    if rank == world - 1:
        shutil.rmtree(os.path.join(shm, lost))
    dist.barrier()
    if node == lost:
        node = None
    out: dict[str, list[dict[str, Any]]] = {s: [] for s in SOURCES}
    for i in range(args.restores):
        for source in (SOURCES if i % 2 == 0 else SOURCES[::-1]):
            out[source].append(restore_once(args, dev, root, shm, node, source, expect, i))
    return out


def warm_up(args: argparse.Namespace, dev: torch.device) -> None:
    """``--warmup`` training steps with no manager before any timed run, so that the first run
    (without the peer tier in odd rounds) does not also pay the process's warm-up (kernels,
    library handles, the allocator's growth)."""
    with phase(f"warm-up: {args.warmup} steps"):
        model, opt = build(args.width, args.layers, dev)
        g = torch.Generator(device=dev).manual_seed(dist.get_rank())
        for _ in range(args.warmup):
            model(torch.randn(args.batch, args.width, device=dev, generator=g)).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        sync(dev)
        del model, opt
        dist.barrier()


def worker(rank: int, world: int, port: int | None, args: argparse.Namespace) -> None:
    LIMIT["s"] = args.phase_timeout  # (set here: a spawned process imports this module afresh)
    dev = init(rank, world, port, args.device)
    base = args.dir or tempfile.gettempdir()
    if args.warmup:
        warm_up(args, dev)
    rounds = []
    for i in range(args.rounds):
        order = [False, True] if i % 2 == 0 else [True, False]
        res: dict[str, Any] = {}
        for peers in order:
            root = os.path.join(base, f"peer-bench-root-{i}-{int(peers)}")
            shm = os.path.join(args.shm, f"peer-bench-{i}-{int(peers)}")
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(shm, ignore_errors=True)
            with phase(f"round {i + 1}/{args.rounds}: clean-up"):
                dist.barrier()
            res["peers" if peers else "plain"] = run(args, dev, root, shm, peers)
            if peers:
                res["recovery"] = recover(args, dev, root, shm, res["peers"]["fingerprints"])
            dist.barrier()
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(shm, ignore_errors=True)
        rounds.append(res)
    if rank == 0:
        report(args, world, rounds)
    dist.destroy_process_group()


def spread(xs: list[float]) -> str:
    """median [min-max] (n)"""
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}] ({len(xs)})"


def report(args: argparse.Namespace, world: int, rounds: list[dict[str, Any]]) -> None:
    med = statistics.median
    plain = med(r["plain"]["step_ms"] for r in rounds)
    peer = med(r["peers"]["step_ms"] for r in rounds)
    rep = med(r["peers"]["replicate_s"] for r in rounds)
    runs = {s: [x for r in rounds for x in r["recovery"][s]] for s in SOURCES}
    took = {s: [x["restore_s"] for x in runs[s]] for s in SOURCES}
    exact = all(x["bit_exact"] for s in SOURCES for x in runs[s])
    cached = [x["cached_after_drop"] for x in runs["durable"]]
    rows = [("step time, no peer tier (ms)", f"{plain:.2f}"), ("step time, peer tier (ms)", f"{peer:.2f}"),
            ("replication overhead", f"{100 * (peer / plain - 1):+.2f}%"),
            ("save() -> replicated (s)", f"{rep:.3f}"),
            ("recovery from peers, NCCL/job group (s)" if args.device == "cuda" else
             "recovery from peers, job group (s)", spread(took["peers"])),
            ("recovery from peers, tier gloo (s)", spread(took["peers-gloo"])),
            ("recovery from durable (s)", spread(took["durable"])),
            ("durable / peers (job group)", f"{med(took['durable']) / med(took['peers']):.1f}x"),
            ("durable / peers (tier gloo)", f"{med(took['durable']) / med(took['peers-gloo']):.1f}x"),
            ("restores bit-exact", str(exact)),
            ("durable pages cached after drop", f"{100 * max(cached):.1f}%" if cached and cached[0] == cached[0]
             else "cannot tell"),
            ("durable write, per rank (GB/s)", f"{med(r['plain']['durable_write_gbs'] for r in rounds):.2f}"),
            ("durable read, all ranks (GB/s)", f"{med(x['read_gbs'] for x in runs['durable']):.2f}"),
            ("replication transport, per rank (GB/s)", f"{med(r['peers']['peer_gbs'] for r in rounds):.2f}"),
            ("fetch, job group, per rank (GB/s)", f"{med(x['fetch_gbs'] for x in runs['peers']):.2f}"),
            ("fetch, tier gloo, per rank (GB/s)", f"{med(x['fetch_gbs'] for x in runs['peers-gloo']):.2f}"),
            ("fetched per restore (GB)", f"{med(x['fetch_bytes'] for x in runs['peers']) / 1e9:.3f}"),
            ("of recovery: moving bytes, job group (s)", f"{med(x['fetch_s'] for x in runs['peers']):.3f}"),
            ("of recovery: moving bytes, tier gloo (s)", f"{med(x['fetch_s'] for x in runs['peers-gloo']):.3f}"),
            *((f"of recovery, job group: {k.removeprefix('peer_').removesuffix('_s')} (s)",
               f"{med(x['phases_s'][k] for x in runs['peers']):.3f}") for k in PHASES),
            ("fetch GPU staging, per rank (MiB)", f"{max(x['staging_bytes'] for x in runs['peers']) / 2**20:.1f}"),
            ("peer restore, all ranks (GB/s)", f"{med(x['read_gbs'] for x in runs['peers']):.2f}")]
    print(f"peer tier: {world} ranks, {args.ranks_per_node} per node, {args.device}, save every {args.every} of "
          f"{args.steps} steps, {args.rounds} round(s) x {args.restores} restore(s) per source; "
          "medians, [min-max] (n)")
    for k, v in rows:
        print(f"  {k:<42} {v:>28}")
    if args.out:
        for r in rounds:
            for k in ("plain", "peers"):
                r[k].pop("fingerprints", None)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "world": world, "rounds": rounds, "summary": dict(rows)}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--nproc", type=int, default=4, help="processes to start (not under torchrun)")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4096, help="rows per training step")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--restores", type=int, default=3, help="restores per source per round")
    p.add_argument("--warmup", type=int, default=20, help="untimed training steps before the first run")
    p.add_argument("--quick", action="store_true",
                   help="width 2048 x 4 layers, batch 512, 20 steps, a save every 5, one round")
    p.add_argument("--phase-timeout", type=float, default=600.0,
                   help="seconds a phase may run before the benchmark says which stalled and exits")
    p.add_argument("--dir", default=None, help="where the durable roots go (default: the temp dir)")
    p.add_argument("--shm", default="/dev/shm", help="where the simulated nodes' RAM directories go")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.quick:
        args.width, args.layers, args.batch, args.steps, args.every, args.rounds = 2048, 4, 512, 20, 5, 1
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.nproc, port, args), nprocs=args.nproc, start_method="spawn")


if __name__ == "__main__":
    sys.exit(main())
