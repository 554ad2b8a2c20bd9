"""CkptmgrTrainer in-process: the files are the stock Trainer's, retention, verification,
and the capture of the Trainer's writes (tests/test_hf_trainer_resume.py kills and resumes)."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

pytest.importorskip("transformers")
from conftest import assert_tree_equal
from hf_trainer_run import Tokens, tiny_llama
from safetensors import safe_open
from transformers import Trainer, TrainingArguments
from transformers.trainer_pt_utils import safe_globals

from ckptmgr import CheckpointCorruptError, ConfigError, KeepEvery
from ckptmgr.format import dirrecord as _dirrecord
from ckptmgr.integrations import _capture, _fileset
from ckptmgr.integrations.transformers import (
    AsyncSaveOptions,
    CkptmgrTrainer,
    get_last_checkpoint,
)
from ckptmgr.restore import dircheck
from ckptmgr.storage.commit import directory as _dircommit


def _args(out, **kw):
    base = {"max_steps": 8, "save_steps": 2, "per_device_train_batch_size": 4, "learning_rate": 1e-3,
            "report_to": [], "use_cpu": True, "seed": 7, "dataloader_num_workers": 0, "disable_tqdm": True,
            "logging_steps": 1}
    return TrainingArguments(output_dir=str(out), **{**base, **kw})


def _train(cls, out, resume=None, **kw):
    opts = kw.pop("checkpointing", None)
    extra = {"checkpointing": opts} if opts is not None else {}
    trainer = cls(model=tiny_llama(), args=_args(out, **kw), train_dataset=Tokens(), **extra)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _ckpts(out):
    return sorted((n for n in os.listdir(out) if n.startswith("checkpoint-")), key=lambda n: int(n.split("-")[1]))


def test_files_load_as_the_stock_trainers(tmp_path):
    _train(CkptmgrTrainer, tmp_path / "ours", max_steps=4, save_steps=4)
    _train(Trainer, tmp_path / "stock", max_steps=4, save_steps=4)
    ours, stock = tmp_path / "ours" / "checkpoint-4", tmp_path / "stock" / "checkpoint-4"
    assert set(os.listdir(ours)) == set(os.listdir(stock)) | {"ckptmgr.json"}
    with safe_open(ours / "model.safetensors", "pt") as a, safe_open(stock / "model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys()) and a.metadata() == b.metadata()
        for k in a.keys():  # noqa: SIM118 (safe_open has no __iter__)
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        with safe_globals():
            assert_tree_equal(torch.load(ours / name, weights_only=True), torch.load(stock / name, weights_only=True))
    a, b = (json.loads((d / "trainer_state.json").read_text()) for d in (ours, stock))
    assert a == b
    assert dircheck.verify_dir(str(ours)) is True


def test_save_total_limit_keeps_newest_and_best(tmp_path):
    _train(CkptmgrTrainer, tmp_path, save_total_limit=2)
    assert _ckpts(tmp_path) == ["checkpoint-6", "checkpoint-8"]
    out = tmp_path / "policy"
    _train(CkptmgrTrainer, out, checkpointing=AsyncSaveOptions(retention=KeepEvery(4)))
    assert _ckpts(out) == ["checkpoint-4", "checkpoint-8"]  # windows of 4 steps, plus the newest


def test_best_checkpoint_is_protected(tmp_path):
    kw = {"save_total_limit": 2, "eval_strategy": "steps", "eval_steps": 2, "load_best_model_at_end": True,
          "metric_for_best_model": "loss", "greater_is_better": True}  # the worst is the best: an old one
    trainer = CkptmgrTrainer(model=tiny_llama(), args=_args(tmp_path, **kw), train_dataset=Tokens(),
                             eval_dataset=Tokens(8))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and os.path.isdir(best)
    assert best != str(tmp_path / "checkpoint-8")
    # the newest two, and the best (the stock Trainer counts the best within the limit)
    assert set(_ckpts(tmp_path)) == {os.path.basename(best), "checkpoint-6", "checkpoint-8"}


def test_damaged_newest_checkpoint_is_skipped(tmp_path, caplog):
    _train(CkptmgrTrainer, tmp_path, max_steps=4)
    bad = tmp_path / "checkpoint-4" / "optimizer.pt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 3] ^= 0x01
    bad.write_bytes(bytes(data))
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    assert "checkpoint-4" in caplog.text and "CRC32C" in caplog.text
    assert get_last_checkpoint(str(tmp_path), verify=False) == str(tmp_path / "checkpoint-4")
    with pytest.raises(CheckpointCorruptError, match=r"optimizer\.pt"):
        _train(CkptmgrTrainer, tmp_path, resume=str(tmp_path / "checkpoint-4"), max_steps=6)
    trainer = _train(CkptmgrTrainer, tmp_path, resume=True, max_steps=6)
    assert trainer.state.global_step == 6


def test_nothing_to_resume(tmp_path):
    os.makedirs(tmp_path / "checkpoint-3")  # not committed by anyone: no record, no files
    (tmp_path / ".ckptmgr-1-00000000.partial").mkdir()
    with pytest.raises(ValueError, match="Can't find a valid checkpoint"):
        _train(CkptmgrTrainer, tmp_path, resume=True)
    with pytest.raises(ConfigError):
        CkptmgrTrainer(model=tiny_llama(), args=_args(tmp_path), checkpointing="fast")


def test_capture_only_takes_this_threads_writes_under_its_directory(tmp_path):
    fs = _fileset.FileSet(str(tmp_path / "ckpt"), torch.save)
    os.makedirs(fs.directory)
    other_thread = tmp_path / "ckpt" / "other.pt"
    outside = tmp_path / "outside.pt"
    with _capture.capturing(fs):
        t = threading.Thread(target=torch.save, args=({"x": torch.ones(3)}, other_thread))
        t.start()
        t.join()
        torch.save({"y": torch.zeros(2)}, outside)
        torch.save({"z": torch.arange(4)}, tmp_path / "ckpt" / "sub" / "z.pt")
        from safetensors.torch import save_file

        save_file({"w": torch.ones(2)}, str(tmp_path / "ckpt" / "w.safetensors"), {"format": "pt"})
    assert torch.load(other_thread)["x"].sum() == 3 and torch.load(outside)["y"].numel() == 2
    assert list(fs.entries) == ["sub/z.pt", "w.safetensors"]
    assert torch.save is fs._serialize  # every patch removed again
    with pytest.raises(RuntimeError, match="already active"), _capture.capturing(fs), _capture.capturing(fs):
        pass


def test_torch_files_hold_what_torch_save_writes(tmp_path):
    """Staged objects come back as torch.save would have written them: dtypes, shapes, aliases,
    non-contiguous views, empty tensors, numpy arrays and plain values."""
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    shared = torch.ones(5, dtype=torch.bfloat16)
    obj = {"a": base.t(), "b": [shared, shared], "c": (torch.empty(0, 2), torch.tensor(True)),
           "d": {1: torch.tensor(7, dtype=torch.int64), "n": None, "f": float("inf")},
           "e": torch.randint(0, 9, (4,), dtype=torch.uint8), "np": __import__("numpy").arange(3, dtype="uint32")}
    fs = _fileset.FileSet(str(tmp_path), torch.save)
    fs.add_torch("x.pt", obj)
    entry = fs.entries["x.pt"]
    assert entry.plan is not None  # staged, not serialized at once
    seg = torch.zeros(fs.sizes()[0], dtype=torch.uint8)
    from ckptmgr.format.layout import Plan
    from ckptmgr.save.staging import Stager

    entry.fill(seg)
    stager = Stager(2)
    stager.stage(Plan([entry.plan], []), [seg]).wait()
    stager.close()
    base.add_(100)  # staged: later changes are not in the file
    rec = entry.write(seg.numpy(), str(tmp_path / "x.pt"), None, 1 << 20)
    assert rec.size == os.path.getsize(tmp_path / "x.pt")
    with safe_globals():
        got = torch.load(tmp_path / "x.pt", weights_only=True)
    want = {**obj, "a": (base - 100).t()}
    assert_tree_equal(got, want)
    assert got["b"][0] is got["b"][1]  # one tensor reached twice stays one tensor


class Opaque:
    def __init__(self):
        self.t = torch.ones(2)


def test_objects_that_cannot_be_staged_are_serialized_at_once(tmp_path):
    fs = _fileset.FileSet(str(tmp_path), torch.save)
    fs.add_torch("o.pt", {"o": Opaque()})
    fs.add_torch("plain.pt", {"lr": 0.1})
    assert fs.entries["plain.pt"].plan is None  # nothing to stage: serialized at once
    # the torch-zip image stages tensors inside any object; without it, only plain containers
    assert (fs.entries["o.pt"].plan is None) == (_fileset.plan_image is None)
    with pytest.raises(Exception, match="twice"):
        fs.add_torch("o.pt", 1)


@pytest.mark.parametrize("record", [
    {"format": "ckptmgr-directory", "version": 1, "step": 1, "chunk_size": 8, "files": {"../x": {"size": 0,
                                                                                                  "crc32c": []}}},
    {"format": "ckptmgr-directory", "version": 1, "step": 1, "chunk_size": 8, "files": {"/etc/passwd": {
        "size": 0, "crc32c": []}}},
    {"format": "ckptmgr-directory", "version": 1, "step": 1, "chunk_size": 8, "files": {"a": {"size": 9,
                                                                                               "crc32c": ["0" * 8]}}},
    {"format": "ckptmgr-directory", "version": 2, "step": 1, "chunk_size": 8, "files": {}},
    {"format": "ckptmgr-directory", "version": 1, "step": 1, "chunk_size": 0, "files": {}},
    [1, 2],
])
def test_hostile_records_are_refused(tmp_path, record):
    (tmp_path / "ckptmgr.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointCorruptError):
        dircheck.verify_dir(str(tmp_path))


def test_record_listing_a_symlink_outside_is_refused(tmp_path):
    (tmp_path / "secret").write_bytes(b"x")
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    os.symlink(tmp_path / "secret", d / "model.safetensors")
    rec = _fileset.FileRecord(1, ("00000000",))
    _dirrecord.write_record(str(d), step=1, files={"model.safetensors": rec}, chunk_size=8)
    with pytest.raises(CheckpointCorruptError, match="outside"):
        dircheck.verify_dir(str(d))


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    dead = tmp_path / ".ckptmgr-999999999-0123456789abcdef.partial"
    mine = tmp_path / f".ckptmgr-{os.getpid()}-0123456789abcdef.partial"
    foreign = tmp_path / ".partial-not-ours"
    for d in (dead, mine, foreign):
        d.mkdir()
    assert _dircommit.remove_stale_temps(str(tmp_path)) == [dead.name]
    assert mine.exists() and foreign.exists()


@pytest.mark.cuda
def test_cuda_bf16_checkpoint_holds_the_live_state(tmp_path):
    """On a GPU (bf16 mixed precision): the files copied off the GPU by the staging stream hold
    exactly the model and optimizer state at the checkpoint's step."""
    trainer = _train(CkptmgrTrainer, tmp_path, max_steps=4, save_steps=4, use_cpu=False, bf16=True)
    d = tmp_path / "checkpoint-4"
    with safe_open(d / "model.safetensors", "pt") as f:
        live = trainer.model.state_dict()
        for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            assert torch.equal(f.get_tensor(k), live[k].cpu()), k
    saved = torch.load(d / "optimizer.pt", weights_only=True, map_location="cpu")
    live_opt = trainer.optimizer.state_dict()
    for i, st in live_opt["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(saved["state"][i][k], v.cpu()), (i, k)
            else:
                assert saved["state"][i][k] == v, (i, k)
