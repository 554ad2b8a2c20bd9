"""The Lightning CheckpointIO plugin with real Trainers on CPU: a fit SIGKILLed mid-run and
resumed with ckpt_path="last" ends bitwise identical to one never interrupted; ModelCheckpoint's
removals never overtake saves in flight; tensors changed right after a save (optimizer step,
BatchNorm forward) never tear it; a path that exists always names a complete checkpoint."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import assert_tree_equal

from ckptmgr import ConfigError
from ckptmgr.integrations._lightning_io import ROOT_NAME, read_pointer
from ckptmgr.integrations.lightning import CkptmgrCheckpointIO

TRAINER = os.path.join(os.path.dirname(__file__), "lightning_trainer.py")


def run(d, epochs, out, *extra):
    proc = subprocess.run([sys.executable, TRAINER, d, str(epochs), out, *extra], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def final(out):
    return torch.load(out, weights_only=False)


def test_killed_fit_resumed_from_last_ends_bitwise_identical(tmp_path):
    run(str(tmp_path / "ref"), 6, str(tmp_path / "ref.pt"))
    d = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, TRAINER, d, "6", str(tmp_path / "x.pt"), "--step-sleep", "0.02"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("epoch 2 done"):
            break
    proc.send_signal(signal.SIGKILL)  # mid-epoch 3, with a save possibly in flight
    proc.wait()
    # every path that exists names a complete checkpoint
    plugin = CkptmgrCheckpointIO()
    names = sorted(n for n in os.listdir(d) if n.endswith(".ckpt"))
    assert "last.ckpt" in names
    for n in names:
        assert plugin.load_checkpoint(os.path.join(d, n))["epoch"] >= 0
    plugin.teardown()
    out = run(d, 6, str(tmp_path / "resumed.pt"), "--resume")
    assert "finished" in out
    ref, got = final(str(tmp_path / "ref.pt")), final(str(tmp_path / "resumed.pt"))
    assert got["global_step"] == ref["global_step"] == 60
    assert_tree_equal(got["model"], ref["model"])
    assert_tree_equal(got["optim"], ref["optim"])
    # ModelCheckpoint's choices are all that is left: top 2 + last, and only their steps
    left = sorted(n for n in os.listdir(d) if n.endswith(".ckpt"))
    assert len(left) == 3 and "last.ckpt" in left
    named = {read_pointer(os.path.join(d, n)) for n in left}
    assert {n for n in os.listdir(os.path.join(d, ROOT_NAME)) if n.startswith("step_")} == {
        f"step_{s:012d}" for s in named}


def test_the_pytorch_lightning_namespace_has_its_own_plugin(tmp_path):
    d = str(tmp_path / "pl")
    run(d, 2, str(tmp_path / "out.pt"), "--namespace", "pytorch_lightning")
    from ckptmgr.integrations.pytorch_lightning import CkptmgrCheckpointIO as PLCheckpointIO

    plugin = PLCheckpointIO()
    ckpt = plugin.load_checkpoint(os.path.join(d, "last.ckpt"))
    assert ckpt["global_step"] == 20 and "state_dict" in ckpt and ckpt["hyper_parameters"]["width"] == 64
    plugin.teardown()


def _lightning_checkpoint(tmp_path):
    """A whole checkpoint dict of a real fit, as Lightning's own CheckpointIO wrote it."""
    d = str(tmp_path / "torchio")
    import lightning.pytorch as pl

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))

    class M(pl.LightningModule):
        def __init__(self, lr=0.1):
            super().__init__()
            self.save_hyperparameters()
            self.m = model

        def training_step(self, batch, i):
            return self.m(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 2)]

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)
    trainer = pl.Trainer(max_epochs=1, default_root_dir=d, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu")
    trainer.fit(M(), data)
    path = os.path.join(d, "x.ckpt")
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=False)


