"""One rank of a multi-rank job on an S3 root, for tests/test_s3_discovery.py.

    python s3_rank_worker.py URL STORAGE_OPTIONS_JSON OUT_JSON   (RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

Runs each manager call on every rank between barriers and records, on rank 0, the wall-clock
window of each call, so the requests a proxy saw can be attributed to the call.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from ckptmgr import CheckpointManager, KeepLatest, PerRank, S3Options, StagingOptions


def main() -> None:
    url, so, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    windows: dict[str, list[float]] = {}

    def timed(name, fn):
        dist.barrier()
        t0 = time.time()
        result = fn()
        dist.barrier()
        windows[name] = [t0, time.time()]
        return result

    def state(step):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(10_000, generator=g), "step": step, "mine": PerRank(torch.full((4,), float(rank)))}

    opts = S3Options(part_size=1 << 20, concurrency=4, base_delay_s=0.01)
    mgr = timed("start-up", lambda: CheckpointManager(url, storage_options=so, s3_options=opts,
                                                       staging=StagingOptions(local_tier=False),
                                                       retention=KeepLatest(1), coordination_timeout=120))
    steps = timed("steps", mgr.steps)
    timed("save", lambda: (mgr.save(1, state(1)).result(timeout=120), mgr.wait(timeout=120)))
    timed("save+retention", lambda: (mgr.save(2, state(2)).result(timeout=120), mgr.wait(timeout=120)))
    latest = timed("latest_step", mgr.latest_step)
    restored = timed("restore", mgr.restore)
    timed("apply_retention", mgr.apply_retention)
    final = timed("steps-again", mgr.steps)
    timed("close", mgr.close)
    report = {"rank": rank, "windows": windows, "steps": steps, "latest": latest, "final": final,
              "restored_step": restored["step"], "mine": restored["mine"].tolist()}
    with open(out, "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
