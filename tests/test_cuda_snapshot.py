"""The device snapshot buffer, for real: run on the GPU machine (``pytest -m cuda``)."""

import itertools

import pytest
import test_cuda
import torch

import ckptmgr._cuda as cuda_shim
import ckptmgr.save.buffers as buffers
from ckptmgr import CheckpointManager, StagingOptions, WriteOptions

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def gpu_state(seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    return {**test_cuda.gpu_state(seed), "b": torch.rand(999, device="cuda", generator=g) > 0.5}


def snapshot(state: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def check(mgr: CheckpointManager, step: int, expected: dict) -> None:
    got = mgr.restore(step=step, device="cuda")
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k].to(v.device), v), (step, k)
        else:
            assert got[k] == v


@pytest.mark.parametrize("capacity", [1 << 30, 1 << 20])  # all of it; all but "w"
@pytest.mark.parametrize(("slots", "local_tier"), [(1, True), (2, True), (2, False)])
@pytest.mark.parametrize("block", [True, False])
def test_the_state_may_change_once_it_is_on_the_device_and_every_step_is_exact(root, capacity, slots, local_tier,
                                                                                block):
    state = gpu_state()
    opts = StagingOptions(slots=slots, local_tier=local_tier, device_buffer_bytes=capacity)
    with CheckpointManager(root, staging=opts) as mgr:
        handles, expected = [], []
        for step in range(4):
            expected.append(snapshot(state))
            h = mgr.save(step, state, block=block)
            h.wait_staged()
            assert h.staged()
            through = h._ticket.staging.snapshot_bytes
            assert through > 0 and (through < 4 << 20) == (capacity < 4 << 20)
            for v in state.values():  # queued on the default stream right behind the snapshot
                if isinstance(v, torch.Tensor):
                    v.add_(1) if v.dtype != torch.bool else v.logical_not_()
            handles.append(h)  # the next save follows at once: its snapshot queues behind this drain
        for step, h in enumerate(handles):
            h.result(timeout=60)
            check(mgr, step, expected[step])


def test_the_buffer_is_the_only_gpu_memory_taken_and_is_made_once(root):
    state = {f"p{i}": torch.randn(1 << 20, device="cuda") for i in range(16)}  # 64 MiB
    state_bytes = 16 * (4 << 20)
    with CheckpointManager(root, staging=StagingOptions(slots=2, device_buffer_bytes=1 << 30)) as mgr:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        mgr.prepare(state)  # allocates the buffer now
        held = mgr.stats()["device_buffer_bytes"]
        assert state_bytes <= held <= state_bytes + 4096
        assert torch.cuda.memory_allocated() - before == held
        mgr.wait()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for step in range(5):
            mgr.save(step, state, block=False).wait_staged()
        mgr.wait()
        assert torch.cuda.max_memory_allocated() == base
        assert mgr.stats()["device_buffer_bytes"] == held
    with CheckpointManager(root, staging=StagingOptions(device_buffer_bytes=10 << 20)) as mgr:
        mgr.save(10, state).result()  # two of the 4 MiB tensors fit; the others go straight to the host
        assert 8 << 20 <= mgr.stats()["device_buffer_bytes"] <= 10 << 20
        check(mgr, 10, state)


@pytest.mark.parametrize("mode", ["pieces", "populate"])
def test_drains_are_split_at_the_slot_pinning_boundaries(root, monkeypatch, mode):
    """A copy across two host registrations fails: the drain from the buffer is split at
    the boundaries as the direct copies are."""
    monkeypatch.setattr(buffers, "PIN_MODE", mode)
    monkeypatch.setattr(buffers, "PIN_PIECE_BYTES", 1 << 20)
    g = torch.Generator(device="cuda").manual_seed(7)
    state = {f"p{i}": torch.randn(300_000 + 1000 * i, device="cuda", generator=g) for i in range(6)}
    state["t"] = torch.randn(700, 900, device="cuda", generator=g).t()
    state["h"] = torch.randn(3_000_000, device="cuda", generator=g).bfloat16()
    opts = WriteOptions(chunk_size=256 << 10, max_file_bytes=8 << 20)
    staging = StagingOptions(slots=2, device_buffer_bytes=12 << 20)  # most of it; the rest direct
    with CheckpointManager(root, write_options=opts, staging=staging) as mgr:
        for step in range(3):
            expected = snapshot(state)
            mgr.save(step, state, block=step % 2 == 0).wait_staged()
            for v in state.values():
                v.add_(1)
            mgr.wait()
            check(mgr, step, expected)
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            mgr.restore(step, target=target)
            for k, v in expected.items():
                assert torch.equal(target[k], v), (mode, step, k)


