"""Restoring multi-rank checkpoints at other world sizes and layouts: real gloo processes on the
CPU (tests/reshard_worker.py), a single process, and ``ckptmgr export``.

Four launches, in this order (each later one reads what the earlier ones saved): 2 ranks save
(and check the same-world-size restores), 3 and 4 ranks restore what 2 saved (and save again),
2 ranks restore what 3 and a 2 x 2 mesh of 4 saved.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dist_launch
import manifest_tools
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ckptmgr import CheckpointCorruptError, CheckpointManager, ConfigError, StagingOptions, StepNotFoundError
from ckptmgr.distributed.ranged import sub_chunk_size
from ckptmgr.distributed.shards import byte_runs, chunk_extent, derive_offsets, intersect, parse_placement
from ckptmgr.restore.verify import verify_step
from ckptmgr.storage import open_target

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "reshard_worker.py")
sys.path.insert(0, HERE)
import reshard_worker as W  # noqa: E402  (the worker's states and training loop, run here in one process)


def run(work: Path, scenario: str, world: int) -> list[dict]:
    rcs, reports = dist_launch.launch(WORKER, scenario, str(work), work, world)
    failed = {f"rank {r['rank']}: {name}": result for r in reports for name, result in r.get("checks", {}).items()
              if result is not True}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())
    assert rcs == [0] * world, f"exit codes {rcs}"
    assert all(r.get("checks") for r in reports)
    return reports


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard")
    shutil.copytree(os.path.join(HERE, "golden", "dist-v2"), d / "golden")  # never write into the repository
    return d


@pytest.fixture(scope="module")
def saved_at_2(work):
    return run(work, "save", 2)


@pytest.fixture(scope="module")
def restored_at_3(work, saved_at_2):
    return run(work, "restore", 3)


@pytest.fixture(scope="module")
def restored_at_4(work, saved_at_2):
    return run(work, "restore", 4)


def test_same_world_size_fresh_and_stepped_optimizers_and_dict_targets(saved_at_2):
    names = set(saved_at_2[0]["checks"])
    assert {"fresh optimizer at the same world size", "stepped optimizer at the same world size",
            "dict target keeps its DTensors", "a Partial DTensor at the same world size",
            "one rank's damaged file: no rank's target changes",
            "an optimizer of its own state_dict format at the same world size"} <= names


def _rows_expected(world: int, saved: int = 2, rows: int = 256, row_bytes: int = 256,
                   piece: int = sub_chunk_size(4096)) -> list[tuple[int, int]]:
    """What each rank must read of the 256 x 64 float32 Shard(0) tensor: (the bytes of the
    verifiable pieces -- 256-byte sub-chunks of the 4 KiB checksum chunks the test writes --
    that cover its rows in each saved shard, the number of saved files it touches)."""
    out = []
    for r in range(world):
        start, n = chunk_extent(rows, world, r)
        total = files = 0
        for k in range(saved):
            s0, sn = chunk_extent(rows, saved, k)
            lo, hi = max(start, s0), min(start + n, s0 + sn)
            if lo < hi:
                b, e = (lo - s0) * row_bytes, (hi - s0) * row_bytes
                total += (math.ceil(e / piece) - b // piece) * piece
                files += 1
        out.append((total, files))
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_save_at_2_restore_at_3_and_4(request, work, world):
    reports = request.getfixturevalue(f"restored_at_{world}")
    names = set(reports[0]["checks"])
    assert {f"mix from 2 at {world}, {layout}" for layout in ("as saved", "swapped", "replicated")} <= names
    assert f"FSDP2 + AdamW from 2 at {world}, trained on" in names
    assert f"an optimizer of its own state_dict format from 2 at {world}" in names
    assert (world == 3) == ("one rank's damaged piece at another world size: no rank's target changes" in names)
    assert f"golden dist-v2 (saved at 2) at {world}" in names
    assert (world == 4) == (f"mix from 2 at {world}, 2-D" in names)
    # each rank reads the header of each file it touches (checked against the index) and the
    # verifiable pieces that cover its rows, nothing else; here the pieces are rows: exact
    expected = _rows_expected(world)
    assert [r["bytes_read"]["rows"] for r in reports] == [data + 4096 * files for data, files in expected]
    assert [data for data, _ in expected] == [chunk_extent(256, world, r)[1] * 256 for r in range(world)]
    ckpt = sum(p.stat().st_size for p in (work / "mix").rglob("*.safetensors"))
    for r in reports:  # no rank reads the whole checkpoint unless its layout needs every tensor whole
        assert r["bytes_read"]["as saved"] < ckpt and r["bytes_read"]["replicated"] < ckpt


def test_save_at_3_restore_at_2_and_a_2d_mesh_at_2(work, restored_at_3, restored_at_4):
    reports = run(work, "from3", 2)
    names = set(reports[0]["checks"])
    assert {f"mix from 3 at 2, {layout}" for layout in ("as saved", "swapped", "replicated")} <= names
    assert {f"mix from a 2 x 2 mesh at 2, {layout}" for layout in ("as saved", "swapped", "replicated")} <= names


def test_a_single_process_gets_whole_tensors(work, saved_at_2, restored_at_4):
    for root, saved in ((work / "mix", 2), (work / "mesh2d", 4)):
        with CheckpointManager(str(root)) as mgr:
            with pytest.raises(ConfigError, match=rf"saved by {saved} rank\(s\) and holds per-rank values "
                                                  r"\(state\['rank'\]\); this job has 1"):
                mgr.restore()
            out = mgr.restore(rank_map=lambda rank, saved_world: saved_world - 1)
        for k, v in W.global_mix().items():
            assert type(out["model"][k]) is torch.Tensor and torch.equal(out["model"][k], v), k
        assert all(torch.equal(out["ddp"][k], v) for k, v in W.replicated().items())
        assert out["rank"]["pos"] == 10 + saved - 1
        assert out["tied"].data_ptr() == out["b"].data_ptr()


def test_a_plain_model_and_optimizer_resume_an_fsdp2_checkpoint(work, saved_at_2):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks trained with one thread: the same matmul blocking
    try:
        model, opt = W.plain_model(seed=9)
        with CheckpointManager(str(work / "fsdp")) as mgr:
            out = mgr.restore(target={"model": model, "optim": opt, "step": 0})
        assert out["step"] == W.KEEP_STEPS
        W.train(model, opt, range(W.KEEP_STEPS, W.KEEP_STEPS + W.MORE_STEPS))
        assert W.same(W.full_state(model, opt), W.reference(W.KEEP_STEPS + W.MORE_STEPS)) is True
    finally:
        torch.set_num_threads(threads)


def test_the_golden_multi_rank_checkpoint_reads_whole_in_one_process(tmp_path):
    from golden.make_golden_dist import STEP, global_tensors, per_rank_value

    root = tmp_path / "golden"
    shutil.copytree(os.path.join(HERE, "golden", "dist-v2"), root)
    with CheckpointManager(str(root)) as mgr:
        assert mgr.metadata() == {"golden": "dist-v2"}
        out = mgr.restore(rank_map=lambda rank, saved: 1)
    g = global_tensors()
    for k in ("w", "u", "c", "e", "r"):
        assert torch.equal(out["model"][k], g[k]), k
    assert torch.equal(out["optim"]["state"][0]["exp_avg"], g["m"]) and out["optim"]["state"][0]["step"] == 3
    assert torch.equal(out["model"]["b"], g["b"]) and torch.equal(out["big"], g["big"]) and out["step"] == STEP
    want = per_rank_value(1)
    assert out["rank"]["pos"] == want["pos"] and torch.equal(out["rank"]["rng"], want["rng"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptmgr", *args], capture_output=True, text=True, timeout=120)


def test_export_writes_whole_tensors_and_every_ranks_own(work, saved_at_2, tmp_path):
    dest = tmp_path / "export"
    r = _cli("export", str(work / "mix"), "1", "--to", str(dest), "--json")
    assert r.returncode == 0, r.stderr
    index = json.loads((dest / "index.json").read_text())
    tensors = {}
    for f in set(index["weight_map"].values()):
        tensors.update(load_file(str(dest / f)))
    assert sorted(tensors) == sorted([*(f"model/{k}" for k in W.global_mix()), *(f"ddp/{k}" for k in W.replicated()),
                                      "b", "tied", "rank00000/rank/rng", "rank00001/rank/rng"])
    for k, v in W.global_mix().items():
        assert torch.equal(tensors[f"model/{k}"], v), k
    assert torch.equal(tensors["rank00001/rank/rng"], torch.arange(4, dtype=torch.uint8) + 1)
    state = json.loads((dest / "state.json").read_text())
    assert state["world_size"] == 2
    assert state["state"]["model"]["w"] == {"tensor": "model/w", "file": index["weight_map"]["model/w"],
                                            "dtype": "F32", "shape": [10, 4], "kind": "tensor"}
    assert state["state"]["rank"]["rank00001"]["pos"] == 11
    # an FSDP2 checkpoint: the model's parameters, whole, as a plain model names them
    only = tmp_path / "fsdp"
    assert _cli("export", str(work / "fsdp"), "latest", "--to", str(only), "--only", "model/").returncode == 0
    model, _ = W.plain_model()
    got = load_file(str(only / "model-00001-of-00001.safetensors"))
    assert sorted(got) == sorted(model.state_dict())


def _flip_beside(root: Path, name: str) -> None:
    """Flip a byte of the verifiable piece (sub-chunk) that holds stored tensor ``name``,
    outside the tensor's bytes."""
    step = next(root.glob("step_*"))
    m = json.loads((step / "manifest.json").read_text())
    e = m["tensors"][name]
    rec = m["files"][e["file"]]
    unit = rec["sub_chunk_size"]
    begin, end = rec["header_size"] + e["offsets"][0], rec["header_size"] + e["offsets"][1]
    piece = begin // unit * unit
    at = next(i for i in range(piece, piece + unit) if not begin <= i < end and i >= rec["header_size"])
    with open(step / e["file"], "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_read_of_part_of_a_chunk_still_verifies_the_whole_chunk(work, saved_at_2, tmp_path):
    root = tmp_path / "mix"
    shutil.copytree(work / "mix", root)
    _flip_beside(root, "rank00001/model/w")  # a byte that model/w's own bytes do not cover
    r = _cli("export", str(root), "1", "--to", str(tmp_path / "x"), "--only", "model/w")
    assert r.returncode == 1 and "fail their checksum" in r.stderr and "data-r00001-00000.safetensors" in r.stderr
    assert not (tmp_path / "x").exists()
    with CheckpointManager(str(root)) as mgr:
        with pytest.raises(CheckpointCorruptError, match=r"data-r00001-00000.safetensors: bytes \[\d+, \d+\) fail"):
            mgr.restore(1, rank_map=lambda rank, saved: 0)
        with pytest.warns(RuntimeWarning, match="skipping step 1"), pytest.raises(StepNotFoundError):
            mgr.restore(rank_map=lambda rank, saved: 0)


def test_verify_checks_the_sub_chunk_checksums(work, saved_at_2, tmp_path):
    root = tmp_path / "mix"
    shutil.copytree(work / "mix", root)

    def damage(m: dict) -> None:
        rec = m["files"]["data-r00001-00000.safetensors"]
        assert rec["sub_chunk_size"] == 256 and len(rec["sub_crc32c"]) == 8 * -(-rec["size"] // 256)
        rec["sub_crc32c"] = rec["sub_crc32c"][:16] + "00000000" + rec["sub_crc32c"][24:]

    manifest_tools.rewrite(str(root), 1, damage)  # re-signed: the sub-chunk checksum itself is what is wrong
    target = open_target(str(root))
    try:
        report = verify_step(target, 1)
    finally:
        target.close()
    assert len(report.problems) == 1, report.problems
    assert "data-r00001-00000.safetensors: bytes [512, 768) fail their sub-chunk checksum" in report.problems[0]


@pytest.mark.parametrize(("offsets", "message"), [([8, 0], r"the shard of state\['model'\]\['w'\] saved by rank 1 "
                                                             r"lies outside its global shape \[10, 4\]"),
                                                  ([0, 0], r"the saved shards of state\['model'\]\['w'\] do not tile"),
                                                  ([4, 0], r"the saved shards of state\['model'\]\['w'\] overlap"),
                                                  ([5], r"the offsets of state\['model'\]\['w'\]|dims")])
def test_shard_offsets_from_the_manifest_are_checked(work, saved_at_2, tmp_path, offsets, message):
    root = tmp_path / "mix"
    shutil.copytree(work / "mix", root)
    manifest_tools.rewrite(str(root), 1, lambda m: m["rank_states"][1]["$dict"]["model"]["$dict"]["w"].update(
        offsets=offsets))
    with CheckpointManager(str(root)) as mgr, pytest.raises(CheckpointCorruptError, match=message):
        mgr.restore(1, rank_map=lambda rank, saved: 0)


def _file_rec(m: dict) -> dict:
    return m["files"]["data-r00000-00000.safetensors"]


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda m: _file_rec(m).update(sub_chunk_size=300), r"sub_chunk_size: must divide chunk_size 4096, got 300"),
    (lambda m: _file_rec(m).update(sub_chunk_size=128), r"sub_chunk_size: must be in \[256, 4096\]"),
    (lambda m: _file_rec(m).update(sub_crc32c=_file_rec(m)["sub_crc32c"][:-8]), r"sub_crc32c: must be \d+ lowercase"),
    (lambda m: _file_rec(m).update(sub_crc32c=_file_rec(m)["sub_crc32c"].upper()), r"sub_crc32c: must be"),
    (lambda m: _file_rec(m).pop("sub_crc32c"), r"lacks sub_crc32c"),
    (lambda m: m["rank_states"][1]["$dict"]["model"]["$dict"]["w"].update(offsets=["5", 0]), r"offsets"),
])
def test_the_schema_checks_the_resharding_fields(work, saved_at_2, tmp_path, mutate, field):
    root = tmp_path / "mix"
    shutil.copytree(work / "mix", root)
    manifest_tools.rewrite(str(root), 1, mutate)
    with CheckpointManager(str(root)) as mgr, pytest.raises(CheckpointCorruptError, match=field):
        mgr.restore(1, rank_map=lambda rank, saved: 0)


