"""accelerate with save_state/load_state through ckptmgr: run it, kill it, run it again.

    pip install '.[accelerate]'   # from a checkout of this repository (ckptmgr is not on PyPI yet)

    python examples/accelerate_resume.py /tmp/acc-run --steps 60
    python examples/accelerate_resume.py /tmp/acc-run --steps 120   # resumes where it stopped

Automatic checkpoint naming (``checkpoints/checkpoint_<n>``), the newest 2 kept
(``total_limit``). ``AsyncStateSaver.save_state()`` runs accelerate's own ``save_state`` with
its writes captured: the tensors are copied into reused host memory, the files written in the
background, and the directory appears only once complete. ``load_state()`` takes the newest
complete, verified checkpoint (with accelerate's stateful data loader, the data position too).
"""

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration

from ckptmgr import StepNotFoundError
from ckptmgr.integrations.accelerate import AsyncStateSaver

ap = argparse.ArgumentParser()
ap.add_argument("project_dir")
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--every", type=int, default=20)
args = ap.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(4096, 32, generator=g), torch.randn(4096, 1, generator=g))
loader = torch.utils.data.DataLoader(data, batch_size=16)
accelerator = Accelerator(project_dir=args.project_dir,
                          project_config=ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2),
                          dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

with AsyncStateSaver(accelerator) as saver:
    try:
        print("resumed from", saver.load_state())
    except StepNotFoundError:
        print("starting fresh")
    batches = iter(loader)
    for _ in range(args.steps - accelerator.step):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        accelerator.step += 1
        if accelerator.step % args.every == 0:
            saver.save_state()  # returns once the copies are enqueued
print("step", accelerator.step, "loss", round(loss.item(), 4))
print("latest checkpoint:", saver.latest())
