"""The ``ckptmgr`` command line, run as a real subprocess on real roots (local and S3 on moto)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading

import pytest
import torch
import zygote
from conftest import assert_tree_equal, make_training, train_steps

from ckptmgr import AnyOf, CheckpointManager, KeepEvery, KeepLatest, StepInfo

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return zygote.run([sys.executable, "-m", "ckptmgr", *args], template="torch", capture_output=True, text=True,
                      env=env or ENV, timeout=120)


def cli_json(*args: str, **kw) -> dict:
    r = cli(*args, "--json", **kw)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _state(model, opt, sched, step):
    return {"model": model, "optim": opt, "sched": sched, "step": step, "rng": torch.get_rng_state()}


@pytest.fixture
def saved(root):
    """Steps 10..50 of a tiny transformer (tied head), step 30 protected."""
    model, opt, sched = make_training()
    with CheckpointManager(root) as mgr:
        for step in (10, 20, 30, 40, 50):
            train_steps(model, opt, sched, 1)
            mgr.save(step, _state(model, opt, sched, step), metadata={"loss": 1.0 / step, "tag": f"s{step}"}).result()
        mgr.protect(30)
    return root


def test_ls_lists_steps_with_size_time_protection_and_metadata(saved):
    out = cli_json("ls", saved)
    rows = {r["step"]: r for r in out["steps"]}
    assert sorted(rows) == [10, 20, 30, 40, 50]
    assert [r["step"] for r in out["steps"] if r["protected"]] == [30]
    assert rows[20]["metadata"] == {"loss": 0.05, "tag": "s20"}
    assert all(r["tier"] == "durable" and r["bytes"] > 0 and r["time"] > 0 for r in rows.values())
    text = cli("ls", saved)
    assert text.returncode == 0
    lines = text.stdout.splitlines()
    assert lines[0].split()[:4] == ["STEP", "TIER", "SIZE", "COMMITTED"]
    assert len(lines) == 6 and "yes" in lines[3] and '"tag": "s30"' in lines[3]


def test_inspect_shows_tree_and_tensors(saved):
    out = cli_json("inspect", saved, "latest")
    assert out["step"] == 50
    tensors = {t["name"]: t for t in out["tensors"]}
    emb = tensors["model/embed.weight"]
    assert emb["dtype"] == "F32" and emb["shape"] == [64, 32] and emb["bytes"] == 64 * 32 * 4
    assert tensors["model/head.weight"]["view_of"] == "model/embed.weight"  # the tied head
    assert out["state"]["step"] == 50 and out["state"]["model"]["embed.weight"]["shape"] == [64, 32]
    text = cli("inspect", saved, "20", "--tensors")
    assert text.returncode == 0
    assert "step 20 under" in text.stdout and "embed.weight: F32 [64, 32] 8.0 KiB" in text.stdout
    assert "model/head.weight" in text.stdout and "view of model/embed.weight" in text.stdout


def test_missing_root_step_and_bad_arguments_exit_codes(saved, tmp_path):
    r = cli("ls", str(tmp_path / "nowhere"))
    assert r.returncode == 3 and "nowhere" in r.stderr
    assert not (tmp_path / "nowhere").exists()  # looking did not create it
    r = cli("inspect", saved, "35")
    assert r.returncode == 3 and "step 35" in r.stderr and "50" in r.stderr
    assert cli("inspect", saved, "abc").returncode == 2
    assert cli("frobnicate", saved).returncode == 2
    assert cli("ls", saved, "--storage-options", "{not json").returncode == 2


def test_verify_passes_then_names_the_corrupt_file(saved):
    out = cli_json("verify", saved)
    assert out["ok"] and [s["step"] for s in out["steps"]] == [10, 20, 30, 40, 50]
    data = os.path.join(saved, "step_000000000040", "data-00000.safetensors")
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) - 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    r = cli("verify", saved)
    assert r.returncode == 1
    assert "step 40: CORRUPT" in r.stdout and "step 50: ok" in r.stdout
    assert data in r.stderr and "fail their checksum" in r.stderr
    assert cli("verify", saved, "50").returncode == 0  # one step only
    os.truncate(os.path.join(saved, "step_000000000020", "data-00000.safetensors"), 100)
    out = json.loads(cli("verify", saved, "--json").stdout)
    bad = {s["step"]: s["problems"] for s in out["steps"] if not s["ok"]}
    assert not out["ok"] and sorted(bad) == [20, 40]
    assert "100 bytes, the manifest records" in bad[20][0]


def test_verify_a_missing_file(saved):
    os.remove(os.path.join(saved, "step_000000000010", "data-00000.safetensors"))
    r = cli("verify", saved, "10")
    assert r.returncode == 1 and "data-00000.safetensors: missing" in r.stderr


def test_prune_dry_run_deletes_nothing_then_prune_matches_the_library_policy(saved):
    def tree():
        return {d: sorted(os.listdir(os.path.join(saved, d))) for d in os.listdir(saved) if d.startswith("step_")}

    before = tree()
    out = cli_json("prune", saved, "--keep-latest", "1", "--keep-every", "20", "--dry-run")
    assert out["dry_run"] and out["deleted"] == []
    assert tree() == before
    policy = AnyOf(KeepLatest(1), KeepEvery(20))
    infos = [StepInfo(s, 0.0) for s in (10, 20, 30, 40, 50)]
    expected = [i.step for i, keep in zip(infos, policy.keep(infos), strict=True) if not keep and i.step != 30]
    assert out["would_delete"] == expected == [10]
    r = cli("prune", saved, "--keep-latest", "1", "--keep-every", "20")
    assert r.returncode == 0 and "deleted 1 step(s)" in r.stdout
    assert [s["step"] for s in cli_json("ls", saved)["steps"]] == [20, 30, 40, 50]
    out = cli_json("prune", saved, "--keep-latest", "1")
    assert out["deleted"] == [20, 40] and out["kept"] == [30, 50]  # 30 is protected, 50 the newest


def test_prune_needs_a_policy_and_valid_flags(saved):
    r = cli("prune", saved)
    assert r.returncode == 2 and "--keep-latest" in r.stderr
    assert cli("prune", saved, "--keep-latest", "-1").returncode == 2
    r = cli("prune", saved, "--keep-best", "loss")
    assert r.returncode == 2 and "METRIC:N" in r.stderr
    out = cli_json("prune", saved, "--keep-best", "loss:1:max", "--dry-run")
    assert out["would_delete"] == [20, 40]  # keeps 10 (highest loss), 30 protected, 50 newest
    assert len(cli_json("ls", saved)["steps"]) == 5


def test_export_is_plain_safetensors_identical_to_restore(saved, tmp_path):
    from safetensors.torch import load_file

    dest = tmp_path / "export"
    out = cli_json("export", saved, "50", "--to", str(dest), "--only", "model/")
    assert sorted(os.listdir(dest)) == sorted([*out["files"], "model.safetensors.index.json", "state.json"])
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    loaded = {}
    for f in set(index["weight_map"].values()):
        loaded.update(load_file(str(dest / f)))
    with CheckpointManager(saved) as mgr:
        restored = mgr.restore(50)["model"]
    assert sorted(loaded) == sorted(restored) and "head.weight" in loaded
    for k, v in restored.items():
        assert torch.equal(loaded[k], v), k
    full = tmp_path / "full"
    assert cli("export", saved, "latest", "--to", str(full)).returncode == 0
    state = json.loads((full / "state.json").read_text())
    assert state["step"] == 50 and state["metadata"] == {"loss": 0.02, "tag": "s50"}
    leaf = state["state"]["optim"]["state"]["0"]["exp_avg"]
    assert leaf["file"].endswith(".safetensors") and leaf["tensor"] == "optim/state/0/exp_avg"
    assert cli("export", saved, "50", "--to", str(full)).returncode == 4  # never overwrites


def test_export_stops_on_corruption_and_leaves_nothing(saved, tmp_path):
    data = os.path.join(saved, "step_000000000050", "data-00000.safetensors")
    with open(data, "r+b") as f:
        f.seek(8 + int.from_bytes(f.read(8), "little") + 100)  # into the data, past the header
        f.write(b"\xff\xff")
    r = cli("export", saved, "50", "--to", str(tmp_path / "x"))
    assert r.returncode == 1 and "fail their checksum" in r.stderr
    assert not (tmp_path / "x").exists() and not [p for p in os.listdir(tmp_path) if "partial" in p]


def test_import_torch_save_and_refuses_unsafe_pickles(tmp_path, root):
    model, opt, sched = make_training()
    train_steps(model, opt, sched, 2)
    src = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}
    torch.save(src, tmp_path / "plain.pt")
    r = cli("import", str(tmp_path / "plain.pt"), root)
    assert r.returncode == 2 and "--step" in r.stderr
    assert cli("import", str(tmp_path / "plain.pt"), root, "--step", "7").returncode == 0
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [7] and mgr.metadata(7)["source_format"] == "torch.save"
        assert_tree_equal(mgr.restore(7), torch.load(tmp_path / "plain.pt", weights_only=True))
    assert cli("import", str(tmp_path / "plain.pt"), root, "--step", "7").returncode == 4
    torch.save({"w": torch.ones(2), "obj": StepInfo(1, 0.0)}, tmp_path / "unsafe.pt")
    r = cli("import", str(tmp_path / "unsafe.pt"), root, "--step", "8")
    assert r.returncode == 2 and "weights_only" in r.stderr and "StepInfo" in r.stderr
    r = cli("import", str(tmp_path / "unsafe.pt"), root, "--step", "8", "--safe-global", "ckptmgr.retention.StepInfo")
    assert r.returncode == 2 and "--allow-pickle" in r.stderr  # loadable now, but not storable natively
    assert cli("import", str(tmp_path / "missing.pt"), root, "--step", "9").returncode == 3
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [7]  # nothing of the refused imports was committed


def test_import_a_lightning_checkpoint_and_export_it_back(tmp_path):
    code = f"""
