"""Restore into a target through the skeleton matcher (``match_target``): the same checks,
messages and results as checking the tree rebuilt with placeholders (``check_target``) and
applying the loaded tree (``apply_target``): the rules the walk applies to the parts it
rebuilds, applied to the whole tree.

A differential test compares the two on random states and random targets derived from
them (changed dtypes and shapes, missing and extra keys, other kinds of values, empty
containers, read-only arrays, Stateful objects, PerRank); the rest goes through a manager:
every kind of mismatch is refused with the old messages and changes nothing, a part of the
skeleton that cannot be rebuilt is refused before any byte lands, Stateful objects and
DTensors (in a gloo world of one) restore in place.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import socket
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from conftest import assert_tree_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manifest_tools import signed_bytes

from ckptmgr import CheckpointCorruptError, CheckpointManager, PerRank, StagingOptions, StateMismatchError
from ckptmgr.format.layout import DTYPE_TO_ST, ST_TO_DTYPE
from ckptmgr.format.tree import flatten, unflatten
from ckptmgr.restore.loaders.landing import Entry, usable_dest
from ckptmgr.restore.target import match_target, survey_target
from ckptmgr.restore.values import apply_target, check_target

NO_TIER = StagingOptions(local_tier=False)
CI = settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])


class Box:
    """A Stateful object: its state_dict() shares its tensors; load_state_dict records what it got."""

    def __init__(self, sd: dict[str, Any]) -> None:
        self.sd = sd
        self.got: Any = None

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: Any) -> None:
        self.got = sd


_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float64]


def _leaf(rnd: random.Random) -> Any:
    kind = rnd.randrange(10)
    if kind < 4:
        shape = [rnd.randint(0, 3) for _ in range(rnd.randint(0, 2))]
        return (torch.randn(shape) * 9).to(rnd.choice(_DTYPES))
    if kind == 4:
        return np.arange(rnd.randint(0, 4), dtype=rnd.choice([np.float32, np.int64]))
    if kind == 5:
        return np.float32(rnd.random())
    return rnd.choice([None, True, 3, 2.5, float("nan"), "s", torch.float16, torch.Size([2, 3])])


def _tree(rnd: random.Random, depth: int = 0) -> Any:
    if depth >= 3 or rnd.random() < 0.35:
        return _leaf(rnd)
    kind = rnd.randrange(7)
    items = [_tree(rnd, depth + 1) for _ in range(rnd.randint(0, 4))]
    if kind == 0:
        return {f"k{i}": v for i, v in enumerate(items)}
    if kind == 1:
        return dict(enumerate(items))
    if kind == 2:
        return OrderedDict((f"o{i}", v) for i, v in enumerate(items))
    if kind == 3:
        return list(items)
    if kind == 4:
        return tuple(items)
    if kind == 5:
        return PerRank({f"p{i}": v for i, v in enumerate(items)})
    return Box({f"b{i}": v for i, v in enumerate(items)})


def _target(rnd: random.Random, node: Any) -> Any:
    """A target shaped like ``node``: zeros where it holds tensors, with random differences."""
    if rnd.random() < 0.06:  # another kind of value altogether
        return rnd.choice([None, 7, "x", torch.zeros(2), {"z": torch.zeros(1)}, [1], (), {}, [], np.zeros(2)])
    if isinstance(node, torch.Tensor):
        r = rnd.random()
        if r < 0.08:
            return torch.zeros(node.numel() + 1, dtype=node.dtype)
        if r < 0.14:
            return torch.zeros(node.shape, dtype=torch.float16)
        if r < 0.2:  # not contiguous: lands in fresh memory, then is copied in
            return torch.zeros((*node.shape, 2), dtype=node.dtype)[..., 0]
        return torch.zeros_like(node)
    if isinstance(node, np.ndarray):
        r = rnd.random()
        out = np.zeros(node.shape if r > 0.1 else (node.size + 1,), dtype=node.dtype)
        out.flags.writeable = r > 0.25
        return out
    if isinstance(node, PerRank):
        return PerRank(_target(rnd, node.value)) if rnd.random() < 0.5 else _target(rnd, node.value)
    if isinstance(node, Box):
        return Box(_target(rnd, node.sd))
    if isinstance(node, dict):
        if rnd.random() < 0.08:
            return type(node)()
        out = type(node)((k, _target(rnd, v)) for k, v in node.items() if rnd.random() > 0.05)
        if rnd.random() < 0.05:
            out["extra"] = torch.zeros(1)
        return out
    if isinstance(node, (list, tuple)) and not isinstance(node, torch.Size):
        if rnd.random() < 0.08:
            return type(node)()
        items = [_target(rnd, v) for v in node]
        if rnd.random() < 0.05:
            items.append(1)
        r = rnd.random()
        kind = type(node) if r > 0.1 else (tuple if isinstance(node, list) else list)
        return kind(items)
    return node


def _index(leaves: list[Any]) -> dict[str, dict[str, Any]]:
    return {x.name: {"dtype": DTYPE_TO_ST[x.tensor.dtype], "shape": list(x.tensor.shape)} for x in leaves}


def _land(dests: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a loader returns: a stored tensor lands in its target tensor where that fits."""
    out = {}
    for name, t in tensors.items():
        d = dests.get(name)
        entry = Entry(name, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size())
        if d is not None and usable_dest(d, entry, torch.device("cpu")):
            d.copy_(t)
            out[name] = d
        else:
            out[name] = t.clone()
    return out


