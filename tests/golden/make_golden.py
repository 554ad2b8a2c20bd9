"""Writes the golden checkpoints under tests/golden/. Run once per new format version:

    python tests/golden/make_golden.py

Committed outputs are read by tests/test_golden.py forever after.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import OrderedDict

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def golden_state() -> dict:
    """A small state touching every feature of format version 1; values are exact on any platform."""
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 8
    sd = OrderedDict([("weight", w), ("bias", torch.arange(4, dtype=torch.float32))])
    sd._metadata = OrderedDict([("", {"version": 1})])
    return {
        "model": sd,
        "tied": w,                    # stored once, restored aliased
        "rows": w[1:3],               # a view
        "bf16": torch.arange(8, dtype=torch.bfloat16) - 3,
        "f8": torch.arange(4, dtype=torch.float32).to(torch.float8_e4m3fn),
        "mask": torch.tensor([True, False, True]),
        "i64": torch.tensor(-(2**40)),
        "empty": torch.empty(0, 3, dtype=torch.int16),
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((2,), 0.5)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "py": (None, True, 7, 2.5, float("nan"), float("-inf"), "text"),
        "types": [torch.float16, torch.device("cpu"), torch.Size([1, 2])],
        "np": np.arange(5, dtype=np.int32),
        "np_scalar": np.float64(0.25),
    }


GOLDEN_METADATA = {"loss": 1.5, "epoch": 2, "tags": ["golden"]}


def main() -> None:
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    from ckptmgr import CheckpointManager
    from ckptmgr.format.manifest import FORMAT_VERSION

    root = os.path.join(HERE, f"v{FORMAT_VERSION}")
    shutil.rmtree(root, ignore_errors=True)
    with CheckpointManager(root) as mgr:
        mgr.save(42, golden_state(), metadata=GOLDEN_METADATA).result()
    print("wrote", root)


if __name__ == "__main__":
    main()
