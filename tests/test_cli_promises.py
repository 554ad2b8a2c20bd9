"""What the ``ckptmgr`` command promises on roots that are not what they seem: a FIFO named
``*.ckpt`` is never opened, ``verify`` fails where there is nothing to verify, ``prune``
refuses a metric no step has, the integrations' checkpoint directories are verified against
their records, Lightning directories are ordered by step, errors are JSON with ``--json``,
and ``--version``/``--help`` import no torch. Every command runs as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import zygote

from ckptmgr import CheckpointManager, PerRank

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "ckptmgr", *args], capture_output=True, text=True, env=ENV,
                       timeout=timeout)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def clis(*commands: tuple[str, ...], timeout: float = 120) -> list[subprocess.CompletedProcess[str]]:
    """Independent commands (none changes what another reads), started together: their
    results, in order."""
    procs = [subprocess.Popen([sys.executable, "-m", "ckptmgr", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV) for args in commands]
    results = []
    try:
        for args, p in zip(commands, procs, strict=True):
            out, err = p.communicate(timeout=timeout)
            assert "Traceback" not in err, err
            results.append(subprocess.CompletedProcess([*args], p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    return results


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.fixture
def saved(root):
    with CheckpointManager(root) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"w": torch.full((8,), float(step))}, metadata={"loss": 1.0 / step, "tag": "x"}).result()
    return root


# 37.18 ------------------------------------------------------------------------------------

def test_a_fifo_named_ckpt_is_listed_never_opened(tmp_path):
    """``ls``, ``inspect`` and ``verify`` of a directory holding a FIFO named ``*.ckpt`` (and
    of the FIFO itself) answer instead of blocking on its open; the FIFO is reported."""
    d = tmp_path / "lightning"
    d.mkdir()
    torch.save({"global_step": 5, "epoch": 0, "state_dict": {"w": torch.ones(3)}}, d / "epoch=0-step=5.ckpt")
    os.mkfifo(d / "stuck.ckpt")
    r = cli("ls", str(d), "--json", timeout=60)  # on a blocking open this never returns: TimeoutExpired
    assert r.returncode == 0, r.stderr
    rows = {os.path.basename(f["file"]): f for f in json.loads(r.stdout)["files"]}
    assert rows["epoch=0-step=5.ckpt"]["global_step"] == 5
    assert "FIFO" in rows["stuck.ckpt"]["note"] and rows["stuck.ckpt"]["regular"] is False
    r = cli("verify", str(d), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "epoch=0-step=5.ckpt: ok" in r.stdout and "stuck.ckpt: not verified" in r.stdout
    assert cli("inspect", str(d), timeout=60).returncode == 0
    r = cli("inspect", str(d), "stuck.ckpt", timeout=60)
    assert r.returncode == 3 and "FIFO" in r.stderr
    r = cli("verify", str(d / "stuck.ckpt"), timeout=60)  # the FIFO as ROOT: nothing to verify
    assert r.returncode == 3 and "FIFO" in r.stderr


# 38.3 -------------------------------------------------------------------------------------

def test_prune_refuses_a_keep_best_metric_no_step_has_unless_forced(saved):
    r = cli("prune", saved, "--keep-best", "los:1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "'los'" in r.stderr and "loss, tag" in r.stderr and "--force" in r.stderr
    assert sorted(n for n in os.listdir(saved) if n.startswith("step_")) == [
        "step_000000000010", "step_000000000020", "step_000000000030"]  # nothing deleted
    r = cli("prune", saved, "--keep-best", "loss:1:max", "--keep-best", "los:1", "--dry-run")
    assert r.returncode == 2  # one good metric does not excuse a typo in another
    out = json.loads(cli("prune", saved, "--keep-best", "loss:1:max", "--dry-run", "--json").stdout)
    assert out["would_delete"] == [20]  # a metric the steps have works as before (10 best, 30 newest)
    out = json.loads(cli("prune", saved, "--keep-best", "los:1", "--force", "--json").stdout)
    assert out["deleted"] == [10, 20] and out["kept"] == [30]  # forced: what the policy says


# 38.4 -------------------------------------------------------------------------------------

def test_verify_fails_like_inspect_where_there_is_no_checkpoint(saved, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("hello")
    (unrelated / "data.bin").write_bytes(b"\0" * 100)
    parent = os.path.dirname(saved)  # the parent of a real root
    for where in (str(empty), str(unrelated), parent):
        r = cli("verify", where)
        assert r.returncode == 3 == cli("inspect", where).returncode, (where, r.stdout, r.stderr)
        assert "no committed checkpoint" in r.stderr
        out = json.loads(cli("verify", where, "--json").stdout)
        assert out["ok"] is False and out["error"]["exit_code"] == 3
    assert os.path.basename(saved) in cli("verify", parent).stderr  # names the root below it
    assert cli("verify", saved).returncode == 0


# 38.5 -------------------------------------------------------------------------------------

def test_verify_checks_hugging_face_checkpoints_against_their_record(tmp_path):
    pytest.importorskip("transformers")
    from hf_trainer_run import Tokens, tiny_llama
    from transformers import TrainingArguments

    from ckptmgr.integrations.transformers import CkptmgrTrainer

    out = tmp_path / "run"
    args = TrainingArguments(output_dir=str(out), max_steps=4, save_steps=2, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, seed=7, dataloader_num_workers=0, disable_tqdm=True)
    CkptmgrTrainer(model=tiny_llama(), args=args, train_dataset=Tokens()).train()
    assert cli("verify", str(out)).returncode == 0
    r = cli("ls", str(out), "--json")
    assert [(c["step"], c["record"]) for c in json.loads(r.stdout)["checkpoints"]] == [(2, True), (4, True)]
    weights = out / "checkpoint-4" / "model.safetensors"
    _flip(str(weights), os.path.getsize(weights) - 3)
    for where in (out, out / "checkpoint-4"):
        r = cli("verify", str(where))
        assert r.returncode == 1, (where, r.stdout, r.stderr)
        assert "checkpoint-4: CORRUPT" in r.stdout and "model.safetensors" in r.stderr
    assert "checkpoint-2: ok" in cli("verify", str(out)).stdout


def test_verify_checks_accelerate_checkpoints_against_their_record(tmp_path):
    pytest.importorskip("accelerate")
    from test_hf_accelerate import build, run

    from ckptmgr.integrations.accelerate import AsyncStateSaver

    acc, model, opt, dl, sched = build(tmp_path / "p")
    with AsyncStateSaver(acc) as saver:
        run(acc, model, opt, dl, sched, 4, save_at=(1, 3), save=saver.save_state)
    ckpts = tmp_path / "p" / "checkpoints"
    r = cli("verify", str(ckpts), "--json")
    assert r.returncode == 0, r.stderr
    assert [(c["step"], c["ok"], c["verified"]) for c in json.loads(r.stdout)["checkpoints"]] == [
        (0, True, True), (1, True, True)]
    _flip(str(ckpts / "checkpoint_1" / "model.safetensors"), 100)
    r = cli("verify", str(ckpts / "checkpoint_1"))
    assert r.returncode == 1 and "model.safetensors" in r.stderr, r.stdout + r.stderr
    r = cli("prune", str(ckpts), "--keep-latest", "1")  # not a ckptmgr root: said, nothing deleted
    assert r.returncode == 2 and "not a ckptmgr root" in r.stderr
    assert sorted(os.listdir(ckpts)) == ["checkpoint_0", "checkpoint_1"]


# 38.9 -------------------------------------------------------------------------------------

def test_a_lightning_directory_by_step(tmp_path):
    """A real ModelCheckpoint directory (epoch=0-step=1.ckpt ... epoch=11-step=12.ckpt): ``ls``
    orders it by step, ``inspect DIR STEP`` takes a step, prune and export say what it is."""
    code = f"""
