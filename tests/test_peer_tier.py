"""The peer tier: 4 real processes on gloo as 2 "nodes" (each its own RAM directory and node
identity), replication on (tests/peer_worker.py). A node is lost (its processes SIGKILLed,
its RAM directory deleted), the job restarts with a fresh node in its place and the ranks in
another order, and every rank resumes from the newest replicated step, bit-exact, without the
durable target (its data files are zeroed: any read of them fails its checksums)."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import peer_worker
import pytest
import torch
import zygote

from ckptmgr import ConfigError, PeerOptions
from ckptmgr.distributed.replicate import peers_of
from ckptmgr.storage.peer_tier import PeerArea
from ckptmgr.storage.tier import tier_dir

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_worker.py")
WORLD = 4


def _start(scenario: str, root: str, out: Path, layout: list[str], nodes: Path,
           env_extra: dict[str, str] | None = None) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r, node in enumerate(layout):
        (nodes / node).mkdir(exist_ok=True)
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(len(layout)), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "CKPT_TIMEOUT": "60", "OMP_NUM_THREADS": "1", "CKPTMGR_NODE": node,
               "NODE_DIR": str(nodes / node), **(env_extra or {})}
        with open(out / f"{scenario}-{r}.stderr", "w") as err:
            procs.append(zygote.Popen([sys.executable, WORKER, scenario, root, str(out / f"{scenario}-{r}.json")],
                                      template="torch", env=env, stdout=subprocess.PIPE, stderr=err, text=True))
    return procs


def _reports(scenario: str, out: Path, world: int = WORLD) -> list[dict]:
    for r in range(world):
        sys.stderr.write((out / f"{scenario}-{r}.stderr").read_text())
    return [json.loads((out / f"{scenario}-{r}.json").read_text()) for r in range(world)]


def _await_ready(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Block until every process printed "ready" (or one exited, or the time is up)."""
    sel = selectors.DefaultSelector()
    for p in procs:
        assert p.stdout is not None
        sel.register(p.stdout, selectors.EVENT_READ, p)
    waiting = set(procs)
    deadline = time.monotonic() + timeout_s
    while waiting:
        left = deadline - time.monotonic()
        assert left > 0, "the workers did not all get ready"
        for key, _ in sel.select(left):
            line = key.fileobj.readline()  # type: ignore[union-attr]
            assert line == "ready\n", f"a worker ended early (said {line!r})"
            waiting.discard(key.data)
            sel.unregister(key.fileobj)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)


def _run(scenario: str, root: str, out: Path, layout: list[str], nodes: Path, *, timeout: float = 240,
         env_extra: dict[str, str] | None = None) -> list[dict]:
    """Run ``scenario`` on the ranks of ``layout`` to their end; their reports (each exited
    cleanly: gloo may abort at exit, after the report)."""
    procs = _start(scenario, root, out, layout, nodes, env_extra)
    try:
        rcs = [p.wait(timeout=timeout) for p in procs]
    finally:
        _kill(procs)
    reports = _reports(scenario, out, len(layout))
    assert all(rc in (0, -6) for rc in rcs), rcs
    return reports


def _resume(tmp: Path, root: str, layout: list[str]) -> list[dict]:
    out = tmp / "resume"
    out.mkdir()
    return _run("resume", root, out, layout, tmp / "nodes")


