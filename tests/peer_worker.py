"""One rank of a gloo job (CPU) with the peer tier on, for tests/test_peer_tier.py.

    python tests/peer_worker.py SCENARIO ROOT OUT_JSON
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT, CKPTMGR_NODE (the node identity) and NODE_DIR (the node's
    RAM directory) set)

Scenarios:
  start    create the manager and close it; report the ConfigError it raised, if any
  train    train steps 1..6, saving every second step; wait until every save is committed and
           replicated; report; print "ready" and block until killed (the node is lost)
  ddp      a DDP model over gloo trains 12 steps (an all-reduce and a barrier of the training
           thread each step too), saving every second step without blocking, so replication
           rounds run while the training thread runs collectives; report each rank's parameter
           digest (DDP keeps them equal only if no collective of the job's group was stolen)
  resume   restore the newest step into fresh state, report where each shard came from and
           what was said, train on to step 8, save it, report the final state's digest
  exchange (2 ranks; PEER_BACKEND=nccl: a "cpu:gloo,cuda:nccl" job on 2 GPUs, else gloo)
           the restore's transport on its own: which group it picks; arrays of
           several segments both ways, bit-exact; then rank 0 sends rank 1 shards through a
           ShardMover on it: a header announcing an oversized record, a record rank 1 must
           refuse (drained), a copy failing its checksums, a good copy
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

from ckptmgr import CheckpointManager, ConfigError, PeerOptions, PerRank, WriteOptions
from ckptmgr.distributed.coordinator import Coordinator
from ckptmgr.distributed.peer_mover import ShardMover
from ckptmgr.distributed.peer_transport import Transport, restore_transport
from ckptmgr.errors import CkptError
from ckptmgr.format.checksum import chunk_ranges, crc32c_hex
from ckptmgr.format.manifest import FileRecord, Manifest
from ckptmgr.format.schema import MAX_MANIFEST_BYTES
from ckptmgr.storage.peer_tier import PeerArea, ShardRecord

FINAL = 8
SAVES = (2, 4, 6)


def fresh(rank: int) -> dict:
    torch.manual_seed(0)  # replicated: identical on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    return {"model": model, "step": 0, "rank": PerRank({"acc": torch.zeros(1000, dtype=torch.float64) + rank})}


def train_step(state: dict, rank: int, step: int) -> None:
    """One deterministic step: the same update on every rank for the model, its own for the rest."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in state["model"].parameters():
            p.mul_(0.99).add_(torch.randn(p.shape, generator=g))
    mine = torch.Generator().manual_seed(1000 * step + rank)
    state["rank"].value["acc"].add_(torch.randn(1000, generator=mine, dtype=torch.float64))
    state["step"] = step


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for t in [*state["model"].state_dict().values(), state["rank"].value["acc"]]:
        h.update(t.detach().contiguous().numpy().tobytes())
    h.update(str(state["step"]).encode())
    return h.hexdigest()


def reference(rank: int, upto: int = FINAL) -> str:
    """The digest of an uninterrupted run at step ``upto``."""
    state = fresh(rank)
    for step in range(1, upto + 1):
        train_step(state, rank, step)
    return digest(state)


def manager(root: str) -> CheckpointManager:
    return CheckpointManager(root, write_options=WriteOptions(chunk_size=64 << 10),
                             peers=PeerOptions(replicas=1, local_dir=os.environ["NODE_DIR"], chunk_bytes=48 << 10,
                                               timeout_s=60),
                             coordination_timeout=float(os.environ.get("CKPT_TIMEOUT", "60")))


