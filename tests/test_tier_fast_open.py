"""A restarted job's manager opens without waiting for the slots it adopts from the local tier:
their checks, page faults and pinning run on the adoption thread, and only what needs the slot
waits for it (a restore from it, a save reusing it), with a timeout. CUDA's pinning is faked
(registration only) and held at a gate: the real registrations run on a GPU in test_cuda.py."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import pytest
import torch
from conftest import damage_last_chunk
from test_restore_atomic import _state, _target

import ckptmgr._cuda as cuda_shim
import ckptmgr.restore.restorer as restorer_mod
import ckptmgr.storage.tier as tier_mod
from ckptmgr import CheckpointManager, Schedule, StagingOptions, WriteOptions
from ckptmgr.storage.tier import tier_dir

SMALL_CHUNKS = WriteOptions(chunk_size=4096)
DURABLE_EVEN = Schedule(durable_every=2)  # odd steps stay in the local tier

# A job that saves steps 2 and 3 (both durable; with one slot, the tier keeps step 3), says so
# and is SIGKILLed: its tier slot is left committed, as after a crash.
SAVER = """
import sys, time, torch
from ckptmgr import CheckpointManager, StagingOptions, WriteOptions

def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(20_000, generator=g), "b": torch.randn(3_000, generator=g).bfloat16(),
            "c": torch.randint(0, 100, (5_000,), generator=g), "n": seed}

mgr = CheckpointManager(sys.argv[1], staging=StagingOptions(slots=1, local_dir=sys.argv[2]),
                        write_options=WriteOptions(chunk_size=4096))
