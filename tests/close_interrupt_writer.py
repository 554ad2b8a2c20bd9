"""Subprocess for the close() interruption test: one save without a local tier whose durable
write is held at a gate (the parent's pipe on stdin) while close() waits for it.

Usage: python close_interrupt_writer.py ROOT
Prints "writing" once the durable write reached the gate (it goes on when a byte arrives on
stdin), "closing" from inside close()'s wait (a SIGINT from then on lands in close()), and
"interrupted" once close() raised KeyboardInterrupt; then returns from main() (the
interpreter's exit hooks run).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from ckptmgr import CheckpointManager, StagingOptions
from ckptmgr.save import saver
from ckptmgr.storage import local


def interrupt_state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(256, 256, generator=g), "step": 5}


def main() -> None:
    # Ctrl-C as a user's process gets it: a suite started in the background of a shell without job
    # control inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    root = sys.argv[1]
    real_write = local._LocalStepWriter._write_file
    real_wait = saver.Saver.wait

    def gated(self, *args):  # the real local writer, held until the parent says so
        print("writing", flush=True)
        os.read(0, 1)
        return real_write(self, *args)

    def announced(self, timeout):  # the wait of close(): say we are in it
        print("closing", flush=True)
        return real_wait(self, timeout)

    local._LocalStepWriter._write_file = gated
    saver.Saver.wait = announced
    mgr = CheckpointManager(root, staging=StagingOptions(local_tier=False))
    mgr.save(5, interrupt_state())
    try:
        mgr.close()
    except KeyboardInterrupt:
        print("interrupted", flush=True)


if __name__ == "__main__":
    main()