def main() -> None:
    scenario, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    if os.environ.get("PEER_BACKEND") == "nccl":  # (the exchange scenario on GPUs)
        local = torch.device("cuda", int(os.environ["RANK"]))
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=local)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("ckptmgr").addHandler(Keep(logging.INFO))
    logging.getLogger("ckptmgr").setLevel(logging.INFO)
    report: dict = {"rank": rank, "node": os.environ["CKPTMGR_NODE"]}
    if scenario == "start":  # only create the manager: report what it raised
        try:
            manager(root).close()
        except ConfigError as exc:
            report["error"] = str(exc)
        with open(out, "w") as f:
            json.dump(report, f)
        return
    if scenario == "exchange":
        report.update(exchange(os.environ["NODE_DIR"], root))
        with open(out, "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()
        return
    mgr = manager(root)
    if scenario == "ddp":
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)  # each rank its own data: DDP's all-reduce makes them agree
        handles = []
        for step in range(1, 13):
            model(torch.randn(32, 64, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            seen = torch.tensor([float(step)])
            dist.all_reduce(seen)
            assert seen.item() == step * dist.get_world_size(), seen
            dist.barrier()
            if step % 2 == 0:
                handles.append(mgr.save(step, {"model": model, "optim": opt}, block=False))
        mgr.wait(120)
        h = hashlib.sha256()
        for t in model.state_dict().values():
            h.update(t.detach().contiguous().numpy().tobytes())
        report.update(stats=mgr.stats(), steps=mgr.steps(), digest=h.hexdigest(), said=said[:],
                      committed=[hd.result(60).step for hd in handles])
        mgr.close()
        with open(out, "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()
        return
    state = fresh(rank)
    if scenario == "train":
        for step in range(1, SAVES[-1] + 1):
            train_step(state, rank, step)
            if step in SAVES:
                mgr.save(step, state)
        mgr.wait(120)
        report.update(stats=mgr.stats(), steps=mgr.steps(), digest=digest(state), said=said[:])
        with open(out, "w") as f:
            json.dump(report, f)
        print("ready", flush=True)
        threading.Event().wait(300)  # until the test SIGKILLs this node (or the job)
        return
    if scenario == "resume":
        report.update(before=mgr.stats()["peer_replicated_step"])  # what the nodes' RAM holds complete
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = mgr.restore(target=state)
        report.update(restored=state["step"], restored_digest=digest(state), stats=mgr.stats(),
                      warnings=[str(w.message) for w in caught], said=said[:])
        for step in range(state["step"] + 1, FINAL + 1):
            train_step(state, rank, step)
        mgr.save(FINAL, state)
        mgr.wait(120)
        report.update(digest=digest(state), after=mgr.stats())
        mgr.close()
        with open(out, "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()
        return
    raise SystemExit(f"unknown scenario {scenario}")


def _shard(step: int, rank: int, data: bytes, node: str, chunk: int) -> tuple[ShardRecord, dict]:
    """A shard record of one file holding ``data`` (a 4096-byte header, then the bytes)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    crcs = tuple(crc32c_hex(arr[b:e]) for b, e in chunk_ranges(arr.size, chunk))
    name = f"data-r{rank:05d}-00000.safetensors"
    n = arr.size - 4096
    tensors = {f"rank{rank:05d}/x": {"file": name, "dtype": "U8", "shape": [n], "offsets": [0, n]}}
    m = Manifest(step=step, state={"x": 1}, tensors=tensors, files={name: FileRecord(arr.size, chunk, crcs, 4096)})
    return ShardRecord.make(m, rank, 2, node), {name: arr}


def _grid(coord: Coordinator, device: torch.device) -> list:
    """Arrays of different sizes, both ways in one exchange, through transports of several
    segment sizes (dividing no array, larger than all, none) and, on CUDA, every copy method
    and thread count: [segment, method, threads, every received array exact]."""
    rank = dist.get_rank()
    sizes = {0: [3_000_001, 10_000], 1: [2_500_000, 1]}  # what each rank sends, in one exchange

    def data(r: int) -> list:
        return [np.random.default_rng((r, i)).integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes[r])]

    mine, want = data(rank), data(1 - rank)
    mine[0].flags.writeable = False  # (sends may be read-only maps)
    methods = [("pinned", 1), ("pinned", 3), ("pageable", 1)] if device.type == "cuda" else [("pinned", 1)]
    out = []
    for seg in (65536, 1 << 20, 3 << 20, None):
        for method, threads in methods:
            got = [np.zeros(a.size, dtype=np.uint8) for a in want]
            t = Transport(coord, dist.group.WORLD, device if device.type == "cuda" else None, segment_bytes=seg,
                          timeout_s=60, copy_threads=threads, copy_method=method)
            t.exchange([(1 - rank, a) for a in mine], [(1 - rank, a) for a in got])
            t.close()
            out.append([seg, method, threads, all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))])
    return out


def exchange(node_dir: str, root: str) -> dict:
    rank = dist.get_rank()
    coord = Coordinator(dist.group.WORLD, 60)
    tier = dist.new_group(backend="gloo")
    t, why = restore_transport(coord, tier, "auto", 60)
    out: dict = {"why": why, "job_group": t.group is dist.group.WORLD, "device": str(t.device)}
    # arrays of several 4 KiB segments, both ways at once, of sizes both ends know
    seg = Transport(coord, dist.group.WORLD, t.device if t.device.type == "cuda" else None, segment_bytes=4096,
                    timeout_s=60)
    sizes = {0: 10000, 1: 30001}  # what each rank sends
    mine = np.random.default_rng(rank).integers(0, 256, sizes[rank], dtype=np.uint8)
    theirs = np.zeros(sizes[1 - rank], dtype=np.uint8)
    seg.exchange([(1 - rank, mine), (1 - rank, np.zeros(0, dtype=np.uint8))], [(1 - rank, theirs)])
    out["segments_exact"] = theirs.tobytes() == np.random.default_rng(1 - rank).integers(
        0, 256, sizes[1 - rank], dtype=np.uint8).tobytes()
    out["grid"] = _grid(coord, t.device)
    chunk = 8192
    data = np.random.default_rng(7).integers(0, 256, 50_000, dtype=np.uint8).tobytes()
    area = PeerArea(node_dir, root)
    with ThreadPoolExecutor(2) as io:
        mover = ShardMover(seg, area, os.environ["CKPTMGR_NODE"], chunk, None, io)
        if rank == 0:  # the sender: its own node is A; rank 1's node is B
            t.exchange([(1, np.array([6, MAX_MANIFEST_BYTES + 1, 0], dtype=np.int64).view(np.uint8))], [])
            rec, files = _shard(6, 0, data, "B", chunk)  # "saved on node B": B must refuse it
            mover.transfer([(1, rec, files)], [], own_node_ok=False)
            rec, files = _shard(6, 0, data, "A", chunk)
            bad = files[next(iter(files))].copy()
            bad[20_000] ^= 1
            mover.transfer([(1, rec, dict.fromkeys(files, bad))], [], own_node_ok=False)
            mover.transfer([(1, rec, files)], [], own_node_ok=False)
            rec, files = _shard(7, 0, data, "A", chunk)
            mover.transfer([(1, rec, files)], [], own_node_ok=False)
        else:
            try:
                ShardMover(t, area, "B", chunk, None, io).transfer([], [0], own_node_ok=False)
            except CkptError as exc:
                out["oversized"] = str(exc)
            got = [mover.transfer([], [0], own_node_ok=False)[0] for _ in range(3)]
            out["kept"] = [(r.record.node if r.record is not None else None, r.ok) for r in got]
            copies = area.copies()
            out["copies"] = [(c.rank, c.record.step) for c in copies]
            with area.mapped(copies[0]) as held:
                out["copy_exact"] = next(iter(held.values())).tobytes() == data
            out["stats"] = mover.stats()
            closed = ThreadPoolExecutor(1)  # its checks cannot run (closing): the slot taken is given back
            closed.shutdown()
            try:
                ShardMover(seg, area, "B", chunk, None, closed).transfer([], [0], own_node_ok=False)
            except RuntimeError as exc:
                out["closed_io"] = str(exc)
            slot = area.take_slot(0)
            out["slot_after_failure"] = slot is not None and not os.listdir(
                os.path.join(area.path, "r00000", f"s{slot}"))
            if slot is not None:
                area.abort(0, slot)
    out["staging_bytes"] = seg.staging_bytes()
    seg.close()
    t.close()
    area.close()
    return out


if __name__ == "__main__":
    main()
