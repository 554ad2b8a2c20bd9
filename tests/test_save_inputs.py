"""Hostile arguments to ``save()``: each refused with a clear error before anything is staged
or written (no slot made, no file under the root), and the manager still works after."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ckptmgr import CheckpointManager, ConfigError, StagingOptions, UnsupportedValueError


def _deep(n: int) -> dict:
    d: dict = {}
    for _ in range(n):
        d = {"x": d}
    return d


STEPS = [
    (-1, "in \\[0, 10\\*\\*12\\)"),
    (10**12, "in \\[0, 10\\*\\*12\\)"),  # a 13-digit name would sort before step 2
    (10**300, "in \\[0, 10\\*\\*12\\)"),
    (2**63, "in \\[0, 10\\*\\*12\\)"),
    (True, "bool"),
    (False, "bool"),
    (1.0, "float"),
    (float("nan"), "float"),
    ("1", "str"),
    (None, "NoneType"),
    (np.int64(3), "int64"),
    (torch.tensor(3), "Tensor"),
]

METADATA = [
    ([1, 2], ConfigError, "metadata must be a dict"),
    ("epoch=3", ConfigError, "metadata must be a dict"),
    ({"a": object()}, UnsupportedValueError, "metadata"),
    ({"a": {1, 2}}, UnsupportedValueError, "metadata"),
    ({"f": lambda: 0}, UnsupportedValueError, "metadata"),
    ({"t": torch.ones(2)}, UnsupportedValueError, "metadata"),
    (_deep(100_000), UnsupportedValueError, "nested deeper"),
]

BLOCKS = [None, 1, 0, "yes", np.bool_(True)]


@pytest.fixture
def mgr(tmp_path):
    m = CheckpointManager(str(tmp_path / "ckpt"), staging=StagingOptions(local_tier=False))
    yield m
    m.close()


def _nothing_happened(mgr: CheckpointManager) -> None:
    stats = mgr.stats()
    assert stats["saves"] == 0 and stats["slot_allocations"] == 0, stats
    assert mgr.steps() == []
    assert not [n for n in os.listdir(mgr.root) if n.startswith((".step_", "step_"))]


@pytest.mark.parametrize(("step", "match"), STEPS, ids=[repr(s)[:20] for s, _ in STEPS])
def test_hostile_steps(mgr, step, match):
    with pytest.raises(ConfigError, match="step must be an int") as info:
        mgr.save(step, {"w": torch.ones(4)})
    assert info.match(match)
    _nothing_happened(mgr)


@pytest.mark.parametrize(("metadata", "error", "match"), METADATA, ids=[type(m).__name__ for m, _, _ in METADATA])
def test_hostile_metadata(mgr, metadata, error, match):
    with pytest.raises(error, match=match):
        mgr.save(1, {"w": torch.ones(4)}, metadata=metadata)
    _nothing_happened(mgr)


@pytest.mark.parametrize("block", BLOCKS, ids=repr)
def test_hostile_block(mgr, block):
    with pytest.raises(ConfigError, match="block must be a bool"):
        mgr.save(1, {"w": torch.ones(4)}, block=block)
    _nothing_happened(mgr)


@pytest.mark.parametrize("step", [10**12, -5, True])
def test_other_step_arguments_are_checked_the_same_way(mgr, step):
    for call in (mgr.protect, mgr.unprotect, mgr.is_protected, mgr.metadata):
        with pytest.raises(ConfigError, match="step"):
            call(step)
    with pytest.raises(ConfigError, match="step"):
        mgr.restore(step)


def test_the_largest_step_is_accepted_and_orders_last(tmp_path):
    with CheckpointManager(str(tmp_path / "ckpt"), staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(10**12 - 1, {"w": torch.ones(2)}).result()
        mgr.save(2, {"w": torch.ones(2)}).result()
        assert mgr.steps() == [2, 10**12 - 1] and mgr.latest_step() == 10**12 - 1
