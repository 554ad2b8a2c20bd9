"""Landing plans: bytes go straight into a restore target's own tensors, leftovers are
packed, chunks of any size land right; the staging slot of this process is read where it
lies. On CPU here; test_cuda.py runs the same paths onto a GPU."""

import os
import random

import numpy as np
import pytest
import torch
from conftest import assert_tree_equal

import ckptmgr
import ckptmgr._cuda as cuda_shim
import ckptmgr.restore.restorer as restorer_mod
from ckptmgr import CheckpointCorruptError, CheckpointManager, StagingOptions, StateMismatchError, WriteOptions
from ckptmgr.restore.loaders import read_tensors_pinned
from ckptmgr.restore.loaders.landing import Entry, plan_landing

CPU = torch.device("cpu")


def _entries(tensors):
    out, pos = [], 0
    for name, t in tensors.items():
        pos = -(-pos // t.element_size()) * t.element_size()
        out.append(Entry(name, t.dtype, tuple(t.shape), pos, pos + t.numel() * t.element_size()))
        pos = out[-1].end
    return out, pos


@pytest.mark.parametrize("seed", range(5))
def test_any_chunking_lands_every_byte_in_its_place(seed):
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(12):
        dtype = rnd.choice([torch.float32, torch.bfloat16, torch.int8, torch.float64])
        tensors[f"t{i}"] = (torch.randn(rnd.randint(0, 300), generator=g) * 50).to(dtype)
    entries, data_len = _entries(tensors)
    header = 24
    image = torch.zeros(header + data_len, dtype=torch.uint8)
    for e in entries:
        image[header + e.begin:header + e.end] = tensors[e.name].view(torch.uint8)
    # every other tensor has a target to land in; one target has the wrong shape and is skipped
    dests = {n: torch.full_like(t, 0) for i, (n, t) in enumerate(tensors.items()) if i % 2 == 0}
    dests["t2"] = torch.zeros(3, dtype=tensors["t2"].dtype)
    landing = plan_landing(entries, header, data_len, CPU, dests)
    pos = 0
    while pos < image.numel():
        n = rnd.randint(1, 700)
        landing.land(pos, image[pos:pos + n])
        pos += n
    got = landing.tensors()
    assert list(got) == list(tensors)
    for n, t in tensors.items():
        assert torch.equal(got[n], t), n
        if n in dests and n != "t2" and t.numel():
            assert got[n] is dests[n]
    assert got["t2"] is not dests["t2"] and not torch.equal(dests["t2"], torch.ones(3, dtype=dests["t2"].dtype))


@pytest.mark.parametrize("seed", range(3))
def test_through_device_memory_the_target_changes_only_at_commit(seed):
    """Landing through spare memory: every chunk lands beside the target; the target's tensors
    change only at commit(), all of them in one fused copy, and the staged memory is the plan's
    own (dropped with it)."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": (torch.randn(rnd.randint(0, 40), generator=g) * 50).to(
        rnd.choice([torch.float32, torch.bfloat16, torch.int8])) for i in range(200)}
    entries, data_len = _entries(tensors)
    header = 16
    image = torch.zeros(header + data_len, dtype=torch.uint8)
    for e in entries:
        image[header + e.begin:header + e.end] = tensors[e.name].view(torch.uint8)
    # three of four tensors have a target (in runs and alone); the rest land in fresh memory
    dests = {n: torch.full_like(t, 7) for i, (n, t) in enumerate(tensors.items()) if i % 4 != 3}
    before = {n: t.clone() for n, t in dests.items()}
    landing = plan_landing(entries, header, data_len, CPU, dests, through_device=True)
    target_ptrs = {t.data_ptr() for t in dests.values() if t.numel()}
    assert not any(dst.data_ptr() in target_ptrs for _, _, dst in landing.spans)
    pos = 0
    while pos < image.numel():
        n = rnd.randint(1, 900)
        landing.land(pos, image[pos:pos + n])
        pos += n
    for n, t in dests.items():
        assert torch.equal(t, before[n]), f"{n} changed before commit"
    landing.commit()
    got = landing.tensors()
    assert list(got) == list(tensors)
    for n, t in tensors.items():
        assert torch.equal(got[n], t), n
        if n in dests and t.numel():  # (an empty tensor has no memory to land in)
            assert got[n] is dests[n]
    landing.commit()  # a second commit moves nothing again
    assert all(torch.equal(got[n], t) for n, t in tensors.items())


def test_through_device_memory_moves_typed_views_into_any_shape_and_parameters():
    """The moves at commit are the targets themselves and typed views of what landed (a run of
    one dtype split in one call): N-d and zero-dim shapes, parameters that require grad, and a
    foreign file's unaligned tensor (moved as bytes) all end exactly as stored."""
    g = torch.Generator().manual_seed(5)
    tensors = {"m": torch.randn(3, 4, generator=g), "s": torch.randn((), generator=g),
               "v": torch.randn(5, generator=g), "c": torch.randn(2, 2, 2, generator=g).double(),
               "i": torch.arange(6, dtype=torch.int8).view(2, 3), "u": torch.randn(3, generator=g)}
    entries, data_len = _entries(tensors)
    # "u" starts one byte past its dtype's alignment, as a foreign file may place it
    u = entries[-1]
    entries[-1] = Entry(u.name, u.dtype, u.shape, u.begin + 1, u.end + 1)
    data_len += 1
    image = torch.zeros(8 + data_len, dtype=torch.uint8)
    for e in entries:
        image[8 + e.begin:8 + e.end] = tensors[e.name].reshape(-1).view(torch.uint8)
    dests = {n: torch.nn.Parameter(torch.zeros_like(t)) if t.is_floating_point() else torch.zeros_like(t)
             for n, t in tensors.items()}
    landing = plan_landing(entries, 8, data_len, CPU, dests, through_device=True)
    landing.land(0, image)
    assert not any(t.any() for t in dests.values())
    landing.commit()
    got = landing.tensors()
    for n, t in tensors.items():
        assert got[n] is dests[n] and torch.equal(dests[n].detach(), t), n


def test_leftovers_are_packed_with_the_file_alignment():
    tensors = {"a": torch.arange(3, dtype=torch.int8), "b": torch.arange(5, dtype=torch.float64),
               "c": torch.arange(7, dtype=torch.float32)}
    entries, data_len = _entries(tensors)
    landing = plan_landing(entries, 8, data_len, CPU, {"a": torch.zeros(3, dtype=torch.int8)})
    image = torch.zeros(8 + data_len, dtype=torch.uint8)
    for e in entries:
        image[8 + e.begin:8 + e.end] = tensors[e.name].view(torch.uint8)
    landing.land(0, image)
    got = landing.tensors()
    # b and c are neighbours: one span, one allocation; each view keeps its dtype's alignment
    assert len(landing.spans) == 2
    assert got["b"].data_ptr() % 8 == 0 and got["c"].data_ptr() % 4 == 0
    assert got["b"].untyped_storage().data_ptr() == got["c"].untyped_storage().data_ptr()
    assert_tree_equal(got, tensors)


def _model_state(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    return {"model": model, "optim": opt, "extra": {"ema": torch.randn(64), "arr": np.arange(6.0)}, "step": seed}


@pytest.mark.parametrize("loader", ["ring", "inplace", "host"])
def test_restore_into_a_target_writes_its_own_tensors(root, loader, monkeypatch):
    import ckptmgr.restore.values as restore_mod

    copies = []  # second copies from a loaded tensor into the target
    real_copy = restore_mod.copy_into
    monkeypatch.setattr(restore_mod, "copy_into", lambda d, s: (copies.append(d) if s is not d else None,
                                                           real_copy(d, s)))
    saved = _model_state(1)
    with CheckpointManager(root, staging=StagingOptions(local_tier=False),
                           write_options=WriteOptions(chunk_size=4096)) as mgr:
        mgr.save(7, saved).result()
        target = _model_state(2)
        fresh_opt = torch.optim.AdamW(target["model"].parameters(), lr=1e-2)  # no state tensors yet
        target["optim"] = fresh_opt
        ptrs = [p.data_ptr() for p in target["model"].parameters()] + [target["extra"]["ema"].data_ptr()]
        out = mgr.restore(target=target, loader=loader)
    assert [p.data_ptr() for p in target["model"].parameters()] + [target["extra"]["ema"].data_ptr()] == ptrs
    assert_tree_equal(target["model"].state_dict(), saved["model"].state_dict())
    assert_tree_equal(fresh_opt.state_dict(), saved["optim"].state_dict())
    assert out["extra"]["ema"] is target["extra"]["ema"] and torch.equal(out["extra"]["ema"], saved["extra"]["ema"])
    assert out["step"] == 1 and np.array_equal(out["extra"]["arr"], np.arange(6.0))
    assert copies == []  # every loader lands straight in the target's tensors


@pytest.mark.parametrize("loader", ["ring", "inplace"])
def test_a_mismatched_target_is_refused_before_any_byte_lands(root, loader):
    saved = {"a": torch.randn(1000), "b": torch.randn(10), "n": np.zeros(3)}
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:
        mgr.save(1, saved).result()
        target = {"a": torch.zeros(1000), "b": torch.zeros(11), "n": np.zeros(4)}
        with pytest.raises(StateMismatchError) as info:
            mgr.restore(target=target, loader=loader)
    assert "state['b']" in str(info.value) and "state['n']" in str(info.value)
    assert not target["a"].any()  # a fits, but nothing was written while b and n do not


def test_a_corrupt_newest_step_falls_back_and_the_target_ends_at_the_older_step(root):
    with CheckpointManager(root, staging=StagingOptions(local_tier=False),
                           write_options=WriteOptions(chunk_size=4096)) as mgr:
        one, two = {"w": torch.randn(10_000)}, {"w": torch.randn(10_000)}
        mgr.save(1, one).result()
        mgr.save(2, two).result()
        path = os.path.join(root, "step_000000000002", "data-00000.safetensors")
        with open(path, "r+b") as f:
            f.seek(-7, 2)
            f.write(b"\x00" * 7)
        target = {"w": torch.zeros(10_000)}
        with pytest.warns(RuntimeWarning, match="skipping step 2"):
            mgr.restore(target=target, loader="ring")
    assert torch.equal(target["w"], one["w"])


def _saved_tier_images(mgr, state, *, shared):
    """Save ``state`` as step 1 and map its local-tier files (``shared``: writes reach the files)."""
    mgr.save(1, state).result()
    manifest = mgr._manifest(1, mgr._tier)
    return manifest, {n: torch.from_file(mgr._tier.path_of(1, n), shared=shared, size=rec.size, dtype=torch.uint8)
                      for n, rec in manifest.files.items()}


def test_pinned_images_are_read_where_they_lie_and_verified(root, tmp_path):
    local = str(tmp_path / "shm")
    os.makedirs(local)
    state = {"w": torch.randn(50_000), "b": torch.randn(7).bfloat16()}
    state["v"] = state["w"][4:9]
    with CheckpointManager(root, staging=StagingOptions(local_dir=local),
                           write_options=WriteOptions(chunk_size=8192)) as mgr:
        manifest, images = _saved_tier_images(mgr, state, shared=True)
        got = read_tensors_pinned(images, manifest, CPU, mgr._ring, "tier")
        assert_tree_equal({k: got[k] for k in ("w", "b", "v")}, {k: state[k] for k in ("w", "b", "v")})
        target = {"w": torch.zeros(50_000)}
        got = read_tensors_pinned(images, manifest, CPU, mgr._ring, "tier", dests=target)
        assert got["w"] is target["w"] and torch.equal(target["w"], state["w"])
        name = next(iter(images))
        images[name][-3] ^= 0xFF
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            read_tensors_pinned(images, manifest, CPU, mgr._ring, "tier")
        images[name][-3] ^= 0xFF
        with pytest.raises(CheckpointCorruptError, match="staged image"):
            read_tensors_pinned({name: images[name][:-1]}, manifest, CPU, mgr._ring, "tier")


def test_pinned_images_with_a_bad_chunk_leave_a_target_as_it_was(root, tmp_path):
    """Straight into a target, every chunk of the images is verified before the first copy:
    a bad one (the last chunk, checked last) raises with the target's bytes unchanged."""
    local = str(tmp_path / "shm")
    os.makedirs(local)
    state = {"w": torch.randn(50_000), "x": torch.randn(30_000)}
    with CheckpointManager(root, staging=StagingOptions(local_dir=local),
                           write_options=WriteOptions(chunk_size=8192)) as mgr:
        manifest, images = _saved_tier_images(mgr, state, shared=False)
        for image in images.values():
            image[-1] ^= 0xFF
        target = {"w": torch.full((50_000,), 7.0), "x": torch.full((30_000,), 7.0)}
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            read_tensors_pinned(images, manifest, CPU, mgr._ring, "tier", dests=target)
        assert bool((target["w"] == 7.0).all()) and bool((target["x"] == 7.0).all())


def test_restores_in_the_saving_process_read_its_pinned_slot(root, tmp_path, monkeypatch, ram_dir):
    """With CUDA (faked here: registration only), the slot files are pinned once at the first
    save; restoring that step reads them where they lie instead of from the files."""
    monkeypatch.setattr(cuda_shim, "available", lambda: True)
    monkeypatch.setattr(cuda_shim, "host_register", lambda p, n, read_only=False: None)
    monkeypatch.setattr(cuda_shim, "host_unregister", lambda p: None)
    used = []
    real = restorer_mod.read_tensors_pinned
    monkeypatch.setattr(restorer_mod, "read_tensors_pinned", lambda *a, **k: used.append(1) or real(*a, **k))
    local = ram_dir  # in RAM, as a pinned tier must be
    state = {"w": torch.randn(20_000)}
    with CheckpointManager(root, staging=StagingOptions(local_dir=local)) as mgr:
        mgr.save(1, state).result()
        got = mgr.restore(device="cpu", loader="inplace")
        assert used == [1] and torch.equal(got["w"], state["w"])
        target = {"w": torch.zeros(20_000)}
        mgr.restore(target=target, loader="inplace")
        assert used == [1, 1] and torch.equal(target["w"], state["w"])


def test_load_file_still_reads_foreign_unaligned_tensors(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "m.safetensors")
    save_file({"a": torch.arange(3, dtype=torch.int8), "b": torch.arange(5, dtype=torch.float32)}, path)
    got = ckptmgr.load_file(path)
    assert torch.equal(got["b"], torch.arange(5, dtype=torch.float32))


_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def _bit_patterns() -> dict[str, torch.Tensor]:
    def bits(values, dtype, width):  # the exact bit patterns, as signed integers of the width
        return torch.tensor([v - (1 << (8 * width)) if v >= 1 << (8 * width - 1) else v for v in values],
                            dtype={2: torch.int16, 4: torch.int32}[width]).view(dtype)

    return {
        "bf": bits([0x7F81, 0xFFC1, 0x7FC0, 0x0001], torch.bfloat16, 2),
        "bf2": bits([0xFF81, 0x7FFF], torch.bfloat16, 2),
        "h": bits([0x7C01, 0xFE01, 0x3C00, 0x0001], torch.float16, 2),
        "f": bits([0x7F800001, 0xFFC00001, 0x00000001, 0x80000000, 0x807FFFFF], torch.float32, 4),
        "d": torch.tensor([0x7FF0000000000001, 0x7FF8000000000001, 1, -(1 << 63)],
                          dtype=torch.int64).view(torch.float64),
        "u16": torch.arange(7, dtype=torch.int32).to(torch.uint16),
        "u32": torch.arange(5, dtype=torch.int64).to(torch.uint32),
        "u32b": torch.arange(9, dtype=torch.int64).to(torch.uint32),
        "u64": torch.arange(3).to(torch.uint64),
        "b": torch.tensor([True, False, True]),
        "f8": torch.arange(4, dtype=torch.int8).view(torch.float8_e4m3fn),
        "c": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
        "large": (torch.arange((2 << 20) // 2, dtype=torch.int16) | 0x7F81).view(torch.bfloat16),
    }


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("names", ["bf,bf2", "h", "f", "d", "u32,u32b", "u16,u64",
                                   "bf,h,f,d,u16,u32,u64,b,f8,c,large"])
def test_moves_through_spare_memory_keep_every_bit(device, names):
    """NaN payloads, subnormals and negative zeros survive the fused copies at commit: bf16
    and fp16 move as integers of the same width (a fused copy of theirs goes through float and
    rewrites NaN payloads), fp32 and fp64 as themselves (their fused copy computes in the
    dtype); dtypes without a fused copy (uint16/32/64, bool, fp8, complex) move too: files of
    one dtype (one fused copy) and a mixed one, small tensors and a large one."""
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else CPU  # (as a restore names it)
    patterns = _bit_patterns()
    tensors = {n: patterns[n] for n in names.split(",")}
    entries, data_len = _entries(tensors)
    image = torch.zeros(8 + data_len, dtype=torch.uint8)
    for e in entries:
        image[8 + e.begin:8 + e.end] = tensors[e.name].reshape(-1).view(torch.uint8)
    dests = {n: torch.zeros(t.shape, dtype=t.dtype, device=dev) for n, t in tensors.items()}
    landing = plan_landing(entries, 8, data_len, dev, dests, through_device=True)
    landing.land(0, image.to(dev))
    landing.commit()
    assert all(landing.tensors()[n] is dests[n] for n in tensors)  # every one moved into its target
    for n, t in tensors.items():
        got = dests[n].cpu()
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        assert torch.equal(got.view(width), t.view(width)), n