def _old(target: Any, skeleton: Any, index: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    stand_ins = {n: torch.zeros((), dtype=ST_TO_DTYPE[e["dtype"]]).expand(e["shape"]) for n, e in index.items()}
    try:
        dests = check_target(target, unflatten(skeleton, stand_ins, allow_pickle=False, keep_per_rank=True), stand_ins)
    except StateMismatchError as exc:
        return "problems", exc.problems
    tree = unflatten(skeleton, _land(dests, tensors), allow_pickle=False, keep_per_rank=True)
    return "ok", apply_target(target, tree)


def _new(target: Any, skeleton: Any, index: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    try:
        plan = match_target(target, skeleton, index, allow_pickle=False)
    except StateMismatchError as exc:
        return "problems", exc.problems
    return "ok", plan.finish(_land(plan.dests, tensors))


def _ids(tree: Any, out: set[int]) -> set[int]:
    """The ids of every tensor and array a target holds (through Stateful objects too)."""
    if isinstance(tree, (torch.Tensor, np.ndarray)):
        out.add(id(tree))
    elif isinstance(tree, PerRank):
        _ids(tree.value, out)
    elif isinstance(tree, Box):
        _ids(tree.sd, out)
    elif isinstance(tree, dict):
        for v in tree.values():
            _ids(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _ids(v, out)
    return out


def _same(a: Any, b: Any, own_a: set[int], own_b: set[int], path: str = "state") -> None:
    """``a`` and ``b`` are equal, with the same types, and each tensor or array is its own
    target's object in both or in neither."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, (torch.Tensor, np.ndarray)):
        assert (id(a) in own_a) == (id(b) in own_b), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes() if isinstance(a, np.ndarray) else torch.equal(a, b), path
    elif isinstance(a, (PerRank, Box)):
        _same(a.value if isinstance(a, PerRank) else a.sd, b.value if isinstance(b, PerRank) else b.sd,
              own_a, own_b, path)
        if isinstance(a, Box):
            _same(a.got, b.got, own_a, own_b, f"{path}.got")
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _same(a[k], b[k], own_a, own_b, f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, own_a, own_b, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


@CI
@given(seed=st.integers(0, 2**32 - 1))
def test_the_matcher_checks_lands_and_returns_as_the_rebuilt_tree_does(seed):
    rnd = random.Random(seed)
    torch.manual_seed(seed)
    state = _tree(rnd)
    skeleton, leaves = flatten(state)
    skeleton = json.loads(json.dumps(skeleton))  # as read back from a manifest
    index = _index(leaves)
    tensors = {x.name: x.tensor.clone() for x in leaves}
    target = _target(rnd, state)
    old_target, new_target = copy.deepcopy(target), copy.deepcopy(target)
    own_old, own_new = _ids(old_target, set()), _ids(new_target, set())
    old, new = _old(old_target, skeleton, index, tensors), _new(new_target, skeleton, index, tensors)
    assert old[0] == new[0], (old, new)
    if old[0] == "problems":
        assert new[1] == old[1]
        _same(new_target, copy.deepcopy(target), set(), set())  # untouched
    else:
        _same(old[1], new[1], own_old, own_new)
    _same(old_target, new_target, own_old, own_new)


# --- through a manager ---------------------------------------------------------------------


def _mismatch(root: str, saved: Any, target: Any) -> list[str]:
    """Restore ``saved`` into ``target``: refused, target unchanged; returns the problems."""
    before = copy.deepcopy(target)
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, saved).result()
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(1, target=target)
    assert_tree_equal(_plain(target), _plain(before))
    return info.value.problems


def _plain(tree: Any) -> Any:
    if isinstance(tree, torch.nn.Module):
        return {k: v.clone() for k, v in tree.state_dict().items()}
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


@pytest.mark.parametrize(("saved", "target", "problems"), [
    ({"w": torch.zeros(3)}, {"w": torch.ones(3, dtype=torch.float64)},
     ["state['w']: the target is torch.float64 [3], the checkpoint torch.float32 [3]"]),
    ({"w": torch.zeros(2, 3)}, {"w": torch.ones(3, 2)},
     ["state['w']: the target is torch.float32 [3, 2], the checkpoint torch.float32 [2, 3]"]),
    ({"a": torch.zeros(1), 3: 1}, {"a": torch.ones(1), "b": torch.ones(1)},
     ["state['b']: missing from the checkpoint", "state[3]: in the checkpoint but not in the target"]),
    ({"l": [torch.zeros(1), 2]}, {"l": [torch.ones(1)]}, ["state['l']: the target has 1 items, the checkpoint 2"]),
    ({"d": {"x": torch.zeros(1)}}, {"d": torch.ones(1)},
     ["state['d']: the target holds a tensor, the checkpoint a dict"]),
    ({"t": torch.zeros(1)}, {"t": {"x": torch.ones(1)}},
     ["state['t']: the target holds a dict, the checkpoint a Tensor"]),
    ({"t": (1, 2)}, {"t": {"x": torch.ones(1)}}, ["state['t']: the target holds a dict, the checkpoint a tuple"]),
    ({"n": np.zeros(3)}, {"n": np.ones(4)},
     ["state['n']: the target is float64 [4], the checkpoint float64 [3]"]),
    ({"s": [torch.zeros(2)]}, {"s": (torch.ones(3),)},
     ["state['s'][0]: the target is torch.float32 [3], the checkpoint torch.float32 [2]"]),
])
def test_each_kind_of_mismatch_is_refused_with_its_message_and_changes_nothing(root, saved, target, problems):
    assert _mismatch(root, saved, target) == problems


def test_a_stateful_object_is_checked_through_its_state_dict_and_changes_nothing(root):
    saved = {"model": torch.nn.Linear(3, 2), "ema": torch.randn(5)}
    target = {"model": torch.nn.Linear(3, 4), "ema": torch.zeros(5)}
    assert _mismatch(root, saved, target) == [
        "state['model']['weight']: the target is torch.float32 [4, 3], the checkpoint torch.float32 [2, 3]",
        "state['model']['bias']: the target is torch.float32 [4], the checkpoint torch.float32 [2]"]
    assert not target["ema"].any()


def test_stateful_objects_and_plain_state_dicts_restore_in_place(root):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    box = Box({"w": torch.randn(6), "n": 3})
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, {"model": model, "optim": opt, "box": PerRank(box), "sd": model.state_dict()}).result()
        m2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
        o2 = torch.optim.AdamW(m2.parameters())  # fresh: its state is {}
        b2 = Box({"w": torch.zeros(6), "n": 0})
        sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        ptrs = [p.data_ptr() for p in m2.parameters()]
        out = mgr.restore(1, target={"model": m2, "optim": o2, "box": PerRank(b2), "sd": sd})
    assert [p.data_ptr() for p in m2.parameters()] == ptrs
    assert out["model"] is m2 and out["optim"] is o2
    assert isinstance(out["box"], PerRank) and out["box"].value is b2  # saved again per rank
    assert_tree_equal(_plain(m2), _plain(model))
    assert_tree_equal(o2.state_dict(), opt.state_dict())
    assert torch.equal(b2.sd["w"], box.sd["w"]) and b2.got["n"] == 3 and b2.got["w"] is b2.sd["w"]
    assert all(out["sd"][k] is sd[k] and torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_a_part_that_cannot_be_rebuilt_is_refused_before_any_byte_lands(root):
    """A pickled value under a part of the target that takes whatever the checkpoint holds
    (an empty dict) is refused by a manager that does not allow pickle, before the tensors
    that do fit are written."""
    with CheckpointManager(root, staging=NO_TIER, allow_pickle=True) as mgr:
        mgr.save(1, {"w": torch.randn(100), "extra": {"thing": {1, 2}}}).result()
    target = {"w": torch.zeros(100), "extra": {}}
    with CheckpointManager(root, staging=NO_TIER) as mgr, pytest.raises(CheckpointCorruptError, match="pickled"):
        mgr.restore(1, target=target)
    assert not target["w"].any()


def test_a_skeleton_value_that_cannot_be_rebuilt_is_refused_before_any_byte_lands(root):
    """A device the skeleton names that torch cannot make, where the target holds a plain value."""
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, {"w": torch.randn(100), "dev": torch.device("cpu")}).result()
    path = os.path.join(root, "step_000000000001", "manifest.json")
    with open(path) as f:
        obj = json.load(f)
    del obj["manifest_crc32c"]
    obj["state"]["$dict"]["dev"] = {"$device": "nosuchdevice"}
    with open(path, "wb") as f:
        f.write(signed_bytes(obj))
    target = {"w": torch.zeros(100), "dev": None}
    with CheckpointManager(root, staging=NO_TIER) as mgr, pytest.raises(CheckpointCorruptError, match="not a device"):
        mgr.restore(1, target=target)
    assert not target["w"].any()


def _craft(root: str, mutate) -> None:
    """Rewrite step 1's manifest as an attacker would, its checksum made valid again."""
    path = os.path.join(root, "step_000000000001", "manifest.json")
    with open(path) as f:
        obj = json.load(f)
    del obj["manifest_crc32c"]
    mutate(obj)
    with open(path, "wb") as f:
        f.write(signed_bytes(obj))


def _zeroed_linear() -> torch.nn.Linear:
    m = torch.nn.Linear(4, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    return m


@pytest.mark.parametrize("loader", ["ring", "inplace", "host"])
def test_a_repeated_key_whose_dropped_value_cannot_be_rebuilt_changes_nothing(root, loader):
    """A crafted Stateful node in list form names "weight" twice: first as a numpy array of a
    bf16 tensor (which cannot be rebuilt), then as the real tensor. The restore rebuilds both,
    so the first one is refused before any byte lands in the module."""
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, {"m": torch.nn.Linear(4, 2), "bf": torch.ones(3, dtype=torch.bfloat16)}).result()

    def repeat(obj):
        node = obj["state"]["$dict"]["m"]["state"]
        node["$dict"] = [["weight", {"$ndarray": "bf"}]] + [[k, v] for k, v in node["$dict"].items()]

    _craft(root, repeat)
    target = {"m": _zeroed_linear(), "bf": torch.zeros(3, dtype=torch.bfloat16)}
    with CheckpointManager(root, staging=NO_TIER) as mgr, pytest.raises(CheckpointCorruptError, match="numpy"):
        mgr.restore(1, target=target, loader=loader)
    assert not any(p.any() for p in target["m"].parameters()) and not target["bf"].any()


def test_dict_metadata_without_its_ordereddict_type_is_refused_at_the_manifest(root):
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, {"m": torch.nn.Linear(4, 2)}).result()
    _craft(root, lambda obj: obj["state"]["$dict"]["m"]["state"].pop("type"))
    target = {"m": _zeroed_linear()}
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        for kw in ({"target": target}, {}):
            with pytest.raises(CheckpointCorruptError, match="metadata belongs to an OrderedDict"):
                mgr.restore(1, **kw)
    assert not any(p.any() for p in target["m"].parameters())


@pytest.mark.parametrize("loader", ["ring", "inplace", "host"])
def test_target_leaves_that_share_memory_end_as_copied_in_walk_order(root, loader):
    """Tied weights and views in the target: the stored tensors land apart and are copied in
    turn (as copying each leaf would), never over each other in place (which also failed the
    loaders' check of what landed: "checksum mismatch", and a fallback to older steps)."""
    a, b, w = torch.full((4,), 1.0), torch.full((4,), 2.0), torch.arange(8.0)
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, {"a": a, "b": b, "v": torch.full((4,), 7.0), "w": w}).result()
    tied, base = torch.zeros(4), torch.zeros(8)
    target = {"a": tied, "b": tied, "v": base[::2], "w": base}
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.restore(1, target=target, loader=loader)
    assert torch.equal(tied, b) and torch.equal(base, w)


def test_target_tensors_that_cannot_be_written_are_refused_before_any_byte_lands(root):
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, {"a": torch.ones(4), "b": torch.ones(3), "c": torch.ones(2)}).result()
    with torch.inference_mode():
        frozen = torch.zeros(2)
    target = {"a": torch.zeros(4), "b": torch.zeros(1).expand(3), "c": frozen}
    with CheckpointManager(root, staging=NO_TIER) as mgr, pytest.raises(StateMismatchError) as err:
        mgr.restore(1, target=target)
    assert "state['b']: the target has elements that share memory" in str(err.value)
    assert "state['c']: the target is an inference tensor" in str(err.value)
    assert not target["a"].any()
    with torch.inference_mode(), CheckpointManager(root, staging=NO_TIER) as mgr:  # where it can be written
        mgr.restore(1, target={"c": frozen, "a": torch.zeros(4), "b": torch.zeros(3)})
    assert torch.equal(frozen, torch.ones(2))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensors_restore_through_their_local_shard_and_stay_dtensors(root, world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    w, b = torch.randn(4, 6), torch.randn(6)
    saved = {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": distribute_tensor(b, mesh, [Replicate()])}
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, saved).result()
        target = {"w": distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0)]),
                  "b": distribute_tensor(torch.zeros(6), mesh, [Replicate()])}
        local = target["w"].to_local()
        out = mgr.restore(1, target=target)
        assert out["w"] is target["w"] and out["b"] is target["b"]
        assert torch.equal(target["w"].full_tensor(), w) and torch.equal(target["b"].full_tensor(), b)
        assert target["w"].to_local().data_ptr() == local.data_ptr()
        wrong = {"w": distribute_tensor(torch.zeros(4, 5), mesh, [Shard(0)]),
                 "b": distribute_tensor(torch.zeros(6), mesh, [Replicate()])}
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(1, target=wrong)
    assert info.value.problems == [
        "state['w']: the target is torch.float32 [4, 5], the checkpoint torch.float32 [4, 6]"]
    assert not wrong["b"].to_local().any()


