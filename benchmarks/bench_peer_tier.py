"""The peer tier: what replication costs a training loop, how soon a step is replicated, and how
fast a replaced node's ranks get their shards back from peers against the durable target.

    torchrun --nproc-per-node 2 benchmarks/bench_peer_tier.py --ranks-per-node 1 --quick   # 2 GPUs, about a minute
    torchrun --nproc-per-node 4 benchmarks/bench_peer_tier.py --ranks-per-node 2 --out $OUT/peer.json   # GPUs
    python benchmarks/bench_peer_tier.py --device cpu --nproc 4 --ranks-per-node 2 --width 256 --layers 2 \\
        --batch 16 --steps 50                                                                   # CPU smoke

Ranks are grouped into simulated nodes of ``--ranks-per-node`` (node identity and RAM directory
per group). A DDP model (``--layers`` x Linear(``--width``)) + AdamW trains ``--steps`` steps
with a save every ``--every`` steps, twice: without the peer tier and with it
(``PeerOptions(replicas=1)``, gloo), the order of the two rotated per ``--rounds``. At the
defaults (width 8192 x 8 layers + AdamW: 6.4 GB of state per rank) one round moves about
10 x 6.4 GB per rank (4 durable writes and 4 RAM copies per run, 4 replications, 2 restores)
and takes minutes; ``--quick`` (2048 x 4, 0.2 GB per rank, one round) finishes in about a
minute on 2 GPUs, most of it process start-up.

Rank 0 prints a line as each phase starts and ends (flushed); a phase that runs longer than
``--phase-timeout`` seconds on any rank is reported by name on that rank and the process exits
with status 3, instead of hanging. Reported, slowest rank:

* the mean step time of each run (saves included) and the overhead of replication;
* the time from ``save()`` until its step is replicated (every rank's shard confirmed on a peer);
* the bandwidths measured: the durable target's writes (a save's bytes over its persist time)
  and reads (the durable restore), and the peer transport's (bytes sent over the time moving
  them, all rounds of a rank together);
* recovery: the last node is lost (its RAM directory deleted); its ranks come back with a fresh
  node identity and restore the newest step from the peer tier (the other ranks from their own
  node's RAM), timed from the call to the last rank's return; then the same step restored from
  the durable target with the page cache dropped. Restored state is checked bit-exact.

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckptmgr import CheckpointManager, PeerOptions

LIMIT = {"s": 600.0}  # --phase-timeout


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
    popts = PeerOptions(replicas=1, node=node, local_dir=os.path.join(shm, node), transport=args.transport) \
        if peers else None
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


def recover(args: argparse.Namespace, dev: torch.device, root: str, shm: str, expect: list[str]) -> dict[str, Any]:
    """The last node is lost and replaced; time the restore from peers, then from the durable target."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lost = node_of(world - 1, args.ranks_per_node)
    node = node_of(rank, args.ranks_per_node)
    dist.barrier()
    if rank == world - 1:
        shutil.rmtree(os.path.join(shm, lost))
    dist.barrier()
    if node == lost:
        node = "replacement"
        os.makedirs(os.path.join(shm, node), mode=0o700, exist_ok=True)
    out: dict[str, Any] = {}
    for source in ("peers", "durable"):
        with phase(f"recovery from {source}: start" + (" (page cache dropped)" if source == "durable" else "")):
            model, opt = build(args.width, args.layers, dev)
            popts = PeerOptions(replicas=1, node=node, local_dir=os.path.join(shm, node), transport=args.transport) \
                if source == "peers" else None
            mgr = CheckpointManager(root, peers=popts)
            if source == "durable" and rank == 0:
                for base, _, names in os.walk(root):
                    for n in names:
                        fd = os.open(os.path.join(base, n), os.O_RDONLY)
                        try:
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        finally:
                            os.close(fd)
            sync(dev)
            dist.barrier()
        with phase(f"recovery from {source}: restore"):
            t0 = time.perf_counter()
            mgr.restore(target={"model": model, "optim": opt})
            sync(dev)
            took = time.perf_counter() - t0
            stats = mgr.stats()
            mgr.close(flush=False)
        nbytes = sum(t.numel() * t.element_size() for t in
                     [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values()
                                                      if isinstance(v, torch.Tensor))])
        got: list[Any] = [None] * world
        dist.all_gather_object(got, (took, fingerprint(model, opt), stats.get("peer_restore_peer", 0), nbytes))
        out[source] = {"restore_s": max(g[0] for g in got), "bit_exact": [g[1] for g in got] == expect,
                       "ranks_from_peers": sum(g[2] for g in got),
                       "read_gbs": sum(g[3] for g in got) / max(g[0] for g in got) / 1e9}
    return out


def worker(rank: int, world: int, port: int | None, args: argparse.Namespace) -> None:
    LIMIT["s"] = args.phase_timeout  # (set here: a spawned process imports this module afresh)
    dev = init(rank, world, port, args.device)
    base = args.dir or tempfile.gettempdir()
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


def report(args: argparse.Namespace, world: int, rounds: list[dict[str, Any]]) -> None:
    med = statistics.median
    plain = med(r["plain"]["step_ms"] for r in rounds)
    peer = med(r["peers"]["step_ms"] for r in rounds)
    rep = med(r["peers"]["replicate_s"] for r in rounds)
    from_peers = med(r["recovery"]["peers"]["restore_s"] for r in rounds)
    from_durable = med(r["recovery"]["durable"]["restore_s"] for r in rounds)
    exact = all(r["recovery"][s]["bit_exact"] for r in rounds for s in ("peers", "durable"))
    rows = [("step time, no peer tier (ms)", f"{plain:.2f}"), ("step time, peer tier (ms)", f"{peer:.2f}"),
            ("replication overhead", f"{100 * (peer / plain - 1):+.2f}%"),
            ("save() -> replicated (s)", f"{rep:.3f}"),
            ("recovery from peers (s)", f"{from_peers:.3f}"), ("recovery from durable (s)", f"{from_durable:.3f}"),
            ("durable / peers", f"{from_durable / from_peers:.1f}x"), ("restores bit-exact", str(exact)),
            ("durable write, per rank (GB/s)", f"{med(r['plain']['durable_write_gbs'] for r in rounds):.2f}"),
            ("durable read, all ranks (GB/s)", f"{med(r['recovery']['durable']['read_gbs'] for r in rounds):.2f}"),
            ("peer transport, per rank (GB/s)", f"{med(r['peers']['peer_gbs'] for r in rounds):.2f}"),
            ("peer restore, all ranks (GB/s)", f"{med(r['recovery']['peers']['read_gbs'] for r in rounds):.2f}")]
    print(f"peer tier: {world} ranks, {args.ranks_per_node} per node, {args.device}, transport {args.transport}, "
          f"save every {args.every} of {args.steps} steps, {args.rounds} round(s), medians")
    for k, v in rows:
        print(f"  {k:<32} {v:>12}")
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
    p.add_argument("--transport", choices=("auto", "gloo"), default="auto")
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
