"""The background work releases the GIL: checksums and host copies run in parallel with each
other and with the training thread. Proved as safetensors' test_threadable does: two calls
behind a barrier overlap in time only if neither holds the GIL while it runs."""

import threading
import time
import weakref

import numpy as np
import pytest
import torch

from ckptmgr import CheckpointManager, StagingOptions
from ckptmgr.format.checksum import crc32c_hex
from ckptmgr.save.staging import _copy_all


def _windows_overlap(fn) -> bool:
    barrier = threading.Barrier(2)
    spans: list[tuple[float, float]] = []

    def run():
        barrier.wait()
        t0 = time.perf_counter()
        fn()
        spans.append((t0, time.perf_counter()))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(s for s, _ in spans) < min(e for _, e in spans)


def test_checksums_release_the_gil():
    data = np.random.default_rng(0).integers(0, 255, size=512 << 20, dtype=np.uint8)
    assert _windows_overlap(lambda: crc32c_hex(data))


def test_host_copies_release_the_gil():
    src = torch.randn(64 << 20)
    dst = torch.empty_like(src)
    assert _windows_overlap(lambda: _copy_all([(dst, src)] * 4))


def test_a_pool_keeps_nothing_of_a_call_once_its_future_is_cancelled_or_done():
    """A caller that drains its futures may release what the calls were given (a mapping's
    views): a call cancelled in the queue, or one that ended, must hold nothing of it by then."""
    from ckptmgr._threads import DaemonPool

    class Held:
        pass

    pool = DaemonPool(1, "ckptmgr-test")
    gate = threading.Event()
    try:
        blocker = pool.submit(gate.wait, 30)  # the one worker is busy: the next call waits in the queue
        queued_arg, done_arg = Held(), Held()
        queued_ref, done_ref = weakref.ref(queued_arg), weakref.ref(done_arg)
        queued = pool.submit(lambda x: None, queued_arg)
        assert queued.cancel()
        del queued_arg
        assert queued_ref() is None  # still in the queue, holding nothing
        gate.set()
        assert blocker.result(30)
        done = pool.submit(lambda x: None, done_arg)
        del done_arg
        done.result(30)
        assert done_ref() is None  # released before the future said it was done
    finally:
        gate.set()
        pool.stop(timeout=30)


class _InterruptedWait(threading.Condition):
    """A condition whose wait ends as CPython's can under a signal: the lock is released for the
    wait, then a KeyboardInterrupt is raised before the lock is taken back."""

    def wait(self, timeout=None):  # type: ignore[override]
        self._release_save()  # type: ignore[attr-defined]
        raise KeyboardInterrupt


def test_an_interrupt_that_lands_before_a_wait_takes_its_lock_back_is_raised_as_itself():
    """``with cond: cond.wait()`` turns such an interrupt into RuntimeError("cannot release
    un-acquired lock"); :func:`holding` raises the interrupt, and the lock is free after."""
    from ckptmgr._threads import holding

    cond = _InterruptedWait()
    with pytest.raises(RuntimeError, match="un-acquired"), cond:  # what plain ``with`` does
        cond.wait(1)
    cond = _InterruptedWait()
    with pytest.raises(KeyboardInterrupt), holding(cond):
        cond.wait(1)
    assert cond.acquire(timeout=1)  # (free: nobody holds it)
    cond.release()
    with pytest.raises(ValueError, match="passes as it is"), holding(threading.Condition()):
        raise ValueError("passes as it is")


def test_close_raises_a_ctrl_c_that_lands_in_its_wait_as_itself(root, monkeypatch):
    """The wait of ``close()`` (the save engine's) raises the interrupt, not a RuntimeError, so
    that ``close()`` names it and the exit hook waits for the writes again."""
    mgr = CheckpointManager(root, staging=StagingOptions(local_tier=False))
    try:
        mgr.save(1, {"w": torch.ones(4)}).result(timeout=60)
        eng = mgr._saver._engine  # (the engine the manager made)
        monkeypatch.setattr(eng, "_mu", _InterruptedWait())
        eng._unsettled += 1  # something still running: the wait must wait (no other thread runs now)
        try:
            with pytest.raises(KeyboardInterrupt):
                eng.wait(5)
        finally:
            eng._unsettled -= 1
    finally:
        monkeypatch.undo()
        mgr.close()
