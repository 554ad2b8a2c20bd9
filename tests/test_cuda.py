"""The CUDA paths, for real: run on the GPU machine (``pytest -m cuda``); skipped elsewhere."""

from concurrent.futures import wait as futures_wait

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
        # each of the two slots was made once (the second may be made ahead, during the first
        # save); nothing after that
        slots = mgr._saver.pool.slots
        assert len(slots) == 2 and stats["slot_allocations"] > 0
        assert after["slot_allocations"] == sum(len(s.buffers) for s in slots)
        assert after["slot_registrations"] >= stats["slot_registrations"] > 0
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


@pytest.mark.parametrize(("loader", "tier"), [("auto", True), ("ring", False), ("inplace", False), ("host", False)])
def test_restore_lands_in_the_gpu_target_and_keeps_no_new_gpu_memory(root, loader, tier):
    """The target's own tensors take the bytes. On the way, a restore may borrow spare device
    memory for the step (it lands there verified, then moves in); none of it is kept."""
    state = {"w": torch.randn(4096, 1024, device="cuda"), "b": torch.randn(1024, device="cuda").bfloat16()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with CheckpointManager(root, staging=StagingOptions(local_tier=tier)) as mgr:
        mgr.save(1, state).result()
        target = {"w": torch.zeros_like(state["w"]), "b": torch.zeros_like(state["b"])}
        ptr = target["w"].data_ptr()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        mgr.restore(target=target, loader=loader)
        torch.cuda.synchronize()
        borrowed = torch.cuda.max_memory_allocated() - before
        kept = torch.cuda.memory_allocated() - before
    assert target["w"].data_ptr() == ptr
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    if loader != "host":
        assert kept < 1 << 20, f"{kept} bytes of new GPU memory kept"
        assert borrowed <= nbytes + (1 << 20), f"{borrowed} bytes borrowed for a {nbytes}-byte step"


def test_a_step_in_this_process_is_copied_from_its_pinned_slot(root, monkeypatch):
    import ckptmgr.restore.restorer as restorer_mod

    used = []
    real = restorer_mod.read_tensors_pinned
    monkeypatch.setattr(restorer_mod, "read_tensors_pinned", lambda *a, **k: used.append(1) or real(*a, **k))
    state = gpu_state(5)
    with CheckpointManager(root) as mgr:
        mgr.save(1, state).result()
        got = mgr.restore(device="cuda")
    assert used == [1]
    for k in ("w", "h", "t"):
        assert got[k].is_cuda and torch.equal(got[k], state[k]), k


def test_a_bad_pinned_chunk_leaves_the_gpu_target_as_it_was(root, ram_dir):
    """From pinned images into a GPU target through spare device memory: the copies run while
    the chunks are verified, and a bad chunk raises before anything moves into the target."""
    from ckptmgr import CheckpointCorruptError, WriteOptions
    from ckptmgr.restore.loaders import read_tensors_pinned

    g = torch.Generator(device="cuda").manual_seed(3)
    state = {f"p{i}": torch.randn(1 << 20, device="cuda", generator=g) for i in range(8)}
    with CheckpointManager(root, staging=StagingOptions(local_dir=ram_dir),
                           write_options=WriteOptions(chunk_size=1 << 20)) as mgr:
        mgr.save(1, state).result()
        manifest = mgr._manifest(1, mgr._tier)
        with mgr._tier.reading(1) as images:
            assert images is not None  # pinned where they lie
            target = {k: torch.full_like(v, 7.0) for k, v in state.items()}
            got = read_tensors_pinned(images, manifest, torch.device("cuda", torch.cuda.current_device()),
                                      mgr._ring, "tier", dests=target, through_device=True)
            for k, v in state.items():
                assert got[k] is target[k] and torch.equal(target[k], v), k
            target = {k: torch.full_like(v, 7.0) for k, v in state.items()}
            copies = {n: image.clone() for n, image in images.items()}  # the slot itself stays intact
            for image in copies.values():
                image[image.numel() // 2] ^= 0xFF
            with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
                read_tensors_pinned(copies, manifest, torch.device("cuda", torch.cuda.current_device()),
                                    mgr._ring, "tier", dests=target, through_device=True)
            torch.cuda.synchronize()
            assert all(bool((t == 7.0).all()) for t in target.values())


def test_kvikio_writes_and_reads_for_real(root):
    pytest.importorskip("kvikio")
    import ckptmgr.storage.cufile as gds
    from ckptmgr import WriteOptions

    state = gpu_state(6)
    state["big"] = torch.randn(8 << 20, device="cuda")
    with CheckpointManager(root, staging=StagingOptions(local_tier=False), write_options=WriteOptions(gds=True)) as mgr:
        assert mgr._target.gds, gds.probe(root)
        mgr.save(1, state).result()
        got = mgr.restore(device="cuda", loader="gds")
        target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
        mgr.restore(target=target, loader="gds")
    for k in ("w", "h", "t", "big"):
        assert got[k].is_cuda and torch.equal(got[k], state[k]), k
        assert torch.equal(target[k], state[k]), k
    with CheckpointManager(root, staging=StagingOptions(local_tier=False)) as mgr:  # standard, verified files
        mgr.restore(device="cuda", loader="ring")


@pytest.mark.parametrize("mode", ["pieces", "populate", "whole"])
def test_slots_pinned_in_pieces_take_copies_split_at_the_boundaries(root, monkeypatch, mode):
    """A copy across two registrations fails with cudaErrorInvalidValue: staging splits its
    device-to-host copies at the piece boundaries, restores copy chunk by chunk."""
    import ckptmgr.save.buffers as buffers
    from ckptmgr import WriteOptions

    monkeypatch.setattr(buffers, "PIN_MODE", mode)
    monkeypatch.setattr(buffers, "PIN_PIECE_BYTES", 1 << 20)  # pieces of 1 MiB: most tensors straddle one
    g = torch.Generator(device="cuda").manual_seed(7)
    state = {f"p{i}": torch.randn(300_000 + 1000 * i, device="cuda", generator=g) for i in range(6)}
    state["t"] = torch.randn(700, 900, device="cuda", generator=g).t()  # non-contiguous, straddling
    state["h"] = torch.randn(3_000_000, device="cuda", generator=g).bfloat16()
    opts = WriteOptions(chunk_size=256 << 10, max_file_bytes=8 << 20)
    with CheckpointManager(root, write_options=opts, staging=StagingOptions(slots=2)) as mgr:
        mgr.prepare(state)
        mgr.wait()
        for step in range(3):
            mgr.save(step, state, block=step % 2 == 0).wait_staged()
            mgr.wait()
            for loader in ("auto", "inplace", "ring"):
                got = mgr.restore(step, device="cuda", loader=loader)
                for k, v in state.items():
                    assert torch.equal(got[k], v), (mode, step, loader, k)
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            mgr.restore(step, target=target)
            for k, v in state.items():
                assert torch.equal(target[k], v), (mode, step, k)
            for v in state.values():
                v.add_(1)
        if mode == "pieces":
            slot = mgr._saver.pool.slots[0]
            assert slot.piece == 1 << 20 and all(len(b.registered) > 1 for b in slot.buffers if b.nbytes > 1 << 20)


@pytest.mark.parametrize("back", [False, True], ids=["front", "both-ends"])
def test_a_restore_during_the_adoption_copies_the_pinned_pieces_to_the_gpu_as_they_come(root, ram_dir, monkeypatch,
                                                                                        back):
    """A restore that reaches an adopted slot while its adoption is held after two of its
    pieces (real registrations) copies those to the GPU target, then the rest once the
    adoption goes on: bit-exact, in place. ``both-ends``: the bounce readers also read the
    slot's files from the far end (real pinned buffers and copies), meeting the front, the
    adoption held meanwhile."""
    import threading

    import ckptmgr._cuda as cuda_shim
    import ckptmgr.restore.loaders.bounce as bounce_mod
    import ckptmgr.restore.loaders.images as images_mod
    import ckptmgr.save.buffers as buffers_mod
    import ckptmgr.storage.tier_pinning as pinning_mod
    from ckptmgr import Schedule, WriteOptions

    monkeypatch.setattr(buffers_mod, "PIN_PIECE_BYTES", 2 << 20)  # two 1 MiB chunks a piece
    taken: list[int] = []
    if back:
        monkeypatch.setattr(images_mod, "BACK_FROM_BYTES", 0)
        monkeypatch.setattr(bounce_mod, "PIECE_BYTES", 256 << 10)
        real_back = bounce_mod.Ends.back

        def back_taken(self, w, k):
            i = real_back(self, w, k)
            if i is not None:
                taken.append(i)
            return i
        monkeypatch.setattr(bounce_mod.Ends, "back", back_taken)
    opts = {"staging": StagingOptions(slots=1, local_dir=ram_dir), "write_options": WriteOptions(chunk_size=1 << 20),
            "schedule": Schedule(durable_every=2)}
    g = torch.Generator(device="cuda").manual_seed(5)
    state = {f"p{i}": torch.randn(1 << 20, device="cuda", generator=g) for i in range(8)}  # 32 MiB: 16+ pieces
    mgr = CheckpointManager(root, **opts)
    mgr.save(1, state).result()
    mgr.close(flush=False)  # step 1 stays in the tier only
    real_register, count, held, go = cuda_shim.host_register, [0], threading.Event(), threading.Event()

    def register(ptr, n, **kw):
        if threading.current_thread().name.startswith("ckptmgr-adopt"):
            count[0] += 1
            if count[0] == 3:  # before the third piece
                held.set()
                assert go.wait(60)
        real_register(ptr, n, **kw)

    blocked, real_wait = threading.Event(), pinning_mod.Pinning.wait

    def wait(self, name, end, deadline, budget):
        with self._cond:
            if self._upto.get(name, 0) < end:
                blocked.set()  # pieces 0 and 1 are queued for the GPU, piece 2 is not pinned
        return real_wait(self, name, end, deadline, budget)

    monkeypatch.setattr(cuda_shim, "host_register", register)
    monkeypatch.setattr(pinning_mod.Pinning, "wait", wait)
    try:
        with CheckpointManager(root, **opts) as mgr:
            assert held.wait(60)
            target = {k: torch.full_like(v, 7.0) for k, v in state.items()}
            torch.cuda.synchronize()
            out: list[object] = []
            t = threading.Thread(target=lambda: out.append(mgr.restore(1, target=target)))
            t.start()
            if back:  # (it holds the adoption and reads the rest itself: no wait for piece 2)
                t.join(60)
                assert not t.is_alive() and out and not blocked.is_set()
            else:
                assert blocked.wait(60)
            go.set()
            t.join(60)
            assert not t.is_alive() and out
            with mgr._saver.pool._cond:
                adoption = mgr._saver.pool._adopting.get(0)
            if adoption is not None:
                adoption.result(timeout=60)
            assert count[0] > 3
            torch.cuda.synchronize()
            for k, v in state.items():
                assert torch.equal(target[k], v), k
            assert bool(taken) == back
            mgr.wait(timeout=60)
    finally:
        go.set()


def test_an_adopted_tier_slot_lands_in_the_gpu_target_in_place_and_a_damaged_one_never(root, ram_dir, monkeypatch):
    """A restarted job adopts the slot its predecessor left in the tier; the slot was verified
    at start-up, so a restore after those checks copies straight into the target (no spare
    device memory); a slot damaged before the start never reaches the target."""
    from conftest import hold_durable_write

    from ckptmgr import CheckpointCorruptError, SaveError, Schedule, WriteOptions

    restored = hold_durable_write(monkeypatch, 3)  # (that write removes the damaged step from the tier)
    opts = {"staging": StagingOptions(slots=1, local_dir=ram_dir), "write_options": WriteOptions(chunk_size=1 << 20),
            "schedule": Schedule(durable_every=2)}  # odd steps stay in the tier
    g = torch.Generator(device="cuda").manual_seed(4)
    state = {f"p{i}": torch.randn(1 << 20, device="cuda", generator=g) for i in range(8)}
    for damaged in (False, True):
        mgr = CheckpointManager(root, **opts)
        mgr.save(2 * damaged + 1, state).result()
        path = mgr._tier.path_of(2 * damaged + 1, "data-00000.safetensors")
        mgr.close(flush=False)  # the odd step stays in the tier only
        if damaged:
            with open(path, "r+b") as f:
                f.seek(-5, 2)
                b = f.read(1)
                f.seek(-5, 2)
                f.write(bytes([b[0] ^ 0x01]))
        with CheckpointManager(root, **opts) as mgr:
            target = {k: torch.full_like(v, 7.0) for k, v in state.items()}
            if not damaged:  # (checks still running would land it through spare memory: the test below)
                for _, checks in list(mgr._p.restorer._adopted.values()):
                    futures_wait(checks, timeout=60)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            if damaged:
                with pytest.raises(CheckpointCorruptError, match="step 3"):
                    mgr.restore(3, target=target)
                torch.cuda.synchronize()
                assert all(bool((t == 7.0).all()) for t in target.values())
                restored.set()
                with pytest.raises(SaveError, match="no longer matches"):  # nor written to the root
                    mgr.wait(timeout=60)
            else:
                mgr.restore(1, target=target)
                torch.cuda.synchronize()
                assert torch.cuda.max_memory_allocated() - before < 1 << 20  # in place: nothing borrowed
                for k, v in state.items():
                    assert torch.equal(target[k], v), k
                mgr.wait(timeout=60)


def test_a_restore_while_the_adopted_slot_is_still_checked_lands_through_spare_memory(root, ram_dir, monkeypatch):
    """Right after a restart the adoption's checks of the tier slot still run: the restore
    copies beside them into spare device memory, and moves the bytes into the target only
    once every check passed (held here until the copies have gone)."""
    import threading

    import ckptmgr.restore.preflight as preflight_mod
    from ckptmgr import Schedule, WriteOptions

    opts = {"staging": StagingOptions(slots=1, local_dir=ram_dir), "write_options": WriteOptions(chunk_size=1 << 20),
            "schedule": Schedule(durable_every=2)}
    g = torch.Generator(device="cuda").manual_seed(6)
    state = {f"p{i}": torch.randn(1 << 20, device="cuda", generator=g) for i in range(8)}  # 32 MiB
    mgr = CheckpointManager(root, **opts)
    mgr.save(1, state).result()
    mgr.close(flush=False)  # step 1 stays in the tier only
    go, real_crc = threading.Event(), preflight_mod.crc32c_hex

    def crc(data):
        assert go.wait(60)
        return real_crc(data)

    monkeypatch.setattr(preflight_mod, "crc32c_hex", crc)
    try:
        with CheckpointManager(root, **opts) as mgr:
            target = {k: torch.full_like(v, 7.0) for k, v in state.items()}
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out: list[object] = []
            t = threading.Thread(target=lambda: out.append(mgr.restore(1, target=target)))
            t.start()
            t.join(2)  # (the restore waits for the held checks; the target has not changed)
            assert t.is_alive() and all(bool((v == 7.0).all()) for v in target.values())
            go.set()
            t.join(60)
            assert not t.is_alive() and out
            torch.cuda.synchronize()
            assert torch.cuda.max_memory_allocated() - before >= 32 << 20  # the step, beside the target
            for k, v in state.items():
                assert torch.equal(target[k], v), k
            mgr.wait(timeout=60)
    finally:
        go.set()


def test_a_device_buffer_snapshot_of_unsigned_and_float8_tensors_only(root):
    """All of a device's copies go into its snapshot buffer and share a dtype and strides: the
    one ``_foreach_copy_`` of them takes its one-kernel path, which dispatches fewer dtypes
    than ``copy_`` (uint16/32/64; float8 on older torch); each such state saves and restores."""
    dtypes = [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]
    for i, dtype in enumerate(dtypes):
        raw = torch.randint(0, 120, (300 + i,), dtype=torch.int64, device="cuda")
        state = {f"p{k}": raw.to(torch.uint8).repeat(dtype.itemsize).view(dtype) for k in range(3)}
        want = {k: v.cpu() for k, v in state.items()}
        with CheckpointManager(root, staging=StagingOptions(device_buffer_bytes=64 << 20)) as mgr:
            mgr.save(i, state).result()
            got = mgr.restore(step=i)
        for k, v in want.items():
            assert got[k].dtype == dtype, (dtype, k)
            assert torch.equal(got[k].cpu().view(torch.uint8), v.view(torch.uint8)), (dtype, k)


def test_a_save_enqueues_its_device_copies_in_one_call_per_stream(root, monkeypatch):
    """A ``copy_`` per tensor gives the GIL up and takes it back once per tensor, each taking
    waiting behind the training thread's Python: the feeder enqueues a device's copies in one
    ``_foreach_copy_`` (and the drains of a device snapshot buffer in one more)."""
    calls: list[int] = []
    real = torch._foreach_copy_

    def counted(dsts, srcs, **kw):
        calls.append(len(dsts))
        return real(dsts, srcs, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    state = {f"p{i}": torch.randn(4096 + i, device="cuda") for i in range(200)}
    state["t"] = torch.randn(64, 32, device="cuda").t()  # non-contiguous
    want = {k: v.clone() for k, v in state.items()}
    with CheckpointManager(root) as mgr:
        mgr.save(1, state).result()
        assert calls == [201]
        got = mgr.restore(step=1, device="cuda")
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    calls.clear()
    with CheckpointManager(root, staging=StagingOptions(device_buffer_bytes=64 << 20)) as mgr:
        mgr.save(2, state).result()
        assert len(calls) == 2 and calls[0] == 201  # into the buffer, then its drains
        got = mgr.restore(step=2, device="cuda")
    for k, v in want.items():
        assert torch.equal(got[k], v), k
