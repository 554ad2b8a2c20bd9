"""A plain training loop that resumes from its newest checkpoint: run it, stop it (Ctrl-C,
SIGTERM, or kill -9), run it again.

    python examples/plain_loop_resume.py /tmp/plain-run --steps 200

Checkpoints every 20 steps (the copy overlaps the next step), keeps the newest 3 plus every
100th, and on SIGTERM saves the current step and stops. Checkpoint s holds the state after
step s: a restart continues at s + 1.
"""

import argparse
import signal

import torch

from ckptmgr import AnyOf, CheckpointManager, KeepEvery, KeepLatest
from ckptmgr.integrations.callbacks import CheckpointCallback

ap = argparse.ArgumentParser()
ap.add_argument("root")
ap.add_argument("--steps", type=int, default=200)
args = ap.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
data = torch.Generator().manual_seed(1)


class GeneratorState:
    """The data generator's position, saved and restored with the rest of the state."""

    def state_dict(self):
        return {"state": data.get_state()}

    def load_state_dict(self, d):
        data.set_state(d["state"])


state = {"model": model, "optim": opt, "sched": sched, "data": GeneratorState()}

manager = CheckpointManager(args.root, retention=AnyOf(KeepLatest(3), KeepEvery(100)))
ckpt = CheckpointCallback(manager, state, every_n_steps=20, save_on_signals=(signal.SIGTERM,))
start = ckpt.resume()  # 0 on a fresh start, else the restored step + 1
print(f"starting at step {start}", flush=True)
for step in range(start, args.steps):
    x = torch.randn(64, 32, generator=data)
    loss = (model(x) - x[:, :1]).pow(2).mean()
    loss.backward()
    ckpt.before_optimizer_step(step)  # the previous save's copy has landed
    opt.step()
    opt.zero_grad()
    sched.step()
    if ckpt.after_step(step):  # SIGTERM: this step is durable, stop
        print(f"stopped at step {step}", flush=True)
        break
ckpt.close()  # waits for the last save and closes the manager
with CheckpointManager(args.root) as manager:
    print(f"done; checkpoints at steps {manager.steps()}", flush=True)
