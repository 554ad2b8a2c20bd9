"""Several writers on one object-store root, fenced by their claims (issue 37, defects 1-3).

Real processes on real servers (moto and SeaweedFS on 127.0.0.1): a writer stalls itself with
SIGSTOP at an exact point (tests/fence_writer.py) and runs in a PID namespace of its own
(``unshare --pid``, as a second container would), so that the other writer can only judge it
by its heartbeat; the lease's stale time is shortened to 2 s. The test waits on the writers'
announcements (pipes) and their exits, never on a sleep; the only time that passes is the
stalled writer's claim going stale, which the other writer polls for (bounded).

1. A writer stalled past the stale time wakes up after another writer committed the step: its
   uploads go to its own keys, never over the committed objects, its save fails, and the step
   restores with the committer's bytes; one killed after waking leaves objects the next start
   removes.
2. A writer stalled between its commit check and its manifest write is not told durable=True
   for a step it does not own: its manifest is withdrawn (where the live writer's start-up
   removed its objects as a gone writer's) or replaced by the live writer's, and the live writer commits; with
   retention on, it deletes nothing.
3. A stalled writer's heartbeat cannot replace the live writer's lease, nor delete it: the
   live writer commits.
4. On a store without conditional writes, a writer whose claim was taken over after its
   manifest write withdraws that manifest for the writer that holds the claim.

tests/test_s3_fencing_committed.py tests that a step seen committed stays committed (and the
windows around a lease and a manifest) with this harness; tests/test_s3_fencing_soak.py runs
the two-writer soak. Scenarios marked ``one_server_in_ci`` run in CI on one server each, the
two servers in turn (tests/conftest.py); ``-m 'not cuda'`` runs each on both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

s3fs = pytest.importorskip("s3fs")
from s3_servers import S3Server, each_server  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WRITER = os.path.join(HERE, "fence_writer.py")
STALE_S = 2.0  # S3's LastModified has whole seconds: shorter would judge by rounding
WAIT_S = 120.0


def pidns_available() -> bool:
    if shutil.which("unshare") is None or shutil.which("sh") is None:
        return False
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "sh", "-c", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


PIDNS = pidns_available()
needs_pidns = pytest.mark.skipif(not PIDNS, reason="unshare --pid is not permitted here (needs CAP_SYS_ADMIN): "
                                 "a stalled writer in this PID namespace is judged alive by its pid, never stale")


@pytest.fixture(scope="module", params=["moto", "seaweedfs"])
def server(request):
    yield from each_server(request)


_counter = iter(range(10**9))


@pytest.fixture
def bucket(server: S3Server):
    name = f"fence-{os.getpid()}-{next(_counter)}"
    s3fs.S3FileSystem(**server.options()).mkdir(name)
    return name


class Writer:
    """A fence_writer.py process (in a PID namespace of its own with ``ns``), its stdout read
    by a thread into a queue; stopped, continued and killed as a process group."""

    def __init__(self, cfg: dict[str, Any], errlog: str, ns: bool) -> None:
        cmd = [sys.executable, WRITER, json.dumps(cfg)]
        if ns:  # sh is the namespace's init (pid 1), so the writer (pid 2) can stop itself
            cmd = ["unshare", "--pid", "--fork", "--", "sh", "-c", '"$@"; exit $?', "sh", *cmd]
        self._err = open(errlog, "w")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     text=True, start_new_session=True)
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.results: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def expect(self, event: str, timeout: float = WAIT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {event!r} from the writer in {timeout} s") from None
            if msg is None:
                raise AssertionError(f"the writer ended before {event!r} (exit {self.proc.wait()}); its saves: "
                                     f"{self.results}; its log: {self.stderr_tail()}")
            if msg.get("event") == "result":
                self.results.append(msg)
            if msg.get("event") == event:
                return msg

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = WAIT_S) -> list[dict[str, Any]]:
        assert self.proc.wait(timeout) == 0, f"writer exited {self.proc.returncode}"
        while (msg := self.lines.get(timeout=timeout)) is not None:
            if msg.get("event") == "result":
                self.results.append(msg)
        return self.results

    def stderr_tail(self) -> str:
        self._err.flush()
        with open(self._err.name) as f:
            return f.read()[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.signal(signal.SIGKILL)
            self.proc.wait(30)
        self._err.close()


@pytest.fixture
def writers(tmp_path):
    made: list[Writer] = []

    def make(cfg: dict[str, Any], ns: bool = False) -> Writer:
        w = Writer(cfg, str(tmp_path / f"writer-{len(made)}.err"), ns)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def config(server: S3Server, root: str, writer: int, **kw: Any) -> dict[str, Any]:
    return {"root": root, "so": server.options(), "part_size": max(server.min_part, 1 << 20), "stale_s": STALE_S,
            "writer": writer, "steps": [5], "n": 5000, "keep": 0, **kw}


def raw(server: S3Server):
    return s3fs.S3FileSystem(**server.options(), skip_instance_cache=True)


def step_keys(server: S3Server, bucket: str, prefix: str) -> list[str]:
    r = raw(server).call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"].rsplit("/", 1)[1] for o in r.get("Contents", []) if not o["Key"].endswith("/"))


def restored_writer(server: S3Server, root: str, step: int) -> int:
    """Which writer's state the step restores to, byte for byte (raises when it does not)."""
    import torch
    from fence_writer import state_of

    from ckptmgr import CheckpointManager, StagingOptions

    with CheckpointManager(root, storage_options=server.options(), staging=StagingOptions(local_tier=False),
                           read_only=True) as mgr:
        got = mgr.restore(step=step)
    want = state_of(step, got["writer"], got["w"].numel())
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"].view(torch.int16), want["b"].view(torch.int16))
    return int(got["writer"])


