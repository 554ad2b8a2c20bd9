"""A writer process for the fencing tests (tests/test_s3_fencing*.py): saves steps to an S3
root with the lease's stale time shortened, and can stall itself at an exact point.

    python fence_writer.py CONFIG_JSON

CONFIG: ``root``, ``so`` (storage options), ``part_size``, ``stale_s``, ``writer`` (an id
the state carries), ``steps`` (saved in order), ``n`` (floats per state), ``keep`` (KeepLatest,
0: none), ``stop`` (a list of: ``data``: before the first data upload; ``after-data``: once
it is done; ``manifest``: before the manifest write; ``after-manifest``: once it is written;
``renewal``: at the first lease renewal, with the data upload held until that renewal is done;
``replace``: before the request that replaces a manifest at the commit (a conditional PUT or
DELETE); ``after-replace``: once it is done),
``gate`` (one or a list of: ``commit``: print ``gate`` and wait for a line on stdin before
the commit; ``save``: the same once the manager has started (its start-up clean-up done),
before the first save),
``takeover`` (retry a save refused because another writer holds the step, until its claim is
stale), ``verify`` (restore each step saved durably, at once), ``log`` (a file for one JSON
line per save).

A stall is ``SIGSTOP`` to the stalling thread (the whole process stops before that thread
goes on), announced first by the line ``stopped`` on stdout; the test continues it with
``SIGCONT``. Every save's outcome is one JSON line on stdout (``result``)
and in ``log``. Exits 0 whatever the saves did.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import torch

from ckptmgr import CheckpointManager, KeepLatest, S3Options, StagingOptions, StepNotFoundError, WriteOptions
from ckptmgr.storage import s3 as s3mod
from ckptmgr.storage.commit import manifest_last as objmod
from ckptmgr.storage.fsspec import FsspecTarget


def state_of(step: int, writer: int, n: int) -> dict:
    g = torch.Generator().manual_seed(step * 1000 + writer)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(64, generator=g).bfloat16(), "step": step,
            "writer": writer}


def say(**kw: object) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def stall(where: str) -> None:
    """Announce the stall, then stop the whole process before this thread goes on.

    The stop goes to this thread (``pthread_kill``), not to the process (``kill``): a stop
    sent to the process is taken by whichever thread the kernel picks (the main thread,
    blocked in ``result()``), and until that thread runs, this one goes on and can send the
    very request the stall is meant to hold back (measured: thousands of system calls on a
    loaded machine). A stop sent to this thread takes effect as its system call returns; the
    other threads stop with it (a stop always stops the whole process)."""
    say(event="stopped", where=where)
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def install_hooks(cfg: dict) -> None:
    stop = cfg.get("stop") or []
    stop, gate = {stop} if isinstance(stop, str) else set(stop), gates(cfg)
    fired: set[str] = set()
    renewed = threading.Event()
    real_call = s3mod.S3Target.call

    def call(self, method, **kw):  # type: ignore[no-untyped-def]
        key = kw.get("Key", "")
        data = method in ("put_object", "create_multipart_upload") and "/data-" in key
        if "data" in stop and data and "data" not in fired:
            fired.add("data")
            stall("data")
        if "renewal" in stop and data and "wait" not in fired:
            fired.add("wait")
            if not renewed.wait(60):
                raise TimeoutError("no lease renewal in 60 s")
        renewal = (method == "put_object" and key.endswith("writer.lease")
                   and threading.current_thread().name.startswith("ckptmgr-lease"))
        if "renewal" in stop and renewal and "renewal" not in fired:
            fired.add("renewal")
            stall("renewal")
            try:
                return real_call(self, method, **kw)
            finally:
                renewed.set()
        replacing = key.endswith("/manifest.json") and (method == "delete_object"
                                                        or (method == "put_object" and "IfMatch" in kw))
        if "replace" in stop and replacing and "replace" not in fired:
            fired.add("replace")
            stall("replace")
        manifest = method == "put_object" and key.endswith("/manifest.json")
        if "manifest" in stop and manifest and "manifest" not in fired:
            fired.add("manifest")
            stall("manifest")
        r = real_call(self, method, **kw)
        if "after-data" in stop and data and "after-data" not in fired:
            fired.add("after-data")
            stall("after-data")
        if "after-replace" in stop and replacing and "after-replace" not in fired:
            fired.add("after-replace")
            stall("after-replace")
        if "after-manifest" in stop and manifest and "after" not in fired:
            fired.add("after")
            stall("after-manifest")
        return r

    s3mod.S3Target.call = call  # type: ignore[method-assign]
    if "commit" in gate:
        real_commit = objmod.ManifestLastCommit.commit

        def commit(self, manifest):  # type: ignore[no-untyped-def]
            wait_for_go()
            return real_commit(self, manifest)

        objmod.ManifestLastCommit.commit = commit  # type: ignore[method-assign]


def gates(cfg: dict) -> set[str]:
    gate = cfg.get("gate") or []
    return {gate} if isinstance(gate, str) else set(gate)


def wait_for_go() -> None:
    say(event="gate")
    if not sys.stdin.readline():
        raise RuntimeError("the test closed the gate")


def refused_for_a_live_claim(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if "is being written" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def main() -> None:
    cfg = json.loads(sys.argv[1])
    FsspecTarget.lease_stale_s = float(cfg["stale_s"])  # the heartbeat every stale_s / 5
    install_hooks(cfg)
    log = open(cfg["log"], "a") if cfg.get("log") else None  # noqa: SIM115
    mgr = CheckpointManager(
        cfg["root"], storage_options=cfg["so"], staging=StagingOptions(local_tier=False),
        s3_options=S3Options(part_size=cfg["part_size"], concurrency=4, base_delay_s=0.01, max_delay_s=0.05),
        write_options=WriteOptions(chunk_size=max(4096, cfg["part_size"]), io_threads=2),
        retention=KeepLatest(cfg["keep"]) if cfg.get("keep") else None)
    try:
        if "save" in gates(cfg):
            wait_for_go()
        for step in cfg["steps"]:
            state = state_of(step, cfg["writer"], cfg["n"])
            deadline = time.monotonic() + 60
            while True:
                t0 = time.time()
                durable, error = False, None
                try:
                    durable = bool(mgr.save(step, state).result().durable)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    if exc.__cause__ is not None:
                        error += f" (from {type(exc.__cause__).__name__}: {exc.__cause__})"
                    if cfg.get("takeover") and refused_for_a_live_claim(exc) and time.monotonic() < deadline:
                        continue  # (until the other claim is stale: polled, bounded)
                break
            restored = None
            if durable and cfg.get("verify"):
                try:
                    got = mgr.restore(step=step)
                    restored = "own" if (got["writer"] == cfg["writer"] and torch.equal(got["w"], state["w"])) \
                        else f"writer {got['writer']}"
                except StepNotFoundError:
                    restored = "deleted"
                except Exception as exc:
                    restored = f"{type(exc).__name__}: {exc}"
            rec = {"event": "result", "step": step, "writer": cfg["writer"], "durable": durable, "error": error,
                   "t0": t0, "t1": time.time(), "restored": restored}
            say(**rec)
            if log is not None:
                log.write(json.dumps(rec) + "\n")
                log.flush()
        mgr.wait()
    finally:
        mgr.close()


if __name__ == "__main__":
    main()
