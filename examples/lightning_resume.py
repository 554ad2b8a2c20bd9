"""Lightning with ckptmgr: fit, and on a restart resume from the newest complete checkpoint.

    pip install '.[lightning]'   # from a checkout of this repository (ckptmgr is not on PyPI yet)

    python examples/lightning_resume.py /tmp/lightning-run --epochs 5

Run it twice: the second run finds ``last.ckpt`` and continues where the first stopped
(``ckpt_path="last"``), also after a kill -9 in the middle of a save. Every ``.ckpt`` in DIR is a
standard PyTorch checkpoint file: ``torch.load(path, weights_only=True)`` reads it anywhere.
"""

import argparse

import lightning.pytorch as pl
import torch

from ckptmgr.integrations.lightning import CkptmgrCheckpointIO

ap = argparse.ArgumentParser()
ap.add_argument("dir")
ap.add_argument("--epochs", type=int, default=5)
args = ap.parse_args()


class Regressor(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


g = torch.Generator().manual_seed(0)
x = torch.randn(512, 16, generator=g)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1] * 2), batch_size=64)
pl.seed_everything(0, verbose=False)
trainer = pl.Trainer(
    max_epochs=args.epochs, accelerator="auto", logger=False, enable_progress_bar=False,
    plugins=[CkptmgrCheckpointIO()],
    callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.dir, monitor="train_loss", save_top_k=2, save_last=True)],
)
trainer.fit(Regressor(), data, ckpt_path="last")  # a fresh start when there is no last.ckpt yet
print(f"finished at global step {trainer.global_step}", flush=True)
last = torch.load(f"{args.dir}/last.ckpt", weights_only=True)  # plain torch: no ckptmgr needed to read it
print(f"last.ckpt: epoch {last['epoch']}, global step {last['global_step']}", flush=True)