def manifest_files(server: S3Server, bucket: str, key: str) -> set[str]:
    return set(json.loads(raw(server).cat_file(f"{bucket}/{key}"))["files"])


def only_the_committed_objects_are_left(server: S3Server, bucket: str, prefix: str) -> None:
    files = manifest_files(server, bucket, prefix + "manifest.json")
    assert step_keys(server, bucket, prefix) == sorted([*files, "manifest.json"])


def _stalled_and_taken_over(server, bucket, writers, stop: str | list[str], gate: bool, large: bool = False):
    """Writer 1 (its own PID namespace) stalls at ``stop`` in its save of step 5; writer 2
    takes the step over once writer 1's claim is stale (and waits at its commit, with
    ``gate``). Returns both and the root."""
    root = f"s3://{bucket}/run"
    n = (server.min_part * 5 // 2) // 4 if large else 5000  # large: a multipart upload of 3 parts, else one PUT
    part = {"part_size": server.min_part} if large else {}
    stale = writers(config(server, root, 1, stop=stop, n=n, **part), ns=True)
    stale.expect("stopped")
    live = writers(config(server, root, 2, takeover=True, n=n, gate="commit" if gate else None, **part))
    return stale, live, root


def test_data_names_carry_a_claim_token_and_manifests_admit_exactly_that():
    from ckptmgr.format.naming import attempt_name, attempt_tag, is_our_file
    from ckptmgr.format.schema import DATA_FILE_RE

    tag = "0123456789abcdef"
    for plain in ("data-00000.safetensors", "data-r00003-00012.safetensors"):
        named = attempt_name(plain, tag)
        assert named == plain.replace(".safetensors", f".{tag}.safetensors")
        assert attempt_tag(named) == tag and attempt_tag(plain) is None
        assert is_our_file(named) and DATA_FILE_RE.fullmatch(named) and DATA_FILE_RE.fullmatch(plain)
    for bad in ("data-00000.0123456789ABCDEF.safetensors", "data-00000.0123456789abcde.safetensors",
                "data-00000.0123456789abcdef0.safetensors", "data-00000..safetensors", "data-00000.x/y.safetensors"):
        assert not is_our_file(bad) and not DATA_FILE_RE.fullmatch(bad) and attempt_tag(bad) is None, bad
    with pytest.raises(ValueError, match="no attempt name"):
        attempt_name(attempt_name("data-00000.safetensors", tag), tag)  # one token per name
    with pytest.raises(ValueError, match="no attempt name"):
        attempt_name("manifest.json", tag)


# ----------------------------------------------------------------------------- defect 1


@pytest.mark.one_server_in_ci
@needs_pidns
@pytest.mark.parametrize("large", [False, True], ids=["put", "multipart"])
def test_a_stale_writer_never_overwrites_a_committed_step(server, bucket, writers, large):
    stale, live, root = _stalled_and_taken_over(server, bucket, writers, "data", gate=False, large=large)
    [committed] = live.finish()
    assert committed["durable"] and committed["error"] is None, committed
    stale.signal(signal.SIGCONT)  # it wakes up and sends the upload it was about to send
    [late] = stale.finish()
    assert restored_writer(server, root, 5) == 2  # the committed bytes, never the stale writer's
    assert not late["durable"] and "taken over" in late["error"], late
    only_the_committed_objects_are_left(server, bucket, "run/step_000000000005/")  # its abort removed its own


@pytest.mark.one_server_in_ci
@needs_pidns
def test_a_stale_writer_killed_after_waking_leaves_objects_the_next_start_removes(server, bucket, writers):
    from ckptmgr import CheckpointManager, StagingOptions

    stale, live, root = _stalled_and_taken_over(server, bucket, writers, ["data", "after-data"], gate=False)
    [committed] = live.finish()
    assert committed["durable"], committed
    stale.signal(signal.SIGCONT)
    stale.expect("stopped")  # its upload is done (to its own key), and it stalls again
    stale.signal(signal.SIGKILL)
    stale.proc.wait(WAIT_S)
    assert restored_writer(server, root, 5) == 2  # its late upload went to its own key
    prefix = "run/step_000000000005/"
    files = manifest_files(server, bucket, prefix + "manifest.json")
    stray = set(step_keys(server, bucket, prefix)) - files - {"manifest.json"}
    assert any(re.fullmatch(r"data-00000\.[0-9a-f]{16}\.safetensors", k) for k in stray), stray
    assert restored_writer(server, root, 5) == 2
    with CheckpointManager(root, storage_options=server.options(), staging=StagingOptions(local_tier=False)) as mgr:
        assert mgr.steps() == [5]  # the start-up clean-up ran
    only_the_committed_objects_are_left(server, bucket, prefix)
    assert restored_writer(server, root, 5) == 2


# ----------------------------------------------------------------------------- defect 2


@pytest.mark.one_server_in_ci
@needs_pidns
def test_a_writer_stalled_before_its_manifest_write_is_never_told_durable(server, bucket, writers):
    stale, live, root = _stalled_and_taken_over(server, bucket, writers, "manifest", gate=True)
    live.expect("gate")  # the live writer has written its files and holds the claim
    stale.signal(signal.SIGCONT)  # it writes its manifest now, past its check
    [late] = stale.finish()
    live.go()
    [committed] = live.finish()
    assert committed["durable"] and committed["error"] is None, committed  # the live writer commits
    assert not late["durable"] and "taken over" in late["error"], late
    assert restored_writer(server, root, 5) == 2
    only_the_committed_objects_are_left(server, bucket, "run/step_000000000005/")


@pytest.mark.one_server_in_ci
@needs_pidns
def test_a_manifest_written_without_the_claim_is_replaced_by_the_live_writer(server, bucket, writers):
    stale, live, root = _stalled_and_taken_over(server, bucket, writers, ["manifest", "after-manifest"], gate=True)
    live.expect("gate")
    stale.signal(signal.SIGCONT)
    stale.expect("stopped")  # its manifest is written, and it stalls before its second renewal
    live.go()
    [committed] = live.finish()
    assert committed["durable"] and committed["error"] is None, committed
    assert restored_writer(server, root, 5) == 2
    stale.signal(signal.SIGCONT)  # it finds the claim gone; the manifest there is not its own to withdraw
    [late] = stale.finish()
    assert not late["durable"] and "taken over" in late["error"], late
    assert restored_writer(server, root, 5) == 2
    only_the_committed_objects_are_left(server, bucket, "run/step_000000000005/")


@pytest.mark.one_server_in_ci
@needs_pidns
def test_a_writer_stalled_before_its_manifest_write_runs_no_retention(server, bucket, writers):
    """The rest of defect 2: the stalled writer, with retention on (KeepLatest(1)), deletes
    nothing on the strength of a step it did not commit; the older step stays restorable."""
    from ckptmgr import CheckpointManager, StagingOptions

    root = f"s3://{bucket}/run"
    [older] = writers(config(server, root, 3, steps=[3])).finish()
    assert older["durable"], older
    stale = writers(config(server, root, 1, stop="manifest", keep=1), ns=True)
    stale.expect("stopped")
    live = writers(config(server, root, 2, takeover=True, gate="commit"))
    live.expect("gate")
    stale.signal(signal.SIGCONT)  # it writes its manifest now, past its check, then ends (retention included)
    [late] = stale.finish()
    live.go()
    [committed] = live.finish()
    with CheckpointManager(root, storage_options=server.options(), staging=StagingOptions(local_tier=False),
                           read_only=True) as mgr:
        assert mgr.steps() == [3, 5]
    assert restored_writer(server, root, 3) == 3
    assert not late["durable"] and "taken over" in late["error"], late
    assert committed["durable"] and committed["error"] is None, committed
    assert restored_writer(server, root, 5) == 2


# ------------------------------------------------------------ a step seen committed stays committed


def _until_stale(server: S3Server, bucket: str, key: str) -> None:
    """Poll (bounded) until the lease at ``key`` is older than the stale time, as a writer
    judges it (now less its listed LastModified)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        r = raw(server).call_s3("list_objects_v2", Bucket=bucket, Prefix=key)
        [lease] = r["Contents"]
        if time.time() - lease["LastModified"].timestamp() > STALE_S:
            return
        assert time.monotonic() < deadline, f"{key} did not go stale in {WAIT_S} s"
        time.sleep(0.1)


def _kept_then_claimed(server: S3Server, bucket: str, writers) -> tuple[Writer, dict[str, Any], str]:
    """Writer 2 starts on an empty root (its start-up clean-up done, so writer 1's objects stay)
    and waits; writer 1 stalls before its manifest write; writer 2 saves step 5, takes the
    claim over once writer 1's is stale, and waits at its commit; writer 1 wakes, writes its
    manifest, finds its claim gone and ends. Returns writer 2, writer 1's save and the root."""
    root = f"s3://{bucket}/run"
    live = writers(config(server, root, 2, takeover=True, gate=["save", "commit"]))
    live.expect("gate")
    stale = writers(config(server, root, 1, stop="manifest"), ns=True)
    stale.expect("stopped")
    live.go()
    live.expect("gate")  # it holds the claim, its files written
    stale.signal(signal.SIGCONT)
    [late] = stale.finish()
    return live, late, root


# ----------------------------------------------------------------------------- defect 3


@pytest.mark.one_server_in_ci
@needs_pidns
def test_a_stale_heartbeat_neither_steals_nor_deletes_the_live_lease(server, bucket, writers):
    stale, live, root = _stalled_and_taken_over(server, bucket, writers, "renewal", gate=True)
    live.expect("gate")  # the live writer holds the claim, its files written
    stale.signal(signal.SIGCONT)  # its heartbeat goes out first, then its save goes on and ends
    [late] = stale.finish()
    live.go()
    [committed] = live.finish()
    assert committed["durable"] and committed["error"] is None, committed  # not failed as "stalled"
    assert not late["durable"] and "taken over" in late["error"], late
    assert restored_writer(server, root, 5) == 2
    only_the_committed_objects_are_left(server, bucket, "run/step_000000000005/")


# ------------------------------------------------- stores without conditional writes


@pytest.fixture
def unconditional(server: S3Server):
    """The server behind a proxy that drops ``If-Match``: a store that ignores conditional
    writes on existing objects (moto only: SeaweedFS checks the signature, which covers it)."""
    if server.name != "moto":
        pytest.skip("dropping a signed header fails SeaweedFS's signature check; moto does not check them")
    from s3_proxy import FaultyProxy

    proxy = FaultyProxy(server.endpoint, drop_headers=("if-match",))
    yield dataclasses.replace(server, endpoint=proxy.endpoint)
    proxy.close()


def _fell_back(tmp_path) -> bool:
    return any("ignores conditional writes" in open(p).read() for p in tmp_path.glob("writer-*.err"))


@needs_pidns
def test_without_conditional_writes_a_committed_step_is_still_never_overwritten(unconditional, bucket, writers,
                                                                                tmp_path):
    stale, live, root = _stalled_and_taken_over(unconditional, bucket, writers, "data", gate=False)
    [committed] = live.finish()
    assert committed["durable"], committed
    stale.signal(signal.SIGCONT)
    [late] = stale.finish()
    assert not late["durable"], late
    assert _fell_back(tmp_path)  # each writer found that the store ignores If-Match, and said so
    assert restored_writer(unconditional, root, 5) == 2
    only_the_committed_objects_are_left(unconditional, bucket, "run/step_000000000005/")


@needs_pidns
def test_without_conditional_writes_a_stalled_manifest_writer_outside_the_window_is_fenced(unconditional, bucket,
                                                                                          writers, tmp_path):
    stale, live, root = _stalled_and_taken_over(unconditional, bucket, writers, "manifest", gate=True)
    live.expect("gate")
    stale.signal(signal.SIGCONT)
    [late] = stale.finish()
    live.go()
    [committed] = live.finish()
    assert _fell_back(tmp_path)
    assert not late["durable"] and committed["durable"], (late, committed)
    assert restored_writer(unconditional, root, 5) == 2


@needs_pidns
def test_without_conditional_writes_a_stalled_writer_withdraws_for_the_claim_holder(unconditional, bucket, writers,
                                                                                      tmp_path):
    """The claim holder cannot replace a manifest on such a store: the stalled writer, finding
    another writer's lease, withdraws its complete manifest rather than keep it."""
    live, late, root = _kept_then_claimed(unconditional, bucket, writers)
    assert not late["durable"] and "manifest was withdrawn" in late["error"], late
    assert "another writer holds the claim" in late["error"], late
    live.go()
    [committed] = live.finish()
    assert _fell_back(tmp_path)
    assert committed["durable"] and committed["error"] is None, committed
    assert restored_writer(unconditional, root, 5) == 2
    only_the_committed_objects_are_left(unconditional, bucket, "run/step_000000000005/")


# ----------------------------------------------- retention beside a writer of the same step


def test_deleting_a_step_leaves_a_new_claim_on_it_alone(server, bucket):
    """Retention deletes step 3 while another writer claims step 3 again between the manifest's
    removal and the objects' (each writer saves the same steps): the new claim's lease, objects
    and upload stay, and it commits."""
    import numpy as np

    from ckptmgr import CheckpointManager, StagingOptions, WriteOptions

    root = f"s3://{bucket}/del"
    so = server.options()
    with CheckpointManager(root, storage_options=so, staging=StagingOptions(local_tier=False),
                           write_options=WriteOptions(chunk_size=4096)) as mgr:
        import torch

        mgr.save(3, {"w": torch.arange(4096, dtype=torch.float32)}).result()
        t = mgr._target
        real_remove = t.remove
        claimed = []

        def remove(rels):
            real_remove(rels)
            if rels and rels[0].endswith("manifest.json") and not claimed:  # the step is gone: claim it again
                w = t.begin(3)
                w.write_files([("data-00000.safetensors", np.frombuffer(b"x" * 8192, dtype=np.uint8))], 4096,
                              checksum=False)
                claimed.append(w)

        t.remove = remove
        t.delete(3)
        t.remove = real_remove
        [w] = claimed
        left = step_keys(server, bucket, "del/step_000000000003/")
        assert "writer.lease" in left and any(k.startswith("data-00000.") for k in left), left
        w.strategy.check({w.strategy.object_name("data-00000.safetensors"): 8192})  # its object is whole
        w.close()
