"""Fuzzing restore with hypothesis: random damage to a committed step's manifest and data
files. Restore either returns the exact saved state or raises a CkptError: never another
exception, never wrong data, never a hang. A few hundred examples in CI (reproducible); many
more under ``-m slow``.

Three kinds of damage: bytes of the (checksummed) manifest and of the data files, where the
only acceptable outcomes are the exact state or an error; structural changes to the manifest
written back with a valid checksum, which exercise the schema itself (a changed plain value
may legitimately restore, so any CkptError or a clean result passes, never another
exception); and bytes of a manifest without a checksum (as written before it existed).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import warnings
from typing import Any

import pytest
import torch
from conftest import assert_tree_equal, evict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manifest_tools import signed_bytes

from ckptmgr import CheckpointManager, CkptError, StagingOptions, WriteOptions

NO_TIER = StagingOptions(local_tier=False)
LOADERS = ["host", "ring", "ring-cold", "inplace"]
CI = settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SLOW = settings(max_examples=3000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(40, 30, generator=g)
    return {"model": {"w": w, "b": torch.randn(30, generator=g).bfloat16()}, "tied": w, "rows": w[3:9],
            "ids": torch.randint(0, 1000, (700,), generator=g), "mask": torch.rand(50, generator=g) > 0.5,
            "optim": {"state": {0: {"step": seed, "exp_avg": torch.randn(900, generator=g)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
            "py": (None, True, 2.5, float("nan"), "text"), "dtype": torch.bfloat16, "epoch": seed}


class Root:
    """A root with steps 1 and 2 saved once; each example damages a copy of step 2's files."""

    def __init__(self, path: str) -> None:
        self.path = path
        opts = WriteOptions(chunk_size=4096, max_file_bytes=6000)  # several files, several chunks each
        with CheckpointManager(path, staging=NO_TIER, write_options=opts) as mgr:
            mgr.save(1, _state(1), metadata={"epoch": 1}).result()
            mgr.save(2, _state(2), metadata={"epoch": 2, "loss": 0.25}).result()
        self.dir = os.path.join(path, "step_000000000002")
        self.names = sorted(os.listdir(self.dir))
        self.original = {}
        for n in self.names:
            with open(os.path.join(self.dir, n), "rb") as f:
                self.original[n] = f.read()
        assert len(self.names) >= 3, self.names
        self.mgr = CheckpointManager(path, staging=NO_TIER)

    def reset(self) -> None:
        if not os.path.isdir(self.dir):
            os.makedirs(self.dir)
        for n in os.listdir(self.dir):
            if n not in self.original:
                os.unlink(os.path.join(self.dir, n))
        for n, data in self.original.items():
            with open(os.path.join(self.dir, n), "wb") as f:
                f.write(data)

    def write(self, name: str, data: bytes) -> None:
        with open(os.path.join(self.dir, name), "wb") as f:
            f.write(data)


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory):
    root = Root(str(tmp_path_factory.mktemp("fuzz") / "ckpt"))
    yield root
    root.mgr.close()


def _target() -> dict[str, Any]:
    s = _state(0)
    return {"model": {"w": torch.zeros(40, 30), "b": torch.zeros(30, dtype=torch.bfloat16)},
            "tied": torch.zeros(40, 30), "rows": torch.zeros(6, 30), "ids": torch.zeros(700, dtype=torch.int64),
            "mask": torch.zeros(50, dtype=torch.bool),
            "optim": {"state": {0: {"step": 0, "exp_avg": torch.zeros(900)}},
                      "param_groups": s["optim"]["param_groups"]},
            "py": s["py"], "dtype": torch.float32, "epoch": 0}


def _restore(root: Root, step: int | None, loader: str, into_target: bool) -> Any:
    """Restore, checking the all-or-nothing promise: a failure leaves the target untouched.
    ``"ring-cold"``: the ring, with the files out of the page cache first (read with O_DIRECT)."""
    if loader == "ring-cold":
        evict(root.path)
        loader = "ring"
    target = _target() if into_target else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if target is None:
                return root.mgr.restore(step, device="cpu", loader=loader)
            return root.mgr.restore(step, target=target, loader=loader)
    except CkptError:
        if target is not None:
            zeros = _target()
            for k in ("ids", "mask"):
                assert torch.equal(target[k], zeros[k]), f"{k} was written by a restore that failed"
            assert not target["optim"]["state"][0]["exp_avg"].any()
        raise


