"""Subprocess for the crash tests: saves step after step until it is killed.

Usage: python crash_writer.py ROOT FIRST_STEP
Prints "ready" once imported, then each step number once its save has committed. With
FIRST_STEP ``-`` it prints "loaded" once imported and reads the first step from stdin before
it opens the root: a test starts it ahead of time, while another writer still owns the root.
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
    root = sys.argv[1]
    if sys.argv[2] == "-":
        print("loaded", flush=True)
        line = sys.stdin.readline()
        if not line:
            raise SystemExit("stdin closed before the first step was given")
        first = int(line)
    else:
        first = int(sys.argv[2])
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
