"""ckptmgr.pin_file on CPU: real files in /dev/shm, real mappings and descriptors (read back
from /proc), registration faked where CUDA must be (the GPU machine runs the copies for real in
test_cuda_pinned.py)."""

import gc
import os
import threading

import pytest
import torch
from safetensors.torch import save_file as st_save_file
from test_load_file import _raw_file

import ckptmgr
import ckptmgr._cuda as cuda_shim
from ckptmgr import CheckpointCorruptError, CheckpointManager, ConfigError, StagingOptions, StateMismatchError
from ckptmgr.format.layout import ST_TO_DTYPE
from ckptmgr.restore.loaders import pieces


def every_dtype(seed: int = 0) -> dict[str, torch.Tensor]:
    """One tensor of every dtype safetensors stores, of random bits (NaN payloads included)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (code, dtype) in enumerate(sorted(ST_TO_DTYPE.items())):
        n = 3 + 5 * i
        if dtype is torch.bool:
            out[code] = torch.randint(0, 2, (n,), generator=g).bool()
        else:
            raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
            out[code] = raw.view(dtype).reshape(n, 1) if i % 2 else raw.view(dtype)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert same_bits(got[k], v), k


def mapped_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}


def open_fds_to(path: str) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target in (path, path + " (deleted)")
    return n


@pytest.fixture
def fake_cuda(monkeypatch):
    """Registration recorded instead of done: (what, pointer, bytes, read_only)."""
    calls = []
    mu = threading.Lock()

    def reg(p, n, read_only=False):
        with mu:
            calls.append(("reg", p, n, read_only))

    def unreg(p):
        with mu:
            calls.append(("unreg", p))
    monkeypatch.setattr(cuda_shim, "available", lambda: True)
    monkeypatch.setattr(cuda_shim, "host_register", reg)
    monkeypatch.setattr(cuda_shim, "host_unregister", unreg)
    monkeypatch.setattr(pieces, "PIECE_BYTES", 64 << 10)  # several pieces in a small file
    return calls


def test_every_dtype_loads_bit_exact(ram_dir):
    path = os.path.join(ram_dir, "w.safetensors")
    want = every_dtype()
    st_save_file(want, path)
    with ckptmgr.pin_file(path) as weights:
        assert_same(weights.load("cpu"), want)
        assert_same(weights.load("cpu"), want)  # and again
        assert {k: v[0] for k, v in weights.tensors().items()} == {k: v.dtype for k, v in want.items()}
    assert_same(ckptmgr.load_file(path), want)


def test_the_file_pinned_in_pieces_and_released_at_close(ram_dir, fake_cuda):
    path = os.path.join(ram_dir, "w.safetensors")
    want = {"a": torch.randn(100_000), "b": torch.randn(7, 3).bfloat16()}
    st_save_file(want, path)
    size = os.path.getsize(path)
    before = open_fds_to(path)
    weights = ckptmgr.pin_file(path)
    regs = [c for c in fake_cuda if c[0] == "reg"]
    assert sum(c[2] for c in regs) == size and len(regs) == -(-size // (64 << 10))
    assert all(c[3] for c in regs)  # read-only registrations
    assert [c[1] - regs[0][1] for c in regs] == [i * (64 << 10) for i in range(len(regs))]
    assert path in mapped_paths() and open_fds_to(path) == before + 1  # the mapping's own descriptor
    assert_same(weights.load("cpu"), want)
    assert len([c for c in fake_cuda if c[0] == "reg"]) == len(regs)  # loads register nothing
    weights.close()
    unregs = [c[1] for c in fake_cuda if c[0] == "unreg"]
    assert sorted(unregs) == sorted(c[1] for c in regs)
    assert path not in mapped_paths() and open_fds_to(path) == before
    weights.close()  # idempotent
    assert weights.closed
    with pytest.raises(ConfigError, match="closed"):
        weights.load("cpu")


def test_a_file_unlinked_after_pinning_still_loads_bit_exact_until_close(ram_dir, fake_cuda):
    path = os.path.join(ram_dir, "w.safetensors")
    want = every_dtype(1)
    st_save_file(want, path)
    with ckptmgr.pin_file(path) as weights:
        os.unlink(path)
        assert_same(weights.load("cpu"), want)
        assert not weights.refresh()  # nothing at the path: the pinned file keeps serving
        assert_same(weights.load("cpu"), want)
        assert path + " (deleted)" in mapped_paths()
    assert path + " (deleted)" not in mapped_paths()  # its pages go back to the system with the mapping


def test_a_file_replaced_under_a_live_handle_is_picked_up(ram_dir, fake_cuda):
    path = os.path.join(ram_dir, "w.safetensors")
    st_save_file({"w": torch.zeros(50_000)}, path)
    with ckptmgr.pin_file(path) as weights:
        assert_same(weights.load("cpu"), {"w": torch.zeros(50_000)})
        first = [c[1] for c in fake_cuda if c[0] == "reg"]
        new = {"w": torch.randn(60_000), "extra": torch.arange(5)}
        st_save_file(new, path + ".tmp")
        os.replace(path + ".tmp", path)  # the trainer's atomic publish
        assert_same(weights.load("cpu"), new)
        assert sorted(c[1] for c in fake_cuda if c[0] == "unreg") == sorted(first)  # the old file let go
        assert not weights.refresh()  # nothing new since
        # rewritten through the same inode, to another size: picked up too
        newer = {"w": torch.randn(10)}
        st_save_file(newer, path + ".tmp")
        with open(path + ".tmp", "rb") as src, open(path, "r+b") as dst:
            dst.write(src.read())
            dst.truncate()
        assert weights.refresh()
        assert_same(weights.load("cpu"), newer)
        # a broken file published at the path is refused; the pinned one stays
        with open(path + ".tmp", "wb") as f:
            f.write(b"\xff" * 64)
        os.replace(path + ".tmp", path)
        with pytest.raises(CheckpointCorruptError, match="header length"):
            weights.load("cpu")
        os.unlink(path)  # gone again: the last good one serves
        assert_same(weights.load("cpu"), newer)
    assert path not in mapped_paths()


def test_load_into_existing_tensors_and_wrong_ones_refused_before_any_copy(ram_dir):
    path = os.path.join(ram_dir, "w.safetensors")
    want = {"a": torch.randn(1000), "b": torch.randn(4, 5).bfloat16(), "e": torch.zeros(0, 2)}
    st_save_file(want, path)
    with ckptmgr.pin_file(path) as weights:
        out = {"a": torch.empty(1000), "e": torch.empty(0, 2)}
        got = weights.load("cpu", out=out)
        assert got["a"] is out["a"] and got["e"] is out["e"]
        assert_same(got, want)
        keep = torch.full((1000,), 7.0)
        bad = {"a": keep, "b": torch.empty(5, 4, dtype=torch.bfloat16), "nope": torch.empty(1),
               "e": torch.empty(0, 2, dtype=torch.float64)}
        with pytest.raises(StateMismatchError) as info:
            weights.load("cpu", out=bad)
        problems = "\n".join(info.value.problems)
        assert "out['b']: bfloat16[5, 4], but the file holds bfloat16[4, 5]" in problems
        assert "out['nope']: " in problems and "holds no tensor of that name" in problems
        assert "out['e']: float64[0, 2], but the file holds float32[0, 2]" in problems
        assert torch.equal(keep, torch.full((1000,), 7.0))  # nothing copied into the good one either
        with pytest.raises(StateMismatchError, match="not contiguous"):
            weights.load("cpu", out={"b": torch.empty(5, 4, dtype=torch.bfloat16).t()})
        shared = torch.empty(1000)
        with pytest.raises(StateMismatchError, match="on cpu, but the load is to meta"):
            weights.load("meta", out={"a": shared})


@pytest.mark.parametrize(("entries", "size", "match"), [
    ({"a": ("F32", [4], [0, 16]), "b": ("F32", [4], [8, 24])}, 24, "overlaps another tensor"),
    ({"t": ("F32", [2**62, 0], [0, 0])}, 0, "the shape must be"),
    ({"t": ("C128", [2], [0, 32])}, 32, "unknown dtype"),
])
def test_bad_headers_are_refused_before_anything_is_pinned(ram_dir, fake_cuda, entries, size, match):
    path = os.path.join(ram_dir, "crafted.safetensors")
    _raw_file(path, entries, bytes(size))
    before = open_fds_to(path)
    with pytest.raises(CheckpointCorruptError, match=match):
        ckptmgr.pin_file(path)
    assert fake_cuda == [] and path not in mapped_paths() and open_fds_to(path) == before


def test_a_step_file_is_checked_against_its_manifest_at_pinning(ram_dir, fake_cuda, root):
    state = {"w": torch.randn(40_000)}
    with CheckpointManager(root, staging=StagingOptions(local_tier=False),
                           write_options=ckptmgr.WriteOptions(chunk_size=4096)) as mgr:
        mgr.save(1, state).result()
    path = os.path.join(root, "step_000000000001", "data-00000.safetensors")
    with ckptmgr.pin_file(path) as weights:
        assert torch.equal(weights.load("cpu")[next(iter(weights.tensors()))], state["w"])
    with open(path, "r+b") as f:
        f.seek(-100, 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    size = os.path.getsize(path)
    with pytest.raises(CheckpointCorruptError, match=rf"checksum mismatch in bytes \[\d+, {size}\)"):
        ckptmgr.pin_file(path)
    assert [c for c in fake_cuda if c[0] == "reg"] and sorted(c[1] for c in fake_cuda if c[0] == "reg") == sorted(
        c[1] for c in fake_cuda if c[0] == "unreg")  # every piece pinned was unpinned
    assert path not in mapped_paths()


def test_loads_from_several_threads_while_the_file_is_replaced(ram_dir):
    path = os.path.join(ram_dir, "w.safetensors")
    versions = [{"w": torch.full((20_000,), float(i))} for i in range(4)]
    st_save_file(versions[0], path)
    errors: list[BaseException] = []
    seen: set[float] = set()
    with ckptmgr.pin_file(path) as weights:
        start = threading.Barrier(3)

        def loader() -> None:
            try:
                start.wait(timeout=60)
                for _ in range(40):
                    w = weights.load("cpu")["w"]
                    assert torch.all(w == w[0])  # one version, never a mix
                    seen.add(float(w[0]))
            except BaseException as exc:  # reported below
                errors.append(exc)
        threads = [threading.Thread(target=loader) for _ in range(2)]
        for t in threads:
            t.start()
        start.wait(timeout=60)
        for v in versions[1:]:
            st_save_file(v, path + ".tmp")
            os.replace(path + ".tmp", path)
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert_same(weights.load("cpu"), versions[-1])
    assert seen <= {0.0, 1.0, 2.0, 3.0}


def test_a_registration_that_fails_midway_leaves_nothing_pinned_or_mapped(ram_dir, fake_cuda, monkeypatch):
    path = os.path.join(ram_dir, "w.safetensors")
    st_save_file({"a": torch.randn(200_000)}, path)
    real = cuda_shim.host_register
    count = [0]

    def third_fails(p, n, read_only=False):
        count[0] += 1
        if count[0] == 3:
            raise RuntimeError("cudaHostRegister failed with CUDA error 2")
        real(p, n, read_only=read_only)
    monkeypatch.setattr(cuda_shim, "host_register", third_fails)
    before = open_fds_to(path)
    with pytest.raises(RuntimeError, match="CUDA error 2"):
        ckptmgr.pin_file(path)
    assert sorted(c[1] for c in fake_cuda if c[0] == "reg") == sorted(c[1] for c in fake_cuda if c[0] == "unreg")
    assert len([c for c in fake_cuda if c[0] == "reg"]) == 2
    gc.collect()  # (the error's traceback holds the failed call's frames in a reference cycle)
    assert path not in mapped_paths() and open_fds_to(path) == before
