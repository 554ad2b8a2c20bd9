"""Ranged reads of S3 restores: how the range length and the number in flight adapt to the
store (a simulated store of known latency and bandwidth, stepped through answer by answer:
no threads, no clocks), and real reads from moto and SeaweedFS on 127.0.0.1: each byte
fetched once, in requests that span or split checksum chunks, verified as they land;
damaged and shortened objects refused by name; SlowDown shrinking the window the reads share
with the writer."""

from __future__ import annotations

import heapq
import itertools
import json
import os

import pytest
import torch
from conftest import assert_tree_equal

from ckptmgr import CheckpointCorruptError, CheckpointManager, S3Options, StagingOptions, WriteOptions
from ckptmgr.format.manifest import Manifest
from ckptmgr.restore.read import ChecksumMismatchError, plan_check, run
from ckptmgr.restore.transports.pread import PreadTransport
from ckptmgr.restore.transports.ranged import RangedTransport
from ckptmgr.storage.throttle import AdaptiveWindow, ReadTuner

MiB = 1 << 20


# ------------------------------------------------------------- the tuner, simulated


def simulate(tuner: ReadTuner, total: int, *, latency: float, conn_bps: float, store_bps: float = float("inf"),
             per_request_s: float = 0.0) -> list[tuple[float, int, int]]:
    """Read ``total`` bytes from a store where a request of ``n`` bytes started while ``k``
    are in flight takes ``latency + k**2 * per_request_s + n / min(conn_bps, store_bps / k)``;
    returns (start time, bytes, requests in flight then) of every request, answers fed to
    the tuner in the order they come."""
    now, asked, running, log = 0.0, 0, [], []  # running: heap of (end time, bytes, duration)
    while asked < total or running:
        while asked < total and len(running) < tuner.inflight():
            n = tuner.range_size(total - asked)
            k = len(running) + 1
            duration = latency + k * k * per_request_s + n / min(conn_bps, store_bps / k)
            tuner.started(now)
            heapq.heappush(running, (now + duration, n, duration))
            log.append((now, n, k))
            asked += n
        end, n, duration = heapq.heappop(running)
        now = end
        tuner.observe(n, duration, now)
    return log


def test_a_high_latency_store_is_read_wide_and_the_read_grows_while_it_pays():
    window = AdaptiveWindow(32)
    tuner = ReadTuner(window, start_inflight=8, start_range=8 * MiB, min_range=MiB, max_range=64 * MiB)
    log = simulate(tuner, 4096 * MiB, latency=0.2, conn_bps=100e6)
    assert [k for _, _, k in log[:8]] == list(range(1, 9))  # eight at once from the start, not one at a time
    assert max(k for _, _, k in log) > 8  # more in flight: every round moved more bytes
    assert max(n for _, n, _ in log) > 8 * MiB  # longer ranges: latency, not bandwidth, bounded a connection
    assert sum(n for _, n, _ in log) == 4096 * MiB and tuner.bytes == 4096 * MiB


def test_a_store_at_its_bandwidth_settles_without_growing_far():
    tuner = ReadTuner(AdaptiveWindow(64), start_inflight=8, start_range=8 * MiB, min_range=MiB, max_range=64 * MiB)
    log = simulate(tuner, 4096 * MiB, latency=0.01, conn_bps=1e9, store_bps=200e6)  # 8 connections fill it
    assert tuner.settled
    assert max(k for _, _, k in log) <= 13  # one growth at most: the next round was no faster
    assert sum(n for _, n, _ in log) == 4096 * MiB


def test_a_slower_round_goes_back_to_the_size_and_count_before_it():
    # a store that slows down for every request with each more it serves at once
    tuner = ReadTuner(AdaptiveWindow(64), start_inflight=8, start_range=8 * MiB, min_range=MiB, max_range=8 * MiB)
    log = simulate(tuner, 2048 * MiB, latency=0.05, conn_bps=1e9, per_request_s=0.01)
    assert tuner.settled
    assert tuner.inflight() == 8
    assert log[-1][2] <= 8


def test_throttling_halves_what_the_read_may_have_in_flight():
    window = AdaptiveWindow(16)
    tuner = ReadTuner(window, start_inflight=16)
    assert tuner.inflight() == 16
    ticket = window.acquire(float("inf"))
    window.release(ticket, ok=False, throttled=True)  # SlowDown: the window the writer uses too
    assert window.limit == 8 and tuner.inflight() == 8