_GARBAGE = [None, 7, -1, "x", [], {}, [1], [[1]], {"$dict": 5}, {"$dict": [[1]]}, {"$dtensor": [1]},
            {"$dtensor": "b", "shape": [6]}, {"$tensor": "nope"}, {"$per_rank": {"$tensor": "b"}}, 1e300, [10**30]]


def _nodes(node, path=()):  # every (path, value) of a JSON tree
    yield path, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _nodes(v, (*path, k))


def test_a_mangled_multi_rank_manifest_raises_only_ckpt_errors(work, saved_at_2, tmp_path):
    """Random nodes of rank 1's tree (its shards' nodes, compared with rank 0's), of the index and
    of the file records replaced with garbage: the restore of whole tensors in one process fails
    with a CkptError or restores. (Rank 0's tree is the one unflattened: the format's fuzzer
    covers that.)"""
    import random

    from ckptmgr import CkptError

    root = tmp_path / "mix"
    shutil.copytree(work / "mix", root)
    path = next(root.glob("step_*")) / "manifest.json"
    original = json.loads(path.read_text())
    rng = random.Random(0)
    for _ in range(150):
        m = json.loads(json.dumps(original))
        tree = rng.choice([m["rank_states"][1], m["tensors"], m["files"]])
        nodes = [p for p, _ in _nodes(tree) if p]
        p = rng.choice(nodes)
        parent = tree
        for k in p[:-1]:
            parent = parent[k]
        parent[p[-1]] = rng.choice(_GARBAGE)  # type: ignore[index]
        path.write_bytes(manifest_tools.signed_bytes(m))  # signed: the reshard path's own checks are tested
        with CheckpointManager(str(root), staging=StagingOptions(local_tier=False)) as mgr:
            try:
                mgr.restore(1, rank_map=lambda rank, saved: 0)
            except CkptError:
                pass


