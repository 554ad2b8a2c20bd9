"""Ten thousand small tensors of mixed dtypes restored into a target, bit for bit: every stored
tensor ends in its own target tensor, none dropped and none moved as another dtype, through
every loader, through spare device memory (the path a GPU restore takes, run here on the CPU
through the same plan), and onto a GPU (``cuda``). The targets start as the complement of
every stored bit, so a tensor that did not move shows in every bit of it; the stored values are
random bit patterns, NaN payloads, subnormals and negative zeros among them."""

from __future__ import annotations

import pytest
import torch

from ckptmgr import CheckpointManager, StagingOptions, WriteOptions
from ckptmgr.restore.loaders import read_tensors_ring
from ckptmgr.restore.loaders.landing import Dests, Entry, plan_landing
from ckptmgr.restore.target import match_target

N = 10_000
NO_TIER = StagingOptions(local_tier=False)
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# the dtypes in turn (fp32 and bf16 the most, as in a model), each tensor's length from a cycle
_DTYPES = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.int8,
           torch.float32, torch.float64, torch.uint8, torch.bfloat16, torch.int64, torch.bool, torch.int32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as signed integers of its width (bit patterns compare exactly)."""
    return t.detach().reshape(-1).view(_INT[t.element_size()]).cpu()


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10)
    out = {}
    for i in range(N):
        dtype = _DTYPES[i % len(_DTYPES)]
        shape: tuple[int, ...] = (1 + (i * 7) % 23,)
        if i % 97 == 5:
            shape = (3, 1 + i % 5)
        elif i % 101 == 7:
            shape = ()
        n = 1
        for s in shape:
            n *= s
        if dtype == torch.bool:
            t = torch.randint(0, 2, (n,), generator=g, dtype=torch.int8).view(torch.bool)
        else:
            t = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype)
        out[f"layers.{i}.w"] = t.reshape(shape)
    # the patterns a fused float copy would rewrite (NaN payloads, subnormals, -0)
    out["layers.1.w"] = torch.tensor([0x7F81, -0x003F, 0x0001, -0x8000], dtype=torch.int16).view(torch.bfloat16)
    out["layers.0.w"] = torch.tensor([0x7F800001, -0x003FFFFF, 0x00000001, -0x80000000],
                                     dtype=torch.int32).view(torch.float32)
    out["layers.7.w"] = torch.tensor([0x7FF0000000000001, 1, -0x8000000000000000],
                                     dtype=torch.int64).view(torch.float64)
    # a tied pair and the base of a strided view, restored into targets that share memory
    out["tied_a"], out["tied_b"] = torch.arange(6.0), torch.arange(6.0) + 100
    out["strided"], out["base"] = torch.arange(5.0) + 7, torch.arange(10.0) - 50
    return out


def _complement(t: torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """A tensor like ``t`` (dtype, shape) on ``device`` whose every bit differs from ``t``'s."""
    if t.dtype == torch.bool:
        return (~t).to(device)
    return (~_bits(t)).view(t.dtype).reshape(t.shape).to(device)


