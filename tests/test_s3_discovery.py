"""Multi-rank discovery on S3: rank 0 lists and the other ranks receive the result, for every
listing (start-up clean-up included), so N ranks make O(1) LISTs per call. Four gloo ranks
against moto behind a proxy that counts requests by kind."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import zygote

pytest.importorskip("s3fs")
from s3_proxy import FaultyProxy

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "s3_rank_worker.py")
WORLD = 4
# LISTs (ListObjectsV2 and ListMultipartUploads) that one call may make, whatever the ranks
BOUNDS = {
    "start-up": 3,  # incomplete uploads and leftovers (clean-up), then the committed steps
    "steps": 1,
    "save": 3,  # rank 0: is the step committed; the commit's check of its objects; retention's listing
    "save+retention": 3 + 2,  # the same, and the deletion of a step: its objects and its uploads
    "latest_step": 1,
    "restore": 1,
    "apply_retention": 1,
    "steps-again": 1,
    "close": 0,
}


def test_n_ranks_make_o1_lists_per_call(s3_bucket, s3_endpoint, tmp_path):
    bucket, so = s3_bucket
    proxy = FaultyProxy(s3_endpoint)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        opts = json.dumps({**so, "endpoint_url": proxy.endpoint})
        outs = [tmp_path / f"rank{r}.json" for r in range(WORLD)]
        procs = [zygote.Popen(
            [sys.executable, WORKER, f"s3://{bucket}/job", opts, str(outs[r])], template="torch",
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "PYTHONWARNINGS": "ignore"}) for r in range(WORLD)]
        assert [p.wait(timeout=300) for p in procs] == [0] * WORLD
        journal = list(proxy.journal)
    finally:
        proxy.close()
    reports = [json.loads(o.read_text()) for o in outs]
    assert all(r["steps"] == [] and r["latest"] == 2 and r["restored_step"] == 2 and r["final"] == [2]
               for r in reports)
    assert [r["mine"] for r in reports] == [[float(r)] * 4 for r in range(WORLD)]
    windows = reports[0]["windows"]
    lists = {name: sum(1 for t, kind in journal if kind == "list" and b <= t <= e)
             for name, (b, e) in windows.items()}
    over = {name: n for name, n in lists.items() if n > BOUNDS[name]}
    assert not over, f"LISTs per call at {WORLD} ranks: {lists} (bounds {BOUNDS})"
