"""The S3 target against real S3 servers: the same tests on moto's server (a mock) and on
SeaweedFS (a real S3 implementation), both on 127.0.0.1, started by this module.

What runs here: a round trip with real multipart uploads; retention leaving no prefixes and
no false warnings; directory markers; SIGKILL mid-upload with no incomplete upload left
after the next start; a second manager starting while a save is in flight; two writers of
one step; the commit's check of every object; two processes sharing one root; the CLI,
whose reading commands never create a bucket; ``verify`` catching a modified object;
read-only credentials; throttling.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import zygote
from conftest import assert_tree_equal

from ckptmgr import (
    CheckpointCorruptError,
    CheckpointManager,
    ConfigError,
    KeepLatest,
    S3Options,
    SaveError,
    StagingOptions,
    StepExistsError,
    WriteOptions,
)

s3fs = pytest.importorskip("s3fs")
from s3_proxy import FaultyProxy  # noqa: E402
from s3_servers import S3Server, each_server  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NO_TIER = StagingOptions(local_tier=False)
VERSIONS: dict[str, str] = {}


@pytest.fixture(scope="module", params=["moto", "seaweedfs"])
def server(request):
    for srv in each_server(request):
        VERSIONS[srv.name] = srv.version
        yield srv


_counter = iter(range(10**9))


@pytest.fixture
def bucket(server: S3Server):
    name = f"conf-{os.getpid()}-{next(_counter)}"
    s3fs.S3FileSystem(**server.options()).mkdir(name)
    return name


def state_of(step, n=20_000):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(100, generator=g).bfloat16(), "step": step}


def opts(server: S3Server, **kw) -> S3Options:
    """Parts as small as the server allows (moto: lowered for tests; SeaweedFS: S3's 5 MiB)."""
    return S3Options(**{"part_size": server.min_part, "concurrency": 8, "base_delay_s": 0.01, "max_delay_s": 0.05,
                        **kw})


def parts(server: S3Server, k: float) -> int:
    """The length of a float32 tensor spanning ``k`` parts."""
    return int(k * server.min_part) // 4


def manager(url, server: S3Server, so=None, **kw):
    kw.setdefault("s3_options", opts(server))
    kw.setdefault("write_options", WriteOptions(chunk_size=max(4096, server.min_part), io_threads=4))
    kw.setdefault("staging", NO_TIER)
    return CheckpointManager(url, storage_options=so or server.options(), **kw)


def raw(server: S3Server):
    return s3fs.S3FileSystem(**server.options(), skip_instance_cache=True)


def keys(server: S3Server, bucket: str, prefix: str = "") -> list[str]:
    r = raw(server).call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in r.get("Contents", []))


def untag(key: str) -> str:
    """``key`` without the writer's claim token that object-store data names carry."""
    return re.sub(r"\.[0-9a-f]{16}\.safetensors$", ".safetensors", key)


def uploads(server: S3Server, bucket: str) -> list[dict]:
    return raw(server).call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])


def test_server_versions_are_recorded(server):
    assert server.version and server.version != "?"
    print(f"{server.name} {server.version}")


def test_round_trip_with_real_multipart(server, bucket):
    n = parts(server, 2.5)
    with manager(f"s3://{bucket}/run", server) as mgr:
        mgr.save(1, state_of(1, n), metadata={"loss": 0.5}).result()
        mgr.save(2, state_of(2, n)).result()
        assert mgr.steps() == [1, 2] and mgr.metadata(1) == {"loss": 0.5}
        assert_tree_equal(mgr.restore(), state_of(2, n))
        assert_tree_equal(mgr.restore(1), state_of(1, n))
    [data] = [k for k in keys(server, bucket, "run/step_000000000001/") if k.endswith(".safetensors")]
    head = raw(server).call_s3("head_object", Bucket=bucket, Key=data)
    assert "-" in head["ETag"]  # an S3 multipart ETag ("<md5 of md5s>-<parts>")
    assert uploads(server, bucket) == []
    assert [untag(k) for k in keys(server, bucket)] == ["run/.ckptmgr-root-id",
                                                        *[f"run/step_00000000000{s}/{n}" for s in (1, 2)
                                                          for n in ("data-00000.safetensors", "manifest.json")]]


