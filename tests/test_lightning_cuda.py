"""The Lightning plugin on a GPU: the device-to-host copy overlaps the next step and is fenced
before the weights change, no GPU memory is added, and the files load anywhere."""

import os

import pytest
import torch

pytestmark = pytest.mark.cuda

pl = pytest.importorskip("lightning.pytorch")


def _fit(d, plugin, steps=6, every=2):
    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)])

        def training_step(self, batch, i):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 2048)), batch_size=8)
    seen = {}

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            if trainer.global_step % every == 0:  # what ModelCheckpoint saved at this step (before the next one)
                seen[trainer.global_step] = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    mc = pl.callbacks.ModelCheckpoint(dirpath=d, every_n_train_steps=every, save_top_k=-1)
    trainer = pl.Trainer(max_steps=steps, accelerator="gpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Record(), mc], plugins=[plugin] if plugin else None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainer.fit(Net(), data)
    return seen, torch.cuda.max_memory_allocated()


def test_every_file_holds_the_weights_of_its_step_and_no_gpu_memory_is_added(tmp_path):
    from ckptmgr.integrations.lightning import CkptmgrCheckpointIO

    _, peak_without = _fit(str(tmp_path / "plain"), None)
    seen, peak = _fit(str(tmp_path / "ours"), CkptmgrCheckpointIO())
    assert peak <= peak_without + (16 << 20)  # no GPU clone of the checkpoint (64 MiB of weights + 128 of Adam)
    for name in sorted(os.listdir(tmp_path / "ours")):
        ckpt = torch.load(tmp_path / "ours" / name, weights_only=True, map_location="cpu")
        want = seen[ckpt["global_step"]]
        for k, v in ckpt["state_dict"].items():
            assert torch.equal(v, want[k]), (name, k)  # the copy landed before the optimizer step changed it
        assert ckpt["state_dict"]["net.0.weight"].device.type == "cpu"
    back = torch.load(tmp_path / "ours" / name, weights_only=True)  # saved from cuda: loads onto cuda
    assert back["state_dict"]["net.0.weight"].is_cuda
