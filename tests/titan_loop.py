"""torchtitan's training loop as its Trainer drives the checkpointer, with torchtitan's own
components (ModelWrapper, OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader)
around a small model.

torchtitan's ``Trainer`` itself needs CUDA (it selects the "cuda" device when no accelerator is
present, and its model modules import triton), so the calls it makes on the checkpointer are
copied here, in its order (torchtitan 0.3.0, ``trainer.py``): ``config.checkpoint.build(...)``
with the trainer's arguments, ``load(step=config.checkpoint.load_step)`` before the loop, per
step ``maybe_wait_for_staging()`` between gradient clipping and ``optimizers.step()``, then
``save(step, last_step=step == steps)``, and ``close()`` at the end.

Usable in-process or from a ``torchrun``-style worker (``python titan_loop.py OUT RESULT``
with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set: gloo, FSDP2 over the ranks).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch.utils.data import Dataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

VOCAB, DIM, SEQ = 64, 32, 12


class Tokens(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(99)
        self.x = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, 2 * DIM),
                                                              torch.nn.GELU(), torch.nn.Dropout(0.1),
                                                              torch.nn.Linear(2 * DIM, DIM)) for _ in range(2))
        self.out = torch.nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


class TrainState:
    """What torchtitan's Trainer saves of itself (``states={"train_state": trainer}``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]
        self.ntokens_seen = sd["ntokens_seen"]


class TorchRNG:
    """The torch RNG (dropout) as an extra state: torchtitan saves none, a job may add it."""

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd["cpu"])


def build(checkpoint_config: Any, dump: str, *, shard: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyLM()
    rank, world = 0, 1
    if shard:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt_cfg = OptimizersContainer.Config(implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.1})])
    optimizers = opt_cfg.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=12)
    loader = ParallelAwareDataloader(Tokens(), dp_rank=rank, dp_world_size=world, batch_size=4, shuffle=True,
                                     generator=torch.Generator().manual_seed(5 + rank))
    state = TrainState()
    checkpointer = checkpoint_config.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                                           lr_schedulers=schedulers, states={"train_state": state, "rng": TorchRNG()},
                                           sd_adapter=None, base_folder=dump)
    return {"model": model, "optimizers": optimizers, "schedulers": schedulers, "loader": loader, "state": state,
            "checkpointer": checkpointer}


def train(parts: dict[str, Any], steps: int, *, load_step: int = -1, stop_after: int | None = None) -> dict[int, str]:
    """torchtitan's ``Trainer.train`` with its checkpointer calls; per-step losses (float.hex)."""
    model, ckpt, state = parts["model"], parts["checkpointer"], parts["state"]
    ckpt.load(step=load_step)
    losses: dict[int, str] = {}
    data = iter(parts["loader"])
    try:
        while state.step < steps:
            state.step += 1
            tokens = next(data)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            ckpt.maybe_wait_for_staging()
            parts["optimizers"].step()
            parts["schedulers"].step()
            parts["optimizers"].zero_grad()
            state.ntokens_seen += tokens.numel()
            losses[state.step] = float(loss.detach()).hex()
            ckpt.save(state.step, last_step=(state.step == steps))
            if stop_after is not None and state.step == stop_after:
                break
    finally:
        ckpt.close()
    return losses


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = full.detach().clone()
    return out


def _worker() -> None:
    """A rank of the FSDP2 test: an uninterrupted run, then a run stopped after step 6 and
    resumed by freshly built objects; losses and full weights of both go to RESULT.<rank>."""
    import torch.distributed as dist

    from ckptmgr.integrations.torchtitan import CkptmgrCheckpointManager

    out, result = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = CkptmgrCheckpointManager.Config(enable=True, folder="ckpt", interval=3, keep_latest_k=2,
                                          last_save_model_only=False, coordination_timeout=60)
    ref = build(cfg, os.path.join(out, "ref"), shard=True)
    ref_losses = train(ref, 9)
    first = train(build(cfg, os.path.join(out, "run"), shard=True), 9, stop_after=6)
    resumed = build(cfg, os.path.join(out, "run"), shard=True)
    second = train(resumed, 9)
    rank = dist.get_rank()
    with open(f"{result}.{rank}.json", "w") as f:
        json.dump({"ref": ref_losses, "first": first, "second": second, "step": resumed["state"].step}, f)
    torch.save({"ref": full_weights(ref["model"]), "resumed": full_weights(resumed["model"])}, f"{result}.{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker()
