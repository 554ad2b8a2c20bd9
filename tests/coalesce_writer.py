"""Subprocess for the coalescing crash test: the durable write of the first step hangs, later
saves land in the local tier only (superseded for the durable tier), then it waits to be killed.

Usage: python coalesce_writer.py ROOT LOCAL_DIR LAST_STEP
Prints "ready" once every step up to LAST_STEP is committed in the local tier.
"""

from __future__ import annotations

import os
import sys
import threading

from crash_writer import crash_state

from ckptmgr import CheckpointManager, StagingOptions, WriteOptions
from ckptmgr.storage.local import LocalTarget
from ckptmgr.storage.tier import LocalTier


def main() -> None:
    root, local_dir, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hang = threading.Event()  # never set: the durable target "stalls" on step 1
    real_begin = LocalTarget.begin

    def stalled_begin(self: LocalTarget, step: int, prefix: str = ""):  # type: ignore[no-untyped-def]
        if step == 1:
            hang.wait()
        return real_begin(self, step, prefix)

    committed: dict[int, threading.Event] = {s: threading.Event() for s in range(1, last + 1)}
    real_commit = LocalTier.commit

    def commit(self: LocalTier, index: int, step: int, manifest: bytes) -> None:
        real_commit(self, index, step, manifest)
        committed[step].set()

    LocalTarget.begin = stalled_begin  # type: ignore[method-assign]
    LocalTier.commit = commit  # type: ignore[method-assign]
    opts = WriteOptions(max_file_bytes=600_000, chunk_size=64 << 10, io_threads=4)
    staging = StagingOptions(slots=3, on_busy="skip", local_dir=local_dir)  # a save never waits: fail fast
    mgr = CheckpointManager(root, write_options=opts, staging=staging)
    for step in range(1, last + 1):
        handle = mgr.save(step, crash_state(step), block=False)
        if handle.skipped:
            print(f"step {step} found no free staging slot", flush=True)
            os._exit(1)  # (not SystemExit: closing would wait for the held write)
        handle.wait_staged(timeout=60)
        if not committed[step].wait(timeout=60):
            print(f"step {step} was not committed in the local tier", flush=True)
            os._exit(1)
    print("ready", flush=True)
    threading.Event().wait(600)  # killed before this ends


if __name__ == "__main__":
    main()
