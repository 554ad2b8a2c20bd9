"""A plain training loop whose data loader resumes at the exact next sample, on every rank.

    pip install '.[torchdata]'   # from a checkout of this repository (ckptmgr is not on PyPI yet)

    python examples/dataloader_resume.py /tmp/dl-run --steps 30 --kill-at 17   # dies at step 17
    python examples/dataloader_resume.py /tmp/dl-run --steps 30                # resumes at step 16

    torchrun --nproc-per-node 2 examples/dataloader_resume.py /tmp/dl-ddp --steps 30  # per rank

torchdata's ``StatefulDataLoader`` (or any object with ``state_dict()``/``load_state_dict()``)
is part of the saved state like the model and the optimizer: its position (and its shuffling
generator) is saved with each checkpoint and restored into it, so the resumed run sees the
very samples the interrupted one would have seen next. Each rank's loader has its own
position: wrapped in :class:`ckptmgr.PerRank`, every rank saves and gets back its own.

Prints the sample ids each step consumed, so two runs can be compared.
"""

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from ckptmgr import CheckpointManager, KeepLatest, PerRank
from ckptmgr.integrations.callbacks import CheckpointCallback

ap = argparse.ArgumentParser()
ap.add_argument("root")
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--every", type=int, default=5)
ap.add_argument("--kill-at", type=int, default=-1, help="SIGKILL this process after that step (a crash)")
ap.add_argument("--log", default="", help="append each step's sample ids (JSON lines) to this file")
args = ap.parse_args()

distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
rank = dist.get_rank() if distributed else 0
world = dist.get_world_size() if distributed else 1

ids = torch.arange(10_000)
features = torch.randn(10_000, 16, generator=torch.Generator().manual_seed(0))
dataset = torch.utils.data.TensorDataset(ids, features)
sampler = torch.utils.data.DistributedSampler(dataset, world, rank, shuffle=True, seed=3) if distributed else None
loader = StatefulDataLoader(dataset, batch_size=8, sampler=sampler, shuffle=sampler is None,
                            generator=torch.Generator().manual_seed(1))

torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
if distributed:  # gradients averaged over the ranks: the model stays identical on all of them
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = {"model": model, "optim": opt, "loader": PerRank(loader)}

manager = CheckpointManager(args.root, retention=KeepLatest(2))
ckpt = CheckpointCallback(manager, state, every_n_steps=args.every)
start = ckpt.resume()
print(f"rank {rank}: starting at step {start}", flush=True)
batches = iter(loader)
for step in range(start, args.steps):
    batch_ids, x = next(batches)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    ckpt.before_optimizer_step(step)
    opt.step()
    if args.log:
        with open(f"{args.log}.{rank}", "a") as f:
            f.write(json.dumps({"step": step, "ids": batch_ids.tolist()}) + "\n")
    ckpt.after_step(step)
    if step == args.kill_at:
        manager.wait()  # the checkpoints so far are durable; the kill then hits mid-run
        os.kill(os.getpid(), signal.SIGKILL)
manager.wait()
print(f"rank {rank}: committed steps {manager.steps()}")
ckpt.close()  # and the manager with it
if distributed:
    dist.destroy_process_group()
