"""Subprocess for the callback tests: a plain training loop driven by CheckpointCallback.

Usage: python callback_trainer.py ROOT OUT STEPS
Prints "resumed N" (the first step it runs), then each finished step, then "done" after
writing the final weights to OUT, or "stopped N" when a SIGTERM made it save and stop.
"""

from __future__ import annotations

import random
import signal
import sys

import numpy as np
import torch
from conftest import RNGState, make_training

from ckptmgr import CheckpointManager
from ckptmgr.integrations.callbacks import CheckpointCallback


def main() -> None:
    root, out, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, opt, sched = make_training(0)
    state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState()}
    ckpt = CheckpointCallback(CheckpointManager(root), state, every_n_steps=3, save_on_signals=(signal.SIGTERM,))
    first = ckpt.resume()
    print("resumed", first, flush=True)
    for step in range(first, total):
        tokens = torch.randint(0, 64, (4, 12))
        scale = 1 + 0 * (float(np.random.rand()) + random.random())  # every RNG advances
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1)) * scale
        opt.zero_grad()
        loss.backward()
        ckpt.before_optimizer_step(step)
        opt.step()
        sched.step()
        print(step, flush=True)
        if ckpt.after_step(step):
            print("stopped", step, flush=True)
            ckpt.close()
            return
    ckpt.close()
    torch.save(model.state_dict(), out)
    print("done", flush=True)


if __name__ == "__main__":
    main()
