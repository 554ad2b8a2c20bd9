"""Staging slots and the save pipeline on CPU: training-safe copies, overlap, backpressure,
slot reuse without new allocations, the host-memory cap and the local tier."""

import os
import threading
import time

import pytest
import torch
from conftest import assert_tree_equal, make_training, train_steps
from test_fsspec_target import FaultyFS, faulty  # noqa: F401  (fixture)

import ckptmgr._cuda as cuda_shim
from ckptmgr import (
    CapacityError,
    CheckpointManager,
    CkptTimeoutError,
    ConfigError,
    SaveError,
    SaveSkippedError,
    StagingOptions,
)
from ckptmgr.storage.tier import tier_dir


def big_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3_000_000, generator=g),  # 12 MB: copied in several pieces
        "h": torch.randn(1000, generator=g).bfloat16(),
        "i": torch.arange(10),
        "t": torch.randn(40, 30, generator=g).t(),  # non-contiguous
        "n": 7,
    }


def clone(tree):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in tree.items()}


def mutate(tree) -> None:
    for v in tree.values():
        if isinstance(v, torch.Tensor):
            v.add_(1)


@pytest.mark.parametrize("local_tier", [False, True])
@pytest.mark.parametrize("block", [True, False])
def test_mutating_right_after_staging_leaves_the_checkpoint_alone(root, local_tier, block):
    state = big_state()
    with CheckpointManager(root, staging=StagingOptions(local_tier=local_tier)) as mgr:
        for step in range(3):
            expected = clone(state)
            h = mgr.save(step, state, block=block)
            h.wait_staged()  # instant after a blocking save
            assert h.staged()
            mutate(state)  # every tensor changes right away
            h.result(timeout=30)
            assert_tree_equal(mgr.restore(step), expected)


