"""torchtitan's checkpoint-manager contract, through CkptmgrCheckpointManager.

torchtitan 0.3.0 installs here (its checkpointing, optimizer, scheduler and data-loader
components run on CPU); its Trainer does not (CUDA only, and its model modules import
triton), so tests/titan_loop.py makes the Trainer's checkpointer calls in the Trainer's order.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading

import pytest
import torch
import zygote

pytest.importorskip("torchtitan")
import torch.distributed as dist
from titan_loop import build, full_weights, train
from torchtitan.components.checkpointer import CheckpointManager as DCPCheckpointManager

from ckptmgr import CheckpointManager, ConfigError
from ckptmgr.integrations.torchtitan import CkptmgrCheckpointManager
from ckptmgr.save.budget import WARMUP

pytestmark = [pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning"),
              pytest.mark.filterwarnings("ignore:To get the last learning rate:UserWarning")]
LOOP = os.path.join(os.path.dirname(__file__), "titan_loop.py")


def config(**kw):
    base = {"enable": True, "folder": "ckpt", "interval": 3, "keep_latest_k": 2, "last_save_model_only": False}
    return CkptmgrCheckpointManager.Config(**{**base, **kw})


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world_of_one():
    """torchtitan's DCP manager asks torch.distributed for the rank: a one-process group."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_selected_from_the_config(tmp_path):
    parts = build(config(), str(tmp_path))
    assert type(parts["checkpointer"]) is CkptmgrCheckpointManager
    parts["checkpointer"].close()
    off = build(config(enable=False), str(tmp_path / "off"))["checkpointer"]
    assert off.load() is False and off.save(3) is False
    off.maybe_wait_for_staging()
    off.maybe_wait_for_saving()
    off.close()
    assert not os.path.exists(tmp_path / "off")


