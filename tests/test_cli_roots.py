"""The ``ckptmgr`` command on damaged, missing and read-only roots (local and S3 on moto):
one damaged step never hides the others, looking never creates anything, and a user never
sees a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
import zygote

from ckptmgr import CheckpointManager
from ckptmgr.cli import EXIT, main

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
STEP = "step_000000000020"
READ_ONLY_COMMANDS = (("ls",), ("inspect",), ("verify",), ("export", "latest", "--to"))


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = zygote.run([sys.executable, "-m", "ckptmgr", *args], template="torch", capture_output=True, text=True,
                   env=env or ENV, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def run(capsys, *args: str) -> tuple[int, str, str]:
    """The command in this process (the mutation table runs it many times): exit code,
    stdout, stderr. An escaping exception fails the test, as a traceback would."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    assert code != EXIT["internal"], err
    return code, out, err


def _state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(64, 32), "b": torch.randn(32)}, "step": step}


@pytest.fixture
def saved(root):
    with CheckpointManager(root) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, _state(step), metadata={"loss": 1.0 / step}).result()
    return root


def _edit_manifest(root: str, fn) -> None:
    path = os.path.join(root, STEP, "manifest.json")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(fn(data))


def _seal(obj: dict) -> bytes:
    """The manifest's bytes as ckptmgr writes them, with its own checksum last: an edit that
    keeps the checksum valid, so that the field checks themselves are exercised."""
    import crc32c

    obj.pop("manifest_crc32c", None)
    head = json.dumps(obj, indent=1, ensure_ascii=False).encode()[:-2]
    return head + f',\n "manifest_crc32c": "{crc32c.crc32c(head):08x}"\n}}'.encode()


def _json_edit(edit):
    def fn(data: bytes) -> bytes:
        obj = json.loads(data)
        edit(obj)
        return _seal(obj)
    return fn


def _flip_a_digit(data: bytes) -> bytes:
    i = data.index(b'"step": ') + len(b'"step": ')
    return data[:i] + (b"3" if data[i:i + 1] != b"3" else b"4") + data[i + 1:]


def _first_tensor(obj: dict) -> dict:
    return next(e for e in obj["tensors"].values() if "file" in e)


def _first_file(obj: dict) -> dict:
    return next(iter(obj["files"].values()))