def test_the_whole_checkpoint_dict_round_trips(tmp_path):
    ckpt = _lightning_checkpoint(tmp_path)
    assert {"loops", "callbacks", "optimizer_states", "lr_schedulers", "hyper_parameters"} <= set(ckpt)
    plugin = CkptmgrCheckpointIO()
    path = str(tmp_path / "ckpts" / "a.ckpt")
    plugin.save_checkpoint(ckpt, path)
    plugin.teardown()
    assert_tree_equal(CkptmgrCheckpointIO().load_checkpoint(path), ckpt)
    # and a file saved by Lightning's own CheckpointIO still loads through the plugin
    assert_tree_equal(CkptmgrCheckpointIO().load_checkpoint(str(tmp_path / "torchio" / "x.ckpt")), ckpt)


def test_removal_waits_for_the_saves_queued_before_it(tmp_path):
    d = tmp_path / "ckpts"
    plugin = CkptmgrCheckpointIO()
    big = {"w": torch.randn(4 << 20), "epoch": 0}
    plugin.save_checkpoint(big, str(d / "a.ckpt"))
    plugin.remove_checkpoint(str(d / "a.ckpt"))  # while a's save is most likely still in flight
    plugin.save_checkpoint({"w": torch.ones(3), "epoch": 1}, str(d / "b.ckpt"))
    plugin.save_checkpoint({"w": torch.zeros(3), "epoch": 2}, str(d / "a.ckpt"))  # the name again
    plugin.remove_checkpoint(str(d / "b.ckpt"))
    plugin.teardown()
    assert sorted(n for n in os.listdir(d) if n.endswith(".ckpt")) == ["a.ckpt"]
    with pytest.raises(FileNotFoundError):
        CkptmgrCheckpointIO().load_checkpoint(str(d / "b.ckpt"))
    assert CkptmgrCheckpointIO().load_checkpoint(str(d / "a.ckpt"))["epoch"] == 2
    # only a.ckpt's step is left: the removed and replaced ones were deleted at teardown
    assert [n for n in os.listdir(d / ROOT_NAME) if n.startswith("step_")] == [
        f"step_{read_pointer(str(d / 'a.ckpt')):012d}"]


@pytest.mark.parametrize("change", ["optimizer_step", "batchnorm_forward"])
def test_tensors_changed_right_after_a_save_do_not_tear_it(tmp_path, change):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(2048), torch.nn.Linear(2048, 2048)).train()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(8, 2048)).sum().backward()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    plugin = CkptmgrCheckpointIO()
    path = str(tmp_path / "c" / "x.ckpt")
    # a large tensor first keeps the copy threads busy: the model's tensors are copied last
    ckpt = {"optimizer_states": [torch.randn(32 << 20)], "state_dict": model.state_dict()}
    plugin.save_checkpoint(ckpt, path)  # returns with the copy in flight
    if change == "optimizer_step":
        opt.step()  # the fence waits for the copy before the weights change
    else:
        model(torch.randn(8, 2048) * 5)  # running statistics change in this forward
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, want[k])]
    assert changed
    plugin.teardown()
    assert_tree_equal(dict(CkptmgrCheckpointIO().load_checkpoint(path)["state_dict"]), want)


def test_a_pointer_to_a_step_that_never_committed_is_refused(tmp_path):
    d = tmp_path / "c"
    plugin = CkptmgrCheckpointIO()
    plugin.save_checkpoint({"x": torch.ones(2)}, str(d / "a.ckpt"))
    plugin.teardown()
    (d / "b.ckpt").write_text('{"format": "ckptmgr-lightning-pointer", "root": ".ckptmgr", "step": 99}')
    with pytest.raises(Exception, match="step 99"):
        CkptmgrCheckpointIO().load_checkpoint(str(d / "b.ckpt"))


def test_bad_arguments_are_refused():
    with pytest.raises(ConfigError, match="retention"):
        CkptmgrCheckpointIO(retention=None)
    with pytest.raises(TypeError, match="storage_options"):
        CkptmgrCheckpointIO().save_checkpoint({}, "/tmp/x.ckpt", storage_options={"a": 1})