import torch, lightning.pytorch as pl
class M(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.l = torch.nn.Linear(4, 2)
    def training_step(self, b, i): return self.l(b[0]).pow(2).mean()
    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.1)
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=4)
cb = pl.callbacks.ModelCheckpoint(dirpath={str(tmp_path / "ckpts")!r}, save_top_k=-1, every_n_epochs=1)
pl.Trainer(max_epochs=12, callbacks=[cb], logger=False, enable_progress_bar=False,
           enable_model_summary=False).fit(M(), dl)
"""
    zygote.run([sys.executable, "-c", code], template="lightning", check=True, capture_output=True, env=ENV,
               timeout=300)
    d = str(tmp_path / "ckpts")
    # prune and export are refused, so nothing the others read changes: all run together
    ls_json, ls, inspect_5, inspect_latest, inspect_50, prune, export = clis(
        ("ls", d, "--json"), ("ls", d), ("inspect", d, "5", "--json"), ("inspect", d, "--json"), ("inspect", d, "50"),
        ("prune", d, "--keep-latest", "1"), ("export", d, "latest", "--to", str(tmp_path / "x")))
    out = json.loads(ls_json.stdout)
    assert [os.path.basename(f["file"]) for f in out["files"]] == [f"epoch={e}-step={e + 1}.ckpt" for e in range(12)]
    assert [f["step"] for f in out["files"]] == list(range(1, 13))
    assert [ln.split()[0] for ln in ls.stdout.splitlines()[1:]] == [f"epoch={e}-step={e + 1}.ckpt" for e in range(12)]
    out = json.loads(inspect_5.stdout)
    assert os.path.basename(out["file"]) == "epoch=4-step=5.ckpt" and out["global_step"] == 5
    assert json.loads(inspect_latest.stdout)["global_step"] == 12  # latest: the highest step
    assert inspect_50.returncode == 3 and "step 50" in inspect_50.stderr and "12" in inspect_50.stderr
    for r in (prune, export):
        assert r.returncode == 2 and "not a ckptmgr root" in r.stderr and "ckptmgr import" in r.stderr, r.stderr
    assert len(os.listdir(d)) == 12 and not (tmp_path / "x").exists()


def test_errors_are_json_with_json(saved, tmp_path):
    cases = [(("inspect", saved, "99"), 3, "StepNotFoundError"),
             (("ls", str(tmp_path / "nowhere")), 3, "StepNotFoundError"),
             (("inspect", saved, "abc"), 2, "ConfigError"),
             (("ls", saved, "--bogus"), 2, "UsageError"),
             (("prune", saved), 2, "ConfigError")]
    for args, code, kind in cases:
        r = cli(*args, "--json")
        assert r.returncode == code, (args, r.stderr)
        doc = json.loads(r.stdout)
        assert doc["ok"] is False and doc["error"]["exit_code"] == code and doc["error"]["type"] == kind, doc
        assert doc["error"]["message"] in r.stderr  # and the same words for a person
    assert cli("inspect", saved, "99").stdout == ""  # without --json: stderr only, as before


def test_inspect_shows_a_per_rank_value_as_a_value(root):
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.ones(3), "loader": PerRank({"pos": 5, "t": torch.arange(4)}), "seed": PerRank(7)}
                 ).result()
    r = cli("inspect", root)
    assert r.returncode == 0 and "$per_rank" not in r.stdout, r.stdout
    assert "  loader: dict[2] (per rank)" in r.stdout and "    pos: 5" in r.stdout
    assert "  seed: 7 (per rank)" in r.stdout
    state = json.loads(cli("inspect", root, "--json").stdout)["state"]
    assert state["seed"] == {"per_rank": 7} and state["loader"]["per_rank"]["pos"] == 5
    assert state["loader"]["per_rank"]["t"]["shape"] == [4]


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["verify", "--help"], ["ls"]],
                         ids=["version", "help", "command-help", "bad-arguments"])
def test_version_help_and_bad_arguments_import_no_torch(args):
    code = f"""