def test_stop_and_resume_is_bit_identical(tmp_path):
    ref_parts = build(config(), str(tmp_path / "ref"))
    reference = train(ref_parts, 9)
    with CheckpointManager(str(tmp_path / "ref" / "ckpt")) as mgr:
        assert mgr.steps() == [6, 9]  # interval 3, keep_latest_k 2
    first = train(build(config(), str(tmp_path / "run")), 9, stop_after=5)
    parts = build(config(), str(tmp_path / "run"))
    second = train(parts, 9)
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(second) == [4, 5, 6, 7, 8, 9]  # resumed at step 3
    assert {**first, **second} == reference
    a, b = full_weights(ref_parts["model"]), full_weights(parts["model"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert parts["state"].ntokens_seen == ref_parts["state"].ntokens_seen


def test_max_overhead_replaces_the_interval(tmp_path):
    parts = build(config(max_overhead=0.5, interval=1000), str(tmp_path / "run"))
    assert parts["checkpointer"].manager.schedule.max_overhead == 0.5
    train(parts, 12)
    with CheckpointManager(str(tmp_path / "run" / "ckpt")) as mgr:
        steps = mgr.steps()
    assert 12 in steps and len(steps) >= 2 and min(steps) >= WARMUP  # saved by the budget, not interval 1000


def test_same_run_as_torchtitans_own_manager(tmp_path, world_of_one):
    ours = train(build(config(), str(tmp_path / "ours")), 9, stop_after=7)
    ours.update(train(build(config(), str(tmp_path / "ours")), 9))
    dcp_cfg = DCPCheckpointManager.Config(enable=True, folder="ckpt", interval=3, keep_latest_k=2,
                                          last_save_model_only=False)
    theirs = train(build(dcp_cfg, str(tmp_path / "dcp")), 9, stop_after=7)
    theirs.update(train(build(dcp_cfg, str(tmp_path / "dcp")), 9))
    assert ours == theirs


def test_staging_is_waited_for_before_the_optimizer_step(tmp_path, monkeypatch):
    """save() returns with the copies in flight; maybe_wait_for_staging() holds the
    optimizer step until they have landed, so the checkpoint has the step's weights."""
    from ckptmgr.save import staging

    gate, entered = threading.Event(), threading.Event()
    original = staging._copy_all

    def held(pairs):
        entered.set()
        assert gate.wait(30)
        original(pairs)

    monkeypatch.setattr(staging, "_copy_all", held)
    parts = build(config(interval=1), str(tmp_path))
    ckpt, model = parts["checkpointer"], parts["model"]
    ckpt.load()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert ckpt.save(1)
    assert entered.wait(30)
    waited = threading.Event()

    def step():
        ckpt.maybe_wait_for_staging()
        waited.set()
        with torch.no_grad():  # what the optimizer step would do to the weights
            for p in model.parameters():
                p.add_(1.0)

    t = threading.Thread(target=step)
    t.start()
    assert not waited.wait(0.3)  # still held by the copies
    gate.set()
    t.join(30)
    ckpt.close()
    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        saved = mgr.restore(1)["model"]
    assert all(torch.equal(saved[k], before[k]) for k in before)


def test_load_step_exclusions_and_errors(tmp_path):
    train(build(config(keep_latest_k=0), str(tmp_path)), 6)
    parts = build(config(keep_latest_k=0, exclude_from_loading=["dataloader"]), str(tmp_path))
    assert parts["checkpointer"].load(step=3)
    assert parts["state"].step == 3
    loader_state = pickle.loads(parts["loader"].state_dict()["dp_rank_0"])
    assert loader_state["_num_yielded"] == 0  # not restored: the loader starts from the beginning
    with pytest.raises(FileNotFoundError, match="load_step=4"):
        parts["checkpointer"].load(step=4)
    parts["checkpointer"].close()
    with pytest.raises(ConfigError, match="last_save_in_hf"):
        build(config(last_save_in_hf=True, last_save_model_only=True), str(tmp_path / "x"))
    with pytest.raises(ConfigError, match="exclude_from_loading"):
        build(config(exclude_from_loading=["nope"]), str(tmp_path / "y"))


def test_last_step_model_only_export(tmp_path):
    parts = build(config(last_save_model_only=True, export_dtype="bfloat16"), str(tmp_path))
    train(parts, 6)
    with CheckpointManager(str(tmp_path / "ckpt")) as mgr:
        assert mgr.metadata(6)["model_only"] is True
        model = mgr.restore(6)["model"]
    assert {v.dtype for v in model.values()} == {torch.bfloat16}
    full = full_weights(parts["model"])
    assert all(torch.equal(model[k], full[k].to(torch.bfloat16)) for k in full)


def test_initial_load_from_a_dcp_checkpoint(tmp_path, world_of_one):
    dcp_cfg = DCPCheckpointManager.Config(enable=True, folder="ckpt", interval=3, keep_latest_k=0,
                                          last_save_model_only=False)
    src = build(dcp_cfg, str(tmp_path / "dcp"))
    train(src, 6)
    parts = build(config(initial_load_path=str(tmp_path / "dcp" / "ckpt" / "step-6")), str(tmp_path / "new"))
    assert parts["checkpointer"].load()
    parts["checkpointer"].close()
    a, b = full_weights(src["model"]), full_weights(parts["model"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert parts["state"].step == 0  # model only, as torchtitan's initial loads


def test_fsdp2_on_two_ranks_resumes_bit_identical(tmp_path):
    """FSDP2 (DTensor shards) over gloo: every rank saves its shards, the ranks commit together;
    a run stopped after step 6 and resumed ends as the uninterrupted run, on every rank."""
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1"}
    procs = [zygote.Popen([sys.executable, LOOP, str(tmp_path / "out"), str(tmp_path / "result")], template="torch",
                          env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-2000:] for e in errs)
    for r in range(2):
        res = json.loads((tmp_path / f"result.{r}.json").read_text())
        assert sorted(map(int, res["first"])) == list(range(1, 7)) and res["step"] == 9
        assert sorted(map(int, res["second"])) == [7, 8, 9]
        assert {**res["first"], **res["second"]} == res["ref"]
        w = torch.load(tmp_path / f"result.{r}.pt")
        assert all(torch.equal(w["ref"][k], w["resumed"][k]) for k in w["ref"])
    with CheckpointManager(str(tmp_path / "out" / "run" / "ckpt")) as mgr:
        assert mgr.steps() == [6, 9]
