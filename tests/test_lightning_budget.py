"""CkptmgrBudgetCheckpoint in real Lightning fits on the CPU: it saves at the steps the budget
schedule picks, through the Trainer's CheckpointIO (ckptmgr's plugin), the same steps on every
rank, resumes from ``last.ckpt``, and refuses a configuration without a budget or with a step trigger too.

The schedule's clock is simulated: each training batch takes ``STEP_S`` and each checkpoint
save ``COST_S`` on it (advanced by a callback), so the steps saved are exact. What they
must be is worked out twice: by hand, and by a :class:`BudgetPlanner` fed the same clock."""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from ckptmgr import ConfigError, Schedule
from ckptmgr.integrations.lightning import CkptmgrBudgetCheckpoint, CkptmgrCheckpointIO
from ckptmgr.save.budget import WINDOW, BudgetPlanner

STEP_S = 1.0
COST_S = 0.5


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def training_step(self, batch, i):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Clock(pl.Callback):
    """The simulated clock: a batch takes STEP_S, a checkpoint save COST_S."""

    def __init__(self, cost_s=COST_S):
        self.t = 0.0
        self.cost_s = cost_s
        self.started_at: int | None = None

    def __call__(self):
        return self.t

    def on_train_start(self, trainer, module):
        self.started_at = trainer.global_step

    def on_train_batch_start(self, trainer, module, batch, i):
        self.t += STEP_S

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self.t += self.cost_s


def data(n=64):
    torch.manual_seed(0)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(n, 8)), batch_size=1)


def fit(d, steps, clock, ckpt_path=None, accumulate_grad_batches=1, **kw):
    ckpt = CkptmgrBudgetCheckpoint(dirpath=d, save_top_k=-1, clock=clock, **kw)
    trainer = pl.Trainer(max_steps=steps, plugins=[CkptmgrCheckpointIO()], callbacks=[clock, ckpt], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         accumulate_grad_batches=accumulate_grad_batches)
    trainer.fit(Net(), data(), ckpt_path=ckpt_path)
    return trainer, ckpt


def saved_steps(d):
    steps = {torch.load(p, weights_only=True)["global_step"] for p in d.glob("*.ckpt") if p.name != "last.ckpt"}
    return sorted(steps)


def planned(schedule, first, last, cost_s, step_s=STEP_S):
    """The steps a BudgetPlanner picks on the same simulated clock."""
    t = [0.0]
    p = BudgetPlanner(schedule, clock=lambda: t[0], tiered=False)
    out = []
    for step in range(first, last + 1):
        t[0] += step_s
        if p.should_save(step):
            out.append(step)
            t[0] += cost_s
            p.saved(step, allocated=len(out) == 1)
    return out


def test_saves_happen_at_the_steps_the_overhead_budget_allows(tmp_path):
    clock = Clock()
    _, ckpt = fit(tmp_path, 24, clock, max_overhead=0.1)
    # 3 steps measured, a first save (its staging memory made: not charged), a second one to
    # measure the cost (0.5 s on 1 s steps), then every ceil(0.5 / (0.1 * 1)) = 5 steps, but
    # never closer than WINDOW + 1 = 9 (a step clear of every save's window)
    assert saved_steps(tmp_path) == [4, 12, 21]
    assert saved_steps(tmp_path) == planned(Schedule(max_overhead=0.1), 1, 24, COST_S)
    stats = ckpt.stats()
    assert stats["interval_steps"] == WINDOW + 1 and stats["step_s"] == pytest.approx(STEP_S)
    assert stats["save_cost_s"] == pytest.approx(COST_S)


def test_a_tighter_budget_saves_less_often(tmp_path):
    fit(tmp_path, 40, Clock(), max_overhead=0.05)  # every ceil(0.5 / 0.05) = 10 steps
    assert saved_steps(tmp_path) == [4, 12, 22, 32]


def test_with_gradient_accumulation_the_step_measured_is_the_optimizer_step(tmp_path):
    _, ckpt = fit(tmp_path, 16, Clock(), max_overhead=0.1, accumulate_grad_batches=2)
    # two batches of 1 s per step: saves every max(4, ceil(0.5 / (0.1 * 2))) = 4 steps
    assert saved_steps(tmp_path) == planned(Schedule(max_overhead=0.1), 1, 16, COST_S, step_s=2.0) == [4, 12]
    assert ckpt.stats()["step_s"] == pytest.approx(2.0)