def test_rank_map_must_name_a_saved_rank(work, saved_at_2):
    with CheckpointManager(str(work / "mix")) as mgr:
        with pytest.raises(ConfigError, match=r"rank_map\(0, 2\) returned 2; it must return a saved rank"):
            mgr.restore(1, rank_map=lambda rank, saved: saved)
        with pytest.raises(ConfigError, match="rank_map must be a function"):
            mgr.restore(1, rank_map=0)  # type: ignore[arg-type]


# ---------------------------------------------------------------- shard arithmetic (pure)


@pytest.mark.parametrize("n", [0, 1, 5, 7, 10, 37])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_chunk_extent_splits_like_torch_chunk(n, parts):
    pieces = torch.arange(n).chunk(parts) if n else ()
    starts = [chunk_extent(n, parts, i) for i in range(parts)]
    got = [torch.arange(n)[s:s + z] for s, z in starts if z]
    assert [p.tolist() for p in got] == [p.tolist() for p in pieces if p.numel()]
    assert sum(z for _, z in starts) == n


def test_placements_of_either_spelling_parse():
    assert [parse_placement(p) for p in ("S(0)", "Shard(dim=2)", "R", "Replicate()", "P(sum)", "_S(0, 2)")] == \
        [0, 2, -1, -1, None, None]


