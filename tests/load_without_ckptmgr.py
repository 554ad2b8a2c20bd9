"""Loads Lightning checkpoint files the ways a user without ckptmgr would; exits non-zero on
the first failure. The tests run it as a subprocess.

    python load_without_ckptmgr.py [--weights-only] FILE...

ckptmgr cannot be imported here (its import is blocked), so nothing of ckptmgr's can take part:
each file goes through ``torch.load``, Lightning's ``pl_load``, ``zipfile`` (every CRC-32
checked) and ``Net.load_from_checkpoint`` of the test trainer's module.
"""

import importlib.abc
import os
import sys
import zipfile


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ckptmgr" or name.startswith("ckptmgr."):
            raise ImportError(f"{name} is blocked in this process")
        return


sys.meta_path.insert(0, _Block())
weights_only = "--weights-only" in sys.argv
files = [a for a in sys.argv[1:] if not a.startswith("--")]
sys.path.insert(0, os.path.dirname(__file__))

import lightning_trainer  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.utilities.cloud_io import _load as pl_load  # noqa: E402

for f in files:
    assert zipfile.ZipFile(f).testzip() is None, f
    ckpt = torch.load(f, weights_only=weights_only)
    assert pl_load(f, weights_only=weights_only)["global_step"] == ckpt["global_step"]
    model = lightning_trainer.Net.load_from_checkpoint(f, weights_only=weights_only)
    want = ckpt["state_dict"]["net.0.weight"]
    assert torch.equal(model.net[0].weight.detach(), want), f
    print(f"{os.path.basename(f)} step {ckpt['global_step']} hparams {sorted(model.hparams)}", flush=True)
assert not any(m == "ckptmgr" or m.startswith("ckptmgr.") for m in sys.modules), "ckptmgr was imported"
print("ok", len(files))
