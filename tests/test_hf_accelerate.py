"""accelerate with ckptmgr: save_state/load_state round trips, files as accelerate writes them."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning")
pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration  # noqa: E402
from conftest import assert_tree_equal  # noqa: E402

from ckptmgr import CheckpointCorruptError, ConfigError, KeepLatest, StepNotFoundError  # noqa: E402
from ckptmgr.integrations.accelerate import AsyncSaveOptions, AsyncStateSaver  # noqa: E402


def build(project_dir, *, dropout=0.0, total_limit=None, auto=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(dropout), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    dl = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    acc = Accelerator(cpu=True, project_dir=str(project_dir),
                      project_config=ProjectConfiguration(automatic_checkpoint_naming=auto, total_limit=total_limit),
                      dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    return (acc, *acc.prepare(model, opt, dl, sched))


def run(acc, model, opt, dl, sched, steps, save_at=(), save=None):
    losses, it = [], iter(dl)
    for step in range(steps):
        x, y = next(it)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step in save_at:
            save()
    return losses


def test_round_trip_resumes_at_the_next_sample(tmp_path):
    acc, model, opt, dl, sched = build(tmp_path / "p")
    with AsyncStateSaver(acc) as saver:
        losses = run(acc, model, opt, dl, sched, 10, save_at=(2, 5), save=saver.save_state)
    ckpts = tmp_path / "p" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["checkpoint_0", "checkpoint_1"]
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "dl_state_dict.bin", "random_states_0.pkl",
            "ckptmgr.json"} <= set(os.listdir(ckpts / "checkpoint_1"))

    acc2, model2, opt2, dl2, sched2 = build(tmp_path / "p")
    with AsyncStateSaver(acc2) as saver2:
        assert saver2.load_state() == str(ckpts / "checkpoint_1")
        assert acc2.save_iteration == 2  # the next automatic name does not collide
        resumed = run(acc2, model2, opt2, dl2, sched2, 4)
    assert resumed == losses[6:]  # exactly where the saved run went on


def test_files_hold_what_accelerate_writes(tmp_path):
    """The same state saved by accelerate itself and through ckptmgr: same files, same contents."""
    acc, model, opt, dl, sched = build(tmp_path / "p", dropout=0.1, auto=False)
    run(acc, model, opt, dl, sched, 3)
    rng = torch.get_rng_state()
    acc.save_state(str(tmp_path / "stock"))
    torch.set_rng_state(rng)
    with AsyncStateSaver(acc) as saver:
        assert saver.save_state(tmp_path / "ours").result() == str(tmp_path / "ours")
    stock, ours = tmp_path / "stock", tmp_path / "ours"
    assert set(os.listdir(ours)) == set(os.listdir(stock)) | {"ckptmgr.json"}
    from safetensors.torch import load_file

    a_w, b_w = load_file(ours / "model.safetensors"), load_file(stock / "model.safetensors")
    assert_tree_equal(dict(sorted(a_w.items())), dict(sorted(b_w.items())))
    for name in ("optimizer.bin", "scheduler.bin", "dl_state_dict.bin"):
        assert_tree_equal(torch.load(ours / name, weights_only=True), torch.load(stock / name, weights_only=True))
    a = torch.load(ours / "random_states_0.pkl", weights_only=False)
    b = torch.load(stock / "random_states_0.pkl", weights_only=False)
    assert a.keys() == b.keys()
    assert a["step"] == b["step"] and a["random_state"] == b["random_state"]
    assert all(np.array_equal(x, y) for x, y in zip(a["numpy_random_seed"], b["numpy_random_seed"], strict=True))
    assert torch.equal(a["torch_manual_seed"], b["torch_manual_seed"])


def test_dropout_resume_matches_accelerate_own_round_trip(tmp_path):
    """With dropout, resuming through ckptmgr behaves exactly like accelerate's own
    save_state/load_state (RNG states included)."""
    results = []
    for mode in ("stock", "ours"):
        acc, model, opt, dl, sched = build(tmp_path / mode, dropout=0.1)
        saver = AsyncStateSaver(acc)
        run(acc, model, opt, dl, sched, 5, save_at=(3,), save=acc.save_state if mode == "stock" else saver.save_state)
        saver.close()
        acc2, *rest = build(tmp_path / mode, dropout=0.1)
        with AsyncStateSaver(acc2) as s2:
            if mode == "stock":
                acc2.load_state()
            else:
                s2.load_state()
            results.append(run(acc2, *rest, 4))
    assert results[0] == results[1]


def test_total_limit_applied_after_commit(tmp_path):
    acc, model, opt, dl, sched = build(tmp_path / "p", total_limit=2)
    with AsyncStateSaver(acc) as saver:
        run(acc, model, opt, dl, sched, 8, save_at=(0, 1, 2, 3, 4), save=saver.save_state)
    assert sorted(os.listdir(tmp_path / "p" / "checkpoints")) == ["checkpoint_3", "checkpoint_4"]
    acc, *rest = build(tmp_path / "q")
    with AsyncStateSaver(acc, checkpointing=AsyncSaveOptions(retention=KeepLatest(1))) as saver:
        run(acc, *rest, 4, save_at=(0, 1, 2), save=saver.save_state)
    assert sorted(os.listdir(tmp_path / "q" / "checkpoints")) == ["checkpoint_2"]


def test_damaged_checkpoint_is_skipped_and_refused(tmp_path):
    acc, *rest = build(tmp_path / "p")
    with AsyncStateSaver(acc) as saver:
        run(acc, *rest, 4, save_at=(0, 2), save=saver.save_state)
    bad = tmp_path / "p" / "checkpoints" / "checkpoint_1" / "optimizer.bin"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    acc2, *_ = build(tmp_path / "p")
    with AsyncStateSaver(acc2) as saver2:
        assert saver2.load_state().endswith("checkpoint_0")
        with pytest.raises(CheckpointCorruptError, match=r"optimizer\.bin"):
            acc2.load_state(str(bad.parent))  # the load pre-hook verifies direct loads too


def test_errors(tmp_path):
    acc, *_ = build(tmp_path / "p", auto=False)
    with pytest.raises(ConfigError):
        AsyncStateSaver(object())
    with AsyncStateSaver(acc) as saver:
        with pytest.raises(ConfigError, match="output_dir"):
            saver.save_state()
        with pytest.raises(ConfigError, match="input_dir"):
            saver.load_state()
    acc2, *_ = build(tmp_path / "empty")
    with AsyncStateSaver(acc2) as saver, pytest.raises(StepNotFoundError):
        saver.load_state()