def _train(base: Path, layout: list[str]) -> Path:
    """The nodes of ``layout`` trained to step 6, every step replicated; then every process
    is SIGKILLed, the last node's first (it is the node lost; the job restarts). Returns a
    folder with the root and the nodes' RAM directories, copied by each test before it
    changes them."""
    root = str(base / "ckpt")
    (base / "nodes").mkdir()
    out = base / "train"
    out.mkdir()
    procs = _start("train", root, out, layout, base / "nodes")
    try:
        _await_ready(procs, 240)
        _kill([p for p, node in zip(procs, layout, strict=True) if node == layout[-1]])
    finally:
        _kill(procs)
    shutil.copytree(root, base / "pristine")
    reports = _reports("train", out, len(layout))
    for r in reports:
        assert r["stats"]["peer_replicated_step"] == 6 and r["stats"]["peer_replicas"] == 1
        assert r["steps"] == [2, 4, 6] and r["stats"]["peer_failed"] == 0
        assert r["stats"]["peer_bytes_sent"] > 0 and r["stats"]["peer_bad_copies"] == 0
    return base


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Nodes A (ranks 0, 1) and B (ranks 2, 3)."""
    return _train(tmp_path_factory.mktemp("trained"), ["A", "A", "B", "B"])


@pytest.fixture(scope="module")
def trained_pair(tmp_path_factory) -> Path:
    """Nodes A (rank 0) and B (rank 1)."""
    return _train(tmp_path_factory.mktemp("trained_pair"), ["A", "B"])


def _setup(trained: Path, tmp: Path, *, lose: tuple[str, ...], zero_durable: bool) -> str:
    shutil.copytree(trained / "nodes", tmp / "nodes", symlinks=True)
    for node in lose:  # the node is gone, and its RAM with it
        shutil.rmtree(tmp / "nodes" / node)
    root = str(trained / "ckpt")  # the same root URL: the RAM directories are keyed by it
    shutil.rmtree(root)
    shutil.copytree(trained / "pristine", root)
    if zero_durable:  # any read of the durable target's data fails its checksums
        for dirpath, _, files in os.walk(root):
            for f in files:
                if f.endswith(".safetensors"):
                    p = os.path.join(dirpath, f)
                    size = os.path.getsize(p)
                    with open(p, "r+b") as fh:
                        fh.write(b"\0" * size)
    return root


def _area(tmp: Path, node: str, root: str) -> PeerArea:
    return PeerArea(str(tmp / "nodes" / node), root)


def test_a_lost_node_of_two_is_restored_from_its_peer_without_the_durable_target(trained_pair, tmp_path):
    """The fast variant of the next test: one rank per node."""
    root = _setup(trained_pair, tmp_path, lose=("B",), zero_durable=True)
    reports = _resume(tmp_path, root, ["C", "A"])  # the fresh node C takes rank 0; A's process runs rank 1
    for r in reports:
        assert r["before"] == 6  # node A's RAM holds both shards of step 6: listed at start-up
        assert r["restored"] == 6 and not r["warnings"], r["warnings"]
        assert r["restored_digest"] == peer_worker.reference(r["rank"], 6)
        assert r["digest"] == peer_worker.reference(r["rank"])
    assert [r["stats"].get("peer_restore_peer", 0) for r in reports] == [1, 0]
    assert [r["stats"].get("peer_restore_own", 0) for r in reports] == [0, 1]
    # the fetch ran on the job's own group, not the peer tier's (which moved nothing: no round yet)
    for r in reports:
        assert any("fetched over the job's process group (gloo)" in m for m in r["said"]), r["said"]
        assert r["stats"]["peer_bytes_sent"] == 0 and r["stats"]["peer_bytes_received"] == 0
    assert reports[0]["stats"]["peer_fetch_bytes_received"] > 0
    assert reports[1]["stats"]["peer_fetch_bytes_sent"] == reports[0]["stats"]["peer_fetch_bytes_received"]
    # rank 0's shard landed in memory, verified there, and its tensors were moved from it into the
    # target: not written into node C's RAM tier (which holds only what was saved after), nor read again
    assert any("fetched onto cpu and verified there" in m for m in reports[0]["said"]), reports[0]["said"]
    assert {c.record.step for c in _area(tmp_path, "C", root).copies()} == {8}


@pytest.mark.slow  # (two launches of 4 processes: over a minute on 2 cores)
def test_a_lost_node_is_restored_from_peers_bit_exact_without_the_durable_target(trained, tmp_path):
    root = _setup(trained, tmp_path, lose=("B",), zero_durable=True)
    # the fresh node C takes ranks 0 and 1; node A's processes now run ranks 2 and 3
    reports = _resume(tmp_path, root, ["C", "C", "A", "A"])
    for r in reports:
        rank = r["rank"]
        assert r["restored"] == 6, r["warnings"]
        assert r["restored_digest"] == peer_worker.reference(rank, 6)
        assert r["digest"] == peer_worker.reference(rank)  # resumed to the end: as if never interrupted
        assert not r["warnings"], r["warnings"]
    # ranks 0 and 1 (on the new node) got their shards from node A; ranks 2 and 3 found theirs on A already
    assert [r["stats"].get("peer_restore_peer", 0) for r in reports] == [1, 1, 0, 0]
    assert [r["stats"].get("peer_restore_own", 0) for r in reports] == [0, 0, 1, 1]
    # the shards fetched landed in memory, not in the new node's RAM tier; the next save (step 8)
    # is held there again, its own ranks' and, as replicas, node A's
    held = {(c.rank, c.record.step) for c in _area(tmp_path, "C", root).copies()}
    assert {(0, 8), (1, 8), (2, 8), (3, 8)} <= held and not {(0, 6), (1, 6)} & held
    assert all(r["after"]["peer_replicated_step"] == 8 for r in reports)


@pytest.mark.slow
def test_a_corrupted_replica_falls_back_to_another_copy(trained, tmp_path):
    root = _setup(trained, tmp_path, lose=(), zero_durable=True)
    area = _area(tmp_path, "A", root)
    bad = next(c for c in area.copies() if c.rank == 2 and c.record.step == 6)  # A's replica of rank 2's shard
    with open(area.path_of(bad, next(iter(bad.record.manifest.files))), "r+b") as f:
        f.seek(5000)
        f.write(b"\xff\xfe")
    # rank 2 runs on a fresh node: it asks node A first (the lowest rank's node), then node B
    reports = _resume(tmp_path, root, ["A", "B", "C", "C"])
    for r in reports:
        assert r["restored"] == 6 and r["digest"] == peer_worker.reference(r["rank"])
    assert any("fails its check" in s for s in reports[2]["said"]), reports[2]["said"]
    assert reports[2]["stats"]["peer_bad_copies"] == 1 and reports[2]["stats"]["peer_restore_peer"] == 1


def test_a_corrupted_last_copy_is_read_from_the_durable_target_saying_why(trained_pair, tmp_path):
    root = _setup(trained_pair, tmp_path, lose=("B",), zero_durable=False)
    area = _area(tmp_path, "A", root)
    bad = next(c for c in area.copies() if c.rank == 1 and c.record.step == 6)  # the only copy left
    with open(area.path_of(bad, next(iter(bad.record.manifest.files))), "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    reports = _resume(tmp_path, root, ["A", "C"])
    for r in reports:
        assert r["restored"] == 6 and r["digest"] == peer_worker.reference(r["rank"])
    assert [r["stats"].get("peer_restore_durable", 0) for r in reports] == [0, 1]
    assert any("read from the durable target" in w and "the copy on node A fails its check" in w
               for w in reports[1]["warnings"]), reports[1]["warnings"]


def test_losing_more_nodes_than_replicas_restores_from_the_durable_target_saying_why(trained_pair, tmp_path):
    root = _setup(trained_pair, tmp_path, lose=("A", "B"), zero_durable=False)
    reports = _resume(tmp_path, root, ["C", "D"])
    for r in reports:
        assert r["before"] == -1  # nothing in RAM
        assert r["restored"] == 6 and r["digest"] == peer_worker.reference(r["rank"])
        assert any("no node's RAM holds a shard of step 6" in w for w in r["warnings"]), r["warnings"]


def test_replication_rounds_run_beside_a_ddp_training_loop_without_touching_its_collectives(tmp_path):
    """DDP over gloo with the peer tier on, saving every second step without blocking: the
    rounds run on their own group while the training thread all-reduces; a round that ran a
    collective on the job's group would pair with the wrong call and stall or corrupt it."""
    (tmp_path / "out").mkdir()
    (tmp_path / "nodes").mkdir()
    reports = _run("ddp", str(tmp_path / "ckpt"), tmp_path / "out", ["A", "B"], tmp_path / "nodes")
    assert reports[0]["digest"] == reports[1]["digest"]  # DDP kept the replicas equal
    for r in reports:
        assert r["committed"] == [2, 4, 6, 8, 10, 12] and r["steps"] == [2, 4, 6, 8, 10, 12]
        assert r["stats"]["peer_failed"] == 0 and r["stats"]["peer_replicated_step"] == 12
        assert r["stats"]["peer_rounds"] == 6 and r["stats"]["peer_bytes_sent"] > 0


