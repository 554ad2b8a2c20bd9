"""The save engine on its own: order, error surfacing, bounded waits, stop and restart.

Real threads and real files; held commits are held by events, never by sleeps.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from ckptmgr.errors import CkptTimeoutError, SaveError
from ckptmgr.extend import AsyncWriter, Destinations, FileCommit


class BytesImage:
    """An image with static bytes only (nothing for the stager to copy)."""

    plan = None

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)

    def fill(self, segment: torch.Tensor) -> None:
        segment.numpy()[:self.size] = np.frombuffer(self.data, dtype=np.uint8)

    def seal(self, buffer, io) -> None:
        pass


class HeldCommit:
    """Writes its buffer to ``path``, first waiting for ``gate`` (bounded); fails when asked."""

    def __init__(self, path: str, log: list[str], gate: threading.Event | None = None, fail: bool = False) -> None:
        self.path, self.log, self.gate, self.fail = path, log, gate, fail
        self.started = threading.Event()

    def write(self, buffers, io) -> None:
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(60)
        if self.fail:
            raise OSError(f"cannot write {self.path}")
        with open(self.path, "wb") as f:
            f.write(buffers[0].tobytes())

    def commit(self, error):
        if error is not None:
            raise error
        self.log.append(os.path.basename(self.path))
        return self.path

    def close(self) -> None:
        self.log.append("closed " + os.path.basename(self.path))


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ckptmgr-test-engine")]


def test_saves_and_calls_run_in_order_and_commit(tmp_path):
    log: list[str] = []
    writer = AsyncWriter(slots=2, copy_threads=1, io_threads=2, name="ckptmgr-test-engine")
    try:
        gate = threading.Event()
        first = writer.submit([BytesImage(b"one")], HeldCommit(str(tmp_path / "a"), log, gate))
        second = writer.submit([BytesImage(b"two!")], HeldCommit(str(tmp_path / "b"), log))
        writer.call(lambda: log.append("call"))
        assert not writer.idle
        gate.set()
        assert first.result(60) == str(tmp_path / "a") and second.result(60) == str(tmp_path / "b")
        writer.wait(60)
        assert log == ["a", "closed a", "b", "closed b", "call"]
        assert (tmp_path / "a").read_bytes() == b"one" and (tmp_path / "b").read_bytes() == b"two!"
        assert writer.idle and writer.take_errors() == []
    finally:
        writer.close(60)
    assert engine_threads() == []


def test_a_failure_is_told_once_and_the_slot_is_free_again(tmp_path):
    log: list[str] = []
    writer = AsyncWriter(slots=1, copy_threads=1, io_threads=1, name="ckptmgr-test-engine")
    try:
        bad = writer.submit([BytesImage(b"x")], HeldCommit(str(tmp_path / "bad"), log, fail=True), step=3)
        with pytest.raises(OSError, match="cannot write"):
            bad.result(60)
        writer.wait(60)
        assert log == ["closed bad"]  # closed, never committed
        err = writer.take_failure()
        assert isinstance(err, SaveError) and "step 3" in str(err) and isinstance(err.__cause__, OSError)
        assert writer.take_failure() is None and writer.take_errors() == []  # told once
        # the one slot was released: the next save gets it at once
        good = writer.submit([BytesImage(b"y")], HeldCommit(str(tmp_path / "good"), log), report=False)
        assert good.result(60) == str(tmp_path / "good")
    finally:
        writer.close(60)


def test_wait_is_bounded_and_park_stops_the_threads_until_the_next_save(tmp_path):
    log: list[str] = []
    writer = AsyncWriter(slots=1, copy_threads=1, io_threads=1, name="ckptmgr-test-engine")
    gate = threading.Event()
    try:
        commit = HeldCommit(str(tmp_path / "held"), log, gate)
        pending = writer.submit([BytesImage(b"h")], commit)
        assert commit.started.wait(60)
        with pytest.raises(CkptTimeoutError):
            writer.wait(0.05)
        gate.set()
        writer.park(60)
        assert pending.future.done() and engine_threads() == []
        again = writer.submit([BytesImage(b"again")], HeldCommit(str(tmp_path / "again"), log))
        assert again.result(60) == str(tmp_path / "again")
    finally:
        gate.set()
        writer.close(60)
    with pytest.raises(SaveError, match="closed"):
        writer.submit([BytesImage(b"late")], HeldCommit(str(tmp_path / "late"), log))
    assert engine_threads() == []


def test_a_file_commit_replaces_the_path_and_sweeps_dead_writers_temporaries(tmp_path):
    dead = tmp_path / ".ckptmgr-999999999-0123456789ab.partial"  # no such pid
    dead.write_bytes(b"left by a killed writer")
    (tmp_path / "model.ckpt").write_bytes(b"old")
    dests = Destinations()
    writer = AsyncWriter(slots=1, copy_threads=1, io_threads=2, name="ckptmgr-test-engine", on_stop=dests.close)
    try:
        path = str(tmp_path / "model.ckpt")
        pending = writer.submit([BytesImage(b"new bytes")], FileCommit(path, None, dests, chunk_size=4,
                                                                         direct_io=False))
        pending.result(60)
    finally:
        writer.close(60)
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt"]
    assert (tmp_path / "model.ckpt").read_bytes() == b"new bytes"
