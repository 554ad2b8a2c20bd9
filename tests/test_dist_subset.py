"""A manager created on some ranks of a torch.distributed job only: it fails within the join
window with a message naming the missing ranks (not after the coordination timeout), a rank
arriving after that fails too, and a group of those ranks (the documented way) works."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

# One rank. argv: SCENARIO ROOT OUT_JSON. Rank 1 never creates a manager in "subset"; it
# creates one only after rank 0 has given up in "late"; in "group" rank 0 passes a group of
# itself, made on every rank.
WORKER = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
import ckptmgr.distributed.coordinator as coordinator
from ckptmgr import CheckpointManager, ConfigError

scenario, root, out = sys.argv[1:4]
coordinator.JOIN_TIMEOUT_S = 3.0
dist.init_process_group("gloo")
rank = dist.get_rank()
report = {"rank": rank}
given_up = root + ".rank0-gave-up"

def make(**kw):
    try:
        with CheckpointManager(root, coordination_timeout=600, **kw) as mgr:
            mgr.save(1, {"w": torch.ones(3)}).result()
            report["steps"] = mgr.steps()
    except ConfigError as exc:
        report["error"] = str(exc)

if scenario == "group":
    group = dist.new_group([0])  # on every rank
    if rank == 0:
        make(process_group=group)
elif rank == 0:
    make()
    open(given_up, "w").close()
elif scenario == "late":
    deadline = time.monotonic() + 60
    while not os.path.exists(given_up) and time.monotonic() < deadline:
        time.sleep(0.05)
    make()
else:  # subset: rank 1 goes on with its own work and never makes a manager
    deadline = time.monotonic() + 60
    while not os.path.exists(given_up) and time.monotonic() < deadline:
        time.sleep(0.05)
with open(out, "w") as f:
    json.dump(report, f)
"""


def launch(tmp_path, scenario: str) -> list[dict]:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = str(tmp_path / "ckpt")
    procs, outs = [], []
    for r in range(2):
        out = tmp_path / f"{scenario}-{r}.json"
        outs.append(out)
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONWARNINGS": "ignore"}
        procs.append(subprocess.Popen([sys.executable, str(worker), scenario, root, str(out)], env=env))
    try:
        rcs = [p.wait(timeout=120) for p in procs]  # the coordination timeout is 600 s: a hang fails here
    finally:
        for p in procs:
            p.kill()
    assert rcs == [0, 0]
    return [json.loads(o.read_text()) for o in outs]


def test_a_manager_on_rank_0_only_fails_within_the_join_window(tmp_path):
    r0, r1 = launch(tmp_path, "subset")
    assert "steps" not in r0 and "error" not in r1
    err = r0["error"]
    assert "ranks [1]" in err and "within 3 s" in err and "process_group=" in err and "new_group([0])" in err


def test_a_rank_arriving_after_the_window_fails_too(tmp_path):
    r0, r1 = launch(tmp_path, "late")
    assert "ranks [1]" in r0["error"]
    assert "stopped waiting for it: it came more than 3 s after the first" in r1["error"]


@pytest.mark.parametrize("scenario", ["group"])
def test_a_group_of_the_ranks_that_use_it_works(tmp_path, scenario):
    r0, r1 = launch(tmp_path, scenario)
    assert r0.get("steps") == [1], r0
    assert r1 == {"rank": 1}
