"""Multi-rank checkpoints: real processes on gloo (CPU), one per rank (tests/dist_worker.py)."""

from __future__ import annotations

import json
import os

import dist_launch
import pytest
import torch

from ckptmgr import CheckpointManager, ConfigError

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")


def launch(tmp_path, scenario: str, root: str, world: int, timeout_s: float = 60.0) -> tuple[list[int], list[dict]]:
    return dist_launch.launch(WORKER, scenario, root, tmp_path, world, timeout_s=timeout_s)


# world 3 by hand (-m slow): CI keeps world 2 here, and 3 ranks saving replicated, sharded and
# per-rank state that restores (at 2) in test_distributed_reshard.py::test_save_at_3_restore_at_2_and_a_2d_mesh_at_2
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_round_trip_of_replicated_and_per_rank_state(tmp_path, world):
    root = str(tmp_path / "ckpt")
    rcs, saved = launch(tmp_path, "save", root, world)
    assert rcs == [0] * world
    assert all(s["steps"] == [1, 2, 3] for s in saved)
    step_dir = os.path.join(root, "step_000000000003")
    files = [f"data-r{r:05d}-00000.safetensors" for r in range(world)]
    assert sorted(os.listdir(step_dir)) == [*files, "manifest.json"]
    with open(os.path.join(step_dir, "manifest.json")) as f:
        m = json.load(f)
    assert m["world_size"] == world and m["format_version"] == 2
    # the replicated model and optimizer are written once, dealt across the ranks
    replicated = [n for n, e in m["tensors"].items() if "file" in e and not n.startswith("rank")]
    owners = {m["tensors"][n]["file"][:12] for n in replicated}
    assert len(owners) == world
    own = [n for n in m["tensors"] if n.startswith("rank")]
    assert sorted(own) == [f"rank{r:05d}/rank/rng" for r in range(world)]

    rcs, restored = launch(tmp_path, "restore", root, world)
    assert rcs == [0] * world
    for s, r in zip(saved, restored, strict=True):
        assert r["step"] == 3 and r["model"] == s["model"] and r["tied"]
        assert r["rng"] == s["rng"] and r["loader_pos"] == s["loader_pos"]  # each rank its own
        assert r["opt_steps"] == [3.0] * 4
    assert len({r["rng"] for r in restored}) == world

    # one process reads a multi-rank checkpoint (evaluation, export): per-rank values only when mapped
    with CheckpointManager(root) as mgr:
        with pytest.raises(ConfigError, match=r"saved by \d rank\(s\) and holds per-rank values \(state\['rank'\]\)"):
            mgr.restore()
        state = mgr.restore(rank_map=lambda rank, saved: 0)
    assert state["step"] == 3 and state["rank"]["loader_pos"] == 30
    assert float(state["model"]["0.bias"].double().sum() + (state["model"]["0.bias"].double() ** 2).sum()) == \
        pytest.approx(saved[0]["model"]["0.bias"])


def test_a_rank_killed_mid_save_commits_nothing_and_the_previous_step_restores(tmp_path):
    root = str(tmp_path / "ckpt")
    assert launch(tmp_path, "save", root, 2)[0] == [0, 0]
    rcs, outs = launch(tmp_path, "die", root, 2, timeout_s=8)
    assert rcs[1] == -9
    assert "CkptTimeoutError" in outs[0]["error"] and "did not complete within 8 s" in outs[0]["error"]
    assert "step_000000000004" not in os.listdir(root)
    rcs, restored = launch(tmp_path, "restore", root, 2)
    assert rcs == [0, 0] and [r["step"] for r in restored] == [3, 3]
    assert [n for n in os.listdir(root) if n.startswith(".step_")] == []  # the dead rank's files: removed at start


def test_retention_is_decided_once_and_every_rank_agrees(tmp_path):
    root = str(tmp_path / "ckpt")
    rcs, outs = launch(tmp_path, "retain", root, 2)
    assert rcs == [0, 0]
    assert [o["steps"] for o in outs] == [[5, 6], [5, 6]]
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_000000000005", "step_000000000006"]


def test_a_rank_that_never_saves_gives_a_clear_timeout(tmp_path):
    root = str(tmp_path / "ckpt")
    rcs, outs = launch(tmp_path, "skip", root, 2, timeout_s=4)
    assert rcs == [0, 0]
    err = outs[0]["error"]
    assert "CkptTimeoutError" in err and "the commit of step 5 did not complete within 4 s" in err
    assert "did not make the same ckptmgr call" in err
    assert not [n for n in os.listdir(root) if n.startswith("step_")]


def test_a_value_that_differs_between_ranks_must_be_wrapped(tmp_path):
    root = str(tmp_path / "ckpt")
    rcs, outs = launch(tmp_path, "mismatch", root, 2)
    assert rcs == [0, 0]
    for o in outs:
        assert "state['loader_pos'] (100 on rank 0, 101 on rank 1)" in o["error"] and "PerRank" in o["error"]
    assert os.listdir(root) == []


def test_restore_then_save_keeps_per_rank_values_per_rank(tmp_path):
    """The README's loop, state = mgr.restore(target=state) then mgr.save(step, state), on two
    ranks: the PerRank values stay per rank, both the one that differs between the ranks (the
    save was refused) and the one that is equal on both (it was written once, as replicated)."""
    root = str(tmp_path / "ckpt")
    rcs, outs = launch(tmp_path, "resave", root, 2)
    assert rcs == [0, 0], outs
    for rank, o in enumerate(outs):
        assert "error" not in o, o["error"]
        assert o["types"] == ["PerRank", "PerRank"] and o["pos"] == 10 + rank and o["seed"] == 7
    with open(os.path.join(root, "step_000000000002", "manifest.json")) as f:
        manifest = json.load(f)
    text = json.dumps(manifest["rank_states"])
    assert len(manifest["rank_states"]) == 2 and text.count('"$per_rank"') == 4  # both values, on both ranks


def test_per_rank_marker_is_transparent_in_one_process(root):
    from ckptmgr import PerRank

    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.ones(3), "r": PerRank({"pos": 5, "t": torch.arange(4)})}).result()
        target = {"w": torch.zeros(3), "r": PerRank({"pos": 0, "t": torch.zeros(4, dtype=torch.int64)})}
        out = mgr.restore(target=target)
    assert isinstance(out["r"], PerRank)  # saved again as it was saved (one process: as a plain value)
    r = out["r"].value
    assert r["pos"] == 5 and torch.equal(r["t"], torch.arange(4)) and torch.equal(out["w"], torch.ones(3))
