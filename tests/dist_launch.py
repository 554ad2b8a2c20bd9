"""Start one process per rank of a gloo job (CPU) and collect each rank's JSON report."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import zygote


def launch(script: str, scenario: str, root: str, out_dir: Path, world: int, *, timeout_s: float = 60.0,
           wait_s: float = 240.0) -> tuple[list[int], list[dict]]:
    """Run ``script SCENARIO ROOT OUT_JSON`` as ranks 0..world-1; return their exit codes and reports
    (``{}`` for a rank that wrote none)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, outs, errs = [], [], []
    for r in range(world):
        out = out_dir / f"{scenario}-{world}-{r}.json"
        out.unlink(missing_ok=True)
        outs.append(out)
        errs.append(out_dir / f"{scenario}-{world}-{r}.stderr")
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "CKPT_TIMEOUT": str(timeout_s), "PYTHONWARNINGS": "ignore",
               "OMP_NUM_THREADS": "1"}
        with open(errs[-1], "w") as err:
            procs.append(zygote.Popen([sys.executable, script, scenario, root, str(out)], template="torch", env=env,
                                      stderr=err))
    try:
        rcs = [p.wait(timeout=wait_s) for p in procs]
    finally:
        for p in procs:  # a rank stuck after a peer failed: ours to stop
            if p.poll() is None:
                p.kill()
                p.wait()
    for err in errs:
        sys.stderr.write(err.read_text())
    rcs = [_exit_after_report(rc, out, err) for rc, out, err in zip(rcs, outs, errs, strict=True)]
    return rcs, [json.loads(o.read_text()) if o.exists() else {} for o in outs]


def _exit_after_report(rc: int, out: Path, err: Path) -> int:
    """0 for a rank that wrote its report, raised nothing, and was then aborted by gloo at
    interpreter exit (torch 2.13's gloo sometimes does: "terminate called without an active
    exception", SIGABRT, after all work is done); else ``rc``."""
    text = err.read_text()
    if (rc == -6 and out.exists() and "Traceback" not in text
            and text.rstrip().endswith("terminate called without an active exception")):
        return 0
    return rc