def _check_exact_or_error(root: Root, loader: str, into_target: bool) -> None:
    try:
        out = _restore(root, 2, loader, into_target)
    except CkptError:
        pass
    else:
        assert_tree_equal(_plain(out), _plain(_state(2)))
    out = _restore(root, None, loader, into_target)  # step 2 or, having skipped it, step 1: exactly
    want = _state(2) if out["epoch"] == 2 else _state(1)
    assert_tree_equal(_plain(out), _plain(want))


def _plain(tree: Any) -> Any:
    """The state as the comparison sees it (a target-shaped result holds the target's objects)."""
    return {k: v for k, v in tree.items() if k != "dtype"}


mutation = st.tuples(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]),
                     st.floats(0, 1, exclude_max=True), st.integers(0, 255), st.integers(1, 64))


def _mutate(data: bytes, ops: list[tuple[str, float, int, int]]) -> bytes:
    buf = bytearray(data)
    for op, where, value, n in ops:
        if not buf:
            break
        i = min(int(where * len(buf)), len(buf) - 1)
        if op == "flip":
            buf[i] ^= 1 << (value % 8)
        elif op == "set":
            buf[i] = value if buf[i] != value else value ^ 0xFF
        elif op == "truncate":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = bytes([value]) * n
        else:
            del buf[i:i + n]
    return bytes(buf)


def _fuzz_bytes(root: Root, data: st.DataObject) -> None:
    root.reset()
    name = data.draw(st.sampled_from(root.names), label="file")
    ops = data.draw(st.lists(mutation, min_size=1, max_size=3), label="ops")
    changed = _mutate(root.original[name], ops)
    if changed == root.original[name]:
        return
    root.write(name, changed)
    loader = data.draw(st.sampled_from(LOADERS), label="loader")
    _check_exact_or_error(root, loader, data.draw(st.booleans(), label="into_target"))


@CI
@given(data=st.data())
def test_damaged_bytes_restore_exactly_or_raise_ckpt_errors(fuzz_root, data):
    _fuzz_bytes(fuzz_root, data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_damaged_bytes_restore_exactly_or_raise_ckpt_errors_long(fuzz_root, data):
    _fuzz_bytes(fuzz_root, data)


json_value = st.recursive(
    st.none() | st.booleans() | st.sampled_from([0, -1, 1, 2**31, 2**63, 10**15, -(10**20), 10**400])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "\x00", "../x", "data-00000.safetensors", "F32", "$tensor", "model/w", "a" * 5000,
                       "nan", "cpu", "OrderedDict", "float32"]) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["$dict", "$tensor", "$tuple", "$float", "$stateful", "state", "file", "dtype", "shape",
                         "offsets", "view_of", "x"]) | st.text(max_size=5), inner, max_size=3),
    max_leaves=12)


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*path, i))
    return out


def _fuzz_structure(root: Root, data: st.DataObject) -> None:
    root.reset()
    obj = json.loads(root.original["manifest.json"])
    del obj["manifest_crc32c"]
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        paths = [p for p in _paths(obj) if p]
        path = data.draw(st.sampled_from(paths), label="path")
        node = obj
        for k in path[:-1]:
            node = node[k]
        action = data.draw(st.sampled_from(["replace", "delete", "add"]), label="action")
        if action == "delete" or (action == "add" and not isinstance(node, dict)):
            if isinstance(node, dict):
                del node[path[-1]]
            else:
                node.pop(path[-1])
        elif action == "add":
            node[data.draw(st.text(max_size=6), label="key")] = data.draw(json_value, label="value")
        else:
            node[path[-1]] = data.draw(json_value, label="value")
    try:
        raw = signed_bytes(obj)
    except (ValueError, RecursionError):
        return
    root.write("manifest.json", raw)
    loader = data.draw(st.sampled_from(LOADERS), label="loader")
    into_target = data.draw(st.booleans(), label="into_target")
    for step in (2, None):
        with contextlib.suppress(CkptError):
            _restore(root, step, loader, into_target)


