"""Stress: four threads save, restore, protect and apply retention on one manager for a
minute, over a filesystem that fails writes and deletions at random; then a fresh manager
restores the newest step byte for byte. No deadlock, no unreported failure, no wrong data.

    pytest -m slow tests/test_stress.py            (CKPTMGR_STRESS_S=60 by default)
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import fsspec
import pytest
import torch
from conftest import assert_tree_equal
from fsspec.implementations.memory import MemoryFileSystem

from ckptmgr import (
    CheckpointManager,
    CkptError,
    KeepLatest,
    SaveError,
    SaveSkippedError,
    StagingOptions,
    StepNotFoundError,
    StorageError,
)
from ckptmgr.storage.tier import ram_filesystem

pytestmark = pytest.mark.slow


class ChaosFS(MemoryFileSystem):
    """The real in-memory filesystem; data writes and deletions fail at random."""

    protocol = "chaos"
    store: dict = {}  # noqa: RUF012  (fsspec's memory filesystem keeps its files on the class)
    pseudo_dirs: list = [""]  # noqa: RUF012
    rng = random.Random(0)
    mu = threading.Lock()
    fail_p = 0.0
    injected = 0

    @classmethod
    def roll(cls) -> bool:
        with cls.mu:
            hit = cls.rng.random() < cls.fail_p
            cls.injected += hit
            return hit

    def _open(self, path, mode="rb", **kw):
        if "w" in mode and not path.endswith(("manifest.json", "protected", "root-id")) and self.roll():
            raise OSError(5, "Input/output error (injected)")
        return super()._open(path, mode, **kw)

    def rm_file(self, path):
        if not path.endswith("manifest.json") and self.roll():
            raise OSError(5, "Input/output error (injected)")
        return super().rm_file(path)


fsspec.register_implementation("chaos", ChaosFS, clobber=True)


def make_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 256, generator=g), "b": torch.randn(1000, generator=g).bfloat16(),
            "i": torch.arange(step % 7 + 1), "step": step}


@pytest.mark.parametrize("slots", [1, 2])
def test_four_threads_on_one_manager_with_failing_storage(tmp_path, slots, request):
    seconds = float(os.environ.get("CKPTMGR_STRESS_S", "60")) / 2
    seed = int(os.environ.get("CKPTMGR_STRESS_SEED", str(int(time.time()))))
    print(f"stress: {seconds} s, seed {seed}")
    ChaosFS.store.clear()
    ChaosFS.pseudo_dirs[:] = [""]
    ChaosFS.rng = random.Random(seed)
    ChaosFS.fail_p = 0.08
    # the tier in RAM, as on a GPU machine it must be (its files are pinned there)
    if ram_filesystem("/dev/shm"):
        local = Path(request.getfixturevalue("ram_dir"))
    else:
        local = tmp_path / "shm"
        local.mkdir()
    mgr = CheckpointManager("chaos://stress", retention=KeepLatest(3),
                            staging=StagingOptions(slots=slots, local_dir=str(local)))
    stop = threading.Event()
    mu = threading.Lock()
    expected: dict[int, dict] = {}
    handles = []
    protected: set[int] = set()
    problems: list[str] = []
    reported: list[str] = []
    counts = {"saves": 0, "restores": 0, "protects": 0, "retention": 0}

    def guard(name, fn):
        def run():
            rng = random.Random(f"{seed}-{name}")
            try:
                while not stop.is_set():
                    fn(rng)
            except BaseException as exc:
                problems.append(f"{name}: {type(exc).__name__}: {exc}")
        return threading.Thread(target=run, name=name, daemon=True)

    step_counter = iter(range(1, 10**9))

    def saver(rng):
        step = next(step_counter)
        state = make_state(step)
        with mu:
            expected[step] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
        try:
            h = mgr.save(step, state, block=rng.random() < 0.5)
            h.wait_staged(timeout=60)
            for v in state.values():  # training goes on: the checkpoint must not change
                if isinstance(v, torch.Tensor):
                    v.add_(1)
            handles.append(h)
            counts["saves"] += 1
        except (SaveError, StorageError) as exc:  # an earlier failure, told here
            reported.append(str(exc))

    newest_seen = [-1]

    def restorer(rng):
        steps = mgr.steps()
        if not steps:
            assert newest_seen[0] < 0, "every checkpoint vanished"
            return
        # steps only grow here and retention keeps the newest: the newest never goes back
        assert steps[-1] >= newest_seen[0], f"the newest step went back from {newest_seen[0]} to {steps[-1]}"
        newest_seen[0] = steps[-1]
        step = steps[-1] if rng.random() < 0.5 else rng.choice(steps)
        try:
            got = mgr.restore(step)
        except StepNotFoundError:
            return  # deleted by retention meanwhile
        with mu:
            want = expected[step]
        assert_tree_equal(got, want)
        counts["restores"] += 1

    def protector(rng):
        steps = mgr.steps()
        if not steps:
            return
        step = rng.choice(steps)
        try:
            if rng.random() < 0.7:
                mgr.protect(step)
                with mu:
                    protected.add(step)
            else:
                with mu:
                    protected.discard(step)
                mgr.unprotect(step)
            counts["protects"] += 1
        except StepNotFoundError:
            pass  # gone, or being deleted: protect() says so
        except OSError as exc:  # the marker write failed (StorageError, or the filesystem's own)
            reported.append(str(exc))
        stop.wait(0.01)

    def retention(rng):
        try:
            mgr.apply_retention()
            counts["retention"] += 1
        except (StorageError, SaveError) as exc:
            reported.append(str(exc))
        stop.wait(0.05)

    threads = [guard("saver", saver), guard("restorer", restorer), guard("protector", protector),
               guard("retention", retention)]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(120)
    assert not [t.name for t in threads if t.is_alive()], "a thread is stuck (deadlock)"
    assert not problems, problems
    ChaosFS.fail_p = 0.0
    try:
        mgr.wait(timeout=120)
    except CkptError as exc:
        reported.append(str(exc))
    try:
        mgr.close(timeout=120)
    except CkptError as exc:
        reported.append(str(exc))
    failed = 0
    committed = set()
    for h in handles:  # every save ended, committed or with its failure told
        assert h.done()
        try:
            committed.add(h.result().step)
        except (SaveError, SaveSkippedError):
            failed += 1
    print(f"stress: {counts}, {failed} saves failed, {ChaosFS.injected} failures injected, "
          f"{len(reported)} reported elsewhere")
    assert counts["saves"] > 20 and counts["restores"] > 5 and ChaosFS.injected > 0
    fresh = CheckpointManager("chaos://stress", staging=StagingOptions(local_tier=False))
    steps = fresh.steps()
    assert steps, "nothing committed at all"
    for step in protected & committed:  # a protection that returned held
        assert step in steps, f"protected step {step} was deleted"
    newest = steps[-1]
    assert_tree_equal(fresh.restore(), expected[newest])
    fresh.close()
