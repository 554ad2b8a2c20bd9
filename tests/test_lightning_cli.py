"""The ckptmgr command on a Lightning ModelCheckpoint directory of .ckpt files."""

import json
import os
import subprocess
import sys

import lightning.pytorch as pl
import torch

from ckptmgr.format import torchzip
from ckptmgr.integrations.lightning import CkptmgrCheckpointIO


def cli(*args):
    proc = subprocess.run([sys.executable, "-m", "ckptmgr", *args], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


class Net(pl.LightningModule):
    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(8, 8)

    def training_step(self, batch, i):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_ls_inspect_verify_a_model_checkpoint_directory(tmp_path):
    d = tmp_path / "ckpts"
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=4)
    mc = pl.callbacks.ModelCheckpoint(dirpath=d, every_n_train_steps=4, save_top_k=-1, save_last=True)
    pl.Trainer(max_steps=8, plugins=[CkptmgrCheckpointIO()], callbacks=[mc], logger=False, enable_progress_bar=False,
               enable_model_summary=False, accelerator="cpu").fit(Net(), data)
    torch.save({"global_step": 99, "epoch": 7, "state_dict": {"w": torch.ones(2)}}, d / "plain.ckpt")

    rc, out, _ = cli("ls", str(d), "--json")
    assert rc == 0
    rows = {os.path.basename(r["file"]): r for r in json.loads(out)["files"]}
    assert sorted(rows) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt", "plain.ckpt"]
    assert rows["epoch=0-step=4.ckpt"]["global_step"] == 4 and rows["epoch=0-step=4.ckpt"]["checksums"]
    assert rows["plain.ckpt"]["global_step"] == 99 and not rows["plain.ckpt"]["checksums"]

    rc, out, _ = cli("inspect", str(d), "epoch=0-step=8.ckpt")
    assert rc == 0 and "global_step: 8" in out and "hyper_parameters: ['lr']" in out

    rc, out, _ = cli("verify", str(d))
    assert rc == 0 and out.count(": ok (crc32c chunks)") == 3 and "plain.ckpt: ok (zip CRC-32)" in out

    path = d / "epoch=0-step=4.ckpt"
    with open(path, "rb") as f:
        records = torchzip.read_records(lambda o, n: (f.seek(o), f.read(n))[1], os.path.getsize(path))
    at = next(r for r in records if r.name.startswith("data/")).data_offset
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    rc, out, err = cli("verify", str(d))
    assert rc == 1 and "epoch=0-step=4.ckpt: CORRUPT" in out and "CRC32C" in err
    rc, out, _ = cli("verify", str(d / "last.ckpt"))  # one file
    assert rc == 0 and "last.ckpt: ok" in out