def test_retention_leaves_no_prefixes_and_no_false_warnings(server, bucket, caplog):
    url = f"s3://{bucket}/ret"
    with caplog.at_level(logging.WARNING, "ckptmgr"):
        with manager(url, server, retention=KeepLatest(1)) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state_of(step)).result()
            mgr.wait()
            assert mgr.steps() == [3]
        with manager(url, server) as mgr:  # a later start finds nothing to clean or warn about
            assert mgr.steps() == [3]
    assert [r.getMessage() for r in caplog.records if r.name == "ckptmgr"] == []
    fs = raw(server)
    fs.invalidate_cache()
    # s3fs lists the empty directory entries some servers keep; none may be left
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/ret")) == [".ckptmgr-root-id", "step_000000000003"]


def test_directory_markers_under_our_step_names_are_removed_silently(server, bucket, caplog):
    fs = raw(server)
    fs.call_s3("put_object", Bucket=bucket, Key="mk/step_000000000009/", Body=b"")  # a marker, nothing else
    fs.call_s3("put_object", Bucket=bucket, Key="mk/step_000000000008/sub/", Body=b"")  # not ours: deeper
    fs.call_s3("put_object", Bucket=bucket, Key="mk/notes/", Body=b"")
    with caplog.at_level(logging.WARNING, "ckptmgr"), manager(f"s3://{bucket}/mk", server) as mgr:
        assert mgr.steps() == []
    assert keys(server, bucket, "mk/") == ["mk/notes/", "mk/step_000000000008/sub/"]
    warned = [r.getMessage() for r in caplog.records if r.name == "ckptmgr"]
    assert len(warned) == 1 and "step_000000000008" in warned[0] and "['sub/']" in warned[0]


