"""A real training state round-trips, and training continued from it is bitwise identical."""

import random

import numpy as np
import torch
from conftest import RNGState, make_training, train_steps

from ckptmgr import CheckpointManager


def test_training_continues_bitwise_identical(root):
    model, opt, sched = make_training(0)
    train_steps(model, opt, sched, 5)
    state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "step": 5}
    with CheckpointManager(root) as mgr:
        mgr.save(5, state).result()
        reference = train_steps(model, opt, sched, 5)  # the uninterrupted run
        ref_params = [p.detach().clone() for p in model.parameters()]

        model2, opt2, sched2 = make_training(123)  # different init and RNG: all must be restored
        restored = mgr.restore(target={"model": model2, "optim": opt2, "sched": sched2, "rng": RNGState(), "step": 0})
    assert restored["step"] == 5
    assert restored["model"] is model2
    assert model2.head.weight is model2.embed.weight  # tying survives load_state_dict
    resumed = train_steps(model2, opt2, sched2, 5)
    assert resumed == reference
    for p, q in zip(ref_params, model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_restore_without_target_gives_loadable_state_dicts(root):
    model, opt, sched = make_training(1)
    train_steps(model, opt, sched, 2)
    with CheckpointManager(root) as mgr:
        mgr.save(2, {"model": model, "optim": opt, "sched": sched, "rng": RNGState()}).result()
        out = mgr.restore()
    assert set(out["model"]) == set(model.state_dict())
    # tied weights come back as one tensor
    assert out["model"]["head.weight"].data_ptr() == out["model"]["embed.weight"].data_ptr()
    assert isinstance(out["optim"]["state"], dict)
    assert all(type(k) is int for k in out["optim"]["state"])
    assert type(out["rng"]["python"]) is tuple
    assert isinstance(out["rng"]["numpy"][1], np.ndarray)
    model2, opt2, sched2 = make_training(2)
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optim"])
    sched2.load_state_dict(out["sched"])
    random.setstate(out["rng"]["python"])
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
