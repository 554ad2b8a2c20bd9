"""The peer tier's split host copies (:func:`~ckptmgr.distributed.peer_transport.split_copy`),
what a CUDA restore transport runs into and out of pinned staging: real threads, real arrays."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from ckptmgr import ConfigError
from ckptmgr.distributed.peer_transport import COPY_PIECE_BYTES, Transport, split_copy
from ckptmgr.errors import CkptTimeoutError


class CountingPool(ThreadPoolExecutor):
    """A real pool that counts the pieces handed to it."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.pieces = 0
        self.threads: set[str] = set()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:  # type: ignore[override]
        self.pieces += 1

        def run() -> Any:
            self.threads.add(threading.current_thread().name)
            return fn(*args, **kwargs)
        return super().submit(run)


@pytest.mark.parametrize("threads", [1, 2, 4, 8])
@pytest.mark.parametrize("size", [0, 4097, 2 * COPY_PIECE_BYTES, 5 * COPY_PIECE_BYTES + 12345])
def test_a_split_copy_lands_every_byte_in_pieces_of_at_least_the_minimum(threads, size):
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    src.flags.writeable = False  # (a send's source may be a read-only map)
    dst = np.zeros(size + 2, dtype=np.uint8)
    with CountingPool(max(1, threads - 1)) as pool:
        split_copy(dst[1:-1], src, threads, pool, 30)
    assert np.array_equal(dst[1:-1], src) and dst[0] == 0 and dst[-1] == 0  # exact, nothing past either end
    assert pool.pieces == max(1, min(threads, size // COPY_PIECE_BYTES)) - 1  # (the first piece: the caller's)
    assert len(pool.threads) <= pool.pieces


def test_a_split_copy_waits_for_every_piece_and_bounds_the_wait():
    """A piece that cannot start (the pool's one thread is held) fails the copy after the
    timeout; once the pool is free, the same copy lands."""
    src = np.arange(4 * COPY_PIECE_BYTES, dtype=np.int64).view(np.uint8)[:4 * COPY_PIECE_BYTES]
    dst = np.zeros_like(src)
    gate, held = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        blocker = pool.submit(lambda: (held.set(), gate.wait(30)))
        assert held.wait(30)
        with pytest.raises(CkptTimeoutError, match="did not end within"):
            split_copy(dst, src, 2, pool, 0.05)
        gate.set()
        blocker.result(timeout=30)
        dst[:] = 0
        split_copy(dst, src, 2, pool, 30)
    assert np.array_equal(dst, src)


def test_a_split_copy_refuses_arrays_of_different_sizes():
    with pytest.raises(ValueError, match="a host copy of 10 bytes into 9"):
        split_copy(np.zeros(9, dtype=np.uint8), np.zeros(10, dtype=np.uint8), 2, None, 1)


def test_a_transport_refuses_an_unknown_copy_method_or_no_threads():
    with pytest.raises(ConfigError, match="copy method 'dma'"):
        Transport(None, None, copy_method="dma")
    with pytest.raises(ConfigError, match="at least one thread, not 0"):
        Transport(None, None, copy_threads=0)
    with pytest.raises(ConfigError, match="segments of at least one byte, not 0"):
        Transport(None, None, segment_bytes=0)
