"""Subprocess for the crash tests: saves step after step until it is killed.

Usage: python crash_writer.py ROOT FIRST_STEP
Prints "ready" once imported, then each step number once its save has committed.
"""

from __future__ import annotations

import sys

import torch

from ckptmgr import CheckpointManager, WriteOptions


def crash_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {f"layer{i}": torch.randn(256, 256, generator=g) for i in range(6)},
        "half": torch.randn(1000, generator=g).bfloat16(),
        "step": step,
    }


def main() -> None:
    root, first = sys.argv[1], int(sys.argv[2])
    opts = WriteOptions(max_file_bytes=600_000, chunk_size=64 << 10, io_threads=4)
    with CheckpointManager(root, write_options=opts) as mgr:
        print("ready", flush=True)
        step = first
        while True:
            mgr.save(step, crash_state(step)).result()
            print(step, flush=True)
            step += 1


if __name__ == "__main__":
    main()