import sys
from ckptmgr.cli import main
try:
    code = main({args!r})
except SystemExit as e:
    code = e.code
print(code, "torch" in sys.modules, "numpy" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.stdout.split()[-3:] == ["2" if args == ["ls"] else "0", "False", "False"], r.stdout + r.stderr


def test_the_package_imports_no_torch_until_a_name_needs_it():
    code = """
import sys
import ckptmgr
before = "torch" in sys.modules
from ckptmgr import CheckpointManager, KeepLatest
print(before, "torch" in sys.modules, CheckpointManager.__module__, ckptmgr.KeepLatest is KeepLatest)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.stdout.split() == ["False", "True", "ckptmgr.manager", "True"], r.stdout + r.stderr



# 38.9: the commands that read manifests, list steps, check CRCs or decide retention import no torch

_MAIN_AND_REPORT = """
import json, sys
from ckptmgr.cli import main
code = main(sys.argv[1:])
print("\\n" + json.dumps({"exit": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""

def _without_torch(command: str, root: str, *rest: str, env: dict[str, str] = ENV) -> tuple[int, str]:
    """Run ``ckptmgr COMMAND ROOT REST`` in a fresh process; its exit code and stdout, after
    checking that torch was not imported by the time it returned."""
    r = subprocess.run([sys.executable, "-c", _MAIN_AND_REPORT, command, root, *rest], capture_output=True,
                       text=True, env=env, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    report = json.loads(r.stderr.strip().splitlines()[-1])
    assert report["torch"] is False, f"ckptmgr {command} {' '.join(rest)} imported torch"
    return report["exit"], r.stdout


def _read_without_torch(root: str, env: dict[str, str] = ENV) -> None:
    """``ls``, ``inspect``, ``verify`` and ``prune --dry-run`` of the ``saved`` steps, each
    in a fresh process that does not import torch."""
    code, out = _without_torch("ls", root, "--json", env=env)
    assert code == 0 and [(s["step"], s["metadata"]["loss"]) for s in json.loads(out)["steps"]] == [
        (10, 0.1), (20, 0.05), (30, 1 / 30)]
    code, out = _without_torch("inspect", root, "20", "--json", env=env)
    assert code == 0 and [(t["name"], t["dtype"], t["shape"]) for t in json.loads(out)["tensors"]] == [
        ("w", "F32", [8])]
    code, out = _without_torch("verify", root, "--json", env=env)
    assert code == 0 and [(s["step"], s["ok"], s["files"]) for s in json.loads(out)["steps"]] == [
        (10, True, 1), (20, True, 1), (30, True, 1)]
    code, out = _without_torch("prune", root, "--keep-latest", "2", "--dry-run", "--json", env=env)
    assert code == 0 and json.loads(out)["would_delete"] == [10]


def test_reading_commands_import_no_torch_on_a_local_root(saved):
    _read_without_torch(saved)
    for rest, code in ((["ls"], 0), (["inspect", "latest", "--tensors"], 0), (["verify", "20"], 0),
                       (["prune", "--keep-best", "los:1"], 2)):  # text output, and a refusal
        assert _without_torch(rest[0], saved, *rest[1:])[0] == code, rest
    assert _without_torch("prune", saved, "--keep-latest", "2")[0] == 0  # the deletion itself
    assert sorted(n for n in os.listdir(saved) if n.startswith("step_")) == ["step_000000000020", "step_000000000030"]
    data = os.path.join(saved, "step_000000000020", "data-00000.safetensors")
    _flip(data, os.path.getsize(data) - 1)  # a damaged tensor byte: found by the CRCs, still without torch
    code, out = _without_torch("verify", saved, "--json")
    assert code == 1 and [(s["step"], s["ok"]) for s in json.loads(out)["steps"]] == [(20, False), (30, True)]


def test_reading_commands_import_no_torch_on_an_s3_root(s3_bucket):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    with CheckpointManager(url, storage_options=opts) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"w": torch.full((8,), float(step))}, metadata={"loss": 1.0 / step, "tag": "x"}).result()
    _read_without_torch(url, {**ENV, "CKPTMGR_STORAGE_OPTIONS": json.dumps(opts)})


def test_the_cli_looks_for_the_local_tier_where_the_tier_is(tmp_path):
    """The CLI imports the tier's module only where this user's tier of the root exists: it
    must name the tier directory as the tier does."""
    from ckptmgr.cli._context import _has_tier
    from ckptmgr.storage.tier import tier_dir

    url = str(tmp_path / "run")
    assert not _has_tier(str(tmp_path), url)
    os.mkdir(tier_dir(str(tmp_path), url), 0o700)
    assert _has_tier(str(tmp_path), url) and not _has_tier(str(tmp_path), url + "2")


def test_the_dtype_table_read_without_torch_is_torch_s():
    """Manifests are checked with the stored dtypes' names and item sizes, without torch:
    they must be torch's, and the torch tables are made from them."""
    from ckptmgr.format.layout import DTYPE_TO_ST, ST_DTYPES, ST_TO_DTYPE

    for code, (name, size) in ST_DTYPES.items():
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype) and dtype.itemsize == size, code
        assert ST_TO_DTYPE[code] is dtype and DTYPE_TO_ST[dtype] == code
    assert len(DTYPE_TO_ST) == len(ST_TO_DTYPE) == len(ST_DTYPES)