# Each damages step 20's manifest in one way; every command must report it with exit 1,
# name step 20, and (ls, verify) still list and check steps 10 and 30.
MUTATIONS = {
    "not json": lambda d: d[: len(d) // 2],
    "empty": lambda d: b"",
    "binary": lambda d: bytes(range(256)),
    "not an object": lambda d: b"[1, 2, 3]",
    "files missing": _json_edit(lambda o: o.pop("files")),
    "tensors wrong type": _json_edit(lambda o: o.update(tensors=[1, 2])),
    "step wrong type": _json_edit(lambda o: o.update(step="twenty")),
    "another step": _json_edit(lambda o: o.update(step=30)),
    "chunk size zero": _json_edit(lambda o: _first_file(o).update(chunk_size=0)),
    "tensor names a missing file": _json_edit(lambda o: _first_tensor(o).update(file="data-00099.safetensors")),
    "file name escapes": _json_edit(lambda o: o.update(files={"../x": _first_file(o)})),
    "newer format": _json_edit(lambda o: o.update(format_version=99)),
    "edited, checksum not updated": _flip_a_digit,
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_damaged_step_is_reported_and_the_others_still_listed_and_verified(saved, tmp_path, capsys, mutation):
    _edit_manifest(saved, MUTATIONS[mutation])
    code = 2 if mutation == "newer format" else 1  # not damage: a checkpoint this version cannot read
    rc, out, err = run(capsys, "ls", saved)
    assert rc == code and "step 20" in err, err
    rows = [line.split()[0] for line in out.splitlines()[1:]]
    assert rows == ["10", "20", "30"] and "DAMAGED" in out.splitlines()[2]
    rc, out, err = run(capsys, "--json", "ls", saved)
    listed = json.loads(out)["steps"]
    assert [(s["step"], s["ok"]) for s in listed] == [(10, True), (20, False), (30, True)]
    assert STEP in listed[1]["error"]
    rc, out, err = run(capsys, "verify", saved)
    assert rc == code
    assert "step 10: ok" in out and "step 30: ok" in out and "step 20: CORRUPT" in out
    rc, out, err = run(capsys, "inspect", saved, "20")
    assert rc == code and STEP in err
    rc, out, err = run(capsys, "export", saved, "20", "--to", str(tmp_path / "out"))
    assert rc == code and not (tmp_path / "out").exists()
    assert run(capsys, "inspect", saved, "30")[0] == 0


def test_no_traceback_from_a_damaged_step_in_a_real_process(saved):
    _edit_manifest(saved, MUTATIONS["tensors wrong type"])
    r = cli("ls", saved)  # cli() fails on a traceback
    assert r.returncode == 1 and "step 20" in r.stderr and "step 30" not in r.stderr
    r = cli("inspect", saved, "20")
    assert r.returncode == 1 and r.stderr.startswith("ckptmgr inspect: error:")


def test_damaged_step_on_s3(s3_bucket, tmp_path):
    import s3fs

    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    with CheckpointManager(url, storage_options=opts) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, _state(step)).result()
    fs = s3fs.S3FileSystem(**opts)
    fs.pipe_file(f"{bucket}/run/{STEP}/manifest.json", b'{"format": "ckptmgr", "format_version": 1}')
    env = {**ENV, "CKPTMGR_STORAGE_OPTIONS": json.dumps(opts)}
    out = json.loads(cli("ls", url, "--json", env=env).stdout)
    assert [(s["step"], s["ok"]) for s in out["steps"]] == [(10, True), (20, False), (30, True)]
    r = cli("verify", url, env=env)
    assert r.returncode == 1 and "step 10: ok" in r.stdout and "step 30: ok" in r.stdout
    assert f"{bucket}/run/{STEP}/manifest.json" in r.stderr


def _huge_offsets(obj: dict) -> None:
    e = _first_tensor(obj)
    e["shape"] = [1 << 28, 1 << 10]  # 1 TiB of float32
    e["offsets"] = [e["offsets"][0], e["offsets"][0] + (1 << 40)]


def _huge_file(obj: dict) -> None:
    rec = _first_file(obj)
    rec["size"] = 1 << 40
    rec["crc32c"] = ["00000000"] * (-(-rec["size"] // rec["chunk_size"]))


@pytest.mark.parametrize("edit", [_huge_offsets, _huge_file], ids=["tensor", "file"])
def test_export_refuses_a_huge_claim_before_writing_anything(saved, tmp_path, edit):
    _edit_manifest(saved, _json_edit(edit))
    before = shutil.disk_usage(tmp_path).used
    r = cli("export", saved, "20", "--to", str(tmp_path / "out"))
    assert r.returncode == 1 and STEP in r.stderr
    assert not (tmp_path / "out").exists() and not [p for p in os.listdir(tmp_path) if "partial" in p]
    assert shutil.disk_usage(tmp_path).used - before < 1 << 30


def test_export_checks_every_data_file_header_before_writing(saved, tmp_path, capsys):
    """A data file whose header no longer matches the manifest (its checksums updated to
    match, so only the header comparison can catch it) is refused before the export writes."""
    import crc32c

    data = os.path.join(saved, STEP, "data-00000.safetensors")
    with open(data, "rb") as f:
        raw = bytearray(f.read())
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n]
    assert b'"F32"' in header
    raw[8:8 + n] = header.replace(b'"F32"', b'"I32"', 1)  # same length: the file keeps its size
    with open(data, "wb") as f:
        f.write(raw)

    def recrc(obj: dict) -> None:
        rec = obj["files"]["data-00000.safetensors"]
        size = rec["chunk_size"]
        rec["crc32c"] = [f"{crc32c.crc32c(bytes(raw[i:i + size])):08x}" for i in range(0, len(raw), size)]

    _edit_manifest(saved, _json_edit(recrc))
    dest = tmp_path / "out"
    code, _, err = run(capsys, "export", saved, "20", "--to", str(dest))
    assert code == EXIT["corrupt"] and "data-00000.safetensors" in err and "header" in err, err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # neither the export nor its partial directory


def _listing(path: str) -> dict[str, tuple[int, int]]:
    return {os.path.relpath(os.path.join(d, n), path): (os.lstat(os.path.join(d, n)).st_mode,
                                                        os.lstat(os.path.join(d, n)).st_size)
            for d, dirs, files in os.walk(path) for n in dirs + files}


@pytest.mark.parametrize("command", READ_ONLY_COMMANDS, ids=lambda c: c[0])
def test_a_missing_local_root_exits_3_and_is_not_created(tmp_path, command):
    missing = tmp_path / "nowhere" / "ckpt"
    args = [command[0], str(missing), *command[1:]]
    if command[0] == "export":
        args.append(str(tmp_path / "out"))
    r = cli(*args)
    assert r.returncode == 3 and "no checkpoint root" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("command", READ_ONLY_COMMANDS, ids=lambda c: c[0])
def test_a_missing_bucket_or_prefix_exits_3_and_nothing_is_created(s3_bucket, tmp_path, command):
    import s3fs

    bucket, opts = s3_bucket
    env = {**ENV, "CKPTMGR_STORAGE_OPTIONS": json.dumps(opts)}
    fs = s3fs.S3FileSystem(**opts)
    buckets = sorted(fs.ls(""))
    missing_bucket = f"{bucket}-missing"
    for url in (f"s3://{missing_bucket}/run", f"s3://{bucket}/no-such-run"):
        args = [command[0], url, *command[1:]]
        if command[0] == "export":
            args.append(str(tmp_path / "out"))
        r = cli(*args, env=env)
        assert r.returncode == 3 and "no checkpoint root" in r.stderr, r.stderr
        assert (missing_bucket in r.stderr) == url.startswith(f"s3://{missing_bucket}")
        fs.invalidate_cache()
        assert sorted(fs.ls("")) == buckets  # no bucket was created
        assert fs.find(bucket) == []  # nothing was written into the existing one
    assert not (tmp_path / "out").exists()


def test_prune_on_a_missing_root_exits_3(tmp_path, s3_bucket):
    bucket, opts = s3_bucket
    assert cli("prune", str(tmp_path / "nowhere"), "--keep-latest", "1").returncode == 3
    assert not (tmp_path / "nowhere").exists()
    env = {**ENV, "CKPTMGR_STORAGE_OPTIONS": json.dumps(opts)}
    assert cli("prune", f"s3://{bucket}-missing/run", "--keep-latest", "1", env=env).returncode == 3


@contextlib.contextmanager
def read_only(path: str):
    """Make ``path`` and everything under it unwritable, even for root (chattr +i), else by
    mode bits; restore it afterwards."""
    paths = [os.path.join(d, n) for d, dirs, files in os.walk(path) for n in dirs + files] + [path]
    if os.geteuid() == 0:
        if shutil.which("chattr") is None:
            pytest.skip("running as root without chattr: cannot make a read-only root")
        subprocess.run(["chattr", "+i", *paths], check=True)
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", *paths], check=True)
    else:
        modes = {p: os.stat(p).st_mode for p in paths}
        for p in reversed(paths):
            os.chmod(p, modes[p] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        try:
            yield
        finally:
            for p in paths:
                os.chmod(p, modes[p])


def test_read_only_commands_work_on_a_read_only_root(saved, tmp_path):
    before = _listing(saved)
    with read_only(saved):
        out = json.loads(cli("ls", saved, "--json", "--local-dir", "").stdout)
        assert [s["step"] for s in out["steps"]] == [10, 20, 30]
        assert cli("inspect", saved, "20").returncode == 0
        assert cli("verify", saved).returncode == 0
        assert cli("export", saved, "30", "--to", str(tmp_path / "out")).returncode == 0
        r = cli("prune", saved, "--keep-latest", "1")
        assert r.returncode == 5  # writing is refused, with the storage's error
    assert _listing(saved) == before


def test_json_before_or_after_the_command(saved):
    for args in (("--json", "ls", saved), ("ls", saved, "--json"), ("ls", "--json", saved)):
        r = cli(*args)
        assert r.returncode == 0 and [s["step"] for s in json.loads(r.stdout)["steps"]] == [10, 20, 30], args
    assert json.loads(cli("--json", "verify", saved).stdout)["ok"]
    assert json.loads(cli("--json", "inspect", saved).stdout)["step"] == 30
    assert cli("-q", "verify", saved).returncode == 0
    r = cli("--storage-options", "{not json", "ls", saved)
    assert r.returncode == 2 and "--storage-options" in r.stderr


def test_each_step_reported_with_its_status_good_damaged_incomplete_and_local_only(saved, tmp_path):
    """A root with a good step, a damaged one (manifest edited), an incomplete one (data
    without a manifest) and a step a killed job committed only to its local tier: ``ls`` and
    ``verify`` give each its status and none stops the others."""
    local_dir = tmp_path / "shm"
    local_dir.mkdir()
    writer = os.path.join(os.path.dirname(__file__), "pending_writer.py")
    proc = subprocess.Popen([sys.executable, writer, saved, str(local_dir), "hang"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:  # step 7 is committed in the local tier; its durable write hangs
        assert proc.stdout.readline().strip() == "staged"
        assert proc.stdout.readline().strip() == "local"
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    _edit_manifest(saved, _flip_a_digit)  # step 20
    incomplete = os.path.join(saved, "step_000000000035")
    os.mkdir(incomplete)
    shutil.copy(os.path.join(saved, "step_000000000030", "data-00000.safetensors"), incomplete)

    r = cli("ls", saved, "--json", "--local-dir", str(local_dir))
    assert r.returncode == 1
    rows = {s["step"]: s for s in json.loads(r.stdout)["steps"]}
    assert sorted(rows) == [7, 10, 20, 30]  # the incomplete step is not a checkpoint
    assert [(rows[s]["tier"], rows[s]["ok"]) for s in (7, 10, 20, 30)] == [
        ("local", True), ("durable", True), ("durable", False), ("durable", True)]
    assert STEP in rows[20]["error"] and "manifest" in rows[20]["error"]
    text = cli("ls", saved, "--local-dir", str(local_dir))
    assert text.returncode == 1 and "DAMAGED" in text.stdout and "step 20: " in text.stderr
    assert [ln.split()[0] for ln in text.stdout.splitlines()[1:]] == ["7", "10", "20", "30"]

    r = cli("verify", saved, "--local-dir", str(local_dir))
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["step 7", "step 10", "step 20", "step 30"]
    assert "local tier only" in lines[0] and "not verified" in lines[0]
    assert lines[1].startswith("step 10: ok") and lines[2].startswith("step 20: CORRUPT")
    assert lines[3].startswith("step 30: ok") and STEP in r.stderr
    out = json.loads(cli("verify", saved, "--json", "--local-dir", str(local_dir)).stdout)
    assert [(s["step"], s["tier"], s["ok"], s["verified"]) for s in out["steps"]] == [
        (7, "local", True, False), (10, "durable", True, True), (20, "durable", False, True),
        (30, "durable", True, True)]
    assert not out["ok"]
