"""A second process on a local root, for tests/test_local_roots.py.

    python local_root_worker.py hold ROOT STEP
        Saves STEP (state_of(STEP, "held")) with a manager whose durable write stops at its
        first data file: prints "writing" once the step is claimed and its first file is
        about to be written, then waits for a line on stdin (the gate) before it goes on.
        Prints a JSON summary last: {"committed": bool, "error": str}.

    python local_root_worker.py nobody ROOT
        Everything imported first, then, when run as root, drops to uid/gid 65534 (nobody:
        root bypasses file permissions, nobody does not); then opens ROOT read-write and
        read-only, lists, restores every step it lists and runs `ckptmgr ls ROOT`. Prints a
        JSON summary last.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import pkgutil
import sys
from contextlib import redirect_stderr, redirect_stdout

import torch

from ckptmgr import CheckpointManager, StagingOptions
from ckptmgr.cli import main as cli_main
from ckptmgr.storage import local

NOBODY = 65534


def state_of(step: int, who: str) -> dict:
    g = torch.Generator().manual_seed(step * 1000 + sum(map(ord, who)))
    return {"w": torch.randn(5000, generator=g), "step": step, "who": who}


def hold(root: str, step: int) -> None:
    real = local._LocalStepWriter._write_file
    held = []

    def gated(self, *args, **kw):  # the real writer, stopped once at the window
        if not held:
            held.append(True)
            print("writing", flush=True)
            if not sys.stdin.readline():
                raise SystemExit("gate closed")
        return real(self, *args, **kw)

    local._LocalStepWriter._write_file = gated  # type: ignore[method-assign]
    out = {"committed": False, "error": ""}
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        try:
            mgr.save(step, state_of(step, "held")).result(timeout=120)
            out["committed"] = True
        except Exception as exc:  # reported to the test
            out["error"] = f"{type(exc).__name__}: {exc} <- {exc.__cause__!r}"
    print(json.dumps(out), flush=True)


def import_all() -> None:
    """Import every module of the package now: the environment may sit in a directory only root
    reads (a CI's private temporary directory), and the package imports some modules lazily."""
    import ckptmgr

    for m in pkgutil.walk_packages(ckptmgr.__path__, "ckptmgr."):
        if m.name.startswith("ckptmgr.integrations") or m.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(m.name)
        except ImportError:  # (an optional dependency this machine lacks: not on these paths)
            pass


def nobody(root: str) -> None:
    import_all()
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    out: dict = {"uid": os.geteuid()}
    for ro in (False, True):
        with CheckpointManager(root, staging=StagingOptions(local_tier=False), read_only=ro) as mgr:
            steps = mgr.steps()
            mgr.steps()  # a second listing: the warning is not repeated
            restored = {}
            for s in steps:
                got = mgr.restore(s)
                restored[s] = bool(torch.equal(got["w"], state_of(s, "main")["w"]))
            latest = mgr.restore()["step"]
            out["ro" if ro else "rw"] = {"steps": steps, "restored": restored, "latest": latest,
                                         "skipped": mgr.skipped_steps(), "stats": mgr.stats()["skipped_steps"]}
    so, se = io.StringIO(), io.StringIO()
    with redirect_stdout(so), redirect_stderr(se):
        code = cli_main(["ls", "--json", root])
    out["ls"] = {"code": code, "stdout": so.getvalue(), "stderr": se.getvalue()}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        hold(sys.argv[2], int(sys.argv[3]))
    else:
        nobody(sys.argv[2])
