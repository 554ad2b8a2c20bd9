"""The background work releases the GIL: checksums and host copies run in parallel with each
other and with the training thread. Proved as safetensors' test_threadable does: two calls
behind a barrier overlap in time only if neither holds the GIL while it runs."""

import threading
import time

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
