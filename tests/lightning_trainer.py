"""A small deterministic Lightning run, checkpointed through CkptmgrCheckpointIO; the tests
start it as a subprocess (and SIGKILL it).

    python lightning_trainer.py DIR EPOCHS OUT [--resume] [--namespace lightning|pytorch_lightning]

Trains a tiny BatchNorm MLP on fixed data (no shuffling, no dropout) for EPOCHS epochs,
saving at every epoch end (top 2 by training loss, plus last.ckpt), optionally resuming with
``ckpt_path="last"``; then writes the final model and optimizer state to OUT with torch.save.
Prints "epoch N done" after each epoch (flushed), and sleeps a little per step so that a
test can kill it mid-run.
"""

import argparse
import os
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("epochs", type=int)
ap.add_argument("out")
ap.add_argument("--resume", action="store_true")
ap.add_argument("--namespace", default="lightning")
ap.add_argument("--step-sleep", type=float, default=0.0)
args = ap.parse_args()

if args.namespace == "lightning":
    import lightning.pytorch as pl

    from ckptmgr.integrations.lightning import CkptmgrCheckpointIO
else:
    import pytorch_lightning as pl

    from ckptmgr.integrations.pytorch_lightning import CkptmgrCheckpointIO


class Net(pl.LightningModule):
    def __init__(self, width: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)}


class Printer(pl.Callback):
    def on_train_epoch_end(self, trainer, module):
        print(f"epoch {trainer.current_epoch} done", flush=True)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 16, generator=g)
    y = (x[:, :4].sum(1, keepdim=True) > 0).float()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=False)


pl.seed_everything(0, verbose=False)
model = Net()
ckpt = pl.callbacks.ModelCheckpoint(dirpath=args.dir, monitor="train_loss", save_top_k=2, save_last=True,
                                    every_n_epochs=1)
trainer = pl.Trainer(max_epochs=args.epochs, plugins=[CkptmgrCheckpointIO()], callbacks=[ckpt, Printer()],
                     logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                     deterministic=True)
trainer.fit(model, data(), ckpt_path="last" if args.resume else None)
torch.save({"model": model.state_dict(), "optim": trainer.optimizers[0].state_dict(),
            "global_step": trainer.global_step, "best": ckpt.best_model_path}, args.out)
print("finished", os.path.basename(ckpt.best_model_path), flush=True)
