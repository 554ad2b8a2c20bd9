"""One of several processes sharing a checkpoint root, for the shared-root tests.

    python root_sharer.py ROOT WRITER ITERATIONS SEED BARRIER_DIR PEERS [STORAGE_OPTIONS_JSON PART_SIZE]

After every peer has reached the barrier (a file each in BARRIER_DIR), each iteration opens a
manager on ROOT (start-up clean-up), saves a step that the peers often pick too (the state
names its writer), lets retention (keep the latest 3) delete, restores the newest step and
checks it byte for byte against the state its writer saved, then closes. Prints a JSON
summary; exits 3 on a restore that returned wrong data.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import torch

from ckptmgr import (
    CheckpointCorruptError,
    CheckpointManager,
    KeepLatest,
    S3Options,
    SaveError,
    StagingOptions,
    StepExistsError,
    StepNotFoundError,
    WriteOptions,
)


def shared_state(step: int, writer: int) -> dict:
    g = torch.Generator().manual_seed(step * 100 + writer)
    return {"w": torch.randn(30_000, generator=g), "b": torch.randn(300, generator=g).bfloat16(),
            "step": step, "writer": writer}


def same(a: dict, b: dict) -> bool:
    return (a.keys() == b.keys() and a["step"] == b["step"] and a["writer"] == b["writer"]
            and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in ("w", "b")))


def barrier(d: str, writer: int, peers: int, timeout: float = 120.0) -> None:
    open(os.path.join(d, f"ready-{writer}"), "w").close()
    deadline = time.monotonic() + timeout
    while sum(n.startswith("ready-") for n in os.listdir(d)) < peers:
        if time.monotonic() > deadline:
            sys.exit(f"writer {writer}: peers not ready after {timeout} s")
        time.sleep(0.01)


def main() -> None:
    root, writer, iterations, seed, bdir, peers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
    so = json.loads(sys.argv[7]) if len(sys.argv) > 7 else None
    kw: dict = {"staging": StagingOptions(local_tier=False), "retention": KeepLatest(3),
                "write_options": WriteOptions(max_file_bytes=64 << 10, chunk_size=16 << 10, io_threads=4)}
    if so is not None:
        kw["storage_options"] = so
        kw["s3_options"] = S3Options(part_size=int(sys.argv[8]), concurrency=8, base_delay_s=0.01, max_delay_s=0.1)
    rng = random.Random(seed)
    out = {"writer": writer, "saved": [], "collided": 0, "restored": 0, "raced": 0}
    barrier(bdir, writer, peers)
    for i in range(iterations):
        step = 2 * i + rng.choice([0, 0, 1])  # the peers pick the same step more often than not
        with CheckpointManager(root, **kw) as mgr:
            try:
                mgr.save(step, shared_state(step, writer)).result(timeout=120)
                out["saved"].append(step)
            except (StepExistsError, SaveError) as exc:
                cause = exc if isinstance(exc, StepExistsError) else exc.__cause__
                if not isinstance(cause, StepExistsError):
                    raise
                out["collided"] += 1
            mgr.wait(timeout=120)
            try:
                got = mgr.restore()
            except (StepNotFoundError, FileNotFoundError):
                out["raced"] += 1  # deleted by a peer's retention while it was read
                continue
            except CheckpointCorruptError as exc:
                print(json.dumps({**out, "corrupt": str(exc)}), flush=True)
                sys.exit(3)
            if not same(got, shared_state(got["step"], got["writer"])):
                print(json.dumps({**out, "wrong": got["step"]}), flush=True)
                sys.exit(3)
            out["restored"] += 1
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
