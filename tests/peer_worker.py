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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import warnings

import torch
import torch.distributed as dist

from ckptmgr import CheckpointManager, ConfigError, PeerOptions, PerRank, WriteOptions

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


if __name__ == "__main__":
    main()
