"""GPUDirect Storage through kvikio, on machines without it: the missing extra is named, a
kvikio that cannot do I/O (no driver) or hangs (cuFile forced without GDS) is detected in a
child process and the POSIX paths serve, and the reader and writer move every byte. kvikio
is the stand-in of tests/fake_kvikio here; test_cuda.py runs the real one on the GPU machine."""

import os
import sys
import time

import pytest
import torch
from conftest import assert_tree_equal

import ckptmgr.storage.cufile as gds
from ckptmgr import CheckpointCorruptError, CheckpointManager, ConfigError, StagingOptions, WriteOptions

FAKE = os.path.join(os.path.dirname(__file__), "fake_kvikio")
NO_TIER = StagingOptions(local_tier=False)


@pytest.fixture
def no_kvikio(monkeypatch):
    if gds.installed() and FAKE not in sys.path:
        pytest.skip("kvikio is installed here")
    monkeypatch.setattr(gds, "_probed", {})


@pytest.fixture
def kvikio(monkeypatch, tmp_path):
    """The stand-in kvikio, importable here and in the probe's child process."""
    monkeypatch.syspath_prepend(FAKE)
    monkeypatch.setenv("PYTHONPATH", FAKE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = tmp_path / "kvikio.log"
    monkeypatch.setenv("CKPTMGR_FAKE_KVIKIO_LOG", str(log))
    monkeypatch.setattr(gds, "_probed", {})
    for name in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
        monkeypatch.delitem(sys.modules, name)
    yield log
    for name in [m for m in sys.modules if m == "kvikio" or m.startswith("kvikio.")]:
        del sys.modules[name]


def state():
    g = torch.Generator().manual_seed(3)
    s = {"w": torch.randn(40_000, generator=g), "b": torch.randn(33, generator=g).bfloat16(), "n": 4}
    s["v"] = s["w"][2:7]
    return s


def test_a_missing_extra_is_named_before_any_work(root, no_kvikio):
    with pytest.raises(ConfigError, match=r"pip install 'ckptmgr\[gds\]'"):
        CheckpointManager(root, write_options=WriteOptions(gds=True))
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, state()).result()
        with pytest.raises(ConfigError, match=r"pip install 'ckptmgr\[gds\]'"):
            mgr.restore(device="cpu", loader="gds")
        assert_tree_equal(mgr.restore(), state())  # nothing saved was touched


def test_gds_needs_a_local_root():
    with pytest.raises(ConfigError, match="local or NFS root"):
        CheckpointManager("memory://gds-root", write_options=WriteOptions(gds=True))
    with pytest.raises(ConfigError, match="must be a bool"):
        WriteOptions(gds="yes")


