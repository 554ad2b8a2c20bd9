"""Subprocess for the lifecycle tests: one save whose durable write is slow, hung or failing.

Usage: python pending_writer.py ROOT LOCAL_DIR MODE
MODE: "hang" (the write never ends), "slow" (it takes 0.5 s), "fail" (it raises).
Prints "staged" once save() returned, "local" once the local tier lists the step, then
returns from main() without closing the manager (the exit hooks must finish the save) or,
for "hang", waits to be killed.
"""

from __future__ import annotations

import sys
import time

import torch

from ckptmgr import CheckpointManager, StagingOptions
from ckptmgr.storage import local


def pending_state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(300, 300, generator=g), "step": 7}


def main() -> None:
    root, local_dir, mode = sys.argv[1:4]
    real = local._LocalStepWriter._write_file

    def patched(self, *args):  # fault injection into the real local writer
        if mode == "hang":
            time.sleep(3600)
        if mode == "fail":
            raise OSError(5, "Input/output error (injected)")
        time.sleep(0.5)
        return real(self, *args)

    local._LocalStepWriter._write_file = patched
    mgr = CheckpointManager(root, staging=StagingOptions(local_dir=local_dir))
    state = pending_state()
    mgr.save(7, state, block=False).wait_staged()
    state["w"].zero_()
    print("staged", flush=True)
    while 7 not in mgr.steps():
        time.sleep(0.01)
    print("local", flush=True)
    if mode == "hang":
        time.sleep(3600)


if __name__ == "__main__":
    main()
