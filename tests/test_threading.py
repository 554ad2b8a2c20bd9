"""The background work releases the GIL: checksums and host copies run in parallel with each
other and with the training thread. Proved as safetensors' test_threadable does: two calls
behind a barrier overlap in time only if neither holds the GIL while it runs."""

import threading
import time
import weakref

import numpy as np
import torch

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
