"""accelerate's state saved twice through AsyncStateSaver (run as a subprocess by
tests/test_hf_accelerate_kill.py):

    python hf_accelerate_run.py PROJECT_DIR {fixed,auto} [--no-exchange]

``fixed``: ``save_state(PROJECT_DIR/state)`` twice (the second replaces the first);
``auto``: automatic checkpoint naming, ``checkpoint_0`` then ``checkpoint_1``. The model's
weights at each save go to ``PROJECT_DIR/../{old,new}.safetensors``. The kill-point hook
(tests/kill_points.py) is installed for the second save only. ``--no-exchange`` makes the
directory exchange unavailable, as on a file system without ``renameat2(RENAME_EXCHANGE)``.
"""

from __future__ import annotations

import os
import sys
import warnings

import kill_points
import torch
from safetensors.torch import save_file

warnings.filterwarnings("ignore", message=".*set_vital.*")


def build(project_dir: str, auto: bool):  # type: ignore[no-untyped-def]
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accelerator(cpu=True, project_dir=project_dir,
                      project_config=ProjectConfiguration(automatic_checkpoint_naming=auto))
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def train(acc, model, opt, steps: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()


def main() -> None:
    project, mode = sys.argv[1], sys.argv[2]
    if "--no-exchange" in sys.argv[3:]:
        try:
            from ckptmgr.storage.commit import directory as _dirreplace
        except ImportError:  # a version without the exchange: nothing to turn off
            pass
        else:
            _dirreplace._exchange_fn = False
    from ckptmgr.integrations.accelerate import AsyncStateSaver

    torch.set_num_threads(1)
    acc, model, opt = build(project, mode == "auto")
    target = None if mode == "auto" else os.path.join(project, "state")
    saver = AsyncStateSaver(acc)
    here = os.path.dirname(os.path.abspath(project))
    for version in ("old", "new"):
        train(acc, model, opt, 2)
        save_file(weights(model), os.path.join(here, f"{version}.safetensors"))
        if version == "new":
            kill_points.install()
        saver.save_state(target).result(120)
    saver.close()
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