def test_writes_and_reads_go_through_kvikio(root, kvikio):
    with CheckpointManager(root, staging=NO_TIER, write_options=WriteOptions(gds=True, chunk_size=8192)) as mgr:
        mgr.save(1, state()).result()
        writes = [line for line in kvikio.read_text().splitlines() if line.startswith("write")]
        assert len(writes) >= 20  # one per chunk, in parallel
        got = mgr.restore(device="cpu", loader="gds")
        assert_tree_equal(got, state())
        assert got["v"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()
        reads = [line for line in kvikio.read_text().splitlines() if line.startswith("read")]
        assert sum(int(line.split()[-1]) for line in reads) >= 40_000 * 4
        target = {"w": torch.zeros(40_000), "b": torch.zeros(33, dtype=torch.bfloat16), "n": 0, "v": torch.zeros(5)}
        w = target["w"]
        mgr.restore(target=target, loader="gds")
        assert target["w"] is w and torch.equal(w, state()["w"])
    # standard files: anyone's reader verifies them
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        assert_tree_equal(mgr.restore(device="cpu", loader="host"), state())


def test_a_grown_or_truncated_file_fails_the_gds_read(root, kvikio):
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        mgr.save(1, state()).result()
        path = os.path.join(root, "step_000000000001", "data-00000.safetensors")
        size = os.path.getsize(path)
        with open(path, "ab") as f:
            f.write(b"\0" * 8)
        with pytest.raises(CheckpointCorruptError, match="bytes; the manifest says"):
            mgr.restore(1, device="cpu", loader="gds")
        os.truncate(path, size - 4)
        with pytest.raises(CheckpointCorruptError, match="truncated"):
            mgr.restore(1, device="cpu", loader="gds")


def test_gds_reads_are_verified_where_they_landed_and_a_target_stays_whole(root, kvikio):
    """A flipped data byte (same size, same header) is caught on the GDS path too, and a
    restore into a target that fails leaves every target tensor as it was."""
    with CheckpointManager(root, staging=NO_TIER, write_options=WriteOptions(chunk_size=8192)) as mgr:
        mgr.save(1, state()).result()
        path = os.path.join(root, "step_000000000001", "data-00000.safetensors")
        with open(path, "r+b") as f:
            f.seek(-100, 2)
            b = f.read(1)
            f.seek(-100, 2)
            f.write(bytes([b[0] ^ 1]))
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(1, device="cpu", loader="gds")
        target = {"w": torch.zeros(40_000), "b": torch.zeros(33, dtype=torch.bfloat16), "n": 0, "v": torch.zeros(5)}
        with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
            mgr.restore(1, target=target, loader="gds")
        assert not target["w"].any() and not target["b"].any()
    reads = [line for line in kvikio.read_text().splitlines() if line.startswith("read")]
    assert reads  # the first restore did read through kvikio before verifying what landed


def test_no_driver_is_detected_and_posix_serves(root, kvikio, monkeypatch):
    monkeypatch.setenv("CKPTMGR_FAKE_KVIKIO", "nodriver")
    with pytest.warns(RuntimeWarning, match="libcuda.so.1"):
        mgr = CheckpointManager(root, staging=NO_TIER, write_options=WriteOptions(gds=True))
    with mgr:
        mgr.save(1, state()).result()
        with pytest.warns(RuntimeWarning, match="pinned ring instead"):
            assert_tree_equal(mgr.restore(device="cpu", loader="gds"), state())


def test_a_hanging_kvikio_is_given_up_on_in_time(root, kvikio, monkeypatch):
    monkeypatch.setenv("CKPTMGR_FAKE_KVIKIO", "hang")
    monkeypatch.setattr(gds, "PROBE_TIMEOUT_S", 3.0)
    t = time.monotonic()
    with pytest.warns(RuntimeWarning, match="did not finish a test read in 3 s"):
        mgr = CheckpointManager(root, staging=NO_TIER, write_options=WriteOptions(gds=True))
    assert time.monotonic() - t < 30
    with mgr:
        mgr.save(1, state()).result()
        assert_tree_equal(mgr.restore(), state())
    assert not [n for n in os.listdir(root) if n.startswith(".ckptmgr-gds-probe")]


def test_the_probe_tells_real_gds_from_compatibility_mode(tmp_path, kvikio, monkeypatch):
    assert gds.probe(str(tmp_path)).compat
    monkeypatch.setattr(gds, "_probed", {})
    monkeypatch.setenv("CKPTMGR_FAKE_KVIKIO", "gds")
    status = gds.probe(str(tmp_path))
    assert status.usable and not status.compat and "GPUDirect Storage" in str(status)


def test_auto_never_picks_gds_even_where_it_is_real(root, kvikio, monkeypatch):
    """``auto`` keeps a loader that verifies as the data passes through host memory; GDS is opt-in."""
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    monkeypatch.setenv("CKPTMGR_FAKE_KVIKIO", "gds")
    with CheckpointManager(root, staging=NO_TIER) as mgr:
        assert gds.probe(root).usable and not gds.probe(root).compat  # real GDS, as far as anyone can tell
        pick = mgr._restorer.auto_loader
        assert pick(mgr._target, cuda, pinned=False) == "ring"
        assert pick(mgr._target, cuda, pinned=True) == "inplace"
        assert pick(mgr._target, torch.device("cpu"), pinned=False) == "host"
    with CheckpointManager("memory://auto-gds", staging=NO_TIER) as mgr:
        assert mgr._restorer.auto_loader(mgr._target, cuda, pinned=False) == "ring"