import torch, lightning.pytorch as pl
class M(pl.LightningModule):
    def __init__(self, lr=0.1):
        super().__init__(); self.save_hyperparameters(); self.l = torch.nn.Linear(4, 2)
    def training_step(self, b, i): return self.l(b[0]).pow(2).mean()
    def configure_optimizers(self): return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
pl.Trainer(max_steps=6, default_root_dir={str(tmp_path)!r}, logger=False, enable_progress_bar=False,
           enable_model_summary=False).fit(M(), dl)
"""
    zygote.run([sys.executable, "-c", code], template="lightning", check=True, capture_output=True, env=ENV,
               timeout=300)
    (ckpt,) = (tmp_path / "checkpoints").iterdir()
    root = str(tmp_path / "ckpt")
    out = cli_json("import", str(ckpt), root)
    assert out["step"] == 6 and out["source_format"] == "lightning"
    orig = torch.load(ckpt, weights_only=True)
    with CheckpointManager(root) as mgr:
        assert_tree_equal(mgr.restore(6), orig)
    cli_json("export", root, "6", "--to", str(tmp_path / "exp"), "--only", "state_dict/")
    from safetensors.torch import load_file

    index = json.loads((tmp_path / "exp" / "model.safetensors.index.json").read_text())
    (f,) = set(index["weight_map"].values())
    exported = load_file(str(tmp_path / "exp" / f))
    assert sorted(exported) == sorted(orig["state_dict"])
    assert all(torch.equal(exported[k], v) for k, v in orig["state_dict"].items())


@pytest.mark.slow  # (tests/test_s3_conformance.py runs the CLI on both S3 servers in the default suite)
def test_every_command_on_an_s3_root(s3_bucket, tmp_path):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    env = {**ENV, "CKPTMGR_STORAGE_OPTIONS": json.dumps(opts)}
    torch.save({"w": torch.arange(10.0), "step": 1}, tmp_path / "a.pt")
    for step in (1, 2, 3):
        assert cli("import", str(tmp_path / "a.pt"), url, "--step", str(step), env=env).returncode == 0
    assert [s["step"] for s in cli_json("ls", url, env=env)["steps"]] == [1, 2, 3]
    assert cli_json("inspect", url, "2", env=env)["tensors"][0]["name"] == "w"
    assert cli_json("verify", url, env=env)["ok"]
    assert cli_json("prune", url, "--keep-latest", "2", "--dry-run", env=env)["would_delete"] == [1]
    assert cli_json("prune", url, "--keep-latest", "2", env=env)["deleted"] == [1]
    cli_json("export", url, "3", "--to", str(tmp_path / "exp"), env=env)
    from safetensors.torch import load_file

    (f,) = [p for p in os.listdir(tmp_path / "exp") if p.endswith(".safetensors")]
    assert torch.equal(load_file(str(tmp_path / "exp" / f))["w"], torch.arange(10.0))
    # corrupt an object in the bucket: verify names it and fails
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    # (data objects carry the writer's claim token: data-00000.<hex>.safetensors)
    (key,) = [k for k in fs.ls(f"{bucket}/run/step_000000000003", refresh=True)
              if k.rsplit("/", 1)[-1].startswith("data-00000.")]
    blob = bytearray(fs.cat_file(key))
    blob[-3] ^= 0xFF
    fs.pipe_file(key, bytes(blob))
    r = cli("verify", url, env=env)
    assert r.returncode == 1 and key in r.stderr
    r = cli("ls", url, "--storage-options", json.dumps({"endpoint_url": "http://127.0.0.1:9", "key": "k",
                                                          "secret": "s"}), env=ENV)
    assert r.returncode == 5


def test_progress_bar_only_on_a_terminal(saved):
    r = cli("verify", saved)
    assert "it/s" not in r.stderr and "B/s" not in r.stderr and "verify:" not in r.stderr
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    chunks: list[bytes] = []

    def drain() -> None:  # a terminal must be read while the program writes to it
        while True:
            try:
                data = os.read(primary, 65536)
            except OSError:  # EIO once the program has exited
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        p = subprocess.run([sys.executable, "-m", "ckptmgr", "verify", saved], stdout=subprocess.PIPE,
                           stderr=secondary, env=ENV, timeout=120)
    finally:
        os.close(secondary)
        reader.join(30)
        os.close(primary)
    assert p.returncode == 0
    assert b"verify:" in b"".join(chunks)  # tqdm's bar, drawn on the terminal
    p = subprocess.run([sys.executable, "-m", "ckptmgr", "verify", saved, "-q"], capture_output=True, env=ENV)
    assert p.returncode == 0 and b"verify:" not in p.stderr


def test_inspect_summarizes_long_sequences_and_all_shows_them(root):
    import random

    class PyRNG:
        def state_dict(self):
            return {"python": random.getstate()}

        def load_state_dict(self, sd):
            random.setstate(sd["python"])

    losses = [float(i) for i in range(40)]
    groups = [{"lr": 0.1, "w": torch.zeros(2)} for _ in range(20)]
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(4, 2), "rng": PyRNG(), "losses": losses, "groups": groups,
                     "short": (1, 2, 3)}).result()
    text = cli("inspect", root)
    assert text.returncode == 0
    lines = text.stdout.splitlines()
    assert len(lines) < 60, len(lines)  # the RNG state alone is 625 numbers
    assert any("tuple[625] of int: [" in ln and "--all" in ln for ln in lines)
    assert any(ln.strip().startswith("losses: list[40] of float: [0.0, 1.0, 2.0, 3.0, ...]") for ln in lines)
    assert any(ln.strip() == "groups: list[20]" for ln in lines)
    assert any(ln.strip() == "... 12 more (--all shows every item)" for ln in lines)
    assert any(ln.strip() == "short: tuple[3]" for ln in lines)  # short ones in full
    full = cli("inspect", root, "--all").stdout.splitlines()
    assert len(full) > 625 + 40 + 20 * 3 and not any("--all" in ln for ln in full)


def test_export_uses_hugging_face_names(saved, root, tmp_path):
    from safetensors import safe_open

    try:  # the names transformers' from_pretrained looks for
        from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
    except ImportError:
        SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
    single = str(tmp_path / "single")
    with CheckpointManager(single) as mgr:
        mgr.save(5, {"model": torch.nn.Linear(8, 4).state_dict(), "step": 5}).result()
    out = cli_json("export", single, "5", "--to", str(tmp_path / "one"), "--only", "model/")
    assert out["files"] == [SAFE_WEIGHTS_NAME]
    assert sorted(os.listdir(tmp_path / "one")) == sorted([SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, "state.json"])
    with safe_open(str(tmp_path / "one" / SAFE_WEIGHTS_NAME), "pt") as f:
        assert sorted(f.keys()) == ["bias", "weight"]
    # tied weights: the views get a file of their own, so the export is sharded
    out = cli_json("export", saved, "50", "--to", str(tmp_path / "two"), "--only", "model/")
    assert out["files"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((tmp_path / "two" / SAFE_WEIGHTS_INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == set(out["files"]) and index["metadata"]["total_size"] > 0
    for name, fname in index["weight_map"].items():
        with safe_open(str(tmp_path / "two" / fname), "pt") as f:
            assert name in set(f.keys())


def test_import_names_foreign_files_and_its_own_flags(tmp_path, root):
    (tmp_path / "garbage.pt").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "notes.pt").write_text("hello world\n")
    for name in ("garbage.pt", "notes.pt"):
        r = cli("import", str(tmp_path / name), root, "--step", "1")
        assert r.returncode == 2 and "is not a file torch.load can read" in r.stderr, r.stderr
        assert "--safe-global" not in r.stderr and "Traceback" not in r.stderr
    torch.save({"w": torch.ones(2), "obj": StepInfo(1, 0.0)}, tmp_path / "unsafe.pt")
    r = cli("import", str(tmp_path / "unsafe.pt"), root, "--step", "8", "--safe-global", "ckptmgr.retention.StepInfo")
    assert r.returncode == 2 and "--allow-pickle" in r.stderr and "allow_pickle=True" not in r.stderr
