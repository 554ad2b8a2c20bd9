"""A small deterministic Lightning run, checkpointed through CkptmgrCheckpointIO; the tests
start it as a subprocess (and SIGKILL it).

    python lightning_trainer.py DIR EPOCHS OUT [--resume] [--namespace lightning|pytorch_lightning]
                                [--step-sleep S] [--strategy ddp_spawn --devices 2] [--hparams rich|plain]

Trains a tiny BatchNorm MLP on fixed data (no shuffling, no dropout) for EPOCHS epochs,
saving at every epoch end (top 2 by training loss, plus last.ckpt), optionally resuming with
``ckpt_path="last"``; then writes the final model and optimizer state to OUT with torch.save.
With ``--hparams rich`` its hyper-parameters hold an nn.Module, a dataclass and a Namespace,
as real ones do (such checkpoints load with ``weights_only=False`` only, as torch.save files).
Prints "epoch N done" after each epoch (flushed), and sleeps a little per step so that a
test can kill it mid-run.
"""

import argparse
import dataclasses
import os
import sys
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("epochs", type=int)
ap.add_argument("out")
ap.add_argument("--resume", action="store_true")
ap.add_argument("--namespace", default="lightning")
ap.add_argument("--step-sleep", type=float, default=0.0)
ap.add_argument("--strategy", default="auto")
ap.add_argument("--devices", type=int, default=1)
ap.add_argument("--hold-last", type=int, default=0,
                help="N: the N-th write of last.ckpt stops half-way (a gate, for a test to SIGKILL the run there)")
ap.add_argument("--hparams", choices=["rich", "plain"], default="plain",
                help="plain: numbers only (weights_only loads); rich: a module, a dataclass and a Namespace")
# Imported by other processes (the loader, a test unpickling its hyper-parameters): the defaults.
args = ap.parse_args(None if os.path.basename(sys.argv[0]) == "lightning_trainer.py" else ["-", "0", "-"])

if args.namespace == "lightning":
    import lightning.pytorch as pl
else:
    import pytorch_lightning as pl


@dataclasses.dataclass
class Optim:
    lr: float = 0.05
    step_size: int = 7


class Net(pl.LightningModule):
    def __init__(self, width: int = 64, optim: Optim = Optim(), loss: torch.nn.Module = torch.nn.MSELoss(),  # noqa: B008
                 extra: argparse.Namespace = argparse.Namespace(tag="run")) -> None:  # noqa: B008
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.hparams.loss or torch.nn.functional.mse_loss)(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        return loss

    def configure_optimizers(self):
        o = self.hparams.optim or Optim()
        opt = torch.optim.AdamW(self.parameters(), lr=o.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=o.step_size,
                                                                                  gamma=0.7)}


class Printer(pl.Callback):
    def on_train_start(self, trainer, module):
        print(f"start at step {trainer.global_step}", flush=True)

    def on_train_epoch_end(self, trainer, module):
        print(f"epoch {trainer.current_epoch} done", flush=True)


class LeaveProcessGroup(pl.Callback):
    # Lightning destroys only NCCL groups at exit: gloo's, left to interpreter shutdown, can abort a ddp_spawn
    # worker (SIGABRT). teardown follows fit's last collective; the spawn launcher's result collection needs none.
    def teardown(self, trainer, module, stage):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 16, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) > 0).float()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=False)


def hold_last_write(n: int) -> None:
    """Stop the ``n``-th write of last.ckpt half-way: the writer's temporary holds the first
    half of its first chunk, "holding" is printed, and the writer waits (up to 5 minutes) for
    the SIGKILL a test sends on reading that line."""
    import threading

    from ckptmgr.storage.commit import file as onefile

    write, pwrite = onefile.write_file_atomic, onefile.pwrite_all
    state = {"seen": 0, "hold": False}

    def write_file_atomic(path, data, **kw):
        if os.path.basename(path) == "last.ckpt":
            state["seen"] += 1
            state["hold"] = state["seen"] == n
        try:
            return write(path, data, **kw)
        finally:
            state["hold"] = False

    def pwrite_all(fd, buf, offset):
        if state["hold"]:
            pwrite(fd, buf[: len(buf) // 2], offset)
            print("holding", flush=True)
            threading.Event().wait(300)
        return pwrite(fd, buf, offset)

    onefile.write_file_atomic = write_file_atomic
    onefile.pwrite_all = pwrite_all


def main() -> None:
    if args.hold_last:
        hold_last_write(args.hold_last)
    if args.namespace == "lightning":
        from ckptmgr.integrations.lightning import CkptmgrCheckpointIO
    else:
        from ckptmgr.integrations.pytorch_lightning import CkptmgrCheckpointIO
    pl.seed_everything(0, verbose=False)
    model = Net() if args.hparams == "rich" else Net(optim=None, loss=None, extra=None)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=args.dir, monitor="train_loss", save_top_k=2, save_last=True,
                                        every_n_epochs=1)
    trainer = pl.Trainer(max_epochs=args.epochs, plugins=[CkptmgrCheckpointIO()],
                         callbacks=[ckpt, Printer(), LeaveProcessGroup()], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", deterministic=True, strategy=args.strategy,
                         devices=args.devices)
    trainer.fit(model, data(), ckpt_path="last" if args.resume else None, weights_only=False)
    if trainer.is_global_zero:
        torch.save({"model": model.state_dict(), "optim": trainer.optimizers[0].state_dict() if trainer.optimizers
                    else None, "global_step": trainer.global_step, "best": ckpt.best_model_path}, args.out)
        print("finished", os.path.basename(ckpt.best_model_path), flush=True)


if __name__ == "__main__":
    import lightning_trainer  # the classes pickled into checkpoints are lightning_trainer's, not __main__'s

    lightning_trainer.main()