def test_a_fit_resumed_from_last_continues_and_the_budget_measures_again(tmp_path):
    fit(tmp_path, 14, Clock(cost_s=0.0), max_overhead=0.1, save_last=True)
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 12
    assert saved_steps(tmp_path) == [4, 12]  # (saves cost nothing: every WINDOW + 1 steps, the least allowed)
    clock = Clock(cost_s=0.0)
    trainer, _ = fit(tmp_path, 24, clock, ckpt_path="last", max_overhead=0.1, save_last=True)
    assert clock.started_at == 12 and trainer.global_step == 24
    resumed = [s for s in saved_steps(tmp_path) if s > 12]
    assert resumed == planned(Schedule(max_overhead=0.1), 13, 24, 0.0) == [16, 24]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 24


@pytest.mark.parametrize("kwargs", [
    {},  # no budget
    {"max_overhead": 1.5},
    {"max_overhead": 0},
    {"max_overhead": True},
    {"max_overhead": 0.01, "every_n_train_steps": 100},
    {"max_overhead": 0.01, "train_time_interval": timedelta(minutes=5)},
    {"max_overhead": 0.01, "clock": 3.0},
])
def test_bad_configurations_are_refused(tmp_path, kwargs):
    with pytest.raises(ConfigError):
        CkptmgrBudgetCheckpoint(dirpath=tmp_path, **kwargs)


def test_the_callback_pickles_without_its_planner(tmp_path):
    import pickle

    clock = Clock()
    _, ckpt = fit(tmp_path, 6, clock, max_overhead=0.1)
    assert ckpt.stats()
    copy = pickle.loads(pickle.dumps(CkptmgrBudgetCheckpoint(dirpath=tmp_path, max_overhead=0.1)))
    assert copy.stats() == {} and copy.schedule == Schedule(max_overhead=0.1)


def test_the_pytorch_lightning_namespace_has_its_own_callback(tmp_path):
    import pytorch_lightning as ptl

    from ckptmgr.integrations.pytorch_lightning import CkptmgrBudgetCheckpoint as PtlBudget
    from ckptmgr.integrations.pytorch_lightning import CkptmgrCheckpointIO as PtlIO

    class PtlNet(ptl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 8)

        def training_step(self, batch, i):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class PtlClock(Clock, ptl.Callback):
        pass

    clock = PtlClock()
    ckpt = PtlBudget(dirpath=tmp_path, save_top_k=-1, clock=clock, max_overhead=0.1)
    assert isinstance(ckpt, ptl.callbacks.ModelCheckpoint)
    trainer = ptl.Trainer(max_steps=13, plugins=[PtlIO()], callbacks=[clock, ckpt], logger=False,
                          enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(PtlNet(), data())
    assert saved_steps(tmp_path) == [4, 12]


class RankClock(Clock):
    """Rank 1's steps take 3x as long and its saves nothing: alone, its planner would pick
    other steps than rank 0's."""

    def on_train_batch_start(self, trainer, module, batch, i):
        self.t += STEP_S if trainer.global_rank == 0 else 3 * STEP_S

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self.t += self.cost_s if trainer.global_rank == 0 else 0.0


def test_ranks_save_the_steps_rank_0_picks(tmp_path):
    assert planned(Schedule(max_overhead=0.1), 1, 14, 0.0) != [4, 7, 12]  # what rank 1 would pick alone
    clock = RankClock()
    ckpt = CkptmgrBudgetCheckpoint(dirpath=tmp_path, save_top_k=-1, clock=clock, max_overhead=0.1)
    trainer = pl.Trainer(max_steps=14, plugins=[CkptmgrCheckpointIO()], callbacks=[clock, ckpt], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         strategy=DDPStrategy(start_method="spawn", timeout=timedelta(seconds=60)), devices=2)
    trainer.fit(Net(), data())  # (ranks that disagreed would wait for each other in the save: timed out)
    assert saved_steps(tmp_path) == [4, 12]
