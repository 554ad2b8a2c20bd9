"""torchtitan with ckptmgr as its checkpoint manager.

    pip install '.[torchtitan]'   # from a checkout of this repository (ckptmgr is not on PyPI yet)

With torchtitan on GPUs, select the manager in a config function (torchtitan's configs are
Python) and point torchtitan at this module::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module examples.torchtitan_checkpointing --config llama3_debugmodel_ckptmgr

Run directly, this file drives the manager exactly as torchtitan's trainer does (build from
the config, ``load`` before the loop, ``maybe_wait_for_staging`` before each optimizer step,
``save`` after it, ``close``) around torchtitan's own optimizer, scheduler and data-loader
components and a small model, on the CPU: stop it with ``--stop-after`` and run it again to
see it resume.

    python examples/torchtitan_checkpointing.py /tmp/titan-run --steps 20 --stop-after 12
    python examples/torchtitan_checkpointing.py /tmp/titan-run --steps 20   # resumes at step 11
"""

import argparse

import torch
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from ckptmgr.integrations.torchtitan import CkptmgrCheckpointManager


def checkpoint_config(**overrides):
    """ckptmgr's manager with torchtitan's checkpoint options."""
    return CkptmgrCheckpointManager.Config(**{"enable": True, "folder": "checkpoint", "interval": 5,
                                              "keep_latest_k": 3, "last_save_model_only": False,
                                              "initial_load_model_only": False, **overrides})


def llama3_debugmodel_ckptmgr():
    """torchtitan's Llama 3 debug model, checkpointed by ckptmgr (needs torchtitan's models,
    i.e. a GPU machine with triton)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.checkpoint = checkpoint_config(interval=10)
    return config


class TrainState:
    """What torchtitan's trainer saves of itself."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump_folder")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--stop-after", type=int, default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    optimizers = OptimizersContainer.Config(implementation="for-loop", param_groups=[
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})]).build(
        model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=args.steps)
    tokens = torch.randint(0, 64, (4096, 17), generator=torch.Generator().manual_seed(1))
    loader = ParallelAwareDataloader(tokens, dp_rank=0, dp_world_size=1, batch_size=8)
    state = TrainState()
    checkpointer = checkpoint_config().build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                                             lr_schedulers=schedulers, states={"train_state": state},
                                             sd_adapter=None, base_folder=args.dump_folder)
    checkpointer.load()
    print("starting at step", state.step + 1)
    batches = iter(loader)
    try:
        while state.step < args.steps:
            state.step += 1
            batch = next(batches)
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
            loss.backward()
            checkpointer.maybe_wait_for_staging()  # the last save's copy has landed
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            checkpointer.save(state.step, last_step=state.step == args.steps)
            if state.step == args.stop_after:
                break
    finally:
        checkpointer.close()
    print("step", state.step, "loss", round(loss.item(), 4))


if __name__ == "__main__":
    main()
