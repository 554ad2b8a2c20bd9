from collections import OrderedDict

import numpy as np
import pytest
import torch
from conftest import assert_tree_equal

from ckptmgr import CheckpointManager, StagingOptions
from ckptmgr.format.layout import DTYPE_TO_ST


def _sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw[: int(np.prod(shape))] % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def roundtrip(root, state, **kw):
    with CheckpointManager(root, **kw) as mgr:
        mgr.save(1, state).result()
        return mgr.restore(1)


@pytest.mark.parametrize("dtype", list(DTYPE_TO_ST), ids=str)
def test_every_dtype_round_trips_bit_exact(root, dtype):
    state = {"t": _sample(dtype), "scalar": _sample(dtype, ()), "empty": _sample(dtype, (0, 4))}
    assert_tree_equal(roundtrip(root, state), state)


def test_strided_views_and_odd_shapes(root):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {
        "transposed": base.t()[1:],          # a non-contiguous view alone: stored compactly
        "step_slice": torch.arange(20.0)[::3],
        "zero_dim": torch.tensor(3.5, dtype=torch.float64),
        "expanded": torch.ones(1, 4).expand(3, 4),
    }
    out = roundtrip(root, state)
    for k, v in state.items():
        assert torch.equal(out[k], v), k


def test_python_values_keep_their_types(root):
    state = {
        "none": None, "bools": [True, False], "ints": (0, -1, 2**62, -(2**63)),
        "floats": [0.1, -0.0, float("nan"), float("inf"), float("-inf"), 1e308],
        "str": "héllo \u2603", "nested": {"a": [{"b": (1, [2, (3,)])}]},
        "int_keys": {0: "zero", 3: {"x": 1}, -5: None}, "mixed_keys": {1: 1, "1": 2, (1, 2): 3, None: 4, 2.5: 5},
        "dtype": torch.bfloat16, "device": torch.device("cuda:1"), "size": torch.Size([2, 3]),
        "empties": ({}, [], ()),
        "odict": OrderedDict([("z", 1), ("a", 2)]),
        "np": np.arange(6, dtype=np.int16).reshape(2, 3), "np_scalar": np.float32(2.5),
        "np_bool": np.array([True, False]),
    }
    out = roundtrip(root, state)
    assert_tree_equal(out, state)
    assert type(out["np_scalar"]) is np.float32
    assert out["floats"][1] == -0.0
    assert str(out["floats"][1]) == "-0.0"


def test_module_state_dict_metadata_survives(root):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    sd = model.state_dict()
    out = roundtrip(root, {"sd": sd})["sd"]
    assert type(out) is OrderedDict
    assert out._metadata == sd._metadata


def test_tied_weights_and_views_come_back_aliased(root, tmp_path):
    w = torch.randn(8, 4)
    state = {"embed": w, "head": w, "rows": w[2:5], "col": w[:, 1], "flat": w.view(-1)}
    out = roundtrip(root, state)
    for k in state:
        assert torch.equal(out[k], state[k]), k
    ptr = out["embed"].untyped_storage().data_ptr()
    assert all(out[k].untyped_storage().data_ptr() == ptr for k in state)
    out["embed"][3, 1] = 123.0
    assert out["head"][3, 1] == 123.0
    assert out["rows"][1, 1] == 123.0
    assert out["col"][3] == 123.0
    # stored once: the file holds one 8x4 float32 tensor
    import os
    data = os.path.join(root, "step_000000000001", "data-00000.safetensors")
    assert os.path.getsize(data) == 4096 + 8 * 4 * 4


def test_overlapping_views_without_a_covering_tensor(root):
    storage = torch.arange(100, dtype=torch.float32)
    a, b = storage[0:60], storage[40:100]
    i = storage.view(torch.int32)[10:20]
    out = roundtrip(root, {"a": a, "b": b, "i": i})
    assert torch.equal(out["a"], a)
    assert torch.equal(out["b"], b)
    assert torch.equal(out["i"], i)
    out["a"][50] = -1.0
    assert out["b"][10] == -1.0


def test_restore_to_device_meta_keeps_values(root):
    state = {"x": torch.randn(3)}
    with CheckpointManager(root) as mgr:
        mgr.save(0, state).result()
        out = mgr.restore(device="cpu")
    assert out["x"].device.type == "cpu"
    assert torch.equal(out["x"], state["x"])


def test_many_files_when_state_exceeds_max_file_bytes(root):
    from ckptmgr import WriteOptions
    state = {f"t{i}": torch.randn(1024) for i in range(10)}  # 4 KiB each
    out = roundtrip(root, state, write_options=WriteOptions(max_file_bytes=10_000, chunk_size=4096))
    assert_tree_equal(out, state)
    import os
    files = sorted(f for f in os.listdir(os.path.join(root, "step_000000000001")) if f.endswith(".safetensors"))
    assert len(files) == 5


def test_steps_latest_metadata(root):
    with CheckpointManager(root, staging=StagingOptions(slots=1)) as mgr:  # (one slot: each save written in turn)
        assert mgr.steps() == []
        assert mgr.latest_step() is None
        for s in (10, 2, 30):
            mgr.save(s, {"x": torch.tensor(s)}, metadata={"loss": s / 10, "tags": ("a", 1)})
        mgr.wait()
        assert mgr.steps() == [2, 10, 30]
        assert mgr.latest_step() == 30
        assert mgr.metadata() == {"loss": 3.0, "tags": ("a", 1)}
        assert mgr.metadata(2)["loss"] == 0.2
        assert mgr.restore()["x"].item() == 30
    with CheckpointManager(root) as again:  # a new process sees the same
        assert again.steps() == [2, 10, 30]


def test_large_state_is_split_into_parallel_files_and_direct_io_tail(root):
    """A large state becomes several files (written in parallel, the bulk with O_DIRECT
    where the filesystem allows); file sizes that are not a multiple of the page size keep
    their tails."""
    import os

    from ckptmgr import WriteOptions

    state = {f"t{i}": torch.randn(8_000_001 + i) for i in range(6)}  # ~32 MB each, odd sizes
    state["small"] = torch.arange(7, dtype=torch.int16)
    for direct in (True, False):
        r = f"{root}-{direct}"
        out = roundtrip(r, state, write_options=WriteOptions(io_threads=4, direct_io=direct))
        assert_tree_equal(out, state)
        step_dir = os.path.join(r, "step_000000000001")
        names = sorted(n for n in os.listdir(step_dir) if n.endswith(".safetensors"))
        assert names == [f"data-{i:05d}.safetensors" for i in range(2)]  # 183 MiB / 64 MiB shards