mgr.save(2, state(2)).result()
mgr.save(3, state(3)).result()
mgr.wait(timeout=60)
print("ready", flush=True)
time.sleep(600)
"""


@dataclass
class Gate:
    """CUDA's registration faked; once ``armed``, each registration on the adoption thread
    waits for ``go`` (those of other threads, such as the durable writer's, go through)."""

    armed: bool = False
    entered: threading.Event = field(default_factory=threading.Event)  # a registration waits at the gate
    go: threading.Event = field(default_factory=threading.Event)
    registered: set[int] = field(default_factory=set)
    mu: threading.Lock = field(default_factory=threading.Lock)
    checks: list[str] = field(default_factory=list)  # when the images were checked: "at adoption" / "at restore"


@pytest.fixture
def gate(monkeypatch):
    g = Gate()

    def register(ptr, n, read_only=False):
        if g.armed and threading.current_thread().name.startswith("ckptmgr-adopt"):
            g.entered.set()
            assert g.go.wait(60)
        with g.mu:
            g.registered.add(ptr)

    def unregister(ptr):
        with g.mu:
            g.registered.discard(ptr)

    monkeypatch.setattr(cuda_shim, "available", lambda: True)
    monkeypatch.setattr(cuda_shim, "host_register", register)
    monkeypatch.setattr(cuda_shim, "host_unregister", unregister)
    real_submit, real_verify = restorer_mod.submit_image_checks, restorer_mod.verify_images
    monkeypatch.setattr(restorer_mod, "submit_image_checks",
                        lambda *a: g.checks.append("at adoption") or real_submit(*a))
    monkeypatch.setattr(restorer_mod, "verify_images", lambda *a: g.checks.append("at restore") or real_verify(*a))
    yield g
    g.go.set()  # (never leave a thread at the gate)


def _open(root: str, local: str) -> CheckpointManager:
    return CheckpointManager(root, staging=StagingOptions(slots=1, local_dir=local), write_options=SMALL_CHUNKS,
                             schedule=DURABLE_EVEN)


def _leave_step_3_in_the_tier(root: str, local: str) -> None:
    """Steps 2 (durable) and 3 (local tier only), then closed with step 3 kept in the tier."""
    with _open(root, local) as mgr:
        mgr.save(2, _state(2)).result()
        mgr.save(3, _state(3)).result()
        assert mgr._tier.steps() == {3: 0}
        mgr.close(flush=False)


def _adoption_ended(mgr: CheckpointManager) -> None:
    """Wait (bounded) for the adoption of slot 0 to end, if it has not."""
    with mgr._saver.pool._cond:
        adoption = mgr._saver.pool._adopting.get(0)
    if adoption is not None:
        adoption.result(timeout=60)


def _mapped(path: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if path in line]


def test_the_manager_opens_and_answers_while_the_adoption_is_held(root, ram_dir, gate):
    _leave_step_3_in_the_tier(root, ram_dir)
    gate.armed = True
    mgr = _open(root, ram_dir)  # returns with the adoption held at its first registration
    try:
        assert gate.entered.wait(60)
        assert mgr.latest_step() == 3 and mgr.steps() == [2, 3]
        assert mgr._saver.pool.adopting() == [0] and not gate.registered  # nothing pinned yet
        gate.go.set()
        out = mgr.restore(3, device="cpu", loader="inplace")
        assert torch.equal(out["a"], _state(3)["a"]) and torch.equal(out["c"], _state(3)["c"])
        _adoption_ended(mgr)  # (the restore copied each piece once pinned: the adoption may still be settling)
        assert mgr._saver.pool.adopting() == [] and gate.registered  # pinned by the adoption
    finally:
        gate.go.set()
        mgr.close()


def test_a_restore_waits_for_the_adoption_and_gets_verified_bytes(root, ram_dir, gate):
    _leave_step_3_in_the_tier(root, ram_dir)
    gate.armed = True
    with _open(root, ram_dir) as mgr:
        assert gate.entered.wait(60)
        waiting = threading.Event()
        with mgr._tier._mu:  # (told when the restore starts waiting for the adoption's pinning)
            pinning = mgr._tier._adopting[0]
            real_wait = pinning.wait
            pinning.wait = lambda *a: waiting.set() or real_wait(*a)
        target = _target()
        got: list[object] = []
        restore = threading.Thread(target=lambda: got.append(mgr.restore(3, target=target, loader="inplace")))
        restore.start()
        assert waiting.wait(60)
        assert restore.is_alive() and not got and not target["a"].any()  # held until the adoption ends
        gate.go.set()
        restore.join(60)
        assert not restore.is_alive() and got
        for k in ("a", "b", "c"):
            assert torch.equal(target[k], _state(3)[k]), k
        assert gate.checks == ["at adoption"]  # verified by the adoption's checks, not a second pass
        mgr.wait(timeout=60)


def test_a_restore_whose_adoption_does_not_end_in_time_reads_and_verifies_the_files(root, ram_dir, gate,
                                                                                    monkeypatch, caplog):
    _leave_step_3_in_the_tier(root, ram_dir)
    monkeypatch.setattr(tier_mod, "ADOPTION_WAIT_S", 0.2)
    gate.armed = True
    with _open(root, ram_dir) as mgr:
        assert gate.entered.wait(60)
        target = _target()
        with caplog.at_level(logging.WARNING, logger="ckptmgr"):
            mgr.restore(3, target=target, loader="inplace")  # with the adoption still held
        assert "the adoption of slot 0 did not end within 0.2 s; step 3 is read from its files" in caplog.text
        for k in ("a", "b", "c"):
            assert torch.equal(target[k], _state(3)[k]), k
        assert gate.checks == ["at adoption"] and mgr._saver.pool.adopting() == [0]  # (its checks unused)
        gate.go.set()
        mgr.wait(timeout=60)


def test_a_tier_copy_damaged_before_the_restart_falls_back_to_the_durable_copy(root, ram_dir, gate, caplog):
    proc = subprocess.Popen([sys.executable, "-c", SAVER, root, ram_dir], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    path = os.path.join(tier_dir(ram_dir, os.path.abspath(root)), "slot-00", "data-00000.safetensors")
    damage_last_chunk(path)  # while no process held the tier
    with _open(root, ram_dir) as mgr:
        assert mgr.latest_step() == 3 and 3 in mgr._tier.steps()
        target = _target()
        with caplog.at_level(logging.WARNING, logger="ckptmgr"):
            out = mgr.restore(3, target=target, loader="inplace")
        assert out["n"] == 3
        for k in ("a", "b", "c"):
            assert torch.equal(target[k], _state(3)[k]), k
        assert gate.checks == ["at adoption"]  # the adoption's checks found it
        assert "the local tier copy of step 3 does not verify" in caplog.text
        assert "checksum mismatch" in caplog.text and os.path.abspath(root) in caplog.text


def test_close_during_a_held_adoption_ends_and_leaves_nothing_mapped(root, ram_dir, gate, caplog):
    _leave_step_3_in_the_tier(root, ram_dir)
    gate.armed = True
    mgr = _open(root, ram_dir)
    tier_path = mgr._tier.path
    adopter = mgr._saver.pool._adopter
    assert gate.entered.wait(60) and _mapped(tier_path)  # held inside a registration, the slot mapped
    mgr.wait(timeout=60)  # (the adopted step 3 is written to the root meanwhile)
    closed: list[bool] = []
    with caplog.at_level(logging.WARNING, logger="ckptmgr"):
        closer = threading.Thread(target=lambda m=mgr: closed.append(m.close(timeout=0.5) is None))
        closer.start()
        closer.join(60)
    assert not closer.is_alive() and closed  # close() ended with the registration still held
    assert re.search(r"adoption of staging slot\(s\) \[0\] did not stop within [0-9.]+ s; it frees them", caplog.text)
    gate.go.set()  # the registration returns: the adoption sees the close and frees the slot
    assert adopter is not None and adopter.stop(timeout=60)
    del mgr
    assert not _mapped(tier_path) and not gate.registered  # unpinned, then unmapped
    assert os.path.exists(os.path.join(tier_path, "slot-00", "manifest.json"))  # kept for the next start
    with _open(root, ram_dir) as again:  # which adopts it
        assert again.latest_step() == 3
        assert torch.equal(again.restore(3, device="cpu")["a"], _state(3)["a"])