def test_the_survey_finds_the_targets_tensors_and_each_saved_moments_parameter():
    """What a multi-rank restore plans with: the target's tensor at each stored name (through
    Stateful objects), and, for a fresh optimizer whose state is still empty, the parameter
    each saved DTensor moment belongs to (by the optimizer's parameter index)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    skeleton, _ = flatten({"model": model, "optim": opt}, allow_pickle=False)
    node = skeleton["$dict"]["optim"]["state"]["$dict"]["state"]["$dict"]
    for index, (_, moments) in enumerate(node):  # the moments saved as DTensors, under keys
        for name in ("exp_avg", "exp_avg_sq"):
            moments["$dict"][name] = {"$dtensor": f"~dtensor/{index}/{name}", "shape": [], "placements": [],
                                      "mesh": []}
    fresh = torch.nn.Linear(3, 2)
    target = {"model": fresh, "optim": torch.optim.AdamW(fresh.parameters())}
    survey = survey_target(target, skeleton)
    assert survey.tensors.keys() == {"model/weight", "model/bias"}  # (state_dict(): views of the parameters)
    assert all(survey.tensors[n].data_ptr() == t.data_ptr() for n, t in (("model/weight", fresh.weight),
                                                                         ("model/bias", fresh.bias)))
    assert survey.params.keys() == {f"~dtensor/{i}/{n}" for i in (0, 1) for n in ("exp_avg", "exp_avg_sq")}
    assert all(survey.params[f"~dtensor/0/{n}"] is fresh.weight for n in ("exp_avg", "exp_avg_sq"))
    assert all(survey.params[f"~dtensor/1/{n}"] is fresh.bias for n in ("exp_avg", "exp_avg_sq"))
    assert survey.dtensors == {} and survey.device is None  # no tensor of the target is on a GPU or a DTensor
    # a target that holds the moments already: they are where the saved ones land
    target = {"model": model, "optim": opt}
    survey = survey_target(target, skeleton)
    moments = opt.state_dict()["state"]
    assert survey.dtensors.keys() == survey.params.keys()
    assert all(survey.dtensors[f"~dtensor/{i}/{n}"] is moments[i][n] for i in (0, 1) for n in ("exp_avg", "exp_avg_sq"))
