"""States at the edges of what the typed skeleton stores: conjugate and negative views, deep
nesting (refused at save beyond the limit; never a RecursionError on read) and tensor names
that no reader should have to handle (NUL, control characters, very long)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckptmgr.format.tree as tree
from ckptmgr import CheckpointCorruptError, CheckpointManager, StagingOptions, UnsupportedValueError
from ckptmgr.format import schema

NO_TIER = StagingOptions(local_tier=False)
MAX_NESTING = getattr(tree, "MAX_NESTING", 100)
MAX_JSON_DEPTH = getattr(tree, "MAX_JSON_DEPTH", 320)


def _nested(depth: int, leaf):
    node = leaf
    for _ in range(depth):
        node = [node]
    return node


def test_conjugate_and_negative_views_are_stored_as_their_values(root):
    z = torch.randn(6, dtype=torch.complex64)
    x = torch.randn(5)
    state = {"z": z, "zc": z.conj(), "zc_imag": z.conj().imag, "xn": torch._neg_view(x), "x": x}
    assert state["zc"].is_conj() and state["zc_imag"].is_neg() and state["xn"].is_neg()
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, state).result()
        out = mgr.restore(1)
        assert torch.equal(out["z"], z) and torch.equal(out["x"], x)
        assert torch.equal(out["zc"], z.conj().resolve_conj()) and not out["zc"].is_conj()
        assert torch.equal(out["zc_imag"], -z.imag)
        assert torch.equal(out["xn"], -x)
        # a target holding conjugate and negative views gets the values they show
        base_z, base_x = torch.zeros(6, dtype=torch.complex64), torch.zeros(5)
        target = {"z": torch.zeros(6, dtype=torch.complex64), "zc": base_z.conj(),
                  "zc_imag": torch.zeros(6), "xn": torch._neg_view(base_x), "x": torch.zeros(5)}
        mgr.restore(1, target=target)
        assert torch.equal(target["zc"].resolve_conj(), z.conj().resolve_conj())
        assert torch.equal(base_z, z)  # what the conjugate view shows is the saved conjugate
        assert torch.equal(target["xn"].resolve_neg(), -x) and torch.equal(base_x, x)


def test_a_state_nested_deeper_than_the_limit_is_refused_at_save_and_the_deepest_allowed_reads_back(root):
    def int_keyed(depth: int, leaf):  # the costliest nesting in JSON: {"$dict": [[key, value]]} per level
        node = leaf
        for _ in range(depth):
            node = {0: node}
        return node

    with CheckpointManager(root, staging=NO_TIER) as mgr:
        with pytest.raises(UnsupportedValueError, match=f"nested deeper than {MAX_NESTING}"):
            mgr.save(1, {"deep": _nested(MAX_NESTING + 5, 1)})
        with pytest.raises(UnsupportedValueError, match=f"nested deeper than {MAX_NESTING}"):
            mgr.save(1, {"deep": int_keyed(MAX_NESTING - 1, torch.ones(2))})
        assert mgr.steps() == []
        mgr.save(2, {"deep": int_keyed(MAX_NESTING - 2, torch.ones(2))}).result()
        out = mgr.restore(2)
    node = out["deep"]
    for _ in range(MAX_NESTING - 2):
        node = node[0]
    assert torch.equal(node, torch.ones(2))


def test_skeletons_of_any_depth_never_raise_recursion_error():
    deep = _nested(50_000, 1)
    with pytest.raises(CheckpointCorruptError, match=f"nested deeper than {MAX_JSON_DEPTH}"):
        schema.check_skeleton(deep, tensors=set(), where="here", field="state")
    with pytest.raises(CheckpointCorruptError, match="nested deeper"):
        tree.unflatten(deep, {}, allow_pickle=False)
    deep_dict = 1
    for _ in range(50_000):
        deep_dict = {"$dict": {"k": deep_dict}}
    with pytest.raises(CheckpointCorruptError, match="nested deeper"):
        schema.check_skeleton(deep_dict, tensors=set(), where="here", field="state")
    with pytest.raises(CheckpointCorruptError, match="nested deeper"):
        tree.unflatten(deep_dict, {}, allow_pickle=False)


def test_tensor_names_never_carry_control_characters_or_unbounded_length(root):
    long_key = "k" * 3000
    state = {"a\x00b": torch.ones(2), "tab\there": torch.zeros(3), long_key: torch.arange(4),
             "k" * 3001: torch.arange(5)}
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, state).result()
        out = mgr.restore(1)
        with open(os.path.join(root, "step_000000000001", "manifest.json"), "rb") as f:
            names = list(json.loads(f.read())["tensors"])
    for k, v in state.items():
        assert torch.equal(out[k], v), k[:20]
    assert all(len(n) <= 1024 and not any(ord(c) < 32 for c in n) for n in names), names
    assert len(set(names)) == 4  # names cut to the same prefix stay distinct
