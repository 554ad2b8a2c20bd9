"""The device snapshot buffer's layout (CPU: GPU tensors stand in as meta tensors), the
staging job's two moments (safe, landed) with stand-in events, and the option's contract on
a machine without CUDA. The copies themselves are tested on the GPU
(tests/test_cuda_snapshot.py)."""

import dataclasses
import itertools
import random

import pytest
import torch
from conftest import assert_tree_equal

from ckptmgr import CheckpointManager, ConfigError, StagingOptions
from ckptmgr.format.layout import Plan, plan_layout
from ckptmgr.format.tree import flatten
from ckptmgr.save.snapshot import plan_snapshot
from ckptmgr.save.staging import Stager, StagingJob, _Enqueued, _resolved

_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.int64, torch.float16]


def _plan(state: dict, *, files: int = 1, on_device=lambda name: True) -> Plan:
    """A save's plan for ``state``, with the tensors ``on_device`` names moved to the meta
    device (what the layout sees of a GPU tensor: its device, dtype and shape)."""
    _, leaves = flatten(state)
    plan = plan_layout(leaves, max_file_bytes=1 << 40, files_hint=files, metadata={}, file_prefix="data-")
    for f in plan.files:
        f.tensors = [dataclasses.replace(t, source=t.source.to("meta")) if on_device(t.name) else t
                     for t in f.tensors]
    return plan


def _random_state(rng: random.Random, n: int) -> dict:
    out = {}
    for i in range(n):
        dtype = rng.choice(_DTYPES)
        shape = [rng.randint(0, 40) for _ in range(rng.randint(0, 3))]
        out[f"t{i}"] = torch.zeros(shape, dtype=dtype)
    return out


def _check(plan: Plan, capacity: int) -> None:
    snap = plan_snapshot(plan, capacity)
    tensors = {(i, len(f.header) + t.begin): (i, len(f.header), t) for i, f in enumerate(plan.files)
               for t in f.tensors if t.end > t.begin}
    # every tensor held in the buffer lies inside one run, at the run's offsets, aligned for its dtype
    for key, (device, dev) in snap.through.items():
        i, hs, t = tensors[key]
        assert t.source.device == device and t.source.device.type != "cpu" and t.end > t.begin
        run = [r for r in snap.runs if r.file == i and r.begin <= hs + t.begin and hs + t.end <= r.end]
        assert len(run) == 1
        assert dev == run[0].at + (hs + t.begin - run[0].begin)
        assert dev % t.source.element_size() == 0
    # runs are disjoint in the buffer, inside the capacity, and made only of held tensors' bytes
    spans = sorted((r.at, r.at + r.end - r.begin) for r in snap.runs)
    assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(spans))
    assert all(end <= capacity for _, end in spans)
    held = sum(t.end - t.begin for k, (_, _, t) in tensors.items() if k in snap.through)
    assert snap.bytes == held
    assert all(n == max(e for _, e in spans) for n in snap.needed.values()) if spans else not snap.needed
    # nothing on the host side is held; with room for all, every device tensor is
    room = sum(f.size for f in plan.files) + 256 * (len(plan.files) + 1)
    if capacity >= room:
        assert set(snap.through) == {k for k, (_, _, t) in tensors.items()
                                     if t.source.device.type != "cpu" and t.end > t.begin}


@pytest.mark.parametrize("seed", range(40))
def test_the_layout_keeps_every_tensor_aligned_disjoint_and_inside_the_buffer(seed):
    rng = random.Random(seed)
    state = _random_state(rng, rng.randint(1, 30))
    plan = _plan(state, files=rng.randint(1, 4), on_device=lambda name: rng.random() < 0.8)
    total = sum(f.size for f in plan.files)
    for capacity in (0, 1, 64, rng.randint(1, total + 1), total // 2, total + 4096):
        _check(plan, capacity)


def test_tensors_adjacent_in_a_file_are_one_run_and_the_host_tensors_split_runs():
    state = {"a": torch.zeros(1000), "b": torch.zeros(1000), "c": torch.zeros(1000), "d": torch.zeros(1000)}
    snap = plan_snapshot(_plan(state), 1 << 20)
    assert len(snap.runs) == 1 and snap.bytes == 16000
    snap = plan_snapshot(_plan(state, on_device=lambda name: "c" not in name), 1 << 20)
    assert len(snap.runs) == 2 and snap.bytes == 12000


def test_a_tensor_that_does_not_fit_goes_to_the_host_and_later_ones_may_still_fit():
    state = {"big": torch.zeros(10_000), "small": torch.zeros(10)}  # laid out in this order (same dtype)
    snap = plan_snapshot(_plan(state), 1000)
    names = {t.name for f in _plan(state).files for t in f.tensors}
    assert names == {"big", "small"}
    assert snap.bytes == 40 and len(snap.runs) == 1
    assert plan_snapshot(_plan(state), 0).runs == []
    meta = torch.device("meta")
    assert plan_snapshot(_plan(state), 1 << 20, {meta: 0}).runs == []  # a device without room
    assert plan_snapshot(_plan(state), 1 << 20, {meta: 1000}).bytes == 40  # one that had room for less


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_device_buffer_bytes_must_be_a_non_negative_int(bad):
    with pytest.raises(ConfigError, match="device_buffer_bytes"):
        StagingOptions(device_buffer_bytes=bad)


def test_a_state_without_gpu_tensors_saves_as_before_and_holds_no_buffer(root):
    state = {"w": torch.randn(100_000), "n": 3}
    with CheckpointManager(root, staging=StagingOptions(device_buffer_bytes=1 << 30)) as mgr:
        mgr.prepare(state)
        h = mgr.save(1, state, block=False)
        h.wait_staged()
        expected = {"w": state["w"].clone(), "n": 3}
        state["w"].add_(1)
        h.result(timeout=30)
        assert mgr.stats()["device_buffer_bytes"] == 0
        assert_tree_equal(mgr.restore(1), expected)


class _Event:
    """Stands in for a CUDA event (this machine has no CUDA)."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_a_job_stays_safe_while_its_drain_is_still_queued():
    landed, safe = _Event(False), _Event(True)
    job = StagingJob(_resolved(_Enqueued(done=landed, safe=safe)), keepalive=object())
    assert job.safe() and not job.done()
    job.wait_safe(timeout=1)
    assert job.safe() and not job.done() and job.safe_at is not None and job.finished_at is None
    job.wait()  # (the stand-in lands on synchronize)
    assert job.safe() and job.done()


def test_a_job_without_a_buffer_is_safe_when_it_has_landed():
    landed = _Event(False)
    job = StagingJob(_resolved(_Enqueued(done=landed)), keepalive=object())
    assert not job.safe()
    job.wait_safe()
    assert landed.done and job.safe() and job.done()


def test_an_interrupt_after_copies_are_enqueued_waits_for_them_before_the_slot_goes(root, monkeypatch):
    """The slot is released when save() fails: no copy may still be writing into it then."""
    real = Stager._submit_cpu
    seen: list = []

    def interrupted(self, cpu, futures):
        real(self, cpu, futures)
        seen.extend(futures)
        raise KeyboardInterrupt

    state = {"w": torch.randn(16_000_000)}  # 64 MB: several copy tasks, still running when it raises
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        monkeypatch.setattr(Stager, "_submit_cpu", interrupted)
        with pytest.raises(KeyboardInterrupt):
            mgr.save(1, state)
        assert seen and all(f.done() for f in seen)
        monkeypatch.undo()
        mgr.save(2, state).result(timeout=60)
        assert_tree_equal(mgr.restore(2), state)
