"""The manifest schema, table-driven: every field missing, of the wrong type, negative and
huge, plus crafted structures (NUL and very long names, path separators, unknown tags and
keys, deep nesting, overlaps and holes) and damaged bytes. For each: restore of that step is
a CheckpointCorruptError naming the step and the field, restore() falls back to the previous
step with one warning, and ``ckptmgr verify``/``ls`` exit 1 with no traceback.

Most mutations are written back with a valid checksum (tests/manifest_tools.py), so what is
tested is the schema itself, not the checksum in front of it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_tree_equal
from manifest_tools import load, manifest_path, rewrite, sign_head, signed_bytes, write_raw

import ckptmgr.format.manifest as manifest_mod
from ckptmgr import CheckpointCorruptError, CheckpointManager, FormatVersionError, StagingOptions
from ckptmgr.cli import main as cli_main

NO_TIER = StagingOptions(local_tier=False)
F = "data-00000.safetensors"


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 8, generator=g)
    return {"model": {"w": w, "b": torch.randn(8, generator=g)}, "tied": w, "rows": w[1:3],
            "opt": {"state": {0: {"step": seed}}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
            "py": (None, True, 2.5, float("nan")), "dtype": torch.float16, "dev": torch.device("cpu"),
            "size": torch.Size([2, 3]), "epoch": seed}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("template") / "ckpt")
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, _state(1), metadata={"epoch": 6, "loss": 0.75}).result()
        mgr.save(2, _state(2), metadata={"epoch": 7, "loss": 0.5}).result()
    return root


@pytest.fixture
def two_steps(template, tmp_path) -> str:
    root = str(tmp_path / "ckpt")
    shutil.copytree(template, root)
    return root


# ------------------------------------------------------------------ the table

Mutation = Callable[[dict[str, Any]], Any]


def put(*path: Any, value: Any) -> Mutation:
    def mutate(m: dict[str, Any]) -> None:
        node = m
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def drop(*path: Any) -> Mutation:
    def mutate(m: dict[str, Any]) -> None:
        node = m
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return mutate


def rename_file(new: str) -> Mutation:
    def mutate(m: dict[str, Any]) -> None:
        m["files"][new] = m["files"].pop(F)
        for e in m["tensors"].values():
            if e.get("file") == F:
                e["file"] = new
    return mutate


def nested(depth: int) -> Any:
    node: Any = 1
    for _ in range(depth):
        node = [node]
    return node


def claim_a_tebibyte(m: dict[str, Any]) -> None:
    """A manifest consistent in itself that claims a 1 TiB file: only the real size tells."""
    data = 1 << 40
    m["files"][F] = {"size": 4096 + data, "header_size": 4096, "chunk_size": 1 << 30, "crc32c": ["00000000"] * 1025}
    m["tensors"]["model/w"].update(shape=[(data - 32) // 4], offsets=[0, data - 32])
    m["tensors"]["model/b"].update(offsets=[data - 32, data])


W, B = ("tensors", "model/w"), ("tensors", "model/b")
ROWS = ("tensors", "rows")
STATE = ("state", "$dict")
TOP = ["format_version", "step", "time", "library_version", "protected", "files", "tensors", "state", "metadata"]

CASES: list[tuple[str, Mutation, str]] = [
    # every required top-level field missing
    *[(f"missing-{k}", drop(k), f"lacks {k}" if k != "format_version" else "format_version") for k in TOP],
    ("missing-format", drop("format"), "not a ckptmgr manifest"),
    ("missing-file-size", drop("files", F, "size"), r"files\['data-00000.safetensors'\]: lacks size"),
    ("missing-file-crc", drop("files", F, "crc32c"), "lacks crc32c"),
    ("missing-tensor-offsets", drop(*W, "offsets"), r"tensors\['model/w'\]: lacks offsets"),
    ("missing-view-stride", drop(*ROWS, "stride"), r"tensors\['rows'\]: lacks stride"),
    ("missing-stateful-state", put(*STATE, "x", value={"$stateful": "m.C"}), r"\$stateful takes the keys"),
    # wrong types
    ("type-format_version", put("format_version", value="1"), "format_version"),
    ("type-format_version-bool", put("format_version", value=True), "format_version"),
    ("type-step-str", put("step", value="2"), "step: must be an int"),
    ("type-step-float", put("step", value=2.0), "step: must be an int"),
    ("type-step-bool", put("step", value=True), "step: must be an int"),
    ("type-time", put("time", value="now"), "time: must be a finite number"),
    ("type-time-bool", put("time", value=True), "time: must be a finite number"),
    ("type-library_version", put("library_version", value=5), "library_version"),
    ("type-protected", put("protected", value="false"), "protected"),
    ("type-files", put("files", value=[]), "files: must be an object"),
    ("type-file-record", put("files", F, value=[1, 2]), r"files\['data-00000.safetensors'\]: must be an object"),
    ("type-size", put("files", F, "size", value="4640"), r"\.size: must be an int"),
    ("type-crc", put("files", F, "crc32c", value="a0c919c2"), r"\.crc32c: must list 1"),
    ("type-crc-entry", put("files", F, "crc32c", 0, value=5), r"\.crc32c\[0\]"),
    ("type-tensors", put("tensors", value=[]), "tensors: must be an object"),
    ("type-tensor-entry", put(*W, value="F32"), r"tensors\['model/w'\]: must be an object"),
    ("type-dtype", put(*W, "dtype", value=5), r"\.dtype: unknown dtype"),
    ("type-shape", put(*W, "shape", value="16x8"), r"\.shape: must be a list"),
    ("type-shape-entry", put(*W, "shape", 0, value=16.0), r"\.shape\[0\]: must be an int"),
    ("type-offsets", put(*W, "offsets", value={"b": 0}), r"\.offsets: must be a list"),
    ("type-file-ref", put(*W, "file", value=0), r"\.file: names no file"),
    ("type-byte_offset", put(*ROWS, "byte_offset", value="32"), r"\.byte_offset: must be an int"),
    ("type-world_size", put("world_size", value="2"), "world_size"),
    ("type-state", put("state", value=[{"a": 1}]), r"state\[0\]: not a typed value"),
    ("type-metadata-tensor", put("metadata", value={"$tensor": "model/w"}), r"metadata: \$tensor cannot appear"),
    ("type-metadata-plain-object", put("metadata", value={"epoch": 7}), "metadata: not a typed value"),
    # negative
    ("negative-step", put("step", value=-1), "step: must be in"),
    ("negative-size", put("files", F, "size", value=-1), r"\.size: must be in"),
    ("negative-header_size", put("files", F, "header_size", value=-4096), r"\.header_size: must be in"),
    ("negative-chunk_size", put("files", F, "chunk_size", value=-4096), r"\.chunk_size: must be in"),
    ("negative-offsets", put(*W, "offsets", value=[-1, 511]), r"\.offsets\[0\]: must be in"),
    ("negative-shape", put(*W, "shape", value=[-16, 8]), r"\.shape\[0\]: must be in"),
    ("negative-stride", put(*ROWS, "stride", value=[-8, 1]), r"\.stride\[0\]: must be in"),
    ("negative-byte_offset", put(*ROWS, "byte_offset", value=-4), r"\.byte_offset: must be in"),
    ("negative-world_size", put("world_size", value=-1), "world_size: must be in"),
    ("reversed-offsets", put(*W, "offsets", value=[512, 0]), r"\.offsets: must be \[begin, end\]"),
    # huge
    ("huge-step", put("step", value=10**12), "step: must be in"),
    ("huge-step-300", put("step", value=10**300), "step: must be in"),
    ("huge-time", put("time", value=10**400), "time: must be a finite number"),
    ("huge-size", put("files", F, "size", value=10**20), r"\.size: must be in"),
    ("huge-size-claimed", put("files", F, value={"size": 1 << 40, "header_size": 4096, "chunk_size": 1 << 30,
                                                "crc32c": ["00000000"] * 1024}), r"the data region is"),
    ("huge-consistent-claim", claim_a_tebibyte, r"has 4640 bytes; the manifest says 1099511631872"),
    ("huge-header_size", put("files", F, "header_size", value=1 << 40), r"\.header_size: must be in"),
    ("huge-chunk_size", put("files", F, "chunk_size", value=1 << 40), r"\.chunk_size: must be in"),
    ("huge-offsets", put(*W, "offsets", value=[0, 10**15]), r"\.offsets: \[0, 1000000000000000\] span"),
    ("huge-shape", put(*W, "shape", value=[10**12, 10**12]), r"needs 4000000000000000000000000"),
    ("huge-dims", put(*W, "shape", value=[1] * 65), r"\.shape: must be a list of at most 64"),
    ("huge-byte_offset", put(*ROWS, "byte_offset", value=10**15), r"tensors\['rows'\]: reaches byte"),
    ("huge-world_size", put("world_size", value=10**9), "world_size: must be in"),
    ("huge-library_version", put("library_version", value="v" * 1000), "library_version"),
    ("huge-name", lambda m: m["tensors"].update({"n" * 5000: m["tensors"]["tied"]}), "a tensor name must be"),
    ("huge-crc-list", put("files", F, "crc32c", value=["a0c919c2"] * 2), r"\.crc32c: must list 1"),
    # crafted structures
    ("nul-name", lambda m: m["tensors"].update({"a\x00b": m["tensors"]["tied"]}), "without NUL"),
    ("reserved-name", lambda m: m["tensors"].update({"__metadata__": m["tensors"]["tied"]}), "reserved"),
    ("path-separator-file", rename_file("../data-00000.safetensors"), "not a data file name"),
    ("absolute-file", rename_file("/etc/passwd"), "not a data file name"),
    ("nul-file", rename_file("data-00000.safetensors\x00"), "not a data file name"),
    ("unknown-top-key", put("evil", value=1), "unknown key"),
    ("unknown-file-key", put("files", F, "mode", value=1), "unknown key"),
    ("unknown-tensor-key", put(*W, "extra", value=1), "unknown key"),
    ("unknown-dtype", put(*W, "dtype", value="F128"), "unknown dtype"),
    ("dtype-disagrees-with-offsets", put(*W, "dtype", value="F64"), r"F64\[16, 8\] needs 1024"),
    ("missing-file-ref", put(*W, "file", value="data-00001.safetensors"), "names no file"),
    ("view-of-missing", put(*ROWS, "view_of", value="nope"), "names no stored tensor"),
    ("view-of-view", put(*ROWS, "view_of", value="tied"), "names no stored tensor"),
    ("view-outside", put(*ROWS, "byte_offset", value=500), "reaches byte 564"),
    ("view-stride-length", put(*ROWS, "stride", value=[8]), "has 1 entries for 2 dimensions"),
    ("overlap", put(*B, "offsets", value=[500, 532]), "overlaps"),
    ("hole", put(*B, "offsets", value=[520, 552]), "hole of 8 bytes"),
    ("data-past-tensors", put("files", F, "size", value=4644), "the data region is 548 bytes"),
    ("header-size-unaligned", put("files", F, "header_size", value=4104), "multiple of 4096"),
    ("crc-not-hex", put("files", F, "crc32c", 0, value="A0C919C2"), "lowercase hex"),
    ("unknown-tag", put(*STATE, "x", value={"$evil": 1}), r"\['x'\]: not a typed value"),
    ("two-tags", put(*STATE, "x", value={"$tuple": [], "$float": "nan"}), "not a typed value"),
    ("float-tag", put(*STATE, "x", value={"$float": "1.5"}), r"\$float is one of"),
    ("float-tag-list", put(*STATE, "x", value={"$float": []}), r"\$float is one of"),
    ("dtype-tag", put(*STATE, "x", value={"$dtype": "os"}), "unknown dtype"),
    ("device-tag", put(*STATE, "x", value={"$device": "../../etc"}), "not a device"),
    ("size-tag", put(*STATE, "x", value={"$size": ["2"]}), r"\$size holds"),
    ("dict-pair", put(*STATE, "opt", "$dict", "state", "$dict", value=[[0]]), r"\[key, value\] pairs"),
    ("dict-list-key", put(*STATE, "opt", "$dict", "state", "$dict", value=[[[0], 1]]), "cannot be a dict key"),
    ("dict-tensor-key", put(*STATE, "opt", "$dict", "state", "$dict", value=[[{"$tensor": "model/b"}, 1]]),
     "cannot be a dict key"),
    ("dict-type", put(*STATE, "model", "type", value="defaultdict"), "unknown dict type"),
    ("tensor-tag-unknown", put(*STATE, "x", value={"$tensor": "nope"}), "names no tensor"),
    ("tensor-tag-type", put(*STATE, "x", value={"$tensor": ["model/w"]}), "names no tensor"),
    ("deep-state", put(*STATE, "x", value=nested(400)), "nested deeper than"),
    ("deep-metadata", put("metadata", value=nested(400)), "nested deeper than"),
    ("rank-states-without-ranks", put("rank_states", value=[]), "rank_states"),
    ("ranks-without-rank-states", put("world_size", value=2), "rank_states"),
    ("another-step", put("step", value=3), "the manifest is for step 3"),
]


# Every field of a file record, a stored tensor and a view: missing, of the wrong type, negative, huge.
NESTED = {
    "files['data-00000.safetensors']": (("files", F), {"size": int, "header_size": int, "chunk_size": int,
                                                       "crc32c": list}),
    "tensors['model/w']": (W, {"file": str, "dtype": str, "shape": list, "offsets": list}),
    "tensors['rows']": (ROWS, {"view_of": str, "dtype": str, "shape": list, "stride": list, "byte_offset": int}),
}
for _field, (_path, _keys) in NESTED.items():
    for _key, _kind in _keys.items():
        _where = re.escape(f"{_field}.{_key}")
        CASES.append((f"missing-{_field}.{_key}", drop(*_path, _key), re.escape(_field) + ": lacks"))
        CASES.append((f"type-{_field}.{_key}", put(*_path, _key, value=5 if _kind is str else "x"),
                      _where if _key != "view_of" else r"view_of: names no stored tensor"))
        if _kind is int:
            CASES.append((f"negative-{_field}.{_key}", put(*_path, _key, value=-1), _where + ": must be in"))
            CASES.append((f"huge-{_field}.{_key}", put(*_path, _key, value=10**30), _where + ": must be in"))
        elif _key in ("shape", "offsets", "stride"):
            CASES.append((f"negative-{_field}.{_key}", put(*_path, _key, value=[-1, -1]),
                          _where + r"\[0\]: must be in"))
            CASES.append((f"huge-{_field}.{_key}", put(*_path, _key, value=[10**30, 10**30]),
                          _where + r"\[0\]: must be in"))


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def mutated(request, two_steps) -> tuple[str, str]:
    _, mutate, match = request.param
    rewrite(two_steps, 2, mutate)
    return two_steps, match


def _check_step_2_is_corrupt(root: str, match: str, capsys: pytest.CaptureFixture[str], *, manifest: bool = True,
                             commands: tuple[str, ...] = ("verify", "ls")) -> None:
    """restore(2) is corrupt (naming step 2 and ``match``), restore() falls back to step 1 with one
    warning, and each CLI command exits 1 naming the step, without a traceback."""
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        with pytest.raises(CheckpointCorruptError, match=match) as info:
            mgr.restore(2)
        assert "step 2" in str(info.value)
        if manifest:
            with pytest.raises(CheckpointCorruptError):
                mgr.metadata(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = mgr.restore()
        assert [str(w.message)[:16] for w in caught] == ["skipping step 2:"]
        assert_tree_equal(out, _state(1))
    capsys.readouterr()
    for command in commands:
        code = cli_main([command, root, "--quiet"])
        err = capsys.readouterr().err
        assert code == 1, f"ckptmgr {command}: exit {code}: {err}"
        assert "Traceback" not in err and "step_000000000002" in err, err


def test_each_manifest_mutation_is_corruption_with_a_fallback(mutated, capsys):
    root, match = mutated
    file_level = match.startswith("has 4640 bytes")  # the manifest is valid; the file's real size is not
    # ls lists what manifests say; only verify compares a manifest's step with its directory
    commands = ("verify",) if "manifest is for step" in match else ("verify", "ls")
    _check_step_2_is_corrupt(root, match, capsys, manifest=not file_level,
                             commands=("verify",) if file_level else commands)


@pytest.mark.parametrize(("what", "edit", "match"), [
    ("metadata digit", lambda d: d.replace(b'"epoch": 7', b'"epoch": 6'), "fails its checksum"),
    ("state digit", lambda d: d.replace(b'"step": 2\n', b'"step": 3\n'), "fails its checksum"),
    ("tensor shape digit", lambda d: d.replace(b"16,\n    8", b"16,\n    9", 1), "fails its checksum"),
    ("whitespace", lambda d: d.replace(b'"format": ', b'"format":  '), "fails its checksum"),
    ("checksum digit", lambda d: d[:-5] + bytes([d[-5] ^ 1]) + d[-4:], "manifest_crc32c"),
    ("checksum moved", lambda d: d.replace(b'{\n "format"', b'{\n "manifest_crc32c": "00000000",\n "format"'),
     "manifest_crc32c"),
    ("truncated", lambda d: d[:len(d) // 2], "not valid JSON"),
    ("empty", lambda d: b"", "not valid JSON"),
    ("not utf-8", lambda d: d.replace(b'"format"', b'"f\xffrmat"'), "not valid JSON"),
    ("NaN constant", lambda d: d.replace(b'"loss": 0.5', b'"loss": NaN'), "not valid JSON"),
    ("50,000 deep", lambda d: sign_head(d[:-40].replace(b'"metadata": {', b'"metadata": ' + b"[" * 50_000 + b"]"
                                                          * 50_000 + b', "x": {', 1)), "nested too deeply"),
])
def test_damaged_manifest_bytes_are_caught(two_steps, capsys, what, edit, match):
    """One flipped digit in the metadata or the state skeleton, and other byte-level damage."""
    with open(manifest_path(two_steps, 2), "rb") as f:
        data = f.read()
    changed = edit(data)
    assert changed != data, what
    write_raw(two_steps, 2, changed)
    _check_step_2_is_corrupt(two_steps, match, capsys)


def test_manifests_without_a_checksum_are_read_with_every_other_check(two_steps, capsys):
    """Written before the checksum existed (like tests/golden/v1): read, but still validated."""
    rewrite(two_steps, 1, lambda m: None, signed=False)
    rewrite(two_steps, 2, put("step", value="2"), signed=False)
    assert "manifest_crc32c" not in load(two_steps, 1)
    with CheckpointManager(two_steps, staging=NO_TIER) as mgr:
        assert_tree_equal(mgr.restore(1), _state(1))
        assert mgr._manifest(1).checksummed is False
    _check_step_2_is_corrupt(two_steps, "step: must be an int", capsys)


def test_a_newer_format_version_is_refused_not_skipped(two_steps):
    rewrite(two_steps, 2, put("format_version", value=99))
    with CheckpointManager(two_steps, staging=NO_TIER) as mgr, pytest.raises(FormatVersionError, match="Upgrade"):
        mgr.restore()


def test_an_oversized_manifest_is_not_parsed(two_steps, monkeypatch, capsys):
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 1000)
    with CheckpointManager(two_steps, staging=NO_TIER) as mgr, \
            pytest.raises(CheckpointCorruptError, match="more than the 1000 a manifest may have"):
        mgr.restore(2)


def _fifo_in_place_of(path: str) -> None:
    os.unlink(path)
    os.mkfifo(path)


def test_a_fifo_as_a_data_file_is_refused_without_opening_it(two_steps, capsys):
    """Opening a FIFO for reading blocks until a writer comes: it must never be opened."""
    _fifo_in_place_of(os.path.join(two_steps, "step_000000000002", F))
    _check_step_2_is_corrupt(two_steps, "not a regular file", capsys, manifest=False, commands=("verify",))
    r = subprocess.run([sys.executable, "-m", "ckptmgr", "verify", two_steps, "2"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 1 and "not a regular file" in r.stderr and "Traceback" not in r.stderr


def test_a_fifo_as_the_manifest_is_refused_by_restore(two_steps):
    _fifo_in_place_of(manifest_path(two_steps, 2))
    with CheckpointManager(two_steps, staging=NO_TIER) as mgr:
        with pytest.raises(CheckpointCorruptError, match=r"step 2: .*manifest\.json is a FIFO, not a regular file"):
            mgr.restore(2)
        assert_tree_equal(mgr.restore(), _state(1))  # not listed as committed, or skipped


def test_data_files_through_symlinks_out_of_the_step_are_refused(two_steps, tmp_path, capsys):
    """Even a byte-identical copy elsewhere is not read through a link that leaves the step."""
    path = os.path.join(two_steps, "step_000000000002", F)
    outside = str(tmp_path / "elsewhere.safetensors")
    shutil.copy(path, outside)
    os.unlink(path)
    os.symlink(outside, path)
    _check_step_2_is_corrupt(two_steps, "symbolic link out of its step directory", capsys, manifest=False,
                             commands=("verify",))


def test_a_directory_as_a_data_file_is_refused(two_steps, capsys):
    path = os.path.join(two_steps, "step_000000000002", F)
    os.unlink(path)
    os.mkdir(path)
    _check_step_2_is_corrupt(two_steps, "not a regular file", capsys, manifest=False, commands=("verify",))


def test_a_header_that_disagrees_with_the_manifest_is_refused_by_restore(two_steps, capsys):
    """The file's header says F64 where the manifest says F32 (sizes kept consistent, the
    manifest re-signed over the new checksum): restore refuses it, as verify does."""
    path = os.path.join(two_steps, "step_000000000002", F)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["model/b"]["dtype"] = "I32"  # same size: 8 x 4 bytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    data[8:8 + n] = raw + b" " * (n - len(raw))
    with open(path, "wb") as f:
        f.write(data)
    import crc32c

    rewrite(two_steps, 2, put("files", F, "crc32c", value=[f"{crc32c.crc32c(bytes(data)):08x}"]))
    _check_step_2_is_corrupt(two_steps, r"tensor 'model/b': its header entry .* differs", capsys, manifest=False,
                             commands=("verify",))


def test_signed_bytes_helper_matches_the_writer(two_steps):
    with open(manifest_path(two_steps, 2), "rb") as f:
        assert signed_bytes(load(two_steps, 2)) == f.read()
