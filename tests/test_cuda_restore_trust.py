"""The read path's guarantees on a real GPU (``pytest -m cuda``; skipped elsewhere): restore into
GPU targets is all or nothing on every loader, concurrent restores through the pinned ring
(real pinned buffers, one stream per buffer) never share a buffer, and GDS reads are verified."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from conftest import damage_last_chunk

from ckptmgr import CheckpointCorruptError, CheckpointManager, StagingOptions, WriteOptions

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NO_TIER = StagingOptions(local_tier=False)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"w": torch.randn(2048, 1024, device="cuda", generator=g),
            "b": torch.randn(8192, device="cuda", generator=g).bfloat16()}


@pytest.mark.parametrize("loader", ["ring", "inplace", "host"])
def test_a_corrupt_step_leaves_the_gpu_target_as_it_was(root, loader):
    with CheckpointManager(root, staging=NO_TIER, write_options=WriteOptions(chunk_size=1 << 20)) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.save(2, _state(2)).result()
        damage_last_chunk(os.path.join(root, "step_000000000002", "data-00000.safetensors"))
        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(2, target=target, loader=loader)
        torch.cuda.synchronize()
        assert not target["w"].any() and not target["b"].any()
        with pytest.warns(RuntimeWarning, match="skipping step 2"):
            mgr.restore(target=target, loader=loader)
        assert torch.equal(target["w"], _state(1)["w"]) and torch.equal(target["b"], _state(1)["b"])


def test_a_corrupt_pinned_slot_leaves_the_gpu_target_as_it_was(root):
    """The step held in this process's pinned staging slot (and on disk) damaged in both."""
    with CheckpointManager(root, write_options=WriteOptions(chunk_size=1 << 20)) as mgr:
        if mgr._tier is None:
            pytest.skip("no local tier here")
        mgr.save(1, _state(1)).result()
        mgr.wait()
        damage_last_chunk(mgr._tier.path_of(1, "data-00000.safetensors"))
        damage_last_chunk(os.path.join(root, "step_000000000001", "data-00000.safetensors"))
        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(1, target=target)
        torch.cuda.synchronize()
        assert not target["w"].any() and not target["b"].any()


def test_two_threads_restoring_through_the_pinned_ring_get_bit_exact_results(root):
    states = {1: _state(1), 2: _state(2)}
    with CheckpointManager(root, staging=NO_TIER, write_options=WriteOptions(chunk_size=1 << 20)) as mgr:
        for step, state in states.items():
            mgr.save(step, state).result()
        start = threading.Barrier(2, timeout=60)
        wrong: list[str] = []

        def run(step: int) -> None:
            start.wait()
            for i in range(100):
                try:
                    out = mgr.restore(step, device="cuda", loader="ring")
                except Exception as exc:
                    wrong.append(f"step {step} #{i}: {exc!r}")
                    continue
                for k, v in states[step].items():
                    if not torch.equal(out[k], v):
                        wrong.append(f"step {step} #{i}: {k}")

        threads = [threading.Thread(target=run, args=(s,)) for s in states]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads)
    assert wrong == []


def test_gds_reads_are_verified_on_the_gpu(root):
    pytest.importorskip("kvikio")
    with CheckpointManager(root, staging=NO_TIER, write_options=WriteOptions(chunk_size=1 << 20)) as mgr:
        mgr.save(1, _state(1)).result()
        assert torch.equal(mgr.restore(1, device="cuda", loader="gds")["w"], _state(1)["w"])
        damage_last_chunk(os.path.join(root, "step_000000000001", "data-00000.safetensors"))
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(1, device="cuda", loader="gds")
        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(1, target=target, loader="gds")
        assert not target["w"].any()


@pytest.mark.parametrize("room", [True, False])
def test_a_target_on_the_gpu_lands_through_spare_memory_or_verifies_first(root, monkeypatch, room):
    """With room on the device the step lands beside the target and moves in after it verified
    (no separate checking pass); without room (allocation refused) every chunk is checked
    first. Either way a damaged step leaves the target as it was."""
    import ckptmgr.restore.loaders.ring as ring_mod
    import ckptmgr.restore.restorer as restorer_mod

    passes = []
    real_verify = restorer_mod.verify_files
    monkeypatch.setattr(restorer_mod, "verify_files", lambda *a, **k: passes.append(1) or real_verify(*a, **k))
    if not room:
        real_plan = ring_mod.plan_landing

        def plan(*a, through_device=False, **k):
            if through_device:
                raise torch.OutOfMemoryError("no room (test)")
            return real_plan(*a, **k)
        monkeypatch.setattr(ring_mod, "plan_landing", plan)
    with CheckpointManager(root, staging=NO_TIER, write_options=WriteOptions(chunk_size=1 << 20)) as mgr:
        mgr.save(1, _state(1)).result()
        mgr.save(2, _state(2)).result()
        damage_last_chunk(os.path.join(root, "step_000000000002", "data-00000.safetensors"))
        target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(2, target=target, loader="ring")
        torch.cuda.synchronize()
        assert not target["w"].any() and not target["b"].any()
        assert passes == ([] if room else [1])
        w = target["w"]
        mgr.restore(1, target=target, loader="ring")
        assert target["w"] is w and torch.equal(w, _state(1)["w"]) and torch.equal(target["b"], _state(1)["b"])


def test_ten_thousand_small_tensors_land_in_a_gpu_target_exactly(root):
    g = torch.Generator(device="cuda").manual_seed(3)
    state = {f"t{i}": torch.randn(1 + i % 257, device="cuda", generator=g).to(
        (torch.float32, torch.bfloat16, torch.float16)[i % 3]) for i in range(10_000)}
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, state).result()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        ptrs = {k: v.data_ptr() for k, v in target.items()}
        mgr.restore(1, target=target)
        torch.cuda.synchronize()
    for k, v in state.items():
        assert target[k].data_ptr() == ptrs[k] and torch.equal(target[k], v), k


def test_a_model_and_its_optimizer_land_in_a_gpu_target_in_place(root):
    """Parameters of any shape (that require grad) and an optimizer's state, restored into a
    model on the GPU through spare device memory: the target's own memory, exact values."""
    torch.manual_seed(4)

    def parts():
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 3)).cuda()
        return model, torch.optim.AdamW(model.parameters())

    model, opt = parts()
    model(torch.randn(5, 16, device="cuda")).sum().backward()
    opt.step()
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, {"model": model, "optim": opt, "w": model.state_dict()}).result()
        m2, o2 = parts()
        sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        ptrs = [p.data_ptr() for p in m2.parameters()]
        out = mgr.restore(1, target={"model": m2, "optim": o2, "w": sd})
        torch.cuda.synchronize()
    assert [p.data_ptr() for p in m2.parameters()] == ptrs and all(p.requires_grad for p in m2.parameters())
    for (k, a), b in zip(model.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b) and out["w"][k] is sd[k] and torch.equal(sd[k], a), k
    assert torch.equal(o2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
