"""Hugging Face Trainer with ckptmgr: killed with SIGKILL mid-save, resumed, bit-identical.

Every run is a real subprocess (tests/hf_trainer_run.py): a tiny Llama from a config, 12
steps, a checkpoint every 4. The reference is an uninterrupted run; the stock Trainer must
give the very same run (the integration changes how files travel, not the training). A run
whose second checkpoint is stopped half-way through writing ``optimizer.pt`` and then
SIGKILLed leaves that checkpoint as a hidden temporary only; resuming with
``resume_from_checkpoint=True``, by CkptmgrTrainer or by the stock Trainer, ends with the
reference's losses and weights, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import zygote

pytest.importorskip("transformers")
from safetensors.torch import load_file

RUN = os.path.join(os.path.dirname(__file__), "hf_trainer_run.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}


def _start(out, result, trainer, *extra):
    """A run, its stderr to a file (runs side by side: none blocks on a full pipe)."""
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115  (closed in _finish)
    proc = zygote.Popen([sys.executable, RUN, str(out), str(result), "--trainer", trainer, *extra],
                        template="lightning", env=ENV, stdout=subprocess.DEVNULL, stderr=err, text=True)
    return proc, err


def _finish(started):
    proc, err = started
    try:
        proc.wait(timeout=240)
        err.seek(0)
        assert proc.returncode == 0, err.read()[-3000:]
    finally:
        proc.kill()
        proc.wait()
        err.close()


def _run(out, result, trainer, *extra):
    _finish(_start(out, result, trainer, *extra))


def _losses(result):
    with open(result) as f:
        return {int(k): v for k, v in json.load(f)["losses"].items()}


def _weights(result):
    return load_file(str(result) + ".safetensors")


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference run (CkptmgrTrainer) and the stock Trainer's, side by side (their own
    directories): each run's result file and output directory."""
    d = tmp_path_factory.mktemp("reference")
    ours, stock = _start(d / "out", d / "r.json", "ckptmgr"), _start(d / "stock", d / "s.json", "stock")
    try:
        _finish(ours)
    finally:
        _finish(stock)
    return {"ckptmgr": (d / "r.json", d / "out"), "stock": (d / "s.json", d / "stock")}


@pytest.fixture(scope="module")
def reference(runs):
    result, out = runs["ckptmgr"]
    return _losses(result), _weights(result), out


def _kill_mid_save(tmp_path):
    """Start a run whose 2nd checkpoint hangs half-way through optimizer.pt; SIGKILL it there."""
    out, marker = tmp_path / "out", tmp_path / "marker"
    cmd = [sys.executable, RUN, str(out), str(tmp_path / "killed.json"), "--trainer", "ckptmgr",
           "--hang-at-save", "2", "--hang-file", "optimizer.pt", "--marker", str(marker)]
    proc = zygote.Popen(cmd, template="lightning", env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                        text=True)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert proc.poll() is None, f"the run ended before the save hung: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "the save never reached the hang point"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stderr.close()
    half_written = marker.read_text()
    assert os.path.getsize(half_written) > 0
    return out


def test_stock_trainer_run_is_the_reference(runs, reference):
    losses, weights, _ = reference
    stock, _ = runs["stock"]
    assert _losses(stock) == losses
    _assert_same_weights(_weights(stock), weights)


def test_reference_checkpoints_are_complete(reference):
    _, _, out = reference
    assert sorted(os.listdir(out)) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "training_args.bin", "config.json", "ckptmgr.json"} <= set(os.listdir(out / "checkpoint-8"))


@pytest.mark.parametrize("resumer", ["ckptmgr", "stock"])
def test_sigkill_mid_save_then_resume_is_bit_identical(tmp_path, reference, resumer):
    losses, weights, _ = reference
    out = _kill_mid_save(tmp_path)
    visible = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert visible == ["checkpoint-4"], visible  # the interrupted checkpoint-8 is not visible
    assert any(n.endswith(".partial") for n in os.listdir(out))
    _run(out, tmp_path / "resumed.json", resumer, "--resume")
    resumed = _losses(tmp_path / "resumed.json")
    assert sorted(resumed) == list(range(5, 13))  # resumed from checkpoint-4
    assert resumed == {s: losses[s] for s in resumed}
    _assert_same_weights(_weights(tmp_path / "resumed.json"), weights)
    names = os.listdir(out)
    if resumer == "ckptmgr":  # the dead writer's temporaries are removed at the next start
        assert not any(n.endswith(".partial") for n in names), names
    assert {"checkpoint-8", "checkpoint-12"} <= set(names)


def _start_ddp(out, result, trainer, busy_ports):
    """A 2-rank DDP run (gloo, CPU), on a rendezvous port none of ``busy_ports`` (added to it)."""
    import socket

    port = 0
    while port == 0 or port in busy_ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    busy_ports.add(port)
    env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return [zygote.Popen([sys.executable, RUN, str(out), str(result), "--trainer", trainer, "--max-steps", "8"],
                         template="lightning",
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True) for r in range(2)]


def _finish_ddp(procs):
    try:
        errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()

    def ok(p: subprocess.Popen, err: str) -> bool:
        # torch 2.13's gloo sometimes aborts a rank at interpreter exit, after all work is done
        # ("terminate called without an active exception", SIGABRT): the files are checked below
        return p.returncode == 0 or (p.returncode == -6 and "\ndone " in "\n" + err
                                     and err.rstrip().endswith("terminate called without an active exception"))
    assert all(ok(p, e) for p, e in zip(procs, errs, strict=True)), "\n".join(e[-3000:] for e in errs)


def test_ddp_two_ranks_write_one_checkpoint(tmp_path):
    """DDP: each rank's files (its RNG state) land in the one checkpoint that rank 0 commits,
    and training is the stock Trainer's, bit for bit, on every rank."""
    ports: set[int] = set()  # both runs at once, each in its own directory
    ours_procs = _start_ddp(tmp_path / "ours", tmp_path / "ours.json", "ckptmgr", ports)
    stock_procs = _start_ddp(tmp_path / "stock", tmp_path / "stock.json", "stock", ports)
    try:
        _finish_ddp(ours_procs)
    finally:
        _finish_ddp(stock_procs)
    for r in range(2):
        assert _losses(f"{tmp_path}/ours.json.{r}") == _losses(f"{tmp_path}/stock.json.{r}")
        _assert_same_weights(_weights(f"{tmp_path}/ours.json.{r}"), _weights(f"{tmp_path}/stock.json.{r}"))
    ours, stock = tmp_path / "ours", tmp_path / "stock"
    assert sorted(os.listdir(ours)) == sorted(os.listdir(stock)) == ["checkpoint-4", "checkpoint-8"]
    for ckpt in ("checkpoint-4", "checkpoint-8"):
        names = set(os.listdir(ours / ckpt))
        assert names == set(os.listdir(stock / ckpt)) | {"ckptmgr.json"}
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= names
        record = json.loads((ours / ckpt / "ckptmgr.json").read_text())
        assert set(record["files"]) == names - {"ckptmgr.json"}
        for name in ("rng_state_0.pth", "rng_state_1.pth", "optimizer.pt"):
            a = torch.load(ours / ckpt / name, weights_only=False)
            b = torch.load(stock / ckpt / name, weights_only=False)
            assert repr(a) == repr(b), name