def _flat(model, opt) -> dict:
    out = {f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        out.update({f"o.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def test_training_with_overlapped_saves_restores_exactly(root):
    model, opt, sched = make_training()
    with CheckpointManager(root) as mgr:
        for step in range(1, 4):
            train_steps(model, opt, sched, 2)
            expected = _flat(model, opt)
            h = mgr.save(step, {"model": model, "optim": opt, "sched": sched}, block=False)
            h.wait_staged()
            train_steps(model, opt, sched, 1)  # changes every parameter and moment
        mgr.wait()
        model2, opt2, sched2 = make_training(seed=1)
        train_steps(model2, opt2, sched2, 1)
        mgr.restore(3, target={"model": model2, "optim": opt2, "sched": sched2})
    assert_tree_equal(_flat(model2, opt2), expected)


def test_backpressure_wait_then_skip(root, faulty):  # noqa: F811
    faulty.gate = threading.Event()
    mgr = CheckpointManager("faulty://bp", staging=StagingOptions(slots=1, local_tier=False))
    h1 = mgr.save(1, big_state())
    threading.Timer(0.3, faulty.gate.set).start()
    t = time.perf_counter()
    h2 = mgr.save(2, big_state())  # waits for step 1's slot
    assert time.perf_counter() - t >= 0.2
    assert h1.done()
    h2.result(timeout=30)
    stats = mgr.stats()
    # (how long it waited depends on when save(2) began under load: only that it did, and says so)
    assert stats["busy_waits"] == 1 and stats["busy_wait_s"] > 0 and stats["skips"] == 0
    assert h2.result().busy_wait_s == pytest.approx(stats["busy_wait_s"])
    mgr.close()

    faulty.gate = threading.Event()
    mgr = CheckpointManager("faulty://bp", staging=StagingOptions(slots=1, on_busy="skip", local_tier=False))
    h3 = mgr.save(3, big_state())
    h4 = mgr.save(4, big_state())
    assert h4.skipped and h4.done() and "skipped" in repr(h4)
    with pytest.raises(SaveSkippedError, match="step 4 was not saved"):
        h4.result()
    faulty.gate.set()
    h3.result(timeout=30)
    mgr.save(5, big_state()).result(timeout=30)  # a free slot again: not skipped
    assert mgr.stats()["skips"] == 1
    mgr.close()  # a skip is not an error: close does not raise
    assert CheckpointManager("faulty://bp").steps() == [1, 2, 3, 5]


def test_busy_timeout(faulty):  # noqa: F811
    faulty.gate = threading.Event()
    mgr = CheckpointManager("faulty://bt", staging=StagingOptions(slots=1, busy_timeout=0.1, local_tier=False))
    mgr.save(1, big_state())
    with pytest.raises(CkptTimeoutError, match="no staging slot"):
        mgr.save(2, big_state())
    faulty.gate.set()
    mgr.close(timeout=30)


def test_two_slots_overlap_staging_with_a_pending_write(faulty):  # noqa: F811
    faulty.gate = threading.Event()
    with CheckpointManager("faulty://two", staging=StagingOptions(slots=2, local_tier=False)) as mgr:
        mgr.save(1, big_state())
        t = time.perf_counter()
        h2 = mgr.save(2, big_state())  # the second slot: no wait
        assert time.perf_counter() - t < 5 and mgr.stats()["busy_waits"] == 0
        faulty.gate.set()
        h2.result(timeout=30)


def test_error_with_block_false_surfaces_on_the_handle_then_at_close(faulty):  # noqa: F811
    faulty.fail_writes = True
    mgr = CheckpointManager("faulty://err", staging=StagingOptions(local_tier=False))
    h = mgr.save(1, big_state(), block=False)
    h.wait_staged()  # the copy itself is fine
    with pytest.raises(SaveError, match="Input/output error"):
        h.result(timeout=30)
    mgr.save(2, big_state(), block=False)
    with pytest.raises(SaveError, match="step 2"):
        mgr.close(timeout=30)


class CountingCuda:
    """Stands in for CUDA's pinning calls on a machine without CUDA, counting them."""

    def __init__(self, monkeypatch):
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.pinned = 0
        monkeypatch.setattr(cuda_shim, "available", lambda: True)
        monkeypatch.setattr(cuda_shim, "host_register", self.register)
        monkeypatch.setattr(cuda_shim, "host_unregister", self.unregister)
        monkeypatch.setattr(cuda_shim, "pinned_empty", self.pinned_empty)

    def register(self, ptr, n, read_only=False):
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = n

    def unregister(self, ptr):
        assert ptr in self.registered, "unregistering a pointer never registered"
        self.unregistered.append(ptr)

    def pinned_empty(self, n):
        self.pinned += 1
        return torch.empty(n, dtype=torch.uint8)


@pytest.mark.parametrize("local_tier", [True, False])
def test_slots_are_made_once_and_reused(root, monkeypatch, local_tier):
    fake = CountingCuda(monkeypatch)
    model, opt, sched = make_training()
    train_steps(model, opt, sched, 1)  # the optimizer state exists from here on
    state = {"model": model, "optim": opt, "sched": sched}
    with CheckpointManager(root, staging=StagingOptions(slots=2, local_tier=local_tier)) as mgr:
        h1 = mgr.save(1, state)
        first = mgr.stats()
        mgr.save(2, state).result()  # step 1 may still be writing: the second slot
        h1.result()
        second = mgr.stats()
        assert second["slot_allocations"] in (first["slot_allocations"], 2 * first["slot_allocations"])
        for step in range(3, 9):
            train_steps(model, opt, sched, 1)
            mgr.save(step, state, block=step % 2 == 0)
        mgr.wait()
        last = mgr.stats()
        assert last["slot_allocations"] == second["slot_allocations"]
        assert last["slot_registrations"] == second["slot_registrations"]
        # tmpfs files or anonymous memory, populated then pinned in place (never cudaHostAlloc)
        assert last["slot_registrations"] == last["slot_allocations"] > 0 and fake.pinned == 0
        assert len(fake.registered) >= last["slot_registrations"]
    # every registration is undone, at the exact pointer, when the manager closes
    assert sorted(fake.unregistered) == sorted(fake.registered)


def test_slots_grow_with_the_state(root):
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.zeros(1000)}).result()
        n = mgr.stats()["slot_allocations"]
        mgr.save(2, {"w": torch.zeros(1000)}).result()
        assert mgr.stats()["slot_allocations"] == n
        mgr.save(3, {"w": torch.zeros(5000)}).result()  # grew: a new buffer
        assert mgr.stats()["slot_allocations"] == n + 1
        assert mgr.restore(3)["w"].shape == (5000,)


def test_prepare_makes_the_slots_ahead_of_the_first_save(root):
    state = big_state()
    with CheckpointManager(root, staging=StagingOptions(slots=2)) as mgr:
        mgr.prepare(state)
        deadline = time.monotonic() + 30
        while mgr.stats()["slot_allocations"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        made = mgr.stats()["slot_allocations"]
        assert made >= 2
        mgr.save(1, state).result()
        mgr.save(2, state).result()
        assert mgr.stats()["slot_allocations"] == made


def test_host_memory_cap_refuses_before_any_copy(root):
    state = big_state()
    with CheckpointManager(root, staging=StagingOptions(slots=2, max_host_bytes=20 << 20)) as mgr:
        with pytest.raises(CapacityError, match="max_host_bytes") as info:
            mgr.save(1, state)
        assert isinstance(info.value, MemoryError)
        assert mgr.stats()["slot_allocations"] == 0 and mgr.steps() == []
        mgr.save(2, {"small": torch.ones(10)}).result()  # a state that fits still saves
        with pytest.raises(CapacityError):
            mgr.prepare(state)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"slots": 0}, "slots"),
    ({"on_busy": "drop"}, "on_busy"),
    ({"busy_timeout": -1}, "busy_timeout"),
    ({"max_host_bytes": 0}, "max_host_bytes"),
    ({"local_tier": "yes"}, "local_tier"),
    ({"local_dir": ""}, "local_dir"),
    ({"copy_threads": 0}, "copy_threads"),
])
def test_bad_staging_options(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        StagingOptions(**kwargs)


def test_bad_staging_arguments(root, tmp_path):
    with pytest.raises(ConfigError, match="staging must be of type StagingOptions"):
        CheckpointManager(root, staging={"slots": 2})
    with pytest.raises(ConfigError, match="not a directory"):
        CheckpointManager(root, staging=StagingOptions(local_tier=True, local_dir=str(tmp_path / "none")))
    with CheckpointManager(root) as mgr:
        with pytest.raises(ConfigError, match="block must be a bool"):
            mgr.save(1, {"x": torch.ones(1)}, block=None)
        assert mgr.steps() == []


def test_local_tier_lists_and_restores_and_is_released_at_close(root, tmp_path):
    local = str(tmp_path / "shm")
    os.makedirs(local)
    opts = StagingOptions(local_dir=local)
    state = big_state()
    with CheckpointManager(root, staging=opts) as mgr:
        info = mgr.save(5, state).result()
        assert info.local_s is not None and info.local_s <= info.total_s
        tier = tier_dir(local, mgr.root)
        assert os.path.isfile(os.path.join(tier, "slot-00", "manifest.json"))
        # the tier copy is what restore reads first: remove the durable files, it still works
        for name in os.listdir(os.path.join(root, "step_000000000005")):
            if name.endswith(".safetensors"):
                os.unlink(os.path.join(root, "step_000000000005", name))
        assert_tree_equal(mgr.restore(), state)
    assert not os.path.exists(tier)  # a clean close frees the slots


def test_a_second_manager_on_the_same_root_does_without_the_tier(root, tmp_path, caplog):
    local = str(tmp_path / "shm")
    os.makedirs(local)
    opts = StagingOptions(local_dir=local)
    with CheckpointManager(root, staging=opts) as a, CheckpointManager(root, staging=opts) as b:
        assert "another manager" in caplog.text
        a.save(1, {"x": torch.ones(3)}).result()
        b.save(2, {"x": torch.ones(3)}).result()
        assert b.steps() == [1, 2]


def test_exception_in_the_training_loop_still_finishes_pending_saves(faulty):  # noqa: F811
    faulty.gate = threading.Event()
    threading.Timer(0.2, faulty.gate.set).start()
    def training_loop():
        with CheckpointManager("faulty://exc", staging=StagingOptions(local_tier=False)) as mgr:
            mgr.save(1, big_state(), block=False)
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        training_loop()
    assert CheckpointManager("faulty://exc").steps() == [1]


def test_save_failure_in_a_failing_with_block_is_logged_not_raised(faulty, caplog):  # noqa: F811
    faulty.fail_writes = True
    def training_loop():
        with CheckpointManager("faulty://exc2", staging=StagingOptions(local_tier=False)) as mgr:
            mgr.save(1, big_state())
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        training_loop()
    assert "save of step 1 failed" in caplog.text


def test_a_full_local_tier_falls_back_to_host_memory(root, tmp_path, monkeypatch, caplog):
    from ckptmgr.storage.tier import LocalTier

    local = str(tmp_path / "shm")
    os.makedirs(local)
    monkeypatch.setattr(LocalTier, "free_bytes", lambda self: 0)  # no room left in the tmpfs
    state = big_state()
    with CheckpointManager(root, staging=StagingOptions(local_dir=local)) as mgr:
        info = mgr.save(1, state).result()
        assert "cannot live in" in caplog.text and info.local_s is None  # not in the tier
        assert mgr._saver.pool.slots[0].kind == "memory"
        assert_tree_equal(mgr.restore(1), state)


def test_a_protection_that_cannot_be_written_is_reported(root, monkeypatch):
    from ckptmgr import KeepLatest, StorageError
    from ckptmgr.storage.local import LocalTarget

    with CheckpointManager(root, retention=KeepLatest(1), staging=StagingOptions(local_tier=False)) as mgr:
        gate = threading.Event()
        real = LocalTarget.begin

        def slow_begin(self, step, prefix=""):
            gate.wait(10)
            return real(self, step, prefix)

        monkeypatch.setattr(LocalTarget, "begin", slow_begin)
        mgr.save(1, big_state())
        mgr.protect(1)  # still being saved: applied when it commits

        def refuse(self, step, protected):
            raise PermissionError(13, "Permission denied (injected)")

        monkeypatch.setattr(LocalTarget, "set_protected", refuse)
        gate.set()
        with pytest.raises(StorageError, match="could not protect step 1"):
            mgr.wait(timeout=30)
        assert mgr.steps() == [1]


def test_slots_are_populated_then_pinned_in_pieces_with_pauses_only_in_the_background(root, monkeypatch):
    import ckptmgr.save.buffers as buffers
    from ckptmgr import WriteOptions

    fake = CountingCuda(monkeypatch)
    order: list[str] = []
    sleeps: list[str] = []
    real_populate = buffers._populate
    monkeypatch.setattr(buffers, "_populate", lambda *a: (order.append("populate"), real_populate(*a)))
    real_register = fake.register
    monkeypatch.setattr(cuda_shim, "host_register", lambda p, n, read_only=False: (order.append("pin"),
                                                                                    real_register(p, n)))
    monkeypatch.setattr(buffers.time, "sleep", lambda s: sleeps.append(threading.current_thread().name))
    monkeypatch.setattr(buffers, "PIN_PIECE_BYTES", 1 << 20)
    state = big_state()
    opts = WriteOptions(chunk_size=256 << 10)
    with CheckpointManager(root, write_options=opts, staging=StagingOptions(slots=2, local_tier=False)) as mgr:
        mgr.prepare(state)
        mgr.wait(timeout=30)
        background = list(sleeps)
        sleeps.clear()
        pool = mgr._saver.pool
        for slot in pool.slots:
            for b in slot.buffers:
                pieces = sorted((p - b.tensor.data_ptr(), fake.registered[p]) for p in b.registered)
                # whole pieces of 1 MiB (4 chunks) from the image's start, covering it exactly
                assert [off for off, _ in pieces] == list(range(0, b.nbytes, 1 << 20))
                assert sum(n for _, n in pieces) == b.nbytes and max(n for _, n in pieces) == 1 << 20
        assert order.index("pin") > order.index("populate")
        assert background and set(background) == {"ckptmgr-prepare"}  # pauses between pieces
        mgr.save(1, state).result(timeout=30)
        assert sleeps == []  # nothing new to pin, and a save never pauses
    assert sorted(fake.unregistered) == sorted(fake.registered)
    fake.registered.clear()
    fake.unregistered.clear()
    with CheckpointManager(root + "2", write_options=opts, staging=StagingOptions(slots=1, local_tier=False)) as mgr:
        mgr.save(1, state).result(timeout=30)  # no prepare(): the save pins its slot itself
        assert mgr.stats()["slot_registrations"] > 0 and sleeps == []  # the training thread waits: no pauses
    assert sorted(fake.unregistered) == sorted(fake.registered)


@pytest.mark.parametrize("kernel", ["populate-write", "older"])
def test_pages_are_populated_in_pieces_keeping_their_bytes(tmp_path, monkeypatch, kernel):
    """One madvise call holds the memory-map lock for reading throughout, and every other
    thread's page faults can queue behind it: so a buffer is populated a piece at a time.
    Kernels without MADV_POPULATE_WRITE write each page once, keeping its value."""
    import ctypes
    import mmap

    import ckptmgr.save.buffers as buffers

    monkeypatch.setattr(buffers, "POPULATE_PIECE_BYTES", 1 << 20)
    nbytes = (5 << 20) + 12345
    path = tmp_path / "image"
    want = os.urandom(nbytes)
    path.write_bytes(want)
    with open(path, "r+b") as f:
        buf = buffers.file_buffer(f.fileno(), nbytes, str(path))
    calls: list[tuple[int, int]] = []
    real = ctypes.CDLL(None, use_errno=True)
    real.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    class Libc:
        @staticmethod
        def madvise(ptr, n, advice):
            calls.append((ptr.value, n.value))
            return -1 if kernel == "older" else real.madvise(ptr, n, advice)

    monkeypatch.setattr(buffers, "_libc", Libc())
    start = buf.tensor.data_ptr()
    buffers._populate(start, nbytes, buf.tensor)
    if kernel == "older":
        assert len(calls) == 1  # refused: every page is written instead
    else:
        assert [p for p, _ in calls] == list(range(start, start + nbytes, 1 << 20))
        assert max(n for _, n in calls) == 1 << 20 and sum(n for _, n in calls) == nbytes
    assert bytes(buf.tensor.numpy()) == want and path.read_bytes() == want
    assert start % mmap.PAGESIZE == 0


def test_staging_copies_are_split_at_piece_boundaries():
    from ckptmgr.save.staging import _split_at

    src = torch.randn(1000, 300).t()  # non-contiguous
    image = torch.zeros(4 << 20, dtype=torch.uint8)
    begin = 3 * 4096 + 100 * 4  # an offset inside the image
    dst = image[begin:begin + src.numel() * 4].view(torch.float32).view(src.shape)
    pairs = _split_at(dst, src, begin, 256 << 10)
    assert len(pairs) > 1
    for d, s in pairs:
        off = d.data_ptr() - image.data_ptr()
        n = d.numel() * d.element_size()
        assert off // (256 << 10) == (off + n - 1) // (256 << 10)  # inside one piece
        d.copy_(s)
    assert torch.equal(dst, src)
    assert _split_at(dst, src, begin, 0) == [(dst, src)]  # no pieces: one copy


def test_a_failing_local_tier_does_not_fail_the_durable_save(root, tmp_path, monkeypatch, caplog):
    from ckptmgr.storage.tier import LocalTier

    local = str(tmp_path / "shm")
    os.makedirs(local)

    def broken(self, index, step, manifest):  # e.g. the tier directory was removed under the manager
        raise FileNotFoundError(2, "No such file or directory (injected)")

    monkeypatch.setattr(LocalTier, "commit", broken)
    state = big_state()
    with CheckpointManager(root, staging=StagingOptions(local_dir=local)) as mgr:
        info = mgr.save(1, state).result(timeout=30)
        assert info.local_s is None and "could not commit step 1" in caplog.text
        assert mgr.steps() == [1]
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        assert_tree_equal(mgr.restore(1), state)  # verified: the checksums were computed all the same


def test_a_non_blocking_save_returns_while_its_copies_are_still_being_enqueued(root, monkeypatch):
    """The copies are enqueued by the stager's feeder thread, not by the caller: save(block=False)
    returns at once even when enqueueing them is held up, and wait_staged() waits for it."""
    from ckptmgr.save.staging import Stager

    real = Stager._enqueue
    gate, entered = threading.Event(), threading.Event()
    threads: list[str] = []

    def held(self, *args):
        threads.append(threading.current_thread().name)
        entered.set()
        assert gate.wait(30)
        return real(self, *args)

    monkeypatch.setattr(Stager, "_enqueue", held)
    state = big_state()
    want = clone(state)
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        h = mgr.save(1, state, block=False)
        assert entered.wait(30)
        assert not h.staged()
        with pytest.raises(CkptTimeoutError, match="enqueued"):
            h.wait_staged(timeout=0.05)
        gate.set()
        h.wait_staged(timeout=30)
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v.add_(1)
        h.result(timeout=60)
        assert_tree_equal(mgr.restore(1), want)
    assert threads == ["ckptmgr-stage_" + threads[0].rsplit("_", 1)[1]]


def test_a_copy_that_fails_on_the_feeder_thread_fails_its_save_and_frees_the_slot(root, monkeypatch):
    from ckptmgr.save import staging

    real = staging._dst_view
    calls = {"n": 0}

    def breaks_once(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("copy refused")
        return real(*args)

    monkeypatch.setattr(staging, "_dst_view", breaks_once)
    state = big_state()
    with CheckpointManager(root, staging=StagingOptions(local_tier=False, slots=1)) as mgr:
        h = mgr.save(1, state, block=False)
        with pytest.raises(SaveError, match="copy refused"):
            h.wait_staged(timeout=30)
        with pytest.raises(SaveError, match="copy refused"):
            h.result(timeout=60)
        mgr.save(2, state).result(timeout=60)  # the one slot is free again
        assert mgr.steps() == [2]
        assert_tree_equal(mgr.restore(2), state)


def test_the_one_call_of_a_device_s_copies_copies_each_pair_as_copy_does():
    """The pairs of one ``_foreach_copy_`` (run here on CPU, where it copies pair by pair as
    CUDA does for pairs of different devices, dtypes or strides): views of one byte segment
    of several dtypes, uint32 and float8 ones copied as the integers of their size, a
    non-contiguous source; each destination holds its source's bytes, and nothing else moved."""
    from ckptmgr.save.staging import _enqueue_copies

    seg = torch.full((64,), 0xAB, dtype=torch.uint8)
    srcs = [torch.arange(6, dtype=torch.float32).view(2, 3).t(),  # non-contiguous
            torch.tensor([1, 2**32 - 1], dtype=torch.int64).to(torch.uint32),
            torch.tensor([0.5, -2.0], dtype=torch.float8_e4m3fn),
            torch.tensor([3.5, -1.25], dtype=torch.bfloat16)]
    at, pairs = 0, []
    for s in srcs:
        n = s.numel() * s.element_size()
        pairs.append((seg[at:at + n].view(s.dtype).view(s.shape), s))
        at += n
    _enqueue_copies(pairs)
    for dst, s in pairs:
        assert dst.dtype == s.dtype
        assert torch.equal(dst.contiguous().view(torch.uint8), s.contiguous().view(torch.uint8))
    assert torch.equal(seg[at:], torch.full((64 - at,), 0xAB, dtype=torch.uint8))