@CI
@given(data=st.data())
def test_crafted_manifests_raise_only_ckpt_errors(fuzz_root, data):
    _fuzz_structure(fuzz_root, data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_crafted_manifests_raise_only_ckpt_errors_long(fuzz_root, data):
    _fuzz_structure(fuzz_root, data)


def _fuzz_unsigned(root: Root, data: st.DataObject) -> None:
    """A manifest without a checksum: damage to it may go unnoticed, but never crashes a restore."""
    root.reset()
    obj = json.loads(root.original["manifest.json"])
    del obj["manifest_crc32c"]
    raw = json.dumps(obj, indent=1).encode()
    changed = _mutate(raw, data.draw(st.lists(mutation, min_size=1, max_size=3), label="ops"))
    root.write("manifest.json", changed)
    loader = data.draw(st.sampled_from(LOADERS), label="loader")
    for step in (2, None):
        with contextlib.suppress(CkptError):
            _restore(root, step, loader, data.draw(st.booleans(), label="into_target"))


@CI
@given(data=st.data())
def test_damaged_unchecksummed_manifests_raise_only_ckpt_errors(fuzz_root, data):
    _fuzz_unsigned(fuzz_root, data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_damaged_unchecksummed_manifests_raise_only_ckpt_errors_long(fuzz_root, data):
    _fuzz_unsigned(fuzz_root, data)


def test_the_fuzz_root_restores_exactly_when_undamaged(fuzz_root):
    fuzz_root.reset()
    for loader in LOADERS:
        for into_target in (False, True):
            out = _restore(fuzz_root, 2, loader, into_target)
            assert_tree_equal(_plain(out), _plain(_state(2)))
    assert math.isnan(out["py"][3])
    shutil.rmtree(fuzz_root.dir)
    fuzz_root.reset()


# Foreign safetensors files through load_file: a valid layout of a few tensors, then one field of
# its header made hostile (a negative, float, bool or huge dimension, offsets of every kind, an
# unknown dtype, a missing key, any JSON value), or its length field, or its size. load_file either
# returns exactly what safetensors itself reads from the file or raises CheckpointCorruptError.
ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
hostile_int = st.sampled_from([-1, -2, 0, 1, 2, 3, 2**31, 2**50, 2**50 + 1, 2**63, 2**64 + 3, -(2**63)])
hostile_field = (st.lists(hostile_int, max_size=3) | st.lists(st.floats(-4, 4) | st.booleans(), max_size=3)
                 | json_value | st.sampled_from(["F32", "C128", "", "f32", "22"]))


def _foreign_file(data: st.DataObject) -> bytes:
    specs = data.draw(st.lists(st.tuples(st.sampled_from(sorted(ST_DTYPES)), st.lists(st.integers(0, 4), max_size=3)),
                               min_size=1, max_size=3), label="tensors")
    header: dict[str, Any] = {}
    pos = 0
    for i, (dtype, shape) in enumerate(specs):
        n = math.prod(shape) * ST_DTYPES[dtype]
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    if data.draw(st.booleans(), label="metadata"):
        header["__metadata__"] = {"format": "pt"}
    how = data.draw(st.sampled_from(["field", "field", "delete", "length", "size", "none"]), label="how")
    name = data.draw(st.sampled_from([k for k in header if k != "__metadata__"]), label="entry")
    key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]), label="key")
    if how == "field":
        header[name][key] = data.draw(hostile_field, label="value")
    elif how == "delete":
        del header[name][key]
    elif how == "size":
        pos = max(0, pos + data.draw(st.integers(-5, 5), label="size change"))
    try:
        raw = json.dumps(header).encode()
    except ValueError:  # (a float the encoder refuses)
        raw = b"{}"
    n = len(raw)
    if how == "length":
        n = data.draw(hostile_int | st.integers(0, len(raw) + 8), label="length") % 2**64
    payload = data.draw(st.binary(min_size=pos, max_size=pos), label="data")
    return n.to_bytes(8, "little") + raw + payload


def _fuzz_foreign(tmp_dir: str, data: st.DataObject) -> None:
    from safetensors.torch import load_file as st_load_file

    import ckptmgr

    path = os.path.join(tmp_dir, "foreign.safetensors")
    with open(path, "wb") as f:
        f.write(_foreign_file(data))
    try:
        got = ckptmgr.load_file(path)
    except ckptmgr.CheckpointCorruptError:
        return
    want = st_load_file(path)  # what ckptmgr accepts, safetensors reads, to the same bytes
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k


@CI
@given(data=st.data())
def test_foreign_safetensors_headers_load_exactly_or_raise_corrupt(tmp_path, data):
    _fuzz_foreign(str(tmp_path), data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_foreign_safetensors_headers_load_exactly_or_raise_corrupt_long(tmp_path, data):
    _fuzz_foreign(str(tmp_path), data)