def _target(saved: dict[str, torch.Tensor], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    target = {k: _complement(v, device) for k, v in saved.items()}
    tied = torch.zeros(6, device=device)
    base = torch.zeros(10, device=device)
    target.update({"tied_a": tied, "tied_b": tied, "strided": base[::2], "base": base})
    return target


def _check(out: dict[str, torch.Tensor], target: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    """Every plain leaf is its target's own tensor, of its dtype and shape, bit for bit; the
    leaves that share memory end as copied in walk order (the strided view, then its base)."""
    wrong = []
    for k, v in saved.items():
        if k in ("tied_a", "tied_b", "strided", "base"):
            continue
        got = out[k]
        if (got is not target[k] or got.dtype != v.dtype or got.shape != v.shape
                or not torch.equal(_bits(got), _bits(v))):
            wrong.append(k)
    assert not wrong, f"{len(wrong)} of {len(saved)} tensors are not bit-exact in their targets: {wrong[:5]}"
    assert torch.equal(target["tied_a"].cpu(), saved["tied_b"])  # the last copied wins, as copying each leaf would
    assert torch.equal(target["base"].cpu(), saved["base"])


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("many") / "ckpt")
    saved = _state()
    with CheckpointManager(root, staging=NO_TIER, write_options=WriteOptions(chunk_size=1 << 16)) as mgr:
        mgr.save(1, saved).result()
    return root, saved


@pytest.mark.parametrize("loader", ["host", "ring", "inplace"])
def test_ten_thousand_mixed_tensors_land_bit_exact_in_their_targets(saved_root, loader):
    root, saved = saved_root
    target = _target(saved)
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        out = mgr.restore(1, target=target, loader=loader)
    _check(out, target, saved)


def test_ten_thousand_mixed_tensors_move_bit_exact_through_spare_memory(saved_root):
    """The plan a GPU restore uses: the step lands in spare memory and moves into the targets
    in fused copies by dtype at commit (on the CPU here; the same lists and views)."""
    root, saved = saved_root
    target = _target(saved)
    cpu = torch.device("cpu")
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        manifest = mgr._manifest(1)
        plan = match_target(target, manifest.state, manifest.tensors, allow_pickle=False)
        # every plain leaf lands in place; the tied pair and the strided view's base do not
        assert set(plan.dests) == {k for k in saved if k not in ("tied_a", "tied_b", "strided", "base")}
        assert plan.dests.device == cpu and plan.device is None
        tensors = read_tensors_ring(mgr._target, 1, manifest, cpu, mgr._ring, plan.dests, through_device=True)
        out = plan.finish(tensors)
    _check(out, target, saved)


def test_targets_that_cannot_take_the_bytes_as_they_are_are_copied_into(root):
    """A conjugate view, an empty tensor and a strided view are matched but never written in
    place (their memory does not hold the stored bytes as they are): each lands apart and is
    copied into, with the values stored."""
    saved = {"z": torch.tensor([1 + 2j, 3 - 4j]), "e": torch.zeros(0), "s": torch.arange(3.0), "w": torch.ones(4)}
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, saved).result()
        for loader in ("host", "ring", "inplace"):
            conj = torch.zeros(2, dtype=torch.complex64).conj()
            target = {"z": conj, "e": torch.zeros(0), "s": torch.zeros(6)[::2], "w": torch.zeros(4)}
            manifest = mgr._manifest(1)
            plan = match_target(target, manifest.state, manifest.tensors, allow_pickle=False)
            assert list(plan.dests) == ["w"]
            out = mgr.restore(1, target=target, loader=loader)
            assert out["z"] is conj and torch.equal(conj, saved["z"]), loader
            assert torch.equal(target["s"], saved["s"]), loader
            assert out["w"] is target["w"] and torch.equal(out["w"], saved["w"]), loader


def test_only_checked_targets_on_the_plans_device_skip_the_loaders_checks():
    """A landing plan trusts a ``Dests`` only on its own device; a plain dict, or a ``Dests``
    for another device, has every target checked (a wrong shape lands in fresh memory)."""
    stored = torch.arange(4.0)
    entry = Entry("a", torch.float32, (4,), 0, 16)
    image = stored.view(torch.uint8)
    for dests in ({"a": torch.zeros(2)}, Dests({"a": torch.zeros(2)})):
        if isinstance(dests, Dests):
            dests.device = torch.device("meta")
        landing = plan_landing([entry], 0, 16, torch.device("cpu"), dests)
        landing.land(0, image)
        got = landing.tensors()["a"]
        assert got is not dests["a"] and torch.equal(got, stored) and not dests["a"].any()
    checked = Dests({"a": torch.zeros(4)})
    checked.device = torch.device("cpu")
    landing = plan_landing([entry], 0, 16, torch.device("cpu"), checked)
    landing.land(0, image)
    assert landing.tensors()["a"] is checked["a"] and torch.equal(checked["a"], stored)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("loader", ["auto", "inplace"])
def test_ten_thousand_mixed_tensors_land_bit_exact_in_gpu_targets(saved_root, loader):
    """Onto a GPU: through spare device memory and fused moves by dtype (``auto``: the ring),
    and straight from the pinned mapping after every checksum (``inplace``)."""
    root, saved = saved_root
    target = _target(saved, "cuda")
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        out = mgr.restore(1, target=target, loader=loader)
    torch.cuda.synchronize()
    assert all(t.is_cuda for t in target.values())
    _check(out, target, saved)