def test_sigkill_mid_upload_leaves_no_incomplete_upload_after_the_next_start(server, bucket, tmp_path):
    url = f"s3://{bucket}/killed"
    with manager(url, server) as mgr:
        mgr.save(1, state_of(1)).result()
    proxy = FaultyProxy(server.endpoint, latency_s=0.3)  # slow enough to be killed mid-upload
    script = tmp_path / "writer.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {HERE!r})\n"
        "from test_s3_conformance import S3Options, manager, state_of\n"
        "from s3_servers import S3Server\n"
        f"server = S3Server({server.name!r}, {proxy.endpoint!r}, '', {server.writer!r}, None, {server.min_part})\n"
        f"mgr = manager({url!r}, server, s3_options=S3Options(part_size={server.min_part}, concurrency=2))\n"
        f"mgr.save(2, state_of(2, n={parts(server, 6)}))\n"
        "print('saving', flush=True)\n"
        "time.sleep(600)\n")
    proc = zygote.Popen([sys.executable, str(script)], template="torch", stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 60
        while not uploads(server, bucket) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert uploads(server, bucket), "no multipart upload started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proxy.close()
        if proc.poll() is None:
            proc.kill()
    assert uploads(server, bucket)  # orphaned by the kill
    assert "killed/step_000000000002/writer.lease" in keys(server, bucket)
    with manager(url, server) as mgr:  # same machine, its writer's process is gone: removed at once
        assert uploads(server, bucket) == []
        assert keys(server, bucket, "killed/step_000000000002") == []
        assert mgr.steps() == [1]
        assert_tree_equal(mgr.restore(), state_of(1))


class _Gate:
    """Holds the S3 requests of one manager matching ``method`` (and a key or prefix ending
    in ``key_end``), after ``after`` of them went through, until released."""

    def __init__(self, monkeypatch, method: str, after: int = 0, key_end: str = "") -> None:
        from ckptmgr.storage import s3 as s3mod

        self.inside, self.go = threading.Event(), threading.Event()
        self.owner: object = None
        seen = [0]
        real = s3mod.S3Target.call
        gate = self

        def call(target, m, **kw):
            if target is gate.owner and m == method and kw.get("Key", kw.get("Prefix", "")).endswith(key_end):
                seen[0] += 1
                if seen[0] > after:
                    gate.inside.set()
                    assert gate.go.wait(60)
            return real(target, m, **kw)

        monkeypatch.setattr(s3mod.S3Target, "call", call)


def test_a_second_manager_starting_keeps_a_save_in_flight(server, bucket, monkeypatch):
    url, n = f"s3://{bucket}/live", parts(server, 2.5)
    gate = _Gate(monkeypatch, "upload_part", after=1)
    with manager(url, server) as writer:
        gate.owner = writer._target
        h = writer.save(1, state_of(1, n))
        assert gate.inside.wait(60)
        before = keys(server, bucket, "live/step_")
        assert "live/step_000000000001/writer.lease" in before and uploads(server, bucket)
        with manager(url, server) as evaluator:  # starts (and cleans up) while the save is in flight
            assert evaluator.steps() == []
        assert keys(server, bucket, "live/step_") == before and uploads(server, bucket)
        gate.go.set()
        h.result(timeout=120)
    with manager(url, server) as mgr:
        assert mgr.steps() == [1]
        assert_tree_equal(mgr.restore(), state_of(1, n))
    assert [untag(k) for k in keys(server, bucket, "live/step_000000000001/")] == [
        "live/step_000000000001/data-00000.safetensors", "live/step_000000000001/manifest.json"]


def test_the_second_writer_of_a_step_is_refused_and_deletes_nothing(server, bucket, monkeypatch):
    url, n = f"s3://{bucket}/race", parts(server, 2.5)
    gate = _Gate(monkeypatch, "upload_part", after=1)
    with manager(url, server) as first, manager(url, server) as second:
        gate.owner = first._target
        h1 = first.save(7, state_of(7, n))
        assert gate.inside.wait(60)
        with pytest.raises(SaveError, match=r"being written .* by another process") as info:
            second.save(7, {"other": torch.ones(10)}).result(timeout=60)
        assert isinstance(info.value.__cause__, StepExistsError)
        gate.go.set()
        assert h1.result(timeout=120).step == 7
        assert first.steps() == second.steps() == [7]
        assert_tree_equal(second.restore(7), state_of(7, n))


def test_a_gone_writers_claim_is_taken_over(server, bucket):
    from ckptmgr.storage.lease import Lease, current

    url = f"s3://{bucket}/takeover"
    fs = raw(server)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    me = current()
    stale = Lease(me.host, me.machine, int(dead.stdout), 12345, "cd" * 8, time.time())
    fs.call_s3("put_object", Bucket=bucket, Key="takeover/step_000000000003/writer.lease", Body=stale.to_bytes())
    with manager(url, server) as mgr:  # (its start-up removes the gone writer's leftovers already)
        fs.call_s3("put_object", Bucket=bucket, Key="takeover/step_000000000003/writer.lease", Body=stale.to_bytes())
        mgr.save(3, state_of(3)).result(timeout=60)
        assert_tree_equal(mgr.restore(3), state_of(3))
    assert "takeover/step_000000000003/writer.lease" not in keys(server, bucket)


def test_the_commit_checks_every_object_is_there(server, bucket, monkeypatch):
    url = f"s3://{bucket}/lost"
    gate = _Gate(monkeypatch, "list_objects_v2", key_end="step_000000000001/")  # the commit's check waits
    three = WriteOptions(chunk_size=4096, io_threads=4, max_file_bytes=100_000)  # files of one PUT each
    with manager(url, server, write_options=three, s3_options=opts(server, part_size=1 << 20)) as mgr:
        gate.owner = mgr._target
        h = mgr.save(1, state_of(1, n=60_000))  # three files, each in one PUT
        assert gate.inside.wait(60)
        victim = [k for k in keys(server, bucket, "lost/") if k.endswith(".safetensors")]
        assert len(victim) >= 2
        raw(server).call_s3("delete_object", Bucket=bucket, Key=victim[0])
        gate.go.set()
        with pytest.raises(SaveError, match="missing"):
            h.result(timeout=60)
        assert mgr.steps() == []


def test_a_commit_between_another_writers_check_and_claim_is_never_overwritten(server, bucket, monkeypatch):
    """Writer A commits step 4 and gives up its claim just before writer B claims step 4: B
    must see A's manifest and stop, not upload its files over A's committed ones."""
    from ckptmgr.storage import s3 as s3mod

    url = f"s3://{bucket}/between"
    real = s3mod.S3Target.call
    with manager(url, server) as a, manager(url, server) as b:
        fired = []

        def call(target, m, **kw):
            if target is b._target and m == "put_object" and kw.get("Key", "").endswith("writer.lease") and not fired:
                fired.append(1)
                a.save(4, state_of(4)).result(timeout=60)  # committed, claim given up
            return real(target, m, **kw)

        monkeypatch.setattr(s3mod.S3Target, "call", call)
        h = b.save(4, {**state_of(5), "writer": "b"})
        with pytest.raises((StepExistsError, SaveError)):
            h.result(timeout=60)
        assert fired == [1]
    with manager(url, server) as mgr:
        assert_tree_equal(mgr.restore(4), state_of(4))


def _share_root(server, bucket, tmp_path, iterations: int) -> None:
    url = f"s3://{bucket}/shared"
    bdir = tmp_path / "barrier"
    bdir.mkdir()
    so = json.dumps(server.options())
    procs = [zygote.Popen([sys.executable, os.path.join(HERE, "root_sharer.py"), url, str(w), str(iterations),
                           str(w), str(bdir), "2", so, str(server.min_part)], template="torch",
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"{out}\n{err[-3000:]}"
    sys.path.insert(0, HERE)
    from root_sharer import same, shared_state

    reports = [json.loads(out.splitlines()[-1]) for out, _ in outs]
    with manager(url, server) as mgr:
        steps = mgr.steps()
        assert steps and len(steps) <= 3 + 2  # retention kept the latest few
        for step in steps:
            got = mgr.restore(step)
            assert same(got, shared_state(step, got["writer"])), step
    assert uploads(server, bucket) == []
    left = [k for k in keys(server, bucket, "shared/") if not k.endswith((".safetensors", "manifest.json"))]
    assert left == ["shared/.ckptmgr-root-id"]
    assert sum(r["collided"] for r in reports) > 0 or iterations < 3  # the same step was saved by both


def test_two_processes_share_a_root(server, bucket, tmp_path):
    _share_root(server, bucket, tmp_path, iterations=6)


# ---------------------------------------------------------------- the CLI


def _cli(server: S3Server, *args: str, read_only: bool = False) -> subprocess.CompletedProcess[str]:
    return _clis(server, args, read_only=read_only)[0]


def _clis(server: S3Server, *commands: tuple[str, ...],
          read_only: bool = False) -> list[subprocess.CompletedProcess[str]]:
    """Commands that read only (none changes what another reads), started together: their
    results, in order."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "CKPTMGR_STORAGE_OPTIONS": json.dumps(server.options(read_only=read_only))}
    procs = [zygote.Popen([sys.executable, "-m", "ckptmgr", *args], template="torch", stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env) for args in commands]
    try:
        results = []
        for args, p in zip(commands, procs, strict=True):
            out, err = p.communicate(timeout=120)
            results.append(subprocess.CompletedProcess(list(args), p.returncode, out, err))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)


def test_the_cli_reads_and_never_creates_a_bucket(server, bucket):
    with manager(f"s3://{bucket}/cli", server) as mgr:
        mgr.save(1, state_of(1), metadata={"tag": "a"}).result()
        mgr.save(2, state_of(2)).result()
    missing = f"nobucket-{os.getpid()}-{next(_counter)}"
    ls, inspect, verify, *on_missing = _clis(
        server, ("ls", f"s3://{bucket}/cli", "--json"), ("inspect", f"s3://{bucket}/cli", "1"),
        ("verify", f"s3://{bucket}/cli"), ("ls", f"s3://{missing}/x"),
        ("prune", "--keep-last", "1", "--dry-run", f"s3://{missing}/x"))
    assert ls.returncode == 0, ls.stderr
    assert [r["step"] for r in json.loads(ls.stdout)["steps"]] == [1, 2]
    assert inspect.returncode == 0
    assert verify.returncode == 0
    for r in on_missing:
        assert "Traceback" not in r.stderr, r.stderr
    buckets = [b["Name"] for b in raw(server).call_s3("list_buckets").get("Buckets", [])]
    assert missing not in buckets


def test_verify_catches_a_modified_object(server, bucket):
    with manager(f"s3://{bucket}/mod", server) as mgr:
        mgr.save(1, state_of(1)).result()
    [key] = [k for k in keys(server, bucket, "mod/step_000000000001/") if k.endswith(".safetensors")]
    fs = raw(server)
    data = bytearray(fs.cat_file(f"{bucket}/{key}"))
    data[-10] ^= 0xFF
    fs.call_s3("put_object", Bucket=bucket, Key=key, Body=bytes(data))
    r = _cli(server, "verify", f"s3://{bucket}/mod")
    assert r.returncode == 1 and "checksum" in r.stdout + r.stderr


def test_an_oversized_manifest_is_refused_by_its_content_length(server, bucket, monkeypatch):
    """On each server, the GET's Content-Length is there and refuses an oversized manifest before
    its body is read (the limit lowered to 64 KiB here; test_manifest_size.py measures the memory),
    and a manifest just under the limit is read whole."""
    import ckptmgr.format.manifest as manifest_mod

    with manager(f"s3://{bucket}/big", server) as mgr:
        mgr.save(1, state_of(1), metadata={"loss": 0.5}).result()
    fs = raw(server)
    size = len(fs.cat_file(f"{bucket}/big/step_000000000001/manifest.json"))
    fs.pipe_file(f"{bucket}/big/step_000000000002/manifest.json", b"{" + bytes(1 << 20))
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", max(size, 64 << 10))
    with manager(f"s3://{bucket}/big", server) as mgr:
        assert mgr.metadata(1) == {"loss": 0.5}
        with pytest.raises(CheckpointCorruptError, match=f"has {(1 << 20) + 1} bytes, more than the {64 << 10}"):
            mgr.metadata(2)


# ------------------------------------------------------------ read-only credentials


def test_read_only_credentials(server, bucket, caplog):
    if server.reader is None:
        pytest.skip(f"{server.name} does not check credentials: any key may write (tested on SeaweedFS)")
    url = f"s3://{bucket}/ro"
    with manager(url, server) as mgr:
        mgr.save(1, state_of(1), metadata={"loss": 1}).result()
    raw(server).call_s3("put_object", Bucket=bucket, Key="ro/step_000000000002/data-00000.safetensors", Body=b"x")
    before = keys(server, bucket)
    reader = server.options(read_only=True)
    with manager(url, server, reader, read_only=True) as mgr:
        assert mgr.steps() == [1] and mgr.metadata(1) == {"loss": 1}
        assert_tree_equal(mgr.restore(), state_of(1))
        with pytest.raises(ConfigError, match="read-only"):
            mgr.save(3, state_of(3))
        with pytest.raises(ConfigError, match="read-only"):
            mgr.protect(1)
    with caplog.at_level(logging.WARNING, "ckptmgr"), manager(url, server, reader) as mgr:
        # not told: its start-up clean-up is refused (logged, not raised); reading works
        assert mgr.steps() == [1]
        assert_tree_equal(mgr.restore(), state_of(1))
        with pytest.raises(SaveError, match=r"Access Denied|AccessDenied"):
            mgr.save(3, state_of(3)).result(timeout=60)
    assert "step_000000000002" in caplog.text
    assert keys(server, bucket) == before
    for r in _clis(server, ("ls", url), ("inspect", url, "1"), ("verify", url), read_only=True):
        assert r.returncode == 0, (r.args, r.stdout, r.stderr)
    missing = f"nobucket-{os.getpid()}-{next(_counter)}"
    with manager(f"s3://{missing}/x", server, reader, read_only=True) as mgr:
        assert mgr.steps() == []


# ---------------------------------------------------------------- throttling


def test_throttling_shrinks_the_request_window(server, bucket):
    proxy = FaultyProxy(server.endpoint, latency_s=0.01, max_inflight=3)
    try:
        so = dict(server.options(), endpoint_url=proxy.endpoint)
        n, fast = parts(server, 8), opts(server, concurrency=12, max_delay_s=0.2)
        with manager(f"s3://{bucket}/slow", server, so, s3_options=fast) as mgr:
            mgr.save(1, state_of(1, n)).result(timeout=120)
            w = mgr._target.window
            assert proxy.throttled > 0 and w.throttled > 0
            assert w.decreases > 0 and w.lowest < 12
        with manager(f"s3://{bucket}/slow", server) as mgr:
            assert_tree_equal(mgr.restore(1), state_of(1, n))
    finally:
        proxy.close()