def test_a_buffer_the_device_has_no_room_for_is_given_up_with_a_warning_and_saves_go_on(root, caplog):
    state = {f"p{i}": torch.randn(1 << 22, device="cuda") for i in range(8)}  # 128 MiB
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    with CheckpointManager(root, staging=StagingOptions(device_buffer_bytes=1 << 30)) as mgr:
        # room for half of the state's buffer: its allocation fails for real
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (64 << 20)) / total)
        try:
            with caplog.at_level("WARNING", logger="ckptmgr"):
                first = mgr.save(1, state)
                second = mgr.save(2, state, block=False)
                second.wait_staged()
                mgr.wait()
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        assert caplog.text.count("no room for a device snapshot buffer") == 1
        assert first._ticket.staging.snapshot_bytes == second._ticket.staging.snapshot_bytes == 0
        assert mgr.stats()["device_buffer_bytes"] == 0
        check(mgr, 1, state)
        check(mgr, 2, state)


def hold_drains(monkeypatch, cycles: int = 1 << 30) -> None:
    """Queue a GPU sleep (~0.5 s) right after each save's *safe* event, so its drain from the
    buffer (and its *landed* event) come later on the GPU's own clock."""
    real, n = cuda_shim.CopyDone, itertools.count()

    def held(streams):
        event = real(streams)
        if next(n) % 2 == 0:  # the first of a save's two: safe
            for s in streams:
                with torch.cuda.stream(s):
                    torch.cuda._sleep(cycles)
        return event

    monkeypatch.setattr(cuda_shim, "CopyDone", held)


def mutate(state: dict) -> None:
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.add_(1) if v.dtype != torch.bool else v.logical_not_()


def test_the_state_is_safe_to_change_before_its_bytes_have_landed(root, monkeypatch):
    hold_drains(monkeypatch)
    state = gpu_state()
    expected = snapshot(state)
    with CheckpointManager(root, staging=StagingOptions(device_buffer_bytes=1 << 30)) as mgr:
        h = mgr.save(1, state)  # blocking: returns when safe
        assert h.staged() and not h._ticket.staging.done()
        mutate(state)
        h.result(timeout=60)
        check(mgr, 1, expected)


def test_a_buffer_grown_while_an_older_drain_is_queued_keeps_both_steps_exact(root, monkeypatch):
    hold_drains(monkeypatch, cycles=1 << 31)  # ~1 s
    # "x" moves to the GPU between the saves: the files (and slots) stay the same size, and the
    # buffer must grow. (A slot refitted to new sizes would unpin its old buffers, and
    # cudaHostUnregister waits for the whole device.)
    state = {**gpu_state(), "x": torch.randn(1 << 24)}
    opts = StagingOptions(slots=2, local_tier=False, device_buffer_bytes=1 << 30)
    with CheckpointManager(root, staging=opts) as mgr:
        mgr.prepare(state)
        mgr.wait()  # both slots made
        first = snapshot(state)
        h1 = mgr.save(1, state)
        small = mgr.stats()["device_buffer_bytes"]
        state["x"] = state["x"].cuda()
        second = snapshot(state)
        h2 = mgr.save(2, state, block=False)
        assert not h1._ticket.staging.done()  # the first drain still reads the old buffer
        assert mgr.stats()["device_buffer_bytes"] > max(small, 64 << 20)
        h2.wait_staged()  # (after the first drain: one stream)
        mutate(state)
        h1.result(timeout=60)
        h2.result(timeout=60)
        check(mgr, 1, first)
        check(mgr, 2, second)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensors_of_two_devices_in_one_file(root):
    state = {f"p{i}": torch.randn(1 << 18, device=f"cuda:{i % 2}") for i in range(8)}
    expected = snapshot(state)
    with CheckpointManager(root, staging=StagingOptions(device_buffer_bytes=1 << 30)) as mgr:
        h = mgr.save(1, state)
        mutate(state)
        h.result(timeout=60)
        assert mgr.stats()["device_buffer_bytes"] >= 8 << 20
        check(mgr, 1, expected)