def test_the_nccl_transport_is_refused_naming_the_deadlock():
    with pytest.raises(ConfigError, match="deadlock"):
        PeerOptions(transport="nccl")


def test_peers_are_on_other_nodes():
    dests, why = peers_of(["a", "a", "b", "b"], 1)
    assert dests == {0: [2], 1: [3], 2: [0], 3: [1]} and why == ""
    dests, why = peers_of(["a", "b", "c", "a", "b", "c"], 2)
    for r, ds in dests.items():
        assert len(ds) == 2 and all(["a", "b", "c", "a", "b", "c"][d] != ["a", "b", "c", "a", "b", "c"][r] for d in ds)
    dests, why = peers_of(["a", "a", "b"], 3)  # 2 nodes hold at most 1 replica off-node
    assert all(len(ds) == 1 for ds in dests.values()) and "at most 1" in why


def test_ls_says_which_steps_this_nodes_peer_tier_holds(trained_pair, tmp_path):
    root = _setup(trained_pair, tmp_path, lose=("B",), zero_durable=False)
    shutil.rmtree(os.path.join(root, "step_000000000006"))  # step 6 is now in RAM only
    p = subprocess.run([sys.executable, "-m", "ckptmgr", "ls", root, "--local-dir", str(tmp_path / "nodes" / "A"),
                        "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = {r["step"]: r for r in json.loads(p.stdout)["steps"]}
    assert rows[6]["tier"] == "peer" and rows[6]["peer"] == {"ranks": [0, 1], "world_size": 2}
    for step in (2, 4):  # (which older copies stay in the 2 slots per shard depends on how rounds coalesced)
        assert rows[step]["tier"] in ("durable", "durable+peer")
        assert ("peer" in rows[step]) == rows[step]["tier"].endswith("peer")


def test_a_node_whose_ram_directory_is_not_private_stops_every_rank_at_start(tmp_path):
    root = str(tmp_path / "ckpt")
    (tmp_path / "nodes" / "B").mkdir(parents=True)
    planted = tier_dir(str(tmp_path / "nodes" / "B"), root)
    os.mkdir(planted, 0o755)  # someone else's (or a careless) directory where node B's would be
    os.chmod(planted, 0o755)
    out = tmp_path / "start"
    out.mkdir()
    reports = _run("start", root, out, ["A", "B"], tmp_path / "nodes")
    for r in reports:  # both ranks raise (rank 0's directory is fine), naming the node and why
        assert "rank 1 (node B)" in r["error"] and "mode 755" in r["error"], r


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                         reason="needs 2 CUDA GPUs")])])
def test_the_restore_transport_runs_on_the_job_group_and_keeps_the_untrusted_input_rules(tmp_path, backend):
    """The restore's fetch transport (the job's group: gloo, or NCCL through GPU memory) in 2
    real processes: arrays cut into several segments both ways land bit-exact, also arrays of
    different sizes in one exchange through segments of several sizes (on CUDA with every
    copy method and a split host copy); through a
    ShardMover on it, an oversized header is refused before any allocation, a record the
    receiver must refuse is drained, a copy failing its checksums is not kept, a good copy
    is, and a transfer that fails once its slot is taken gives that slot back, emptied."""
    (tmp_path / "out").mkdir()
    (tmp_path / "nodes").mkdir()
    reports = _run("exchange", str(tmp_path / "ckpt"), tmp_path / "out", ["A", "B"], tmp_path / "nodes",
                   timeout=120, env_extra={"PEER_BACKEND": backend})
    for r in reports:
        if backend == "gloo":
            assert r["why"] == "the job's process group (gloo)" and r["device"] == "cpu" and r["staging_bytes"] == 0
        else:  # two halves x (one send + one receive) x 4 KiB segments, no more
            assert r["why"] == "the job's process group (NCCL, through GPU memory)"
            assert r["device"] == f"cuda:{r['rank']}" and 0 < r["staging_bytes"] <= 2 * 2 * 4096
        assert r["job_group"] and r["segments_exact"]
        assert len(r["grid"]) == 4 * (3 if backend == "nccl" else 1) and all(ok for *_, ok in r["grid"]), r["grid"]
    got = reports[1]
    assert "announced a shard record of" in got["oversized"]
    assert got["kept"] == [[None, False], ["A", False], ["A", True]]  # refused (drained), bad checksum, kept
    assert got["copies"] == [[0, 6]] and got["copy_exact"]
    assert got["stats"]["peer_bad_copies"] == 1
    assert got["stats"]["peer_bytes_received"] == 3 * 50_000  # the drained bytes too, all of them consumed
    # a transfer failing after its slot was taken (here: the checks' threads are shut down) gives the slot back
    assert "shutdown" in got["closed_io"] and got["slot_after_failure"]