def test_the_last_wave_is_spread_over_every_request_in_flight():
    tuner = ReadTuner(AdaptiveWindow(8), start_inflight=8, start_range=32 * MiB, min_range=4 * MiB)
    assert tuner.range_size(100 * MiB) == -(-100 * MiB // 8)  # one wave: eight equal ranges
    assert tuner.range_size(100 * MiB - 12.5 * MiB) == -(-100 * MiB // 8)  # (kept for the rest of the wave)
    later = ReadTuner(AdaptiveWindow(8), start_inflight=8, start_range=32 * MiB, min_range=4 * MiB)
    assert later.range_size(1024 * MiB) == 32 * MiB  # (not the last wave yet)
    later.started(0.0)
    assert later.range_size(380 * MiB) == -(-380 * MiB // 8)  # within a wave and a half of the end: spread
    one = ReadTuner(AdaptiveWindow(16), start_inflight=8, start_range=32 * MiB, min_range=4 * MiB)
    assert one.range_size(256 * MiB) == 16 * MiB and one.inflight() == 16  # one wave from the start: all of it
    odd = ReadTuner(AdaptiveWindow(16), start_inflight=8, start_range=32 * MiB, min_range=4 * MiB)
    assert odd.range_size(256 * MiB + 4096) == 16 * MiB + 256  # (no request of the last 4 KiB alone)
    big = ReadTuner(AdaptiveWindow(16), start_inflight=8, start_range=32 * MiB, min_range=4 * MiB)
    assert big.range_size(1024 * MiB) == 32 * MiB and big.inflight() == 8  # (rounds to learn from: it starts at 8)
    small = ReadTuner(AdaptiveWindow(8), start_inflight=8, start_range=32 * MiB, min_range=4 * MiB)
    assert small.range_size(6 * MiB) == 4 * MiB  # never below min_range
    assert small.range_size(2 * MiB) == 2 * MiB  # nor more than is left


# ----------------------------------------------------------- real servers

s3fs = pytest.importorskip("s3fs")
from s3_proxy import FaultyProxy  # noqa: E402
from s3_servers import S3Server, each_server  # noqa: E402

_counter = iter(range(10**9))


@pytest.fixture(scope="module", params=["moto", "seaweedfs"])
def server(request):
    yield from each_server(request)


@pytest.fixture
def bucket(server: S3Server):
    name = f"reads-{os.getpid()}-{next(_counter)}"
    s3fs.S3FileSystem(**server.options()).mkdir(name)
    return name


def state(n: int = 3 * MiB // 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(1000, generator=g)}


def manager(url: str, server: S3Server, so: dict | None = None, **kw) -> CheckpointManager:
    return CheckpointManager(url, storage_options=so or server.options(), staging=StagingOptions(local_tier=False),
                             write_options=WriteOptions(chunk_size=256 << 10, io_threads=4),
                             s3_options=kw.pop("s3_options", S3Options(part_size=max(server.min_part, 256 << 10),
                                                                        concurrency=8,
                                                                        base_delay_s=0.01, max_delay_s=0.05)), **kw)


def saved(server: S3Server, bucket: str, prefix: str) -> dict[str, torch.Tensor]:
    s = state()
    with manager(f"s3://{bucket}/{prefix}", server) as mgr:
        mgr.save(1, s).result(timeout=120)
    return s


def test_a_restore_fetches_each_byte_once_in_ranges_that_span_and_split_chunks(server, bucket):
    s = saved(server, bucket, "once")
    with manager(f"s3://{bucket}/once", server, read_only=True) as mgr:
        target = mgr._target
        manifest = Manifest.from_bytes(target.read_manifest(1), where="test")
        [rec] = manifest.files.values()
        # ranges of 1.5 chunks: most requests span two chunks, and split one
        tuner = ReadTuner(target.window, start_inflight=3, start_range=384 << 10, min_range=384 << 10,
                          max_range=384 << 10)
        transport = RangedTransport(target, 1, tuner=tuner)
        run(plan_check(manifest, "test"), transport)
        assert tuner.bytes == rec.size  # each byte once
        assert -(-rec.size // (576 << 10)) <= tuner.requests < len(rec.crc32c)  # (the last wave: up to 1.5x)
        assert_tree_equal(mgr.restore(), s)  # (through the manager: the ranged transport, default tuning)


def test_a_modified_object_fails_its_checksum_naming_file_and_bytes(server, bucket):
    saved(server, bucket, "mod")
    fs = s3fs.S3FileSystem(**server.options(), skip_instance_cache=True)
    [key] = [k for k in fs.find(f"{bucket}/mod") if k.endswith(".safetensors")]
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    with manager(f"s3://{bucket}/mod", server, read_only=True) as mgr:
        manifest = Manifest.from_bytes(mgr._target.read_manifest(1), where="test")
        with pytest.raises(ChecksumMismatchError, match=r"checksum mismatch in bytes \[\d+, \d+\)"):
            run(plan_check(manifest, "test"), PreadTransport(mgr._target, 1))
        with pytest.raises(CheckpointCorruptError, match="checksum"):
            mgr.restore(1)


def test_an_object_shortened_after_the_checks_is_refused_as_ended_early(server, bucket):
    saved(server, bucket, "short")
    fs = s3fs.S3FileSystem(**server.options(), skip_instance_cache=True)
    [key] = [k for k in fs.find(f"{bucket}/short") if k.endswith(".safetensors")]
    with manager(f"s3://{bucket}/short", server, read_only=True) as mgr:
        manifest = Manifest.from_bytes(mgr._target.read_manifest(1), where="test")
        data = fs.cat_file(key)
        fs.pipe_file(key, data[:len(data) - 300_000])  # (after the manifest and sizes were read)
        with pytest.raises(CheckpointCorruptError, match=r"ended early, at byte \d+"):
            run(plan_check(manifest, "test"), PreadTransport(mgr._target, 1))


def test_slowdown_shrinks_the_window_reads_share_with_the_writer(server, bucket):
    s = saved(server, bucket, "slow")
    proxy = FaultyProxy(server.endpoint, latency_s=0.01, max_inflight=2)
    try:
        so = dict(server.options(), endpoint_url=proxy.endpoint)
        opts = S3Options(concurrency=12, base_delay_s=0.01, max_delay_s=0.2)
        with manager(f"s3://{bucket}/slow", server, so, s3_options=opts, read_only=True) as mgr:
            target = mgr._target
            manifest = Manifest.from_bytes(target.read_manifest(1), where="test")
            tuner = ReadTuner(target.window, start_inflight=12, start_range=128 << 10, min_range=128 << 10)
            run(plan_check(manifest, "test"), RangedTransport(target, 1, tuner=tuner))
            assert proxy.throttled > 0 and target.window.decreases > 0 and target.window.limit < 12
            assert tuner.bytes == manifest.files[next(iter(manifest.files))].size
            assert_tree_equal(mgr.restore(1), s)
    finally:
        proxy.close()


def test_a_restore_into_a_target_fetches_each_byte_once_and_changes_it_only_once_verified(server, bucket):
    s = saved(server, bucket, "into")
    proxy = FaultyProxy(server.endpoint)
    try:
        so = dict(server.options(), endpoint_url=proxy.endpoint)
        with manager(f"s3://{bucket}/into", server, so, read_only=True) as mgr:
            proxy.reset_counts()
            assert_tree_equal(mgr.restore(1), s)
            fresh = proxy.count("get")
            target = {k: torch.zeros_like(v) for k, v in s.items()}
            w = target["w"]
            proxy.reset_counts()
            mgr.restore(1, target=target)
            assert proxy.count("get") == fresh  # no second pass over the data to check it first
            assert target["w"] is w and torch.equal(w, s["w"])
        fs = s3fs.S3FileSystem(**server.options(), skip_instance_cache=True)
        [key] = [k for k in fs.find(f"{bucket}/into") if k.endswith(".safetensors")]
        data = bytearray(fs.cat_file(key))
        data[-10] ^= 0xFF  # (the last chunk: every other lands first)
        fs.pipe_file(key, bytes(data))
        with manager(f"s3://{bucket}/into", server, so, read_only=True) as mgr:
            target = {k: torch.zeros_like(v) for k, v in s.items()}
            with pytest.raises(CheckpointCorruptError, match="checksum"):
                mgr.restore(1, target=target)
            assert not target["w"].any() and not target["b"].any()  # unchanged
    finally:
        proxy.close()


def test_a_readers_restore_sends_one_list_and_no_head_before_its_ranges(server, bucket):
    """The set-up a restore pays on a store, one request after another: a read-only manager
    lists nothing when it opens (it saves nothing), the restore's discovery lists the steps
    once, and the data file's size comes from that listing (checked against the manifest as
    before), not from a HEAD. Then the manifest and the ranges: the data file's header comes with
    its first range (checked there, against the manifest), not in a request of its own."""
    s = saved(server, bucket, "setup")
    proxy = FaultyProxy(server.endpoint)
    try:
        so = dict(server.options(), endpoint_url=proxy.endpoint)
        proxy.reset_counts()
        with manager(f"s3://{bucket}/setup", server, so, read_only=True) as mgr:
            assert not any(proxy.counts.values()), dict(proxy.counts)  # opening sent no request
            assert_tree_equal(mgr.restore(), s)
        assert proxy.count("list") == 1 and proxy.count("head") == 0, dict(proxy.counts)
        data = [r for path, r in proxy.gets if path.endswith(".safetensors")]
        assert data and len([r for r in data if r is None or r.startswith("bytes=0-")]) == 1, data
        proxy.reset_counts()
        with manager(f"s3://{bucket}/setup", server, so, read_only=True) as mgr:
            assert_tree_equal(mgr.restore(1), s)  # a step named: nothing listed, so its size is asked
        assert proxy.count("head") == 1, dict(proxy.counts)
    finally:
        proxy.close()


def test_an_object_cut_short_after_the_listing_fails_the_restore_by_name(server, bucket):
    """The size a listing gave is as good as a HEAD's was: the object may change after either.
    A data object cut short between the listing and the reads fails the restore with an error
    that names it, and a target is left as it was."""
    s = saved(server, bucket, "cut")
    with manager(f"s3://{bucket}/cut", server, read_only=True) as mgr:
        assert mgr.steps() == [1]  # the listing, with the object's full size
        fs = s3fs.S3FileSystem(**server.options(), skip_instance_cache=True)
        [key] = [k for k in fs.find(f"{bucket}/cut") if k.endswith(".safetensors")]
        fs.pipe_file(key, fs.cat_file(key)[:-4096])
        target = {k: torch.zeros_like(v) for k, v in s.items()}
        with pytest.raises(CheckpointCorruptError, match=r"data-00000\.[0-9a-f]+\.safetensors ended early"):
            mgr.restore(1, target=target)
        assert not target["w"].any() and not target["b"].any()


@pytest.mark.parametrize("tokens", [True, False], ids=["claim-tokens", "plain-names"])
def test_a_step_saved_again_after_the_listing_restores_as_saved_again(server, bucket, tmp_path, tokens):
    """A step deleted and saved again under the same number after a reader listed it: with
    ckptmgr's writer its objects carry new claim tokens (new names); a step written without
    tokens (copied from a local root, or by a writer before tokens) keeps its names, whose
    size the listing therefore never answers. Either way the reader restores what is there."""
    fs = s3fs.S3FileSystem(**server.options(), skip_instance_cache=True)
    url, first, second = f"s3://{bucket}/again", state(100_000), state(200_000)

    def write(s: dict[str, torch.Tensor]) -> None:
        if tokens:
            with manager(url, server) as w:
                w.save(1, s).result(timeout=120)
            return
        local = tmp_path / f"local-{len(s['w'])}"
        with CheckpointManager(str(local), staging=StagingOptions(local_tier=False)) as w:
            w.save(1, s).result(timeout=120)
        for f in sorted(os.listdir(local / "step_000000000001")):  # as `aws s3 sync` would copy it
            fs.put_file(str(local / "step_000000000001" / f), f"{bucket}/again/step_000000000001/{f}")

    write(first)
    with manager(url, server, read_only=True) as reader:
        assert reader.steps() == [1]
        assert_tree_equal(reader.restore(1), first)
        fs.rm(f"{bucket}/again/step_000000000001", recursive=True)
        write(second)
        assert_tree_equal(reader.restore(1), second)  # named: nothing listed again


def test_verify_asks_the_store_for_each_size_however_recent_the_listing(server, bucket):
    """A verify walk (``ckptmgr verify`` lists first) may reach a step long after the listing:
    an object grown since is reported by its size, not passed by the listing's."""
    from ckptmgr.restore.verify import verify_step

    saved(server, bucket, "verify")
    with manager(f"s3://{bucket}/verify", server, read_only=True) as mgr:
        assert mgr.steps() == [1]
        fs = s3fs.S3FileSystem(**server.options(), skip_instance_cache=True)
        [key] = [k for k in fs.find(f"{bucket}/verify") if k.endswith(".safetensors")]
        fs.pipe_file(key, fs.cat_file(key) + b"\0" * 4096)
        report = verify_step(mgr._target, 1)
        assert not report.ok and any("the manifest records" in p for p in report.problems), report.problems


def test_a_header_that_disagrees_with_the_manifest_fails_a_restore_from_the_store_and_leaves_the_target(
        server, bucket, tmp_path):
    """A step whose data file's header says I32 where the manifest says F32 (sizes alike, the
    manifest re-signed over the new checksum, copied to the store as `aws s3 sync` would): the
    header, which comes with the first range, is checked there, and the restore fails naming
    the tensor, before anything reaches the target."""
    import crc32c
    from manifest_tools import rewrite

    local = tmp_path / "local"
    s = state(100_000)
    with CheckpointManager(str(local), staging=StagingOptions(local_tier=False)) as w:
        w.save(1, s).result(timeout=120)
    step = local / "step_000000000001"
    [f] = [n for n in os.listdir(step) if n.endswith(".safetensors")]
    raw = bytearray((step / f).read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    [key] = [k for k in header if k.endswith("b")]
    header[key]["dtype"] = "I32"  # same size as F32
    text = json.dumps(header, separators=(",", ":")).encode()
    raw[8:8 + n] = text + b" " * (n - len(text))
    (step / f).write_bytes(bytes(raw))

    def resign(m):
        rec = m["files"][f]
        size = rec["chunk_size"]
        rec["crc32c"] = [f"{crc32c.crc32c(bytes(raw[b:b + size])):08x}" for b in range(0, len(raw), size)]

    rewrite(str(local), 1, resign)
    fs = s3fs.S3FileSystem(**server.options(), skip_instance_cache=True)
    for name in sorted(os.listdir(step)):
        fs.put_file(str(step / name), f"{bucket}/forged/step_000000000001/{name}")
    with manager(f"s3://{bucket}/forged", server, read_only=True) as mgr:
        target = {k: torch.zeros_like(v) for k, v in s.items()}
        with pytest.raises(CheckpointCorruptError, match=r"its header entry .* differs"):
            mgr.restore(1, target=target)
        assert not target["w"].any() and not target["b"].any()
        with pytest.raises(CheckpointCorruptError, match=r"its header entry .* differs"):
            mgr.restore(1)


def _spans(gets: list[tuple[str, str | None]]) -> list[tuple[int, int]]:
    """The byte ranges [begin, end) of the data GETs (``bytes=a-b``)."""
    out = []
    for path, r in gets:
        if path.endswith(".safetensors") and r is not None and r.startswith("bytes="):
            a, b = r.removeprefix("bytes=").split("-")
            out.append((int(a), int(b) + 1))
    return sorted(out)


def test_a_device_restore_from_the_store_reads_by_ranges_each_byte_once_and_refuses_a_bad_chunk(server, bucket):
    """The loader a GPU restore takes (``loader="ring"``, here onto the CPU): the store's
    ranges, sized by its answers, cover the data file once, its header among them (no request
    of its own), each chunk verified as it lands; a corrupted chunk fails the restore by name."""
    s = saved(server, bucket, "device")
    proxy = FaultyProxy(server.endpoint)
    try:
        so = dict(server.options(), endpoint_url=proxy.endpoint)
        with manager(f"s3://{bucket}/device", server, so, read_only=True) as mgr:
            assert mgr.steps() == [1]
            m = Manifest.from_bytes(mgr._target.read_manifest(1), where="test")
            [rec] = m.files.values()
            proxy.reset_counts()
            assert_tree_equal(mgr.restore(1, device="cpu", loader="ring"), s)
            spans = _spans(proxy.gets)
            assert sum(e - b for b, e in spans) == rec.size and spans[0][0] == 0, spans
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), spans  # no byte twice
            assert len(spans) < len(rec.crc32c), spans  # ranges span chunks: fewer requests than chunks
        fs = s3fs.S3FileSystem(**server.options(), skip_instance_cache=True)
        [key] = [k for k in fs.find(f"{bucket}/device") if k.endswith(".safetensors")]
        data = bytearray(fs.cat_file(key))
        data[-10] ^= 0xFF
        fs.pipe_file(key, bytes(data))
        with manager(f"s3://{bucket}/device", server, read_only=True) as mgr, \
                pytest.raises(CheckpointCorruptError, match=r"checksum mismatch"):
            mgr.restore(1, device="cpu", loader="ring")
    finally:
        proxy.close()
