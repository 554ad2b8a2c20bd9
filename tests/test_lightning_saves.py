"""The Lightning plugin's background saves, held in flight by a gate on the file write:
ModelCheckpoint never gives two saves one name, removals wait for the saves before them,
temporaries are invisible to Lightning's name parsers, threads end at teardown, direct
saves are on disk when they return, and the plugin pickles at any time."""

import copy
import os
import pickle
import threading

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from ckptmgr import StagingOptions
from ckptmgr.format.naming import FILE_TEMP_RE as TEMP_PATTERN
from ckptmgr.integrations.lightning import CkptmgrCheckpointIO
from ckptmgr.storage.commit import file as onefile

_max_version = _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder


class Gate:
    """Holds every local file write, its temporary just created, until ``open()``."""

    def __init__(self, monkeypatch):
        self._open = threading.Event()
        self.started = threading.Semaphore(0)
        real = onefile.pwrite_all

        def gated(fd, data, offset):
            self.started.release()
            assert self._open.wait(60), "the test never opened the gate"
            return real(fd, data, offset)

        monkeypatch.setattr(onefile, "pwrite_all", gated)

    def wait_started(self, n=1):
        for _ in range(n):
            assert self.started.acquire(timeout=60)

    def open(self):
        self._open.set()


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def training_step(self, batch, i):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("const", 1.0)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BigNet(Net):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1024, 2048)  # 8 MiB of weights: two 5 MiB parts

    def training_step(self, batch, i):
        return self.layer(torch.nn.functional.pad(batch[0], (0, 1016))).pow(2).mean()


def data():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8)), batch_size=4)


