"""Start one process per rank of a gloo job (CPU) and collect each rank's JSON report."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def launch(script: str, scenario: str, root: str, out_dir: Path, world: int, *, timeout_s: float = 60.0,
           wait_s: float = 240.0) -> tuple[list[int], list[dict]]:
    """Run ``script SCENARIO ROOT OUT_JSON`` as ranks 0..world-1; return their exit codes and reports
    (``{}`` for a rank that wrote none)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, outs = [], []
    for r in range(world):
        out = out_dir / f"{scenario}-{world}-{r}.json"
        out.unlink(missing_ok=True)
        outs.append(out)
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "CKPT_TIMEOUT": str(timeout_s), "PYTHONWARNINGS": "ignore",
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, script, scenario, root, str(out)], env=env))
    try:
        rcs = [p.wait(timeout=wait_s) for p in procs]
    finally:
        for p in procs:  # a rank stuck after a peer failed: ours to stop
            if p.poll() is None:
                p.kill()
                p.wait()
    return rcs, [json.loads(o.read_text()) if o.exists() else {} for o in outs]
