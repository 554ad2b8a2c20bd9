"""The S3 target against a real S3 endpoint (moto's server on 127.0.0.1): round trip,
multipart, retries through injected faults, no orphaned uploads, crash recovery, and fresh
discovery across managers."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import assert_tree_equal

from ckptmgr import CheckpointManager, ConfigError, S3Options, SaveError, StagingOptions, WriteOptions

s3fs = pytest.importorskip("s3fs")

TINY = S3Options(part_size=8 << 10, concurrency=8, base_delay_s=0.01, max_delay_s=0.05)
SMALL_CHUNKS = WriteOptions(chunk_size=4096, io_threads=4)
NO_TIER = StagingOptions(local_tier=False)


def state_of(step, n=20_000):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(100, generator=g).bfloat16(), "step": step}


def manager(url, so, **kw):
    kw.setdefault("s3_options", TINY)
    kw.setdefault("write_options", SMALL_CHUNKS)
    kw.setdefault("staging", NO_TIER)
    return CheckpointManager(url, storage_options=so, **kw)


def uploads(so, bucket):
    return s3fs.S3FileSystem(**so).call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])


def test_round_trip_with_multipart(s3_bucket, monkeypatch):
    bucket, so = s3_bucket
    from ckptmgr.storage import s3 as s3mod

    calls = []
    real = s3mod.S3Target.call
    monkeypatch.setattr(s3mod.S3Target, "call", lambda self, m, **kw: calls.append(m) or real(self, m, **kw))
    with manager(f"s3://{bucket}/run", so) as mgr:
        mgr.save(1, state_of(1), metadata={"loss": 0.5}).result()
        mgr.save(2, state_of(2)).result()
        assert mgr.steps() == [1, 2]
        assert mgr.metadata(1) == {"loss": 0.5}
        assert_tree_equal(mgr.restore(), state_of(2))
        assert_tree_equal(mgr.restore(1), state_of(1))
    assert calls.count("create_multipart_upload") >= 2 and calls.count("upload_part") >= 20
    assert calls.count("complete_multipart_upload") == calls.count("create_multipart_upload")
    assert uploads(so, bucket) == []
    fs = s3fs.S3FileSystem(**so)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/run/step_000000000001"))
    assert len(names) == 2 and names[1] == "manifest.json"
    assert re.fullmatch(r"data-00000\.[0-9a-f]{16}\.safetensors", names[0])  # named with the writer's claim


def test_a_second_manager_sees_a_commit_at_once(s3_bucket):
    bucket, so = s3_bucket
    url = f"s3://{bucket}/shared"
    with manager(url, so) as writer, manager(url, so) as reader:
        assert reader.steps() == []
        writer.save(5, state_of(5)).result()
        assert reader.steps() == [5] and reader.latest_step() == 5
        assert_tree_equal(reader.restore(), state_of(5))
        writer.save(6, state_of(6)).result()
        assert reader.latest_step() == 6


def test_saves_succeed_through_throttling_errors_and_resets(s3_bucket, s3_endpoint):
    from s3_proxy import FaultyProxy

    bucket, so = s3_bucket
    proxy = FaultyProxy(s3_endpoint, fail_rate=0.25, seed=3)
    try:
        flaky = {**so, "endpoint_url": proxy.endpoint}
        with manager(f"s3://{bucket}/flaky", flaky) as mgr:
            for step in range(3):
                mgr.save(step, state_of(step)).result(timeout=120)
            assert mgr._target.retries > 0 and proxy.failed > 0
        with manager(f"s3://{bucket}/flaky", so) as check:  # straight to the store
            assert check.steps() == [0, 1, 2]
            for step in range(3):
                assert_tree_equal(check.restore(step), state_of(step))
        assert uploads(so, bucket) == []
    finally:
        proxy.close()


def test_failed_uploads_fail_the_save_commit_nothing_and_leave_no_parts(s3_bucket, s3_endpoint):
    from s3_proxy import FaultyProxy

    bucket, so = s3_bucket
    with manager(f"s3://{bucket}/run", so) as mgr:
        mgr.save(1, state_of(1)).result()
    proxy = FaultyProxy(s3_endpoint, fail_rate=1.0, match=r"^PUT .*partNumber=")  # every part fails
    try:
        flaky = {**so, "endpoint_url": proxy.endpoint}
        opts = S3Options(part_size=8 << 10, max_attempts=3, base_delay_s=0.01, max_delay_s=0.02)
        with manager(f"s3://{bucket}/run", flaky, s3_options=opts) as mgr:
            h = mgr.save(2, state_of(2))
            failures = r"SlowDown|reduce your request rate|internal error|reset|Connection|Disconnected"
            with pytest.raises(SaveError, match=failures):
                h.result(timeout=120)
            assert mgr.steps() == [1]
        assert uploads(so, bucket) == []  # aborted, not orphaned
        with manager(f"s3://{bucket}/run", so) as mgr:
            assert mgr.steps() == [1]
            assert_tree_equal(mgr.restore(), state_of(1))
    finally:
        proxy.close()


def test_random_faults_never_commit_an_incomplete_checkpoint(s3_bucket, s3_endpoint):
    from s3_proxy import FaultyProxy

    bucket, so = s3_bucket
    proxy = FaultyProxy(s3_endpoint, fail_rate=0.35, seed=11)
    outcomes = {}
    try:
        flaky = {**so, "endpoint_url": proxy.endpoint}
        opts = S3Options(part_size=8 << 10, max_attempts=2, base_delay_s=0.0, max_delay_s=0.0)
        for step in range(6):
            try:
                with manager(f"s3://{bucket}/rnd", flaky, s3_options=opts) as mgr:
                    mgr.save(step, state_of(step)).result(timeout=120)
                outcomes[step] = "ok"
            except Exception as exc:  # SaveError, or the start-up listing failing through
                outcomes[step] = type(exc).__name__
        assert set(outcomes.values()) & {"SaveError"}, outcomes  # some failed at this rate
    finally:
        proxy.close()
    with manager(f"s3://{bucket}/rnd", so) as mgr:  # the restart cleans what faults left
        for step in mgr.steps():
            assert_tree_equal(mgr.restore(step), state_of(step))  # each committed step is whole
        assert set(mgr.steps()) >= {s for s, o in outcomes.items() if o == "ok"}
    assert uploads(so, bucket) == []


def test_sigkill_mid_upload_then_restart_cleans_and_restores(s3_bucket, s3_endpoint, tmp_path):
    from s3_proxy import FaultyProxy

    bucket, so = s3_bucket
    url = f"s3://{bucket}/killed"
    with manager(url, so) as mgr:
        mgr.save(1, state_of(1)).result()
    proxy = FaultyProxy(s3_endpoint, latency_s=0.05)  # slow enough to be killed mid-upload
    script = tmp_path / "writer.py"
    so_proxy = {"endpoint_url": proxy.endpoint, "key": "testing", "secret": "testing"}
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_s3 import manager, state_of\n"
        f"mgr = manager({url!r}, {so_proxy!r})\n"
        "mgr.save(2, state_of(2, n=400_000))\n"
        "print('saving', flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 60
        while not uploads(so, bucket) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert uploads(so, bucket), "no multipart upload started"
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proxy.close()
        if proc.poll() is None:
            proc.kill()
    assert uploads(so, bucket)  # orphaned by the kill
    with manager(url, so) as mgr:
        assert uploads(so, bucket) == []  # aborted at start-up, ours only
        assert mgr.steps() == [1]
        assert_tree_equal(mgr.restore(), state_of(1))


def test_cleanup_aborts_only_our_uploads(s3_bucket):
    bucket, so = s3_bucket
    fs = s3fs.S3FileSystem(**so)
    theirs = fs.call_s3("create_multipart_upload", Bucket=bucket, Key="other/big.bin")["UploadId"]
    mine = fs.call_s3("create_multipart_upload", Bucket=bucket, Key="run/step_000000000003/data-00000.safetensors")
    beside = fs.call_s3("create_multipart_upload", Bucket=bucket, Key="run/step_000000000003/user.bin")["UploadId"]
    with manager(f"s3://{bucket}/run", so):
        pass
    left = {(u["Key"], u["UploadId"]) for u in uploads(so, bucket)}
    assert left == {("other/big.bin", theirs), ("run/step_000000000003/user.bin", beside)}
    assert mine["UploadId"] not in {u for _, u in left}


def test_part_size_grows_to_stay_under_ten_thousand_parts():
    from ckptmgr.storage.s3 import S3Target

    class T(S3Target):
        def __init__(self):
            self.opts = S3Options(part_size=5 << 20)

    assert T().part_size(1 << 30) == 5 << 20
    assert T().part_size(100 << 30) == -(-(100 << 30) // 10_000)


def test_s3_options_are_checked(s3_bucket, tmp_path):
    with pytest.raises(ConfigError, match="part_size"):
        S3Options(part_size=0)
    with pytest.raises(ConfigError, match="not an s3:// root"):
        CheckpointManager(str(tmp_path / "x"), s3_options=S3Options())
    with pytest.raises(ConfigError, match="s3_options must be of type S3Options"):
        CheckpointManager(f"s3://{s3_bucket[0]}/x", storage_options=s3_bucket[1], s3_options={"part_size": 1})
