"""The CUDA paths, for real: run on the GPU machine (``pytest -m cuda``); skipped elsewhere."""

import pytest
import torch

from ckptmgr import CheckpointManager, StagingOptions

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def gpu_state(seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "w": torch.randn(1024, 1024, device="cuda", generator=g),
        "h": torch.randn(4096, device="cuda", generator=g).bfloat16(),
        "t": torch.randn(64, 32, device="cuda", generator=g).t(),  # non-contiguous
        "cpu": torch.arange(1000),
        "n": 3,
    }


@pytest.mark.parametrize("local_tier", [True, False])
@pytest.mark.parametrize("block", [True, False])
def test_mutating_right_after_staging_leaves_the_checkpoint_alone(root, local_tier, block):
    state = gpu_state()
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    with CheckpointManager(root, staging=StagingOptions(local_tier=local_tier)) as mgr:
        for step in range(3):
            h = mgr.save(step, state, block=block)
            h.wait_staged()
            for v in state.values():  # queued on the default stream right behind the copy
                if isinstance(v, torch.Tensor):
                    v.add_(1)
            h.result()
            got = mgr.restore(step=step, device="cuda")
            for k, v in expected.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(got[k].to(v.device), v), (step, k)
            expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def test_copy_is_ordered_after_pending_gpu_work(root):
    x = torch.zeros(8192, 8192, device="cuda")
    with CheckpointManager(root) as mgr:
        a = torch.randn(8192, 8192, device="cuda")
        for _ in range(20):  # a long queue of kernels writing x, not yet finished at save()
            x.copy_(a @ a).div_(x.abs().max() + 1)
        want = x.clone()
        mgr.save(1, {"x": x}).result()
        assert torch.equal(mgr.restore(step=1)["x"].cuda(), want)


def test_no_extra_gpu_memory_and_no_repinning(root):
    state = {f"p{i}": torch.randn(1 << 20, device="cuda") for i in range(32)}
    with CheckpointManager(root, staging=StagingOptions(slots=2)) as mgr:
        mgr.save(0, state).result()
        stats = mgr.stats()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for step in range(1, 6):
            mgr.save(step, state, block=False).wait_staged()
        mgr.wait()
        assert torch.cuda.max_memory_allocated() == base
        after = mgr.stats()
        # the second slot was made once, like the first; nothing after that
        assert after["slot_allocations"] == 2 * stats["slot_allocations"]
        assert after["slot_registrations"] == 2 * stats["slot_registrations"] > 0
        for step in range(6, 9):
            mgr.save(step, state)
        mgr.wait()
        assert mgr.stats()["slot_allocations"] == after["slot_allocations"]
        assert mgr.stats()["slot_registrations"] == after["slot_registrations"]


def test_restore_onto_gpu_target(root):
    state = gpu_state(1)
    target = gpu_state(2)
    with CheckpointManager(root) as mgr:
        mgr.save(1, state).result()
        out = mgr.restore(target=target)
    assert out["w"] is target["w"] and out["w"].is_cuda
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["t"], state["t"])


def test_load_file_onto_the_gpu(tmp_path):
    from safetensors.torch import save_file

    import ckptmgr

    state = {"a": torch.randn(1000, 3), "b": torch.randn(7).bfloat16(), "c": torch.arange(5)}
    path = str(tmp_path / "m.safetensors")
    save_file(state, path)
    got = ckptmgr.load_file(path, device="cuda")
    for k, v in state.items():
        assert got[k].is_cuda and torch.equal(got[k].cpu(), v)


def test_restore_to_gpu_from_the_local_tier_in_place(root):
    state = gpu_state(3)
    state["view"] = state["w"][5:9]
    with CheckpointManager(root) as mgr:
        mgr.save(1, state).result()
        assert mgr._tier is not None and 1 in mgr._tier.steps()
        got = mgr.restore(device="cuda", loader="inplace")
    for k in ("w", "h", "t", "view"):
        assert got[k].is_cuda and torch.equal(got[k], state[k]), k
    assert got["view"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()


@pytest.mark.parametrize("loader", ["ring", "inplace", "auto"])
def test_restore_to_gpu_from_disk_with_each_loader(root, loader):
    state = gpu_state(4)
    state["view"] = state["w"][3:6]
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, state).result()
        got = mgr.restore(device="cuda", loader=loader)
    for k in ("w", "h", "t", "view"):
        assert got[k].is_cuda and torch.equal(got[k], state[k]), k