def test_derived_offsets_tile_the_tensor_on_a_2d_mesh():
    shape = (7, 5)
    boxes = {derive_offsets(shape, ["S(0)", "S(1)"], [2, 3], r) for r in range(6)}
    assert sum(math.prod(b[1]) for b in boxes) == 35
    assert all(intersect(a, b) is None for a in boxes for b in boxes if a != b)
    assert derive_offsets(shape, ["S(0)", "S(1)"], [2, 3], 5) == ((4, 4), (3, 1))
    assert derive_offsets(shape, ["R", "S(0)"], [2, 2], 3) == ((4, 0), (3, 5))
    assert derive_offsets(shape, ["P(sum)"], [2], 0) is None


@pytest.mark.parametrize(("shape", "lo", "size"), [((6, 5, 4), (1, 2, 0), (3, 2, 4)), ((6, 5, 4), (0, 0, 1), (6, 5, 2)),
                                           ((6, 5, 4), (2, 0, 0), (3, 5, 4)), ((9,), (3,), (4,)), ((), (), ())])
def test_byte_runs_cover_exactly_the_sub_box(shape, lo, size):
    a = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
    want = set(a[tuple(slice(x, x + z) for x, z in zip(lo, size, strict=True))].reshape(-1).tolist())
    runs = byte_runs(shape, 4, lo, size)
    got = {i for b, e in runs for i in range(b // 4, e // 4)}
    assert got == want
    hull = byte_runs(shape, 4, lo, size, max_runs=1)
    assert len(hull) == 1 and set(range(hull[0][0] // 4, hull[0][1] // 4)) >= want
