"""The ckptmgr demo: train, checkpoint, get SIGKILLed, resume from the newest checkpoint,
and end bit-for-bit identical to a run that was never interrupted.

    python examples/demo.py
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import torch

from ckptmgr import CheckpointManager

TOTAL_STEPS, SAVE_EVERY = 60, 5


class RNG:
    """Python and torch RNG state, saved and restored like any Stateful object."""

    def state_dict(self) -> dict:
        return {"python": random.getstate(), "torch": torch.get_rng_state()}

    def load_state_dict(self, sd: dict) -> None:
        random.setstate(sd["python"])
        torch.set_rng_state(sd["torch"])


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, TOTAL_STEPS)
    return model, opt, sched


def train(root: str | None, slow: bool = False) -> torch.nn.Module:
    model, opt, sched = build()
    state = {"model": model, "optim": opt, "sched": sched, "rng": RNG(), "step": 0}
    mgr = CheckpointManager(root) if root else None
    if mgr is not None and mgr.latest_step() is not None:
        state = mgr.restore(target=state)
        print(f"[trainer] resumed from step {state['step']}", flush=True)
    for step in range(state["step"], TOTAL_STEPS):
        x = torch.randn(32, 16)
        y = x.sum(dim=1, keepdim=True) * random.uniform(0.9, 1.1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if mgr is not None and (step + 1) % SAVE_EVERY == 0:
            state["step"] = step + 1
            mgr.save(step + 1, state, metadata={"loss": loss.item()})
            print(f"[trainer] step {step + 1}: loss {loss.item():.4f}, checkpoint saved", flush=True)
        if slow:
            time.sleep(0.02)
    if mgr is not None:
        mgr.close()
    return model


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--train":
        train(sys.argv[2], slow=True)
        return
    root = os.path.join(tempfile.mkdtemp(prefix="ckptmgr-demo-"), "checkpoints")
    cmd = [sys.executable, __file__, "--train", root]
    print(f"1. training with checkpoints every {SAVE_EVERY} steps under {root}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        print("  ", line.rstrip())
        if "step 25:" in line:
            break
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with CheckpointManager(root) as mgr:
        print(f"2. SIGKILLed the trainer; committed checkpoints: {mgr.steps()}")
    print("3. restarting: it resumes from the newest complete checkpoint")
    subprocess.run(cmd, check=True)
    with CheckpointManager(root) as mgr:
        resumed = mgr.restore()["model"]
    reference = train(None).state_dict()
    same = all(torch.equal(reference[k], resumed[k]) for k in reference)
    print(f"4. resumed run vs uninterrupted run: {'IDENTICAL' if same else 'DIFFERENT'} "
          f"({sum(v.numel() for v in reference.values())} parameters compared bit for bit)")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
