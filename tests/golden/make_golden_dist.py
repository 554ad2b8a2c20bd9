"""Writes the golden multi-rank checkpoint under tests/golden/dist-v2/: two gloo ranks on a
1-D mesh save DTensor shards (even, uneven, an empty one, along dim 0 and dim 1, a
replicated DTensor), replicated tensors (one tied pair), optimizer-like state with int keys,
and PerRank values. Run it once per multi-rank format revision:

    python tests/golden/make_golden_dist.py

It starts its own two processes. Committed outputs are read by tests/test_distributed_golden.py
forever after, at the world size they were saved at and at others.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "dist-v2")
WORLD = 2
STEP = 7


def global_tensors() -> dict[str, torch.Tensor]:
    """The global values of every tensor, exact on any platform."""
    return {
        "w": torch.arange(40, dtype=torch.float32).reshape(10, 4) / 4,   # Shard(0), even
        "u": torch.arange(15, dtype=torch.float64).reshape(5, 3) - 7,    # Shard(0), 3 + 2 rows
        "c": torch.arange(24, dtype=torch.int32).reshape(4, 6),          # Shard(1)
        "e": torch.tensor([[1.5, -2.5]], dtype=torch.bfloat16),          # Shard(0): rank 1's shard is empty
        "r": torch.arange(3, dtype=torch.float32) * 3,                   # Replicate
        "m": torch.arange(40, dtype=torch.float32).reshape(10, 4) / 8,   # optimizer moment, Shard(0)
        "b": torch.arange(6, dtype=torch.float32) - 1,                   # replicated plain tensors
        "big": torch.arange(300, dtype=torch.int64),
    }


PLACEMENTS = {"w": ("S", 0), "u": ("S", 0), "c": ("S", 1), "e": ("S", 0), "r": ("R", 0), "m": ("S", 0)}


def per_rank_value(rank: int) -> dict:
    return {"pos": 10 + rank, "rng": torch.arange(4, dtype=torch.uint8) + rank}


def state_for(rank: int, mesh) -> dict:  # mesh: a DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = global_tensors()
    dt = {k: distribute_tensor(g[k], mesh, [Shard(d) if kind == "S" else Replicate()])
          for k, (kind, d) in PLACEMENTS.items()}
    return {
        "model": {"w": dt["w"], "u": dt["u"], "c": dt["c"], "e": dt["e"], "r": dt["r"], "b": g["b"]},
        "tied": g["b"],                                  # the same tensor as model.b: stored once
        "big": g["big"],
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": dt["m"]}},
                  "param_groups": [{"lr": 0.5, "params": [0]}]},
        "rank": _per_rank(per_rank_value(rank)),
        "step": STEP,
    }


def _per_rank(value):
    from ckptmgr import PerRank

    return PerRank(value)


def _rank_main() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ckptmgr import CheckpointManager

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD,))
    with CheckpointManager(ROOT) as mgr:
        mgr.save(STEP, state_for(dist.get_rank(), mesh), metadata={"golden": "dist-v2"}).result()
    dist.destroy_process_group()


def main() -> None:
    shutil.rmtree(ROOT, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = os.path.join(HERE, "..", "..")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank"],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "PYTHONPATH": repo}) for r in range(WORLD)]
    if any(p.wait(timeout=120) for p in procs):
        raise SystemExit("a rank failed")
    print("wrote", ROOT)


if __name__ == "__main__":
    if "--rank" in sys.argv:
        sys.path.insert(0, os.path.join(HERE, "..", ".."))
        _rank_main()
    else:
        main()
