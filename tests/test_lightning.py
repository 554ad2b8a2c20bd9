"""The Lightning CheckpointIO plugin with real Trainers on CPU: every .ckpt is a torch
checkpoint file that loads with no ckptmgr installed, wherever it is copied; a fit SIGKILLed
mid-run and resumed with ckpt_path="last" ends bitwise identical to one never interrupted;
direct saves are on disk when they return; hyper-parameters of any type round-trip."""

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import zygote
from conftest import assert_tree_equal

from ckptmgr import CheckpointCorruptError, ConfigError, StagingOptions
from ckptmgr.format import torchzip
from ckptmgr.integrations.lightning import CkptmgrCheckpointIO

HERE = os.path.dirname(__file__)
TRAINER = os.path.join(HERE, "lightning_trainer.py")
LOADER = os.path.join(HERE, "load_without_ckptmgr.py")


def run(d, epochs, out, *extra):
    # faulthandler: a worker process that dies of a signal prints its threads' stacks
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = zygote.run([sys.executable, TRAINER, d, str(epochs), out, *extra], template="lightning",
                      capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr + died_how(proc.stderr)
    return proc.stdout


def died_how(stderr):
    """What a process that died of a signal printed (a C++ exception, faulthandler's stacks),
    repeated at the end of a failure's message: a report that keeps only the tail of a long
    output then still shows it."""
    lines = stderr.splitlines()
    # glibc's line: a thread exited (Python 3.11 does so to one taking the GIL at shutdown) through a catch (...)
    starts = [i for i, ln in enumerate(lines)
              if ln.startswith(("Fatal Python error", "terminate called", "FATAL: exception not rethrown"))]
    return "\n--- why a process died:\n" + "\n".join(lines[starts[0]:starts[0] + 60]) if starts else ""


def load_elsewhere(files, *flags):
    proc = zygote.run([sys.executable, LOADER, *flags, *files], template="lightning", capture_output=True, text=True,
                      timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def ckpts(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".ckpt"))


EPOCHS = 6  # of the reference fit, and of the fits that are compared with it


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted fit of EPOCHS epochs for the module: its checkpoint directory (not to
    be changed) and its final state (``ref.pt``)."""
    base = tmp_path_factory.mktemp("reference")
    run(str(base / "run"), EPOCHS, str(base / "ref.pt"))
    return base / "run", base / "ref.pt"


def test_every_ckpt_loads_without_ckptmgr_also_copied_elsewhere(tmp_path, reference):
    ref_dir, _ = reference
    d = str(tmp_path / "run")
    shutil.copytree(ref_dir, d)  # the fit's own files, copied: the copy is moved and removed below
    names = ckpts(d)
    assert "last.ckpt" in names and len(names) == 3  # top 2 + last
    assert not [n for n in os.listdir(d) if not n.endswith(".ckpt")]  # no temporaries, no hidden directories
    out = load_elsewhere([os.path.join(d, n) for n in names], "--weights-only")
    assert f"ok {len(names)}" in out
    moved = tmp_path / "elsewhere"
    shutil.copytree(d, moved)
    shutil.rmtree(d)
    assert f"ok {len(names)}" in load_elsewhere([str(moved / n) for n in names], "--weights-only")


def test_hyper_parameters_with_modules_dataclasses_and_namespaces_round_trip(tmp_path):
    d = str(tmp_path / "run")
    run(d, 2, str(tmp_path / "out.pt"), "--hparams", "rich")
    out = load_elsewhere([os.path.join(d, "last.ckpt")])
    assert "['extra', 'loss', 'optim', 'width']" in out
    ckpt = CkptmgrCheckpointIO().load_checkpoint(os.path.join(d, "last.ckpt"), weights_only=False)
    hp = ckpt["hyper_parameters"]
    assert type(hp["loss"]) is torch.nn.MSELoss and hp["optim"].lr == 0.05 and hp["extra"].tag == "run"
    # weights_only stays torch's default (True) unless asked: such a file is refused, as Lightning's own
    with pytest.raises(Exception, match="weights_only"):
        CkptmgrCheckpointIO().load_checkpoint(os.path.join(d, "last.ckpt"))


def test_killed_fit_resumed_from_last_ends_bitwise_identical(tmp_path, reference):
    _, ref_pt = reference
    d = str(tmp_path / "run")
    proc = zygote.Popen([sys.executable, TRAINER, d, str(EPOCHS), str(tmp_path / "x.pt"), "--step-sleep", "0.02"],
                        template="lightning", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("epoch 2 done"):
            break
    proc.send_signal(signal.SIGKILL)  # mid-epoch 3, with a save possibly in flight
    proc.wait()
    # every .ckpt that exists is complete: it loads and passes its checksums
    names = ckpts(d)
    assert "last.ckpt" in names
    for n in names:
        with open(os.path.join(d, n), "rb") as f:
            assert torchzip.verify_file(f)
        assert torch.load(os.path.join(d, n), weights_only=True)["epoch"] >= 0
    out = run(d, EPOCHS, str(tmp_path / "resumed.pt"), "--resume")
    assert "finished" in out
    ref, got = torch.load(ref_pt, weights_only=False), torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert got["global_step"] == ref["global_step"] == 60
    assert_tree_equal(got["model"], ref["model"])
    assert_tree_equal(got["optim"], ref["optim"])
    # ModelCheckpoint's choices are all that is left, and the killed run's temporaries are gone
    assert sorted(os.listdir(d)) == ckpts(d) and len(ckpts(d)) == 3


def test_a_kill_during_the_write_of_last_ckpt_resumes_from_the_newest_complete_checkpoint(tmp_path, reference):
    """ckpt_path="last" picks last.ckpt by mtime: killed while last.ckpt of epoch 2 was being
    written, it still holds epoch 1, and epoch=2-step=30.ckpt, complete, is newer."""
    _, ref_pt = reference
    d = str(tmp_path / "run")
    proc = zygote.Popen([sys.executable, TRAINER, d, str(EPOCHS), str(tmp_path / "x.pt"), "--hold-last", "3"],
                        template="lightning", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("holding"):
                break
        else:
            raise AssertionError("the run ended without writing last.ckpt a third time")
        proc.send_signal(signal.SIGKILL)  # the third last.ckpt half-written, in its temporary
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert [n for n in os.listdir(d) if n.endswith(".partial")]  # the cut-short write
    assert torch.load(os.path.join(d, "last.ckpt"), weights_only=True)["global_step"] == 20
    assert "epoch=2-step=30.ckpt" in ckpts(d)
    out = run(d, EPOCHS, str(tmp_path / "resumed.pt"), "--resume")
    assert "start at step 30\n" in out  # not 20: the newest complete checkpoint
    ref, got = (torch.load(p, weights_only=False) for p in (ref_pt, tmp_path / "resumed.pt"))
    assert got["global_step"] == ref["global_step"] == 60
    assert_tree_equal(got["model"], ref["model"])
    assert_tree_equal(got["optim"], ref["optim"])


def test_a_damaged_last_ckpt_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path, caplog):
    d = str(tmp_path / "run")
    run(d, 3, str(tmp_path / "out.pt"))
    last = os.path.join(d, "last.ckpt")
    assert torch.load(last, weights_only=True)["global_step"] == 30
    os.utime(os.path.join(d, "epoch=2-step=30.ckpt"), (1, 1))  # older by mtime: last.ckpt is still picked
    with open(last, "r+b") as f:  # a flipped byte in a tensor's bytes
        rec = torchzip.read_records(lambda o, n: (f.seek(o), f.read(n))[1], os.path.getsize(last))
        data = next(r for r in rec if r.name == "data/0")
        f.seek(data.data_offset)
        b = f.read(1)
        f.seek(data.data_offset)
        f.write(bytes([b[0] ^ 0xFF]))
    io = CkptmgrCheckpointIO()
    with caplog.at_level("WARNING", logger="ckptmgr"):
        ckpt = io.load_checkpoint(last)
    assert ckpt["global_step"] == 30 and ckpt["epoch"] == 2
    assert any("last.ckpt is damaged" in r.getMessage() for r in caplog.records)
    assert any("resuming from" in r.getMessage() and "epoch=2-step=30.ckpt" in r.getMessage()
               for r in caplog.records)
    # a damaged file named by itself is not replaced by another
    named = str(tmp_path / "epoch=2-step=30.ckpt")
    shutil.copy(last, named)
    with pytest.raises(CheckpointCorruptError):
        io.load_checkpoint(named)
    # and through a Trainer: fit(ckpt_path="last") resumes from epoch=2-step=30.ckpt
    out = run(d, 4, str(tmp_path / "resumed.pt"), "--resume")
    assert "start at step 30\n" in out and "finished" in out


def test_the_pytorch_lightning_namespace_has_its_own_plugin(tmp_path):
    d = str(tmp_path / "pl")
    run(d, 2, str(tmp_path / "out.pt"), "--namespace", "pytorch_lightning")
    from ckptmgr.integrations.pytorch_lightning import CkptmgrCheckpointIO as PLCheckpointIO

    ckpt = PLCheckpointIO().load_checkpoint(os.path.join(d, "last.ckpt"))
    assert ckpt["global_step"] == 20 and "state_dict" in ckpt and ckpt["hyper_parameters"]["width"] == 64


def test_the_whole_checkpoint_dict_round_trips_and_damage_is_caught(tmp_path):
    torch.manual_seed(0)
    ckpt = {"state_dict": {"w": torch.randn(1000), "b": torch.zeros(3)}, "epoch": 2, "global_step": 7,
            "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(1000)}}, "param_groups": [{"lr": 0.1}]}],
            "loops": {"x": {"y": 1}}, "hparams_name": "kwargs", "hyper_parameters": {"lr": 0.1}}
    plugin = CkptmgrCheckpointIO()
    path = str(tmp_path / "ckpts" / "a.ckpt")
    plugin.save_checkpoint(ckpt, path)  # a direct save: on disk when it returns
    assert os.path.isfile(path) and torch.load(path, weights_only=True)["global_step"] == 7
    assert_tree_equal(plugin.load_checkpoint(path), ckpt)
    plugin.teardown()
    with open(path, "rb") as f:
        data = bytearray(f.read())
    image = torchzip.plan_image(ckpt)
    data[image.spans[0].offset + 10] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="CRC32C"):
        CkptmgrCheckpointIO().load_checkpoint(path)
    # a file saved by torch.save (Lightning's own plugin) loads as it is
    torch.save(ckpt, tmp_path / "plain.ckpt")
    assert_tree_equal(CkptmgrCheckpointIO().load_checkpoint(str(tmp_path / "plain.ckpt")), ckpt)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="overlap"):
        CkptmgrCheckpointIO(overlap=1)
    with pytest.raises(ConfigError, match="device_buffer_bytes"):
        CkptmgrCheckpointIO(staging=StagingOptions(device_buffer_bytes=1 << 30))
    with pytest.raises(TypeError, match="storage_options"):
        CkptmgrCheckpointIO().save_checkpoint({}, str(tmp_path / "x.ckpt"), storage_options={"a": 1})
    with pytest.raises(FileNotFoundError):
        CkptmgrCheckpointIO().load_checkpoint(str(tmp_path / "missing.ckpt"))


def test_ddp_spawn_on_two_cpu_processes(tmp_path):
    d = str(tmp_path / "ddp")
    out = run(d, 2, str(tmp_path / "out.pt"), "--strategy", "ddp_spawn", "--devices", "2")
    assert "finished" in out
    names = ckpts(d)
    assert "last.ckpt" in names and len(names) == 3
    ckpt = torch.load(os.path.join(d, "last.ckpt"), weights_only=True)
    assert ckpt["global_step"] == 10  # 320 samples, batch 32, split over 2 processes, 2 epochs


def test_legacy_non_zip_torch_files_still_load(tmp_path):
    path = tmp_path / "legacy.ckpt"
    torch.save({"w": torch.ones(2), "epoch": 1}, path, _use_new_zipfile_serialization=False)
    assert CkptmgrCheckpointIO().load_checkpoint(str(path))["epoch"] == 1
