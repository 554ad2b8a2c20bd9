"""The host-memory guard and the default slot count: slots are sized against what the node
and the process's cgroup have available, refused before anything is allocated when they do
not fit, and the default adds a slot (within its share) rather than stall a save behind a
slow durable write. The memory figure comes from real files (a meminfo and cgroup trees
written here) that the guard is pointed at; the durable target is held with a gate."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from ckptmgr import CapacityError, CheckpointManager, CkptTimeoutError, StagingOptions
from ckptmgr.save import memory
from ckptmgr.save.memory import DEFAULT_HOST_SHARE, MAX_HOST_SHARE, HostMemory, read_host_memory
from ckptmgr.save.slots import AUTO_MAX_SLOTS, SlotPool, slot_bytes
from ckptmgr.storage.local import LocalTarget

MIB = 1 << 20


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _meminfo(tmp_path, available: int):
    p = tmp_path / "meminfo"
    _write(p, f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {available // 1024} kB\n")
    return p


@pytest.fixture
def host(tmp_path, monkeypatch):
    """Point the guard at a meminfo written here (no cgroup limit); returns a setter."""
    def set_available(available: int) -> None:
        p = _meminfo(tmp_path, available)
        monkeypatch.setattr(memory, "MEMINFO", str(p))
        monkeypatch.setattr(memory, "SELF_CGROUP", str(tmp_path / "no-such-cgroup-file"))
    return set_available


# ---------------------------------------------------------------------------- reading the figure

def test_the_figure_is_the_smallest_of_memavailable_and_every_cgroup_headroom(tmp_path):
    meminfo = _meminfo(tmp_path, 64 << 30)
    cg = tmp_path / "cg"
    _write(tmp_path / "self", "0::/job/step\n")
    _write(cg / "job" / "memory.max", str(20 << 30))  # the parent: 20 GiB, 12 used of which 4 reclaimable cache
    _write(cg / "job" / "memory.current", str(12 << 30))
    _write(cg / "job" / "memory.stat", f"anon 1\ninactive_file {4 << 30}\n")
    _write(cg / "job" / "step" / "memory.max", "max")  # the process's own group: no limit
    _write(cg / "job" / "step" / "memory.current", str(10 << 30))
    mem = read_host_memory(str(meminfo), str(cg), str(tmp_path / "self"))
    assert mem is not None and mem.available == (20 - 12 + 4) << 30 and "memory.max" in mem.source
    _write(cg / "job" / "memory.max", "max")  # no limit anywhere: MemAvailable
    mem = read_host_memory(str(meminfo), str(cg), str(tmp_path / "self"))
    assert mem is not None and mem.available == 64 << 30 and "MemAvailable" in mem.source


def test_cgroup_v1_limit_counts_and_its_no_limit_value_does_not(tmp_path):
    meminfo = _meminfo(tmp_path, 64 << 30)
    cg = tmp_path / "cg"
    _write(tmp_path / "self", "4:memory:/pod\n1:cpu:/\n")
    _write(cg / "memory" / "pod" / "memory.limit_in_bytes", str(8 << 30))
    _write(cg / "memory" / "pod" / "memory.usage_in_bytes", str(6 << 30))
    _write(cg / "memory" / "pod" / "memory.stat", f"total_inactive_file {1 << 30}\n")
    mem = read_host_memory(str(meminfo), str(cg), str(tmp_path / "self"))
    assert mem is not None and mem.available == 3 << 30 and "cgroup v1" in mem.source
    _write(cg / "memory" / "pod" / "memory.limit_in_bytes", str(9223372036854771712))
    mem = read_host_memory(str(meminfo), str(cg), str(tmp_path / "self"))
    assert mem is not None and mem.available == 64 << 30


def test_nothing_readable_means_no_figure(tmp_path):
    assert read_host_memory(str(tmp_path / "x"), str(tmp_path / "y"), str(tmp_path / "z")) is None


# ---------------------------------------------------------------------------- the pool

SIZES = [3 * MIB, MIB]
PER = slot_bytes(SIZES)


def _pool(count, base: int, **kw) -> SlotPool:
    """A pool whose memory figure drops by what its slots hold, as MemAvailable would."""
    box: list[SlotPool] = []
    pool = SlotPool(count, tier=None, memory=lambda: HostMemory(base - box[0]._held(), "test"), **kw)
    box.append(pool)
    return pool


def test_configured_slots_that_exceed_the_memory_are_refused_before_anything_is_allocated():
    pool = _pool(3, base=3 * PER, max_host_bytes=None)  # 3 slots need 100% of it; 90% is the most
    with pytest.raises(CapacityError, match=r"3 slot\(s\).*nothing was allocated"):
        pool.check_capacity(SIZES)
    assert pool.allocations == 0 and all(not s.buffers for s in pool.slots)
    ok = _pool(3, base=int(3 * PER / MAX_HOST_SHARE) + PER // 10, max_host_bytes=None)
    ok.check_capacity(SIZES)  # 3 slots fit 90% of it


def test_the_default_refuses_a_state_whose_one_slot_exceeds_its_share():
    pool = _pool(None, base=int(1.5 * PER), max_host_bytes=None)
    with pytest.raises(CapacityError, match=r"50% of host memory the default options may use.*slots=1"):
        pool.check_capacity(SIZES)
    assert pool.allocations == 0
    _pool(1, base=int(1.5 * PER), max_host_bytes=None).check_capacity(SIZES)  # configured: up to 90%


@pytest.mark.parametrize("fits", [1, 2, 3])
def test_the_default_grows_only_within_its_share_of_available_memory(fits, caplog):
    base = int((fits + 0.5) * PER / DEFAULT_HOST_SHARE)  # room for `fits` slots within the share
    pool = _pool(None, base=base, max_host_bytes=None)
    pool.check_capacity(SIZES)
    held = []
    with caplog.at_level(logging.WARNING, logger="ckptmgr"):
        for _ in range(AUTO_MAX_SLOTS + 1):  # every slot stays busy: each save wants another
            slot, _ = pool.acquire(wait=False, timeout=None)
            if slot is None:
                break
            pool.fit(slot, SIZES)
            held.append(slot)
            assert pool._held() <= DEFAULT_HOST_SHARE * base
    assert len(held) == len(pool.slots) == min(fits, AUTO_MAX_SLOTS)
    assert pool._held() <= DEFAULT_HOST_SHARE * base
    added = [r.getMessage() for r in caplog.records if "added staging slot" in r.getMessage()]
    assert len(added) == (0 if fits == 1 else 1)  # slot 2, and slot 3 as a spare when it fits
    assert all(("and slot 3" in m) == (fits >= 3) for m in added)
    refused = [r for r in caplog.records if "would exceed" in r.getMessage()]
    assert len(refused) == (1 if fits < AUTO_MAX_SLOTS else 0)
    if refused:
        assert "50% of" in refused[0].getMessage() and "slots=" in refused[0].getMessage()
    pool.acquire(wait=False, timeout=None)  # refused again: told once only
    assert len([r for r in caplog.records if "would exceed" in r.getMessage()]) == len(refused)
    for s in held:
        pool.release(s, step=None, durable=False)
    pool.close()


def test_configured_slots_never_grow():
    pool = _pool(1, base=1 << 40, max_host_bytes=None)
    pool.check_capacity(SIZES)
    slot, _ = pool.acquire(wait=False, timeout=None)
    assert slot is not None
    assert pool.acquire(wait=False, timeout=None)[0] is None and len(pool.slots) == 1
    pool.release(slot, step=None, durable=False)


# ---------------------------------------------------------------------------- the manager

def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 1024, generator=g), "step": seed}  # 1 MiB


class Gate:
    """Holds every durable write at its start until released."""

    def __init__(self, monkeypatch) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        real = LocalTarget.begin
        gate = self

        def begin(self, step, prefix=""):
            gate.started.set()
            assert gate.release.wait(timeout=60)
            return real(self, step, prefix)

        monkeypatch.setattr(LocalTarget, "begin", begin)


@pytest.mark.parametrize("tier", [True, False], ids=["local-tier", "no-tier"])
def test_with_the_defaults_a_save_during_a_slow_write_does_not_block_when_memory_allows(
        root, tmp_path, monkeypatch, tier, caplog):
    gate = Gate(monkeypatch)
    local = tmp_path / "shm"
    local.mkdir()
    caplog.set_level(logging.INFO, logger="ckptmgr")
    mgr = CheckpointManager(root, staging=StagingOptions(local_tier=tier, local_dir=str(local)))
    try:
        h1 = mgr.save(1, _state(1))
        assert gate.started.wait(30)  # step 1's durable write is held
        done = threading.Event()
        out: list = []

        def second() -> None:
            out.append(mgr.save(2, _state(2)))
            done.set()

        t = threading.Thread(target=second, daemon=True)
        t.start()
        returned = done.wait(30)  # with one slot it would wait for the gate: never, here
        assert returned, "save(2) blocked behind the durable write of step 1"
        stats = mgr.stats()
        assert stats["slots"] == 3, stats  # slot 2 made after save 1; slot 3 once saves overlap
        told = [r.getMessage() for r in caplog.records if "being made in the background" in r.getMessage()]
        assert len(told) == 2, told
        assert "staging slot 2 of at most 3" in told[0] and "previous one's durable write" in told[0], told
        assert "staging slot 3 of at most 3" in told[1] and "still running" in told[1], told
        out[0].wait_staged(30)
    finally:
        gate.release.set()
    h1.result(timeout=60)
    out[0].result(timeout=60)
    mgr.close()
    assert CheckpointManager(root, read_only=True).steps()[-1] == 2


def test_with_no_memory_for_a_second_slot_the_default_waits_and_says_why(root, monkeypatch, host, caplog):
    host(3 * MIB)  # 50%: room for the first 1 MiB slot, not a second one
    gate = Gate(monkeypatch)
    mgr = CheckpointManager(root, staging=StagingOptions(local_tier=False, busy_timeout=0.2))
    try:
        mgr.save(1, _state(1))
        assert gate.started.wait(30)
        with caplog.at_level(logging.WARNING, logger="ckptmgr"), pytest.raises(CkptTimeoutError):
            mgr.save(2, _state(2))
        assert mgr.stats()["slots"] == 1
        assert any("would exceed 50% of" in r.getMessage() and "MemAvailable" in r.getMessage()
                   for r in caplog.records)
    finally:
        gate.release.set()
    mgr.close(timeout=60)


@pytest.mark.parametrize("staging", [StagingOptions(local_tier=False), StagingOptions(slots=2, local_tier=False)],
                         ids=["default", "slots=2"])
def test_the_manager_refuses_before_the_first_save_allocates(root, host, staging):
    host(int(1.5 * MIB))  # one 1 MiB slot exceeds the default's 50%, two exceed 90%
    with CheckpointManager(root, staging=staging) as mgr:
        with pytest.raises(CapacityError, match="GiB"):
            mgr.save(1, _state(1))
        with pytest.raises(CapacityError):
            mgr.prepare(_state(1))
        assert mgr.stats()["slot_allocations"] == 0 and mgr.steps() == []
    with CheckpointManager(root, staging=StagingOptions(slots=1, local_tier=False)) as mgr:
        mgr.save(1, _state(1)).result(timeout=30)  # one configured slot fits 90%


def test_the_share_is_divided_among_the_processes_of_a_node(monkeypatch):
    """Every rank of a node reads the same MemAvailable: each may take its part of the share,
    so that all of them staging at once stay within it."""
    from ckptmgr.save.memory import HostMemory, allowed_bytes

    mem = HostMemory(64 << 30, "test")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = allowed_bytes(mem, 0, default=True, max_host_bytes=None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert allowed_bytes(mem, 0, default=True, max_host_bytes=None) == alone // 8
    assert allowed_bytes(mem, 0, default=False, max_host_bytes=None) == int((64 << 30) * 0.9 / 8)


def test_the_default_makes_a_second_slot_in_the_background_after_the_first_save(root, monkeypatch, host, caplog):
    """Where two slots fit its share, the default makes the second as soon as the first save
    holds the first, off the training thread: the next save finds it made. A third is made only
    once saves overlap (it would fit the share here, but they never do)."""
    host(7 * MIB)  # 50%: room for three 1 MiB slots
    caplog.set_level(logging.INFO, logger="ckptmgr")
    made_on: list[str] = []
    real = SlotPool.fit

    def fit(self, *args, **kw):
        made_on.append(threading.current_thread().name)
        return real(self, *args, **kw)

    monkeypatch.setattr(SlotPool, "fit", fit)
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, _state(1)).result(timeout=30)
        mgr.wait(timeout=30)  # (waits for the slot being made too)
        assert mgr.stats()["slots"] == 2 and mgr.stats()["slot_allocations"] == 2, mgr.stats()
        assert len(made_on) == 2, made_on  # (fit: the first save's own slot, then the one made ahead)
        assert made_on[0] == threading.current_thread().name  # the first save's own slot
        assert made_on[1].startswith("ckptmgr-prepare"), made_on
        for step in (2, 3, 4):  # each save's durable write ends before the next: no overlap
            mgr.save(step, _state(step)).result(timeout=30)
        stats = mgr.stats()
        assert stats["slots"] == 2 and stats["busy_waits"] == 0 and stats["slot_allocations"] == 2, stats
    told = [r.getMessage() for r in caplog.records if "being made in the background" in r.getMessage()]
    assert len(told) == 1 and "staging slot 2 of at most 3" in told[0], told
