"""The ckptmgr demo: train, checkpoint, get SIGKILLed at a random moment while a checkpoint is
being written, resume from the newest complete checkpoint, and end bit-for-bit identical to
a run that was never interrupted. Three trials, each killed in a different save.

    python examples/demo.py [--trials N] [--seed S] [--keep]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
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
    """Train to TOTAL_STEPS; with a root, checkpoint every SAVE_EVERY steps and resume from
    the newest checkpoint. Checkpoint s holds the state after step s: resume at s + 1."""
    torch.set_num_threads(1)  # tiny tensors: more threads only contend
    model, opt, sched = build()
    state = {"model": model, "optim": opt, "sched": sched, "rng": RNG(), "step": 0}
    mgr = CheckpointManager(root) if root else None
    start = 0
    if mgr is not None and mgr.latest_step() is not None:
        state = mgr.restore(target=state)  # the newest checkpoint that verifies, in place
        start = state["step"] + 1
        print(f"[trainer] resumed from step {state['step']}, continuing at {start}", flush=True)
    pending = None
    for step in range(start, TOTAL_STEPS):
        x = torch.randn(32, 16)
        y = x.sum(dim=1, keepdim=True) * random.uniform(0.9, 1.1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if pending is not None and pending.done():  # how long the last save took to be durable
            print(f"[trainer] step {pending.step} durable after {pending.result().total_s * 1e3:.1f} ms", flush=True)
            pending = None
        if mgr is not None and (step % SAVE_EVERY == 0 or step == TOTAL_STEPS - 1):  # and the last step
            print(f"[trainer] step {step}: loss {loss.item():.4f}, saving", flush=True)
            pending = mgr.save(step, {**state, "step": step}, metadata={"loss": loss.item()})
        if slow:
            time.sleep(0.02)
    if mgr is not None:
        mgr.close()
    return model


def trial(n: int, rng: random.Random, reference: dict[str, torch.Tensor], root: str) -> bool:
    """Train in a child process, SIGKILL it at a random moment inside a random save's
    window (between ``save()`` and the durable commit), restart it, compare the result."""
    cmd = [sys.executable, __file__, "--train", root]
    victim = rng.randrange(2, TOTAL_STEPS // SAVE_EVERY - 1) * SAVE_EVERY
    print(f"trial {n}: training with checkpoints every {SAVE_EVERY} steps under {root}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    window = 0.0  # the longest save seen so far, from save() to durable
    for line in proc.stdout:
        if n == 1:
            print("  ", line.rstrip())
        if " durable after " in line:
            window = max(window, float(line.split(" durable after ")[1].split()[0]) / 1e3)
        if line.startswith(f"[trainer] step {victim}:"):
            break
    delay = rng.uniform(0, window)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with CheckpointManager(root) as mgr:
        print(f"  SIGKILLed {delay * 1e3:.1f} ms into the save of step {victim} (saves took up to "
              f"{window * 1e3:.1f} ms); committed checkpoints: {mgr.steps()}")
    print("  restarting: it resumes from the newest complete checkpoint")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if n > 1 else None)
    with CheckpointManager(root) as mgr:
        resumed = mgr.restore()["model"]
    same = all(torch.equal(reference[k], resumed[k]) for k in reference)
    print(f"  resumed run vs uninterrupted run: {'IDENTICAL' if same else 'DIFFERENT'} "
          f"({sum(v.numel() for v in reference.values())} parameters compared bit for bit)")
    return same


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--train":
        train(sys.argv[2], slow=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, help="pick the same kill moments again")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (default: removed at the end)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    rng = random.Random(seed)
    reference = train(None).state_dict()
    results = []
    for n in range(args.trials):
        work = tempfile.mkdtemp(prefix="ckptmgr-demo-")
        try:
            results.append(trial(n + 1, rng, reference, os.path.join(work, "checkpoints")))
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
    print(f"{sum(results)} of {len(results)} interrupted runs ended IDENTICAL to the uninterrupted one "
          f"(--seed {seed} repeats these kill moments)")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