def trainer(d, plugin, steps, callbacks=(), **ckpt):
    mc = pl.callbacks.ModelCheckpoint(dirpath=d, **ckpt)
    return pl.Trainer(max_steps=steps, plugins=[plugin] if plugin else None, callbacks=[mc, *callbacks], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")


class OpenAtTrainEnd(pl.Callback):
    def __init__(self, gate):
        self.gate = gate

    def on_train_end(self, trainer, module):
        self.gate.open()


@pytest.fixture
def gate(monkeypatch):
    g = Gate(monkeypatch)
    yield g
    g.open()  # a failed test must not leave writer threads waiting


def test_in_flight_saves_are_never_given_one_name(tmp_path, gate):
    # What Lightning's own plugin produces: every save kept, each under its own name.
    names = {"filename": "fixed", "save_top_k": -1, "monitor": "const", "every_n_train_steps": 1}
    trainer(tmp_path / "torch", TorchCheckpointIO(), 4, **names).fit(Net(), data())
    want = sorted(os.listdir(tmp_path / "torch"))
    assert want == ["fixed-v1.ckpt", "fixed-v2.ckpt", "fixed-v3.ckpt", "fixed.ckpt"]
    # Ours with all four saves still in flight when ModelCheckpoint names the next one.
    plugin = CkptmgrCheckpointIO(staging=StagingOptions(slots=4))
    trainer(tmp_path / "ours", plugin, 4, callbacks=[OpenAtTrainEnd(gate)], **names).fit(Net(), data())
    assert sorted(os.listdir(tmp_path / "ours")) == want
    steps = {torch.load(tmp_path / "ours" / n, weights_only=True)["global_step"] for n in want}
    assert steps == {1, 2, 3, 4}


def test_removal_waits_for_the_saves_enqueued_before_it(tmp_path, gate):
    d = tmp_path / "ckpts"
    plugin = CkptmgrCheckpointIO(async_direct_saves=True, staging=StagingOptions(slots=3))
    plugin.save_checkpoint({"w": torch.randn(1000), "epoch": 0}, str(d / "a.ckpt"))
    gate.wait_started()  # a's write is held
    plugin.remove_checkpoint(str(d / "a.ckpt"))
    plugin.save_checkpoint({"w": torch.ones(3), "epoch": 1}, str(d / "b.ckpt"))
    plugin.save_checkpoint({"w": torch.zeros(3), "epoch": 2}, str(d / "a.ckpt"))  # the name again
    plugin.remove_checkpoint(str(d / "b.ckpt"))
    temps = os.listdir(d)
    assert len(temps) == 1 and TEMP_PATTERN.match(temps[0])  # only a's temporary, nothing named yet
    gate.open()
    plugin.teardown()
    assert os.listdir(d) == ["a.ckpt"]
    assert torch.load(d / "a.ckpt", weights_only=True)["epoch"] == 2


def test_temporaries_are_invisible_to_lightnings_name_parsers(tmp_path, gate):
    torch.save({}, tmp_path / "hpc_ckpt_3.ckpt")
    plugin = CkptmgrCheckpointIO(async_direct_saves=True)
    plugin.save_checkpoint({"w": torch.ones(3)}, str(tmp_path / "hpc_ckpt_4.ckpt"))
    plugin.save_checkpoint({"w": torch.ones(3)}, str(tmp_path / "last.ckpt"))
    gate.wait_started()
    assert len(os.listdir(tmp_path)) == 2  # hpc_ckpt_3.ckpt and one temporary
    assert _max_version(str(tmp_path), "hpc_ckpt_") == 3
    assert _max_version(str(tmp_path)) == 3  # the default key, "ckpt_"
    mc = pl.callbacks.ModelCheckpoint(dirpath=tmp_path)
    t = pl.Trainer(callbacks=[mc], logger=False)
    assert mc._find_last_checkpoints(t) == set()
    gate.open()
    plugin.teardown()
    assert _max_version(str(tmp_path), "hpc_ckpt_") == 4
    assert mc._find_last_checkpoints(t) == {str(tmp_path / "last.ckpt")}


def test_threads_run_only_between_the_first_save_and_teardown(tmp_path):
    seen = []
    before = set(threading.enumerate())  # (other tests' managers may have left threads of their own)

    class Threads(pl.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            seen.append([(t.name, t.daemon) for t in threading.enumerate()
                         if t.name.startswith("ckptmgr") and t not in before])

    t = trainer(tmp_path, CkptmgrCheckpointIO(), 4, callbacks=[Threads()], every_n_train_steps=2, save_top_k=-1)
    t.fit(Net(), data())
    assert any(seen) and not any(daemon for names in seen for _, daemon in names)  # no daemon threads
    assert set(threading.enumerate()) == before  # teardown stopped them all
    t.save_checkpoint(tmp_path / "after.ckpt")  # outside a run: on disk at return, and no thread left
    assert set(threading.enumerate()) == before and os.path.isfile(tmp_path / "after.ckpt")


def test_a_direct_save_is_on_disk_when_it_returns(tmp_path, gate):
    gate.open()
    path = tmp_path / "direct.ckpt"

    class SaveMidFit(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            if trainer.global_step == 2:
                trainer.save_checkpoint(path)
                assert torch.load(path, weights_only=True)["global_step"] == 2  # at once

    t = trainer(tmp_path / "mc", CkptmgrCheckpointIO(), 4, callbacks=[SaveMidFit()], every_n_train_steps=1)
    t.fit(Net(), data())
    t2 = trainer(tmp_path / "mc2", CkptmgrCheckpointIO(), 6)
    t2.fit(Net(), data(), ckpt_path=str(path))  # a second Trainer resumes from it
    assert t2.global_step == 6


def test_the_plugin_pickles_and_copies_before_during_and_after_saves(tmp_path, gate):
    plugin = CkptmgrCheckpointIO(overlap=False, async_direct_saves=True)
    pickle.loads(pickle.dumps(plugin))
    plugin.save_checkpoint({"w": torch.ones(3)}, str(tmp_path / "a.ckpt"))
    gate.wait_started()
    clone = pickle.loads(pickle.dumps(plugin))  # threads and a save in flight: none of it is carried
    twin = copy.deepcopy(plugin)
    assert clone.overlap is False and clone.async_direct_saves and clone._writer is None and twin._writer is None
    gate.open()
    plugin.teardown()
    assert clone.load_checkpoint(str(tmp_path / "a.ckpt"))["w"].tolist() == [1, 1, 1]
    pickle.dumps(plugin)


def test_a_failed_background_save_is_raised_at_the_next_save_and_at_teardown(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    before = set(threading.enumerate())
    plugin = CkptmgrCheckpointIO(async_direct_saves=True)
    plugin.save_checkpoint({"w": torch.ones(3)}, str(tmp_path / "file" / "a.ckpt"))
    with pytest.raises(FileExistsError, match="file"):  # the directory to create is a file
        plugin.wait(timeout=60)
    plugin.save_checkpoint({"w": torch.ones(3)}, str(tmp_path / "file" / "b.ckpt"))
    with pytest.raises(FileExistsError, match="file"):
        plugin.teardown()
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptmgr") and t not in before]
    # a direct save fails at the call, and only there
    plugin = CkptmgrCheckpointIO()
    with pytest.raises(FileExistsError, match="file"):
        plugin.save_checkpoint({"w": torch.ones(3)}, str(tmp_path / "file" / "c.ckpt"))
    plugin.save_checkpoint({"w": torch.ones(3)}, str(tmp_path / "c.ckpt"))
    plugin.teardown()


def test_memory_urls_are_written_through_fsspec(tmp_path, monkeypatch):
    import fsspec

    monkeypatch.chdir(tmp_path)
    t = trainer("memory://ckpts/run", CkptmgrCheckpointIO(), 4, every_n_train_steps=2, save_top_k=-1, save_last=True)
    t.fit(Net(), data())
    fs = fsspec.filesystem("memory")
    names = sorted(os.path.basename(p) for p in fs.ls("/ckpts/run", detail=False))
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert os.listdir(tmp_path) == []  # no local folder named "memory:"
    from lightning.fabric.utilities.cloud_io import _load as pl_load

    assert pl_load("memory://ckpts/run/last.ckpt", weights_only=True)["global_step"] == 4
    t2 = trainer("memory://ckpts/run2", CkptmgrCheckpointIO(), 6)
    t2.fit(Net(), data(), ckpt_path="memory://ckpts/run/last.ckpt")
    assert t2.global_step == 6
    fs.rm("/ckpts", recursive=True)


def test_s3_urls_are_uploaded_in_parts_through_ckptmgrs_s3_target(s3_bucket, monkeypatch):
    import fsspec
    import s3fs

    from ckptmgr import S3Options
    from ckptmgr.storage import s3 as s3_module

    bucket, opts = s3_bucket
    monkeypatch.setitem(fsspec.config.conf, "s3", opts)  # ModelCheckpoint's own filesystem finds moto too
    parts = []
    real = s3_module.S3Target.call

    def call(self, method, **kw):
        parts.append(method)
        return real(self, method, **kw)

    monkeypatch.setattr(s3_module.S3Target, "call", call)
    plugin = CkptmgrCheckpointIO(storage_options=opts, s3_options=S3Options(part_size=5 << 20))
    t = trainer(f"s3://{bucket}/run", plugin, 4, every_n_train_steps=2, save_top_k=1, save_last=True)
    model = BigNet()
    t.fit(model, data())
    fs = s3fs.S3FileSystem(**opts)
    assert sorted(os.path.basename(p) for p in fs.ls(f"{bucket}/run")) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert parts.count("upload_part") >= 6 and "complete_multipart_upload" in parts  # 3 files of 2 parts
    from lightning.fabric.utilities.cloud_io import _load as pl_load

    ckpt = pl_load(f"s3://{bucket}/run/last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4 and torch.equal(ckpt["state_dict"]["layer.weight"], model.layer.weight)
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")
