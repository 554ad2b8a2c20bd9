"""CkptmgrBudgetCallback in real Hugging Face Trainer runs on the CPU: ``control.should_save``
comes from the budget schedule, the checkpoints are the Trainer's (``checkpoint-<step>``,
written by CkptmgrTrainer), a run resumes from them, and a bad configuration is refused.

The schedule's clock is simulated: each step takes ``STEP_S`` and each save ``COST_S`` on it
(advanced by a callback), so the steps saved are exact. What they must be is worked out
twice: by hand, and by a :class:`BudgetPlanner` fed the same clock."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")
from hf_trainer_run import Tokens, tiny_llama
from transformers import Trainer, TrainerCallback, TrainingArguments

from ckptmgr import ConfigError, Schedule
from ckptmgr.integrations.transformers import CkptmgrBudgetCallback, CkptmgrTrainer
from ckptmgr.save.budget import WINDOW, BudgetPlanner

STEP_S = 1.0
COST_S = 0.5


class Clock(TrainerCallback):
    """The simulated clock: a step takes STEP_S, a save COST_S."""

    def __init__(self, cost_s=COST_S):
        self.t = 0.0
        self.cost_s = cost_s
        self.started_at: int | None = None

    def __call__(self):
        return self.t

    def on_train_begin(self, args, state, control, **kw):
        self.started_at = state.global_step

    def on_step_begin(self, args, state, control, **kw):
        self.t += STEP_S

    def on_save(self, args, state, control, **kw):
        self.t += self.cost_s


def _args(out, **kw):
    base = {"max_steps": 24, "save_strategy": "steps", "per_device_train_batch_size": 4, "learning_rate": 1e-3,
            "report_to": [], "use_cpu": True, "seed": 7, "dataloader_num_workers": 0, "disable_tqdm": True}
    return TrainingArguments(output_dir=str(out), **{**base, **kw})


def _train(out, clock, cls=CkptmgrTrainer, resume=None, max_overhead=0.1, **kw):
    budget = CkptmgrBudgetCallback(max_overhead=max_overhead, clock=clock)
    trainer = cls(model=tiny_llama(), args=_args(out, **kw), train_dataset=Tokens(), callbacks=[clock, budget])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, budget


def _steps(out):
    return sorted(int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-"))


def planned(schedule, first, last, cost_s):
    """The steps a BudgetPlanner picks on the same simulated clock (and the save at the end)."""
    t = [0.0]
    p = BudgetPlanner(schedule, clock=lambda: t[0], tiered=False)
    out = []
    for step in range(first, last + 1):
        t[0] += STEP_S
        if p.should_save(step) or step == last:
            out.append(step)
            t[0] += cost_s
            p.saved(step, allocated=len(out) == 1)
    return out


def test_saves_happen_at_the_steps_the_overhead_budget_allows(tmp_path):
    _, budget = _train(tmp_path, Clock(), save_steps=3)  # save_steps no longer decides
    # 3 steps measured, a first save (its staging memory made: not charged), a second one to
    # measure the cost (0.5 s on 1 s steps), then every ceil(0.5 / (0.1 * 1)) = 5 steps but never
    # closer than WINDOW + 1 = 9; and the steps strategy's save at the last step
    assert _steps(tmp_path) == [4, 12, 21, 24]
    assert _steps(tmp_path) == planned(Schedule(max_overhead=0.1), 1, 24, COST_S)
    stats = budget.stats()
    assert stats["interval_steps"] == WINDOW + 1 and stats["step_s"] == pytest.approx(STEP_S)
    assert stats["save_cost_s"] == pytest.approx(COST_S)


def test_the_stock_trainer_takes_the_callback_too(tmp_path):
    _train(tmp_path, Clock(), cls=Trainer, max_steps=14, max_overhead=0.05)  # every 10 steps
    assert _steps(tmp_path) == [4, 12, 14]


def test_a_run_resumed_from_its_checkpoints_continues_and_the_budget_measures_again(tmp_path):
    _train(tmp_path, Clock(cost_s=0.0), max_steps=14)
    assert _steps(tmp_path) == [4, 12, 14]  # (saves cost nothing: every WINDOW + 1 steps, the least allowed)
    clock = Clock(cost_s=0.0)
    trainer, _ = _train(tmp_path, clock, resume=True, max_steps=24)
    assert clock.started_at == 14 and trainer.state.global_step == 24
    resumed = [s for s in _steps(tmp_path) if s > 14]
    assert resumed == planned(Schedule(max_overhead=0.1), 15, 24, 0.0) == [18, 24]


def test_retention_applies_to_the_budget_saves(tmp_path):
    _train(tmp_path, Clock(), save_total_limit=2)
    assert _steps(tmp_path) == [21, 24]


@pytest.mark.parametrize("kwargs", [{"max_overhead": None}, {"max_overhead": 1.0}, {"max_overhead": -0.1},
                                    {"max_overhead": 0.01, "clock": 3.0}])
def test_bad_budgets_are_refused(kwargs):
    with pytest.raises(ConfigError):
        CkptmgrBudgetCallback(**kwargs)


@pytest.mark.parametrize("strategy", ["no", "epoch"])
def test_a_save_strategy_other_than_steps_is_refused_when_the_trainer_is_made(tmp_path, strategy):
    budget = CkptmgrBudgetCallback(max_overhead=0.01)
    with pytest.raises(ConfigError, match="save_strategy"):
        CkptmgrTrainer(model=tiny_llama(), args=_args(tmp_path, save_strategy=strategy), train_dataset=Tokens(),
                       callbacks=[budget])
    trainer = CkptmgrTrainer(model=tiny_llama(), args=_args(tmp_path, save_strategy=strategy), train_dataset=Tokens())
    trainer.add_callback(budget)  # (added later: refused when training starts, before any step)
    with pytest.raises(ConfigError, match="save_strategy"):
        trainer.train()
    assert trainer.state.global_step == 0 and not _steps(tmp_path)
